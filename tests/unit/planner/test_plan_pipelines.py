"""Pipelined plans as plans (issue 51): the format that describes them, the stage each rank
realises, the choice between the flat and the pipelined plan, and the two facts of a stage's
graph the runtime forced on the search."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tidal.cli.plan_command import train_argv
from tidal.config import ConfigError
from tidal.models import preset
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Plan, PlannerConfig, make_plan
from tidal.planner.check import not_run
from tidal.planner.graph import ModelGraph
from tidal.planner.pipelines import stage_graph
from tidal.planner.plan import Recompute
from tidal.planner.report import plan_report
from tidal.planner.wiring import code_to_code, derive_wiring

QUICK = {"pareto": (), "baselines": ()}


@pytest.fixture(scope="module")
def four_blocks() -> ModelGraph:
    """The tiny GPT with four blocks, and dropout: its dropout units are in the graph."""
    model = dataclasses.replace(preset("tiny"), num_layers=4, dropout=0.1)
    return measure_gpt(model, micro_batch=1)


@pytest.fixture(scope="module")
def interleaved(four_blocks: ModelGraph) -> Plan:
    config = PlannerConfig(pp=2, tp=1, schedules=("interleaved",), **QUICK)
    return make_plan(four_blocks, ClusterSpec(devices=4), config).plan


def test_a_pipelined_plan_says_what_each_stage_holds_and_does(interleaved: Plan) -> None:
    layout = interleaved.pipeline
    assert layout is not None and (layout.pp, layout.virtual_stages) == (2, 2)
    assert layout.schedule == "interleaved" and interleaved.devices == 4 == 2 * interleaved.dp
    assert layout.block_ranges == ((0, 1), (1, 2), (2, 3), (3, 4))  # k / v blocks a chunk
    assert layout.kinds == ("first", "last", "first", "last")  # each stage its rank's kind
    assert interleaved.mesh_name == f"pp 2 x dp {interleaved.dp} x tp 1"
    # stage 2 is rank 0's second chunk: the first stage's choices, on its one block, no embedding
    second = interleaved.stage_plan(2)
    assert {u.count for u in second.units} == {1} and "tok_embed" not in {
        u.name for u in second.units
    }
    assert second.devices == interleaved.dp and second.pipeline is None
    assert "tok_embed" in {u.name for u in interleaved.stage_plan(0).units}
    assert "lm_head" in {u.name for u in interleaved.stage_plan(3).units}
    # a rank's chunks together are one of the planner's stages: rank 1 holds the last, so its
    # first chunk realises the last stage's choices and offload, as the rank was priced
    assert (layout.rank_kind(0), layout.rank_kind(1)) == ("first", "last")
    # (the last stage's choices made unlike the first's, so that taking either shows)
    last = dataclasses.replace(layout.stages["last"], recompute={"marker": Recompute.FULL},
                               units=[dataclasses.replace(u, zero=2) for u in layout.stages["last"].units])  # fmt: skip
    assert last.units != layout.stages["first"].units
    marked = dataclasses.replace(
        interleaved, pipeline=dataclasses.replace(layout, stages={**layout.stages, "last": last})
    )
    one = marked.stage_plan(1)
    blocks = {u.name: u for u in last.units if "*" in u.module}
    assert {u.name: dataclasses.replace(u, count=last.blocks) for u in one.units} == blocks
    assert one.offload is last.offload and one.recompute == {"marker": Recompute.FULL}
    assert interleaved.rank_memory(1) is layout.stages["last"].memory
    assert interleaved.memory.total == max(c.memory.total for c in layout.stages.values())


def test_the_format_round_trips_and_an_older_one_is_one_line(interleaved: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    interleaved.save(path)
    again = Plan.load(path)
    assert again.to_dict() == interleaved.to_dict()
    assert again.pipeline == interleaved.pipeline
    data = json.loads(path.read_text())
    data["format"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format 1, written by another version") as err:
        Plan.load(path)
    assert "\n" not in str(err.value)


def test_the_better_of_the_flat_and_the_pipelined_plan_is_chosen() -> None:
    """demo on 16 devices: the pipelined plan holds less within eps of the fastest, so it is
    the plan; --pp 1 keeps the flat one, which is the search's best flat plan either way."""
    graph = measure_gpt(preset("demo"), micro_batch=1)
    cluster = ClusterSpec(devices=16)
    chosen = make_plan(graph, cluster, PlannerConfig(**QUICK))
    flat = make_plan(graph, cluster, PlannerConfig(pp=1, **QUICK))
    assert chosen.plan.pipeline is not None and flat.plan.pipeline is None
    assert chosen.flat is not None and chosen.flat.to_dict() == flat.plan.to_dict()
    assert chosen.plan.peak_memory_bytes < flat.plan.peak_memory_bytes
    fastest = min(flat.fastest_s, chosen.pipelines.fastest.fastest_s)
    assert chosen.plan.step_time_s <= 1.05 * fastest * (1 + 1e-9)
    # the report's fastest plan that fits is the faster kind's (the pipelined one's here)
    assert plan_report(chosen, cluster)["fastest_step_time_s"] == fastest < flat.fastest_s
    timed = make_plan(graph, cluster, PlannerConfig(objective="time", **QUICK)).plan
    assert timed.step_time_s <= min(flat.plan.step_time_s, chosen.plan.step_time_s) + 1e-12
    with pytest.raises(ConfigError, match="pp: asks for 2 pipeline stages"):
        PlannerConfig(pp=2, pipelines=False)


def test_code_hands_code_its_tensor_as_made(four_blocks: ModelGraph) -> None:
    """The ILP may not convert between two runs of a forward's own code (no hook runs there),
    except into a block, whose pre-hook converts, and out of position code, which is whole."""
    pairs = code_to_code(four_blocks)
    assert ("blocks.*[0]", "blocks.*[1]") in pairs  # the two residual adds of a block
    assert ("blocks.*[1]", "blocks.*[0]") not in pairs  # enters the next block
    wiring = derive_wiring(four_blocks)
    for src, dst in pairs:
        assert wiring.units[src].segment is not None and wiring.units[dst].segment is not None


def test_a_stage_after_the_first_reads_the_stream_it_is_handed(four_blocks: ModelGraph) -> None:
    """Its blocks' own code reads what the stage before sends (not position code, whose layout
    is whole), as the first stage's reads what its embedding makes."""
    for first in (True, False):
        stage = stage_graph(four_blocks, blocks=2, first=first, last=not first)
        assert stage.handed is not first
        roles = {n: u.role for n, u in derive_wiring(stage).units.items()}
        assert roles["blocks.*[0]"] == roles["blocks.*[1]"] == "elementwise"
        assert roles["blocks.*.attn.resid_drop"] == "dropout"


def test_pipemare_plans_are_of_stages_it_can_version(four_blocks: ModelGraph) -> None:
    """[Note: PipeMare plans]: where 1F1B shards units or recomputes blocks to hold less,
    PipeMare's stages keep every unit whole on each data rank on one tensor rank and recompute
    nothing, so a run carries them out; a PipeMare plan on sharded units (no tidal plan's) is
    refused in one line naming what it cannot version."""
    cluster = ClusterSpec(devices=4)
    synchronous = make_plan(four_blocks, cluster, PlannerConfig(pp=2, tp=1, **QUICK)).plan
    assert synchronous.pipeline is not None
    sharded = {u.zero for c in synchronous.pipeline.stages.values() for u in c.units}
    assert sharded != {0}  # what PipeMare is held back from
    config = PlannerConfig(pp=2, schedules=("pipemare",), recompute=tuple(Recompute), **QUICK)
    plan = make_plan(four_blocks, cluster, config).plan
    layout = plan.pipeline
    assert layout is not None and layout.schedule == "pipemare" and plan.tp == 1
    assert {u.zero for c in layout.stages.values() for u in c.units} == {0}
    assert {m for c in layout.stages.values() for m in c.recompute.values()} == {Recompute.NONE}
    assert not any(plan.offloads()) and not_run(plan) == []
    # the command tidal plan prints trains it in fp32, an asynchronous schedule's precision
    asynchronous, synchronous_argv = (
        train_argv(p, plan_path="p.json", recipe="tiny", settings=[], devices_per_node=8)
        for p in (plan, synchronous)
    )
    assert "training.precision=fp32" in asynchronous and "--nproc" in asynchronous
    assert "training.precision=fp32" not in synchronous_argv
    stages = {k: dataclasses.replace(c, units=[dataclasses.replace(u, zero=3) for u in c.units])
              for k, c in layout.stages.items()}  # fmt: skip
    edited = dataclasses.replace(plan, pipeline=dataclasses.replace(layout, stages=stages))
    (gap,) = not_run(edited)
    assert (
        gap.why.startswith("the plan runs pipemare on ZeRO-sharded units") and "\n" not in gap.why
    )
