"""Stage splits and micro-batch sizes in the pipelined search ([Note: stage splits] in
tidal/planner/stage_split.py, [Note: micro-batch scaling] in tidal/planner/graph.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidal.cli.main import main
from tidal.config import ConfigError
from tidal.models import GPTConfig
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Mesh, PlannerConfig
from tidal.planner.cost_model import evaluate
from tidal.planner.graph import ModelGraph, with_micro_batch
from tidal.planner.pipelines import PipelineOption, pipeline_options, search_pipelines, stage_graph
from tidal.planner.stage_split import _shapes, stage_splits
from tidal.planner.strategies import TrainingSpec

SPLITS = ("even", "time", "memory")
WIDE_HEAD = GPTConfig(vocab_size=1024, seq_len=128, num_layers=12, num_heads=4, d_model=64,
                      dropout=0.0)  # fmt: skip


def test_the_shapes_are_every_split_with_alike_middle_stages() -> None:
    """Brute force over every composition of 9 blocks into 4 stages of at least one: the shapes
    are exactly those whose middle stages hold the same count."""
    count, p = 9, 4
    every = [
        (a, b, c, count - a - b - c)
        for a in range(1, count)
        for b in range(1, count)
        for c in range(1, count)
        if count - a - b - c >= 1
    ]
    assert sorted(_shapes(count, p)) == sorted(s for s in every if s[1] == s[2])
    assert sorted(_shapes(count, 2)) == [(k, count - k) for k in range(1, count)]


@pytest.fixture(scope="module")
def wide_head() -> ModelGraph:
    """A GPT whose head and loss cost more than a block (a vocabulary 16x the width), as GPT-3
    1.3B's do ([Note: stage splits])."""
    return measure_gpt(WIDE_HEAD, micro_batch=1)


def test_the_time_split_unloads_the_head_and_the_memory_split_the_first_stage(
    wide_head: ModelGraph,
) -> None:
    cluster, spec = ClusterSpec(devices=4), TrainingSpec()
    splits = {s.kind: s for s in stage_splits(wide_head, 4, kinds=SPLITS, spec=spec,
                                              cluster=cluster)}  # fmt: skip
    assert splits["even"].blocks == (3, 3, 3, 3)
    assert splits["time"].last < splits["time"].middle  # the head's stage holds fewer blocks
    assert splits["memory"].first < splits["memory"].middle  # the most in flight, fewer blocks
    for split in splits.values():
        assert sum(split.blocks) == 12 and len(split.blocks) == 4
    # seven blocks do not split evenly into four stages: only the shaped splits are offered
    assert {s.kind for s in stage_splits(stage_graph(wide_head, blocks=7, first=True, last=True),
                                         4, kinds=SPLITS, spec=spec, cluster=cluster)} <= {"time", "memory"}  # fmt: skip


def _real_stages(option: PipelineOption, graph: ModelGraph) -> list[tuple[ModelGraph, float]]:
    """Every stage of the option's split with its micro-batches in flight (1F1B, m >= p)."""
    split, p = option.split, option.pp
    return [
        (stage_graph(graph, blocks=k, first=s == 0, last=s == p - 1), float(p - s))
        for s, k in enumerate(split.blocks)
    ]


def test_the_priced_stages_bound_every_stage_of_the_split(
    wide_head: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """[Note: stage splits]: every stage of a split, given the choices of the stage that prices
    it (the last its own; a middle one the middle stage's where it is solved, else the first's),
    needs no more memory and time than that stage's plan says."""
    cluster = ClusterSpec(devices=8, device_memory_bytes=64 * 1024**2)
    config = PlannerConfig(pareto=(), baselines=())
    meshes, problem = search_parts(wide_head, config)
    options = [o for o in pipeline_options(wide_head, cluster, global_batch=32, base=TrainingSpec(),
                                           meshes=meshes, schedules=("1f1b",), splits=SPLITS)
               if o.pp in (2, 4) and o.mesh.tp == 2]  # fmt: skip
    assert {o.split.kind for o in options} == set(SPLITS)
    assert any(o.split.needs_middle for o in options) and any(
        not o.split.is_even and not o.split.needs_middle for o in options
    )
    for option in options:
        option.build(problem)
        option.solve_fastest(memory_limit=cluster.device_memory_bytes, solver_time_limit_s=60)
        assert option.fastest is not None and all(s.feasible for s in option.fastest)
        plan = option.plan(option.fastest)
        first, last, *middle = plan.stages
        pricer = middle[0] if middle else first
        for s, (stage, in_flight) in enumerate(_real_stages(option, wide_head)):
            solved = first if s == 0 else last if s == option.pp - 1 else pricer
            priced = plan.costed[plan.stages.index(solved)]
            spec = dataclasses.replace(option.specs[0], in_flight=in_flight)
            assert solved.assignment is not None
            real = evaluate(stage, solved.assignment, option.cluster, spec)
            assert real.memory.total <= priced.memory.total * (1 + 1e-9), (option.split, s)
            assert real.step_time_s <= priced.step_time_s * (1 + 1e-9), (option.split, s)
        assert plan.peak_memory_bytes == max(plan.stage_peaks().values())


def test_the_bounded_search_over_splits_finds_what_solving_every_option_finds(
    wide_head: ModelGraph,
    search_parts: Callable[..., Any],
    matches_every_option: Callable[..., Any],
) -> None:
    """Every (p, split, dp, tp, micro-batch) option of a 12-block model on 4 devices solved
    against the search that solves only what its LP bounds cannot rule out."""
    memory = 24 * 1024**2
    cluster = ClusterSpec(devices=4, device_memory_bytes=memory)
    config = PlannerConfig(pareto=(), baselines=())
    meshes, problem = search_parts(wide_head, config)
    kwargs = dict(global_batch=8, base=TrainingSpec(), meshes=meshes, schedules=("1f1b",),
                  splits=SPLITS, micro_batches=(1, 2))  # fmt: skip
    search = search_pipelines(
        wide_head,
        cluster,
        problem=problem,
        memory_limit=memory,
        solver_time_limit_s=60,
        slack=0.05,
        **kwargs,
    )  # type: ignore[arg-type]
    every = pipeline_options(wide_head, cluster, **kwargs)  # type: ignore[arg-type]
    assert {(o.split.kind, o.micro_batch) for o in every} >= {
        (k, b) for k in SPLITS for b in (1, 2)
    }
    matches_every_option(search, every, problem, memory, slowdowns=(1.2, math.inf))


def test_a_trace_at_more_rows_is_the_trace_scaled_but_for_what_sequences_share() -> None:
    """[Note: micro-batch scaling]: tidal's GPT traced at micro-batches of 2 and 4 equals its
    trace at 1 scaled in every block and edge between units that hold rows; the few units whose
    tensors every row shares (positions, the position embedding, the loss's scalar) are
    over-counted by less than 1% of the graph's saved bytes."""
    config = GPTConfig(vocab_size=512, seq_len=64, num_layers=3, num_heads=4, d_model=64,
                       dropout=0.1)  # fmt: skip
    one = measure_gpt(config, micro_batch=1)
    for b in (2, 4):
        traced, scaled = measure_gpt(config, micro_batch=b), with_micro_batch(one, b)
        assert (scaled.micro_batch, scaled.blocks) == (b, traced.blocks)
        differ = {u.name for u, v in zip(scaled.units, traced.units, strict=True) if u != v}
        assert differ == {"[0]", "pos_embed", "[1]", "[2]"}  # positions, their embedding, loss
        assert all(traced.block_of(traced.unit(n)) is None for n in differ)
        over = sum(
            u.saved_bytes - v.saved_bytes for u, v in zip(scaled.units, traced.units, strict=True)
        )
        assert 0 <= over < 0.01 * sum(u.saved_bytes * u.count for u in traced.units)
        assert {(e.src, e.dst) for e, f in zip(scaled.edges, traced.edges, strict=True)
                if e != f} == {("[0]", "pos_embed"), ("pos_embed", "[1]")}  # fmt: skip
    assert one.micro_batch == 1  # the original is untouched


def test_the_search_traces_again_where_it_can(
    wide_head: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """``retrace`` gives the graph at each other size; without it the graph is scaled."""
    asked: list[int] = []

    def retrace(b: int) -> ModelGraph:
        asked.append(b)
        return measure_gpt(WIDE_HEAD, micro_batch=b)

    cluster = ClusterSpec(devices=2)
    meshes, _ = search_parts(wide_head, PlannerConfig(pareto=(), baselines=()))
    kwargs = dict(global_batch=4, base=TrainingSpec(), meshes=meshes, schedules=("1f1b",),
                  micro_batches=(1, 2))  # fmt: skip
    traced = pipeline_options(wide_head, cluster, retrace=retrace, **kwargs)  # type: ignore[arg-type]
    scaled = pipeline_options(wide_head, cluster, **kwargs)  # type: ignore[arg-type]
    assert asked == [2]
    (first_traced,) = {o.graphs[0].units[0].io_bytes for o in traced if o.micro_batch == 2}
    (first_scaled,) = {o.graphs[0].units[0].io_bytes for o in scaled if o.micro_batch == 2}
    assert first_traced == wide_head.units[0].io_bytes  # positions: one sequence's
    assert first_scaled == 2 * wide_head.units[0].io_bytes


def test_smaller_micro_batches_fit_where_larger_do_not(
    wide_head: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """Micro-batches of 4 rows hold four times a micro-batch of 1's activations: under a budget
    only the smaller fits, and each size's count of micro-batches follows the global batch."""
    cluster = ClusterSpec(devices=4)
    config = PlannerConfig(pareto=(), baselines=())
    meshes, _ = search_parts(wide_head, config)
    options = pipeline_options(wide_head, cluster, global_batch=8, base=TrainingSpec(),
                               meshes=meshes, schedules=("1f1b",), micro_batches=(1, 4, 3))  # fmt: skip
    sizes = {(o.micro_batch, o.mesh.dp, o.num_microbatches) for o in options}
    assert (1, 2, 4) in sizes and (4, 2, 1) in sizes and (4, 1, 2) in sizes
    assert not any(b == 3 for b, _, _ in sizes)  # 3 rows do not split 8 sequences
    (b4,) = [o for o in options if (o.pp, o.micro_batch, o.mesh) == (4, 4, Mesh(dp=1, tp=1))]
    (b1,) = [o for o in options if (o.pp, o.micro_batch, o.mesh) == (4, 1, Mesh(dp=1, tp=1))]
    acts = [g.units[5].saved_bytes for g in (b1.graphs[0], b4.graphs[0])]
    assert acts[1] == 4 * acts[0]
    assert "8 micro-batches of 1" in _describe(
        b1, search_parts
    ) and "2 micro-batches of 4" in _describe(b4, search_parts)


def _describe(option: PipelineOption, search_parts: Callable[..., Any]) -> str:
    _, problem = search_parts(option.graphs[0], PlannerConfig(pareto=(), baselines=()))
    option.build(problem)
    option.solve_fastest(memory_limit=math.inf, solver_time_limit_s=60)
    assert option.fastest is not None
    return option.plan(option.fastest).describe()


def test_tidal_plan_searches_splits_and_micro_batches(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "demo", "--devices", "8", "--schedules", "1f1b", "--pareto", "",
            "--baselines", "", "--objective", "time", "--stage-splits", "even,time,memory",
            "--micro-batches", "1,2", "--global-batch", "16", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    pipeline = json.loads(path.read_text())["pipeline_search"]
    assert pipeline["split"] in SPLITS and pipeline["micro_batch"] in (1, 2)
    assert sum(pipeline["stage_blocks"]) == 4 and len(pipeline["stage_blocks"]) == pipeline["pp"]
    with pytest.raises(ConfigError, match="stage_splits"):
        PlannerConfig(stage_splits=("balanced",))
    with pytest.raises(ConfigError, match="micro_batches"):
        PlannerConfig(micro_batches=(0,))


def test_a_bad_micro_batch_list_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "demo", "--devices", "8", "--micro-batches", "1,two"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--micro-batches" in err[0] and "two" in err[0]
