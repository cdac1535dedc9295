"""Pipeline stages in the planner's search (tidal/planner/pipelines.py): stage graphs, the
schedule's figures in the ILP and the cost model, and a bounded search that finds what solving
every option finds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from tidal.config import ConfigError
from tidal.models import PRESETS
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Mesh, PlannerConfig
from tidal.planner.cost_model import evaluate
from tidal.planner.graph import ModelGraph
from tidal.planner.pipelines import pipeline_options, search_pipelines, stage_graph
from tidal.planner.plan import Recompute
from tidal.planner.search import _problem
from tidal.planner.strategies import TrainingSpec, unit_options

GiB = 1024**3


def test_stage_graphs_split_the_blocks_and_the_ends(graph: ModelGraph) -> None:
    first = stage_graph(graph, blocks=2, first=True, last=False)
    last = stage_graph(graph, blocks=2, first=False, last=True)
    names = {u.name for u in graph.units}
    first_names, last_names = {u.name for u in first.units}, {u.name for u in last.units}
    assert "tok_embed" in first_names and "tok_embed" not in last_names
    assert "lm_head" in last_names and "lm_head" not in first_names
    assert first_names | last_names == names and "[2]" in last_names  # the loss
    for g in (first, last):
        assert g.blocks == {"blocks.*": 2}
        assert all(u.count == 2 for u in g.units if g.block_of(u))
        edge = {(e.src, e.dst): e for e in g.edges}
        assert edge[("blocks.*[1]", "blocks.*.ln_1")].count == 1  # block i feeds block i + 1
        assert edge[("blocks.*.ln_1", "blocks.*.attn.qkv")].count == 2
    # the head's weight is tied to the embedding, on the other stage: a copy of its own here
    (head,) = [u for u in last.units if u.name == "lm_head"]
    assert all(p.tied_to is None for p in head.params) and head.num_params > 0
    # one stage of every block is the model; two stages hold the tied weight twice
    whole = stage_graph(graph, blocks=8, first=True, last=True)
    assert whole.num_params == graph.num_params
    (embed,) = [u for u in graph.units if u.name == "tok_embed"]
    halves = (
        stage_graph(graph, blocks=4, first=True, last=False).num_params
        + stage_graph(graph, blocks=4, first=False, last=True).num_params
    )
    assert halves == graph.num_params + embed.num_params


def test_in_flight_and_time_slots_scale_activations_and_per_microbatch_time(
    graph: ModelGraph,
) -> None:
    """What the ILP solves is what the cost model prices: activations times the micro-batches
    in flight, per-micro-batch time times the slots, the gradient collectives once."""
    stage = stage_graph(graph, blocks=4, first=True, last=False)
    cluster, mesh = ClusterSpec(devices=4), Mesh(dp=2, tp=2)
    plain = TrainingSpec(num_microbatches=4)
    piped = dataclasses.replace(plain, in_flight=3.0, time_slots=4 + 1.5)
    config = PlannerConfig(pareto=(), baselines=(), pipelines=False)
    problem = _problem(stage, mesh, cluster, piped, config)
    solution = problem.solve(objective="time", memory_limit=math.inf)
    assert solution.assignment is not None
    mine, base = (
        evaluate(stage, solution.assignment, cluster, piped),
        evaluate(stage, solution.assignment, cluster, plain),
    )
    assert solution.peak_bytes == pytest.approx(mine.memory.total, rel=1e-6)
    assert solution.step_time_s == pytest.approx(mine.step_time_s, rel=1e-6)
    assert mine.memory.activations == pytest.approx(3 * base.memory.activations, rel=1e-9)
    assert mine.memory.params == base.memory.params
    sync = sum(
        u.count * solution.assignment.choice[u.name].sync_s for u in stage.units
    )  # the per-step collectives, which the slots do not multiply
    per_microbatch = (base.step_time_s - sync) / 4
    assert mine.step_time_s == pytest.approx(sync + 5.5 * per_microbatch, rel=1e-9)
    assert unit_options(stage, mesh, cluster, piped) == unit_options(stage, mesh, cluster, plain)


@pytest.mark.parametrize("memory", [64 * 1024**2, 24 * 1024**2])
def test_the_bounded_search_finds_what_solving_every_option_finds(
    graph: ModelGraph, memory: int, search_parts: Callable[..., Any]
) -> None:
    """Every (p, dp, tp, v) of an 8-block model on 8 devices solved exhaustively against the
    search that solves only what its LP bounds cannot rule out: the same fastest step, and the
    same smallest plan at a step-time limit and at any speed."""
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory)
    config = PlannerConfig(pareto=(), baselines=())
    meshes, problem = search_parts(graph, config)
    base = TrainingSpec()
    search = search_pipelines(graph, cluster, global_batch=16, base=base, meshes=meshes,
                              problem=problem, memory_limit=memory, solver_time_limit_s=60,
                              slack=0.05)  # fmt: skip
    every = pipeline_options(graph, cluster, global_batch=16, base=base, meshes=meshes)
    assert len(every) == len(search.options) > 10
    assert {(o.pp, o.vp) for o in every} >= {(2, 1), (2, 2), (4, 1), (4, 2), (8, 1)}
    for option in every:
        option.build(problem)
        option.solve_fastest(memory_limit=memory, solver_time_limit_s=60)
    fastest = min(o.fastest_s for o in every)
    assert math.isfinite(fastest)
    assert search.fastest is not None
    assert search.fastest.fastest_s == pytest.approx(fastest, rel=1e-3)
    assert search.num_solved < len(every)  # the bounds ruled some out
    for limit in (1.2 * fastest, math.inf):
        plans = [o.smallest(memory_limit=memory, time_limit=limit, solver_time_limit_s=60)
                 for o in every]  # fmt: skip
        smallest = min(p.peak_memory_bytes for p in plans if p is not None)
        found = search.smallest(time_limit=limit)
        assert found is not None
        assert found.peak_memory_bytes == pytest.approx(smallest, rel=1e-3)
        assert found.step_time_s <= limit * (1 + 1e-6)
        assert found.peak_memory_bytes <= memory * (1 + 1e-6)


def test_interleaving_holds_more_micro_batches_and_shrinks_the_bubble(
    graph: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """[Note: pipeline stages]: 1F1B holds min(p, m) on the first stage and one on the last;
    v chunks hold p + (p - 1)/v and p - (p - 1)/v, and the bubble is (p - 1)/v."""
    cluster = ClusterSpec(devices=8)
    meshes, _ = search_parts(graph, PlannerConfig(pareto=(), baselines=()))
    options = pipeline_options(graph, cluster, global_batch=16, base=TrainingSpec(),
                               meshes=meshes)  # fmt: skip
    four = {o.vp: o for o in options if o.pp == 4 and o.mesh == Mesh(dp=2, tp=1)}
    assert set(four) == {1, 2}
    one, two = four[1], four[2]
    assert one.num_microbatches == two.num_microbatches == 8
    assert [s.in_flight for s in one.specs] == [4.0, 1.0]
    assert [s.in_flight for s in two.specs] == [4 + 3 / 2, 4 - 3 / 2]
    assert one.specs[0].slots == 8 + 3 and two.specs[0].slots == 8 + 3 / 2


def test_gpt3_175b_on_64_devices_pipelined_against_megatrons_best(
    search_parts: Callable[..., Any],
) -> None:
    """The pipelined search on GPT-3 175B's stages at 64 devices, restricted to Megatron's
    fastest fitting layout (t4 x p16, interleaved): the stages' ILP finds a plan within 5% of
    its step time that holds less (the whole search's figures are in docs/planner.md)."""
    from tidal.planner.megatron import (
        MegatronConfig,
        TransformerShape,
        megatron_memory,
        megatron_step_s,
    )

    config = dataclasses.replace(PRESETS["gpt3-175b"], dropout=0.1)
    graph = measure_gpt(config, micro_batch=1)
    cluster = ClusterSpec(devices=64)
    planner = PlannerConfig(pareto=(), baselines=())
    meshes, problem = search_parts(graph, planner)
    options = [
        o
        for o in pipeline_options(
            graph, cluster, global_batch=64, base=TrainingSpec(), meshes=meshes
        )  # fmt: skip
        if (o.pp, o.mesh, o.vp) == (16, Mesh(dp=1, tp=4), 6)
    ]
    (option,) = options
    option.build(problem)
    option.solve_fastest(memory_limit=cluster.device_memory_bytes, solver_time_limit_s=60)
    shape = TransformerShape(num_layers=96, hidden=12288, heads=96, ffn=4 * 12288, seq_len=2048,
                             vocab=50257)  # fmt: skip
    megatron = MegatronConfig(tp=4, pp=16, dp=1, micro_batch=1, num_microbatches=64, vp=6,
                              recompute=Recompute.SELECTIVE, distributed_optimizer=False)  # fmt: skip
    their_s = megatron_step_s(shape, megatron, cluster)
    their_bytes = megatron_memory(shape, megatron).total
    plan = option.smallest(memory_limit=cluster.device_memory_bytes,
                           time_limit=1.05 * their_s, solver_time_limit_s=60)  # fmt: skip
    assert plan is not None
    assert plan.step_time_s <= 1.05 * their_s * (1 + 1e-6)
    assert plan.peak_memory_bytes < 0.95 * their_bytes


def test_pipemare_never_drains_and_holds_a_weight_copy_more(
    graph: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """[Note: pipeline stages]: PipeMare (opt-in) takes m slots and p micro-batches in flight on
    the first stage whatever m is; each stage holds its delta, one weight-sized copy more, and
    builds a unit's corrected weights in its backward. On the same stages it is faster than
    1F1B and holds more."""
    cluster = ClusterSpec(devices=4)
    config = PlannerConfig(pareto=(), baselines=())
    meshes, problem = search_parts(graph, config)
    options = pipeline_options(graph, cluster, global_batch=2, base=TrainingSpec(),
                               meshes=meshes, schedules=("1f1b", "pipemare"))  # fmt: skip
    pair = {o.schedule: o for o in options if o.pp == 4 and o.mesh == Mesh(dp=1, tp=1)}
    sync, pipemare = pair["1f1b"], pair["pipemare"]
    assert sync.num_microbatches == pipemare.num_microbatches == 2
    assert [s.in_flight for s in sync.specs] == [2.0, 1.0]  # 1F1B: min(p, m)
    assert [s.in_flight for s in pipemare.specs] == [4.0, 1.0]
    assert sync.specs[0].slots == 2 + 3 and pipemare.specs[0].slots == 2
    for option in (sync, pipemare):
        option.build(problem)
        option.solve_fastest(memory_limit=math.inf, solver_time_limit_s=60)
    assert pipemare.fastest_s < sync.fastest_s
    assert pipemare.fastest is not None
    stage, spec = pipemare.graphs[0], pipemare.specs[0]
    held = unit_options(stage, pipemare.mesh, pipemare.cluster, spec)
    plain = unit_options(stage, pipemare.mesh, pipemare.cluster,
                         dataclasses.replace(spec, weight_copies=0.0))  # fmt: skip
    qkv = "blocks.*.attn.qkv"
    for mine, theirs in zip(held[qkv], plain[qkv], strict=True):
        assert mine.memory.params == pytest.approx(2 * theirs.memory.params, rel=1e-12)
        extra = mine.memory.transient - theirs.memory.transient
        assert extra == pytest.approx(theirs.memory.params, rel=1e-12)
    assert "PipeMare" in pipemare.plan(pipemare.fastest).describe()
    with pytest.raises(ConfigError, match="schedules: unknown"):
        PlannerConfig(schedules=("gpipe",))


def test_micro_batches_in_flight_are_what_the_schedule_holds() -> None:
    """Each option's first and last stage hold, in the planner, the most micro-batches' worth of
    blocks the generated schedule has on rank 0 and rank p - 1 at once (forwards less backwards
    at its worst, a model chunk counting 1 / v): interleaved with m = p caps at m (priced at
    p + (p - 1) / v before, 25% over on the demo GPT's chunk stages)."""
    from tidal.pipeline.ir import Kind
    from tidal.pipeline.schedules import interleaved_1f1b, one_f_one_b

    graph = measure_gpt(dataclasses.replace(PRESETS["tiny"], num_layers=12), micro_batch=1)
    cluster = ClusterSpec(devices=4)
    checked = 0
    options = [o for batch in (4, 8, 48)  # m = p, 2p and more
               for o in pipeline_options(graph, cluster, global_batch=batch, base=TrainingSpec(),
                                         meshes=lambda stage: [Mesh(dp=stage.devices, tp=1)])]  # fmt: skip
    assert any(o.schedule == "interleaved" and o.num_microbatches == o.pp for o in options)
    for option in options:
        p, v, m = option.pp, option.vp, option.num_microbatches
        if option.schedule == "interleaved":
            programs = interleaved_1f1b(stages=p, microbatches=m, virtual=v).programs
        elif option.schedule == "1f1b":
            programs = one_f_one_b(stages=p, microbatches=m).programs
        else:
            continue
        held = []
        for program in (programs[0], programs[p - 1]):
            live = most = 0
            for action in program:
                live += (action.kind is Kind.FORWARD) - (action.kind is Kind.BACKWARD)
                most = max(most, live)
            held.append(most / v)
        first, last = option.specs[0].in_flight, option.specs[1].in_flight
        assert (first, last) == pytest.approx(tuple(held)), (option.schedule, p, v, m, held)
        checked += 1
    assert checked >= 6
