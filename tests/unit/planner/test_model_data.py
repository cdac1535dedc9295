"""Which transform holds a plan stage's model data ([Note: chunk stages in plans] in
tidal/planner/model_data.py): the choice ``--model-data`` makes after the search, the budgets
it writes, the format that keeps them, and the one-line refusal of a hand-made plan that asks
chunks for a stage they cannot hold."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tidal.config import ConfigError
from tidal.models import preset
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Plan, PlannerConfig, make_plan
from tidal.planner.check import not_run
from tidal.planner.graph import ModelGraph
from tidal.planner.model_data import chunk_budgets, chunk_refusal, with_model_data
from tidal.planner.plan import ChunkBudgets, Recompute

QUICK = {"pareto": (), "baselines": ()}
ON_HOST = {"offload": (1.0,), "offload_params": (1.0,)}


@pytest.fixture(scope="module")
def tiny() -> ModelGraph:
    return measure_gpt(dataclasses.replace(preset("tiny"), dropout=0.0), micro_batch=1)


def _plan(graph: ModelGraph, devices: int = 4, **config) -> Plan:  # noqa: ANN003
    cluster = ClusterSpec(devices=devices, nvme_bytes_per_node=2**40)
    return make_plan(graph, cluster, PlannerConfig(**QUICK, **config)).plan


def test_auto_gives_chunks_the_stages_that_keep_model_data_off_the_device(tiny) -> None:
    offloaded = _plan(tiny, pp=2, tp=1, model_data="auto", **ON_HOST)
    on_device = _plan(tiny, pp=2, tp=1, model_data="auto")
    assert [offloaded.rank_chunks(r) is not None for r in (0, 1)] == [True, True]
    assert [on_device.rank_chunks(r) for r in (0, 1)] == [None, None]
    for r in (0, 1):  # each kind's budgets are its own figures
        budgets, memory = offloaded.rank_chunks(r), offloaded.rank_memory(r)
        assert budgets == ChunkBudgets(device_bytes=math.ceil(memory.total),
                                       activation_bytes=math.floor(memory.activations))  # fmt: skip
    assert offloaded.chunks == offloaded.rank_chunks(0)  # a pipelined plan's: its first stage's
    # fsdp2 (the default) leaves every stage to FSDP2, chunks takes every stage they can hold
    assert _plan(tiny, pp=2, tp=1, **ON_HOST).rank_chunks(0) is None
    assert _plan(tiny, pp=2, tp=1, model_data="chunks").rank_chunks(0) is not None


def test_chunks_hold_only_the_stages_their_runtime_can(tiny) -> None:
    """Tensor-parallel stages, units below ZeRO-3 on a data axis, swapped or lent blocks, and
    asynchronous schedules stay FSDP2's, each named."""
    split = _plan(tiny, pp=2, tp=2, model_data="chunks", eps=1000.0)
    assert split.tp == 2 and split.rank_chunks(0) is None
    assert "tensor-parallel" in chunk_refusal(split, split.stage_plan(0))
    plan = _plan(tiny, pp=2, tp=1, model_data="auto", **ON_HOST)
    stage = plan.stage_plan(0)
    assert chunk_refusal(plan, stage) == ""
    below = dataclasses.replace(stage, units=[dataclasses.replace(u, zero=1) for u in stage.units])
    assert "not ZeRO-3" in chunk_refusal(plan, below)
    assert chunk_refusal(plan, dataclasses.replace(below, dp=1)) == ""  # nothing to shard over
    swapped = dataclasses.replace(stage, recompute={"blocks.*": Recompute.SWAP})
    assert "swaps blocks" in chunk_refusal(plan, swapped)
    lent = dataclasses.replace(stage, memory=dataclasses.replace(stage.memory, lent=1.0))
    assert "lends" in chunk_refusal(plan, lent)
    pipemare = dataclasses.replace(
        plan, pipeline=dataclasses.replace(plan.pipeline, schedule="pipemare")
    )
    assert "pipemare" in chunk_refusal(pipemare, stage)


def test_chunks_keep_the_plans_share_of_the_state_on_nvme(tiny) -> None:
    """A stage with all of its model data off the device and part of its optimizer state on
    NVMe: the chunks' disk tier keeps that share (``nvme_fraction``); with part of it on the
    device the stage stays FSDP2's (sharded chunks keep every shard on the host), named."""
    plan = _plan(tiny, devices=1, pp=1, offload=(1.0,), offload_params=(1.0,),
                 offload_nvme=(0.5,), model_data="chunks")  # fmt: skip
    assert plan.memory.nvme > 0 and plan.chunks == chunk_budgets(plan)
    assert plan.chunks.nvme_fraction == 0.5 and "50% of the state on NVMe" in plan.chunks.describe()
    assert not_run(plan) == []
    part = _plan(tiny, devices=1, pp=1, offload=(0.5,), offload_nvme=(0.5,), model_data="chunks")
    assert part.memory.nvme > 0 and part.chunks is None
    assert "on NVMe with part of its model data on the device" in chunk_refusal(part, part)
    on_host = _plan(tiny, devices=1, pp=1, offload=(1.0,), offload_params=(1.0,),
                    model_data="auto")  # fmt: skip
    assert on_host.chunks == chunk_budgets(on_host) and on_host.chunks is not None
    assert on_host.chunks.device_bytes == math.ceil(on_host.memory.total)
    assert on_host.chunks.nvme_fraction == 0.0


def test_the_budgets_round_trip_and_a_hand_made_plan_is_refused_in_one_line(tiny, tmp_path) -> None:
    plan = _plan(tiny, pp=2, tp=1, model_data="auto", **ON_HOST)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == plan.to_dict() and again.rank_chunks(1) == plan.rank_chunks(1)
    disk = dataclasses.replace(plan, chunks=ChunkBudgets(device_bytes=10, nvme_fraction=0.25))
    disk.save(path)
    assert Plan.load(path).chunks == disk.chunks
    assert not_run(plan) == []
    # chunks asked for on units below ZeRO-3 over two data ranks: one line, naming the fix
    layout = plan.pipeline
    first = layout.stages["first"]
    edited = dataclasses.replace(first, units=[dataclasses.replace(u, zero=2) for u in first.units])
    bad = dataclasses.replace(
        plan, pipeline=dataclasses.replace(layout, stages={**layout.stages, "first": edited})
    )
    (gap,) = not_run(bad)
    assert "not ZeRO-3" in gap.why and "--model-data fsdp2" in gap.why and "\n" not in gap.why
    with pytest.raises(ConfigError, match="model_data"):
        PlannerConfig(model_data="zero3")


def test_the_choice_does_not_move_the_search(tiny) -> None:
    """The same bytes are priced either way: the plan differs only in what holds them."""
    fsdp2 = _plan(tiny, pp=2, tp=1, model_data="fsdp2", **ON_HOST)
    chunks = with_model_data(fsdp2, "auto")
    assert chunks.rank_chunks(0) is not None
    assert dataclasses.replace(chunks, chunks=None, pipeline=fsdp2.pipeline) == fsdp2
    assert chunks.step_time_s == fsdp2.step_time_s and chunks.memory == fsdp2.memory
