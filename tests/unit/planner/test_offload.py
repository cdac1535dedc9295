"""Model data off the device in the planner's search ([Note: model data offload] in
tidal/planner/strategies.py): what a unit keeps, moves and adds under each fraction (optimizer
state, parameters, NVMe), the host and disk rows, a search over the fractions equal to solving
each one, the offload baselines (ZeRO-3 offload, FSDP2 CPU offload, ZeRO-Infinity), and plans
with offload priced, not run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from tidal.config import ConfigError
from tidal.planner import ClusterSpec, Infeasible, Mesh, PlannerConfig, Recompute, make_plan
from tidal.planner.check import check_plan
from tidal.planner.emit import to_pipelined_plan
from tidal.planner.graph import ModelGraph
from tidal.planner.pipelines import pipeline_options, search_pipelines
from tidal.planner.plan import Offload, Plan
from tidal.planner.search import _problem, _spec, meshes_for
from tidal.planner.strategies import Candidate, TrainingSpec, candidates, valid_tensor_sizes

MiB = 1024**2
TiB = 1024**4
FLAT = PlannerConfig(pareto=(), baselines=(), pipelines=False)


def _pairs(graph: ModelGraph, offload: Offload, m: int = 1) -> list[tuple[Candidate, Candidate]]:
    """blocks.*.mlp.fc's candidates on dp 4 x tp 2 without and with ``offload``, paired."""
    cluster, mesh = ClusterSpec(devices=8), Mesh(dp=4, tp=2)
    unit = graph.unit("blocks.*.mlp.fc")
    kept = candidates(unit, mesh, cluster, TrainingSpec(num_microbatches=m))
    moved = candidates(unit, mesh, cluster, TrainingSpec(num_microbatches=m, offload=offload))
    assert len(kept) == len(moved) > 4 and {c.zero for c in kept} == {0, 1, 2, 3}
    for a, b in zip(kept, moved, strict=True):
        assert (a.strategy, a.zero) == (b.strategy, b.zero)
    return list(zip(kept, moved, strict=True))


def _owned(graph: ModelGraph, cand: Candidate) -> float:
    """The parameters whose update this device runs."""
    unit = graph.unit("blocks.*.mlp.fc")
    split = 2 if cand.placements[0] != "R" else 1
    return unit.num_params / split / (4 if cand.zero >= 1 else 1)


def test_the_optimizer_on_the_host_takes_its_state_and_sharded_gradients(graph: ModelGraph) -> None:
    cluster, m = ClusterSpec(devices=8), 3
    for a, b in _pairs(graph, Offload(optimizer=0.5), m=m):
        owned = _owned(graph, a)
        assert a.memory.optimizer == pytest.approx(12 * owned) and a.memory.host == 0
        assert b.memory.optimizer == pytest.approx(6 * owned)
        # sharded gradients (ZeRO >= 2) go down as each micro-batch reduces them; whole ones stay
        moved_grads = 2 * owned / 2 if a.zero >= 2 else 0.0
        assert b.memory.grads == pytest.approx(a.memory.grads - moved_grads)
        assert b.memory.host == pytest.approx(6 * owned + moved_grads)
        assert b.memory.params == a.memory.params and b.memory.nvme == 0
        down = 2 * owned / 2 * (m if a.zero >= 2 else 1)
        up = 2 * owned / 2
        added = (
            down + up
        ) / cluster.host_link_bandwidth + owned / 2 * 8 / cluster.host_adam_params_per_s
        assert b.sync_s - a.sync_s == pytest.approx(added)


def test_parameters_on_the_host_leave_a_zero3_unit_only_its_gathers(graph: ModelGraph) -> None:
    cluster, m = ClusterSpec(devices=8), 3
    optimizer_only = [b for _, b in _pairs(graph, Offload(optimizer=1.0), m=m)]
    moved = _pairs(graph, Offload(optimizer=1.0, params=1.0), m=m)
    for (a, b), base in zip(moved, optimizer_only, strict=True):
        owned = _owned(graph, a)
        if a.zero < 3:  # whole weights on every data rank: nothing of them moves
            assert b.memory == base.memory and b.sync_s == pytest.approx(base.sync_s)
            continue
        assert b.memory.params == 0 and b.memory.grads == 0 and b.memory.optimizer == 0
        assert b.memory.host == pytest.approx(owned * (2 + 2 + 12))
        assert b.memory.transient == a.memory.transient  # the gathered weights still come in
        # the shard goes up for each forward's and backward's gather; no weights go up after the
        # step, since they stay where they were updated
        extra = (2 * m * 2 * owned - 2 * owned) / cluster.host_link_bandwidth
        assert b.sync_s - base.sync_s == pytest.approx(extra)


def test_nvme_holds_the_offloaded_state_and_is_read_and_written_each_step(
    graph: ModelGraph,
) -> None:
    cluster = ClusterSpec(devices=8)
    host = [b for _, b in _pairs(graph, Offload(optimizer=1.0))]
    for (a, b), base in zip(_pairs(graph, Offload(optimizer=1.0, nvme=0.5)), host, strict=True):
        owned = _owned(graph, a)
        assert b.memory.nvme == pytest.approx(6 * owned)
        assert b.memory.host == pytest.approx(base.memory.host - 6 * owned)
        assert b.memory.total == base.memory.total
        disk = 2 * 8 * 6 * owned / cluster.nvme_bandwidth  # the node's 8 devices share the drives
        assert b.sync_s - base.sync_s == pytest.approx(disk)


def test_offload_fractions_are_checked_and_combined() -> None:
    with pytest.raises(ConfigError, match="offload.params: 1.0 exceeds the optimizer's 0.5"):
        Offload(optimizer=0.5, params=1.0)
    with pytest.raises(ConfigError, match="offload.nvme: holds offloaded optimizer state"):
        Offload(nvme=1.0)
    with pytest.raises(ConfigError, match="offload.optimizer: must be a fraction"):
        Offload(optimizer=1.5)
    config = PlannerConfig(offload=(0.0, 0.5, 1.0), offload_params=(0.0, 1.0),
                           offload_nvme=(0.0, 1.0))  # fmt: skip
    assert set(config.offloads()) == {
        Offload(), Offload(optimizer=0.5), Offload(optimizer=0.5, nvme=1.0), Offload(optimizer=1.0),
        Offload(optimizer=1.0, nvme=1.0), Offload(optimizer=1.0, params=1.0),
        Offload(optimizer=1.0, params=1.0, nvme=1.0),
    }  # fmt: skip
    with pytest.raises(ConfigError, match="offload_params: each of"):
        PlannerConfig(offload=(0.5,), offload_params=(1.0,))
    # a plan file of before: one number, the optimizer's
    assert Offload.from_json(0.5) == Offload(optimizer=0.5) and Offload.from_json(None) == Offload()
    assert Offload.from_json(Offload(optimizer=1, params=1).to_dict()) == Offload(
        optimizer=1, params=1
    )


def test_nvme_without_a_disk_is_one_line(graph: ModelGraph) -> None:
    config = dataclasses.replace(FLAT, offload=(1.0,), offload_nvme=(0.0, 1.0))
    with pytest.raises(ConfigError, match=r"offload_nvme: .* the cluster has none: .*--nvme"):
        make_plan(graph, ClusterSpec(devices=8), config)


def test_offload_makes_room_within_the_host_memory(graph: ModelGraph) -> None:
    cluster = ClusterSpec(devices=8, device_memory_bytes=3 * MiB)
    with pytest.raises(Infeasible):
        make_plan(graph, cluster, FLAT)
    result = make_plan(graph, cluster, dataclasses.replace(FLAT, offload=(0.0, 0.5, 1.0)))
    plan = result.plan
    assert plan.offload.optimizer > 0 and plan.peak_memory_bytes <= 3 * MiB
    assert 0 < plan.memory.host <= cluster.host_bytes_per_device
    # a host too small for the state: each offloaded problem is infeasible, said in one line
    small = dataclasses.replace(cluster, host_memory_per_node_bytes=8 * MiB)
    with pytest.raises(ConfigError, match=r"offload: no plan's offloaded model data fits the host"):
        make_plan(graph, small, dataclasses.replace(FLAT, offload=(1.0,)))
    roomy = dataclasses.replace(cluster, device_memory_bytes=8 * MiB)
    assert not make_plan(graph, roomy, dataclasses.replace(FLAT, offload=(0.0, 1.0))).plan.offload


def test_parameters_and_nvme_make_room_where_the_optimizer_alone_does_not(
    graph: ModelGraph,
) -> None:
    """A device too small for any plan with its optimizer on the host fits one with its
    parameters there too; a host too small for that fits it with the state on the disk, within
    the disk's share."""
    memory = 600_000
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory)
    with pytest.raises(Infeasible):
        make_plan(graph, cluster, dataclasses.replace(FLAT, offload=(1.0,)))
    config = dataclasses.replace(FLAT, offload=(1.0,), offload_params=(0.0, 1.0))
    plan = make_plan(graph, cluster, config).plan
    assert plan.offload == Offload(optimizer=1.0, params=1.0) and plan.peak_memory_bytes <= memory
    zero3 = [u for u in plan.units if u.zero == 3]  # whose parameters move
    assert zero3 and all(u.memory.params == 0 for u in zero3)
    host = plan.memory.host
    small = dataclasses.replace(cluster, host_memory_per_node_bytes=int(8 * host * 0.6),
                                nvme_bytes_per_node=64 * MiB)  # fmt: skip
    with pytest.raises(ConfigError, match="no plan's offloaded model data fits"):
        make_plan(graph, small, config)
    disk = make_plan(graph, small, dataclasses.replace(config, offload_nvme=(0.0, 1.0))).plan
    assert disk.offload.nvme == 1.0
    assert disk.memory.host <= small.host_bytes_per_device
    assert 0 < disk.memory.nvme <= small.nvme_bytes_per_device


@pytest.mark.parametrize("memory", [5 * MiB, 600_000])
def test_the_search_over_offload_equals_solving_each_fraction(
    graph: ModelGraph, memory: int
) -> None:
    """The flat search with offload fractions against every (mesh, offload) solved alone: the
    fastest fitting step, then the least memory within eps of it."""
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory, nvme_bytes_per_node=TiB)
    config = dataclasses.replace(FLAT, offload=(0.0, 0.5, 1.0), offload_params=(0.0, 1.0),
                                 offload_nvme=(0.0, 1.0))  # fmt: skip
    result = make_plan(graph, cluster, config)
    problems = [
        _problem(graph, mesh, cluster, _spec(graph, mesh, config, 8, offload), config)
        for mesh in meshes_for(graph, cluster, config)
        for offload in config.offloads()
    ]
    assert len(problems) == 7 * len(meshes_for(graph, cluster, config))
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
    graph: ModelGraph, matches_every_option: Callable[..., Any]
) -> None:
    memory = 3 * MiB
    cluster = ClusterSpec(devices=8, device_memory_bytes=memory)

    def meshes(stage: ClusterSpec) -> list[Mesh]:
        sizes = valid_tensor_sizes(graph.units, stage.devices, stage.devices_per_node)
        return [Mesh(dp=stage.devices // t, tp=t) for t in sizes]

    def problem(g, mesh, stage, spec):  # noqa: ANN001, ANN202
        return _problem(g, mesh, stage, spec, FLAT)

    offloads = (Offload(), Offload(optimizer=1.0), Offload(optimizer=1.0, params=1.0))
    search = search_pipelines(graph, cluster, global_batch=16, base=TrainingSpec(),
                              meshes=meshes, problem=problem, memory_limit=memory,
                              solver_time_limit_s=60, slack=0.05, offloads=offloads)  # fmt: skip
    every = pipeline_options(graph, cluster, global_batch=16, base=TrainingSpec(), meshes=meshes,
                             offloads=offloads)  # fmt: skip
    assert all(o.offloads == offloads for o in every)
    matches_every_option(search, every, problem, memory)
    # without the host, nothing fits these stages' devices
    plain = pipeline_options(graph, cluster, global_batch=16, base=TrainingSpec(), meshes=meshes)
    for option in plain:
        option.build(problem)
    assert all(
        o.solve_fastest(memory_limit=memory, solver_time_limit_s=60) == math.inf for o in plain
    )


def test_each_pipeline_stage_takes_its_own_offload(
    graph: ModelGraph, search_parts: Callable[..., Any]
) -> None:
    """Mist's per-stage offload ([Note: offload per stage] in pipelines.py): on two devices of
    16 MiB, without recomputation, the first stage (the embedding, two micro-batches in flight)
    must move half its optimizer to the host and the last fits as it is, so it keeps its own:
    the step is the first stage's, faster than with both at half. Each option's fastest step
    and smallest plan are the best of every combination of its stages' offloads, each solved
    alone; the plan file carries each stage's and a run gives each rank its own."""
    config = dataclasses.replace(FLAT, recompute=(Recompute.NONE,))
    meshes, problem = search_parts(graph, config)
    memory = 16 * MiB
    cluster = ClusterSpec(devices=2, device_memory_bytes=memory)
    half = Offload(optimizer=0.5)
    offloads = (Offload(), half, Offload(optimizer=1.0), Offload(optimizer=1.0, params=1.0))
    search = search_pipelines(graph, cluster, global_batch=4, base=TrainingSpec(), meshes=meshes,
                              problem=problem, memory_limit=memory, solver_time_limit_s=60,
                              slack=0.05, offloads=offloads)  # fmt: skip
    best = search.fastest
    assert best is not None and best.fastest is not None
    chosen = best.plan(best.fastest)
    assert chosen.offloads() == (half, Offload())
    for option in search.options:
        times = [[p.solve(objective="time", memory_limit=memory, refine=False).step_time_s
                  for p in stage] for stage in option.problems]  # fmt: skip
        combos = list(itertools.product(range(len(offloads)), repeat=len(times)))
        fastest = min(max(t[c] for t, c in zip(times, combo, strict=True)) for combo in combos)
        option.solve_fastest(memory_limit=memory, solver_time_limit_s=60)
        assert option.fastest_s == pytest.approx(fastest + option.send_s, rel=1e-6)
        if option is best:
            uniform = min(max(t[j] for t in times) for j in range(len(offloads)))
            assert option.fastest_s < uniform + option.send_s  # both at half: the last's step
        if not math.isfinite(fastest):
            continue
        budget = 1.05 * option.fastest_s
        peaks = [[p.solve(objective="memory", memory_limit=memory, refine=False,
                          time_limit=(budget - option.send_s) * (1 + 1e-9)).peak_bytes
                  for p in stage] for stage in option.problems]  # fmt: skip
        smallest = option.smallest(memory_limit=memory, time_limit=budget, solver_time_limit_s=60)
        assert smallest is not None
        assert smallest.peak_memory_bytes == pytest.approx(
            min(max(p[c] for p, c in zip(peaks, combo, strict=True)) for combo in combos), rel=1e-3
        )
    plan = Plan.from_dict(json.loads(json.dumps(to_pipelined_plan(chosen).to_dict())))
    assert plan.pipeline is not None and plan.pipeline.stages["last"].offload == Offload()
    assert [plan.rank_offload(r) for r in (0, 1)] == [half, Offload()]
    assert [plan.stage_plan(s).offload for s in (0, 1)] == [half, Offload()]
    assert plan.describe_offload() == (
        "first stage: 50% of the optimizer on the host; last stage: all on the device"
    )


def test_the_offload_baselines_move_what_their_systems_move(graph: ModelGraph) -> None:
    """ZeRO-3 offload: optimizer state and sharded gradients; FSDP2's CPU offload: parameters
    too; ZeRO-Infinity: the optimizer state on NVMe, only where the cluster has a disk."""
    names = ("zero3_full", "zero3_offload", "fsdp2_cpu_offload", "zero_infinity")
    config = dataclasses.replace(FLAT, baselines=names)
    result = make_plan(graph, ClusterSpec(devices=8), config)
    assert "zero_infinity" not in result.baselines  # no disk
    full, zero_offload, fsdp2 = (result.baselines[n].costed for n in names[:3])
    assert full is not None and zero_offload is not None and fsdp2 is not None
    f = full.memory
    assert zero_offload.memory.optimizer == 0 and zero_offload.memory.grads == 0 and f.host == 0
    assert zero_offload.memory.host == pytest.approx(f.optimizer + f.grads)
    assert zero_offload.memory.params == pytest.approx(f.params)
    assert fsdp2.memory.resident == 0
    assert fsdp2.memory.host == pytest.approx(f.resident)
    assert fsdp2.memory.transient == pytest.approx(f.transient)  # a unit's gathered weights
    assert full.step_time_s < zero_offload.step_time_s < fsdp2.step_time_s
    disk = ClusterSpec(devices=8, nvme_bytes_per_node=TiB)
    infinity = make_plan(graph, disk, config).baselines["zero_infinity"].costed
    assert infinity is not None and infinity.memory.nvme == pytest.approx(f.optimizer)
    assert infinity.memory.host == pytest.approx(f.params + f.grads)
    assert infinity.step_time_s > fsdp2.step_time_s


def test_a_plan_with_offload_is_priced_not_run_and_its_file_says_what_moves(
    graph: ModelGraph, tmp_path
) -> None:
    plan = make_plan(graph, ClusterSpec(devices=1), FLAT).plan
    offload = Offload(optimizer=1.0, params=0.5, nvme=1.0)
    moved = dataclasses.replace(plan, offload=offload)
    with pytest.raises(
        ValueError,
        match="keeps 100% of the optimizer on the host, 50% of the parameters, 100% of that "
        "state on NVMe; .* are not ZeRO-3, which is priced but not run yet: .* --offload-params 0",
    ):  # a plan made without parameter offload keeps whole weights: FSDP2 offloads ZeRO-3 units
        check_plan(nn.Linear(2, 2), moved)  # fmt: skip
    moved.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").offload == offload
