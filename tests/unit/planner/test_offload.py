"""Optimizer state on the host in the planner's search ([Note: optimizer offload] in
tidal/planner/strategies.py): what a unit keeps and adds, the host-memory row, a search over the
fractions equal to solving each one, the ZeRO-3 offload baseline, and plans with offload priced,
not run."""

from __future__ import annotations

import dataclasses
import math

import pytest
from torch import nn

from tidal.config import ConfigError
from tidal.planner import ClusterSpec, Infeasible, Mesh, PlannerConfig, make_plan
from tidal.planner.check import check_plan
from tidal.planner.graph import ModelGraph
from tidal.planner.pipelines import pipeline_options, search_pipelines
from tidal.planner.search import _problem, _spec, meshes_for
from tidal.planner.strategies import TrainingSpec, candidates, valid_tensor_sizes

MiB = 1024**2
FLAT = PlannerConfig(pareto=(), baselines=(), pipelines=False)


def test_a_unit_keeps_on_the_device_what_it_does_not_offload(graph: ModelGraph) -> None:
    cluster, mesh = ClusterSpec(devices=8), Mesh(dp=4, tp=2)
    unit = graph.unit("blocks.*.mlp.fc")
    kept = candidates(unit, mesh, cluster, TrainingSpec())
    half = candidates(unit, mesh, cluster, TrainingSpec(offload=0.5))
    assert len(kept) == len(half) > 4
    for a, b in zip(kept, half, strict=True):
        assert (a.strategy, a.zero) == (b.strategy, b.zero)
        owned = a.memory.optimizer / 12  # parameters whose update this device runs
        assert owned == pytest.approx(unit.num_params / (2 if a.placements[0] != "R" else 1)
                                      / (4 if a.zero >= 1 else 1))  # fmt: skip
        assert b.memory.optimizer == pytest.approx(a.memory.optimizer / 2)
        assert b.memory.host == pytest.approx(a.memory.optimizer / 2) and a.memory.host == 0
        assert (b.memory.params, b.memory.grads) == (a.memory.params, a.memory.grads)
        added = owned / 2 * (4 / cluster.host_link_bandwidth + 8 / cluster.host_adam_params_per_s)
        assert b.sync_s - a.sync_s == pytest.approx(added)


def test_offload_makes_room_within_the_host_memory(graph: ModelGraph) -> None:
    cluster = ClusterSpec(devices=8, device_memory_bytes=3 * MiB)
    with pytest.raises(Infeasible):
        make_plan(graph, cluster, FLAT)
    result = make_plan(graph, cluster, dataclasses.replace(FLAT, offload=(0.0, 0.5, 1.0)))
    plan = result.plan
    assert plan.offload > 0 and plan.peak_memory_bytes <= 3 * MiB
    assert 0 < plan.memory.host <= cluster.host_bytes_per_device
    # a host too small for the state: each offloaded problem is infeasible, said in one line
    small = dataclasses.replace(cluster, host_memory_per_node_bytes=8 * MiB)
    with pytest.raises(ConfigError, match=r"offload: no plan's optimizer state fits the host"):
        make_plan(graph, small, dataclasses.replace(FLAT, offload=(1.0,)))
    roomy = dataclasses.replace(cluster, device_memory_bytes=8 * MiB)
    assert make_plan(graph, roomy, dataclasses.replace(FLAT, offload=(0.0, 1.0))).plan.offload == 0


@pytest.mark.parametrize("memory", [5 * MiB, 3 * MiB])
def test_the_search_over_offload_equals_solving_each_fraction(
    graph: ModelGraph, memory: int
) -> None:
    """The flat search with offload fractions against every (mesh, fraction) solved alone: the
    fastest fitting step, then the least memory within eps of it."""
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory)
    config = dataclasses.replace(FLAT, offload=(0.0, 0.5, 1.0))
    result = make_plan(graph, cluster, config)
    problems = [
        _problem(graph, mesh, cluster, _spec(graph, mesh, config, 8, f), config)
        for mesh in meshes_for(graph, cluster, config)
        for f in config.offload
    ]
    # solved as the search solves them (no second solve for ties: the memory objective's)
    fastest = min(
        p.solve(objective="time", memory_limit=memory, refine=False).step_time_s for p in problems
    )
    assert result.fastest_s == pytest.approx(fastest, rel=1e-6)
    smallest = min(
        p.solve(objective="memory", memory_limit=memory,
                time_limit=(1 + config.eps) * fastest * (1 + 1e-9)).peak_bytes
        for p in problems
    )  # fmt: skip
    assert result.plan.peak_memory_bytes == pytest.approx(smallest, rel=1e-6)


def test_the_pipeline_search_with_offload_finds_what_solving_every_option_finds(
    graph: ModelGraph,
) -> None:
    memory = 3 * MiB
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory)

    def meshes(stage: ClusterSpec) -> list[Mesh]:
        sizes = valid_tensor_sizes(graph.units, stage.devices, stage.devices_per_node)
        return [Mesh(dp=stage.devices // t, tp=t) for t in sizes]

    def problem(g, mesh, stage, spec):  # noqa: ANN001, ANN202
        return _problem(g, mesh, stage, spec, FLAT)

    offloads = (0.0, 1.0)
    search = search_pipelines(graph, cluster, global_batch=16, base=TrainingSpec(),
                              meshes=meshes, problem=problem, memory_limit=memory,
                              solver_time_limit_s=60, slack=0.05, offloads=offloads)  # fmt: skip
    every = pipeline_options(graph, cluster, global_batch=16, base=TrainingSpec(), meshes=meshes,
                             offloads=offloads)  # fmt: skip
    assert {o.specs[0].offload for o in every} == set(offloads)
    for option in every:
        option.build(problem)
        option.solve_fastest(memory_limit=memory, solver_time_limit_s=60)
    fastest = min(o.fastest_s for o in every)
    assert math.isfinite(fastest) and search.fastest is not None
    assert search.fastest.fastest_s == pytest.approx(fastest, rel=1e-3)
    plans = [o.smallest(memory_limit=memory, time_limit=math.inf, solver_time_limit_s=60)
             for o in every]  # fmt: skip
    found = search.smallest(time_limit=math.inf)
    assert found is not None
    assert found.peak_memory_bytes == pytest.approx(
        min(p.peak_memory_bytes for p in plans if p is not None), rel=1e-3
    )
    # without the host, nothing fits these stages' devices
    plain = pipeline_options(graph, cluster, global_batch=16, base=TrainingSpec(), meshes=meshes)
    for option in plain:
        option.build(problem)
    assert all(
        o.solve_fastest(memory_limit=memory, solver_time_limit_s=60) == math.inf for o in plain
    )


def test_the_zero3_offload_baseline_moves_its_optimizer_state_to_the_host(
    graph: ModelGraph,
) -> None:
    config = dataclasses.replace(FLAT, baselines=("zero3_full", "zero3_offload"))
    result = make_plan(graph, ClusterSpec(devices=8), config)
    full, offload = result.baselines["zero3_full"], result.baselines["zero3_offload"]
    assert full.costed is not None and offload.costed is not None
    assert offload.costed.memory.optimizer == 0 and full.costed.memory.host == 0
    assert offload.costed.memory.host == pytest.approx(full.costed.memory.optimizer)
    assert offload.costed.memory.params == pytest.approx(full.costed.memory.params)
    assert offload.step_time_s > full.step_time_s


def test_a_plan_with_offload_is_priced_not_run(graph: ModelGraph) -> None:
    plan = make_plan(graph, ClusterSpec(devices=8), FLAT).plan
    with pytest.raises(ValueError, match="priced but not run yet"):
        check_plan(nn.Linear(2, 2), dataclasses.replace(plan, offload=0.5))
