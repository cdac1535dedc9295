"""The cost model's per-device memory against what ranks running the plan actually allocate.

Plans (the planner's own on each mesh of two devices, and Megatron-LM with sequence parallelism)
run on 2 gloo ranks, and on one process with a fake process group standing in for 8 to 64
ranks. Each rank counts what it holds after a training step: its parameter, gradient and
optimizer-state shards (local tensors of the DTensors), and the activations alive at the end of
the forward pass (torch's MemTracker, which sees every allocation). The prediction is the plan's
own breakdown; the issue asks for 10% on the total, and each kind is held to 20%.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.models import GPTConfig, build_gpt
from tidal.models.gpt import measure_gpt
from tidal.parallel.plan_apply import apply, make_mesh
from tidal.planner import ClusterSpec, Plan, PlannerConfig, make_plan
from tidal.planner.baselines import baseline
from tidal.planner.search import to_plan
from tidal.planner.strategies import TrainingSpec
from tidal.testing import run_on_ranks

TOLERANCE = 0.10  # the bound, on a rank's total
CATEGORY_TOLERANCE = 0.20  # each kind on its own, against at least a twentieth of the total
# fp32 weights and gradients, AdamW's two fp32 moments, no master copy.
BYTES = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
CONFIG = GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=8, d_model=128)
MICRO_BATCH = 4  # sequences per data-parallel rank


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors: Any) -> int:
    unique = {id(t): _local(t) for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def held_bytes(plan_data: dict[str, Any], *, step: bool = True) -> dict[str, int]:
    """Run one step of ``plan_data`` on this process's rank and count what it holds. Without
    ``step`` (a fake process group, whose collectives return nothing real for backward's
    recomputation) only the forward runs, and gradients and AdamW's two moments are counted as
    the shards they would fill: one and two copies of the local parameter shards (ZeRO-1:
    whole gradients, accumulated between micro-batches). With ``step`` a single micro-batch
    runs, where the planner never picks ZeRO-1 (ZeRO-2 moves as much and holds less)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    plan = Plan.from_dict(plan_data)
    model = build_gpt(CONFIG, seed=0)
    apply(model, plan, make_mesh(plan, "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank() // plan.tp)
    idx = torch.randint(0, CONFIG.vocab_size, (MICRO_BATCH, CONFIG.seq_len), generator=g)
    sharded = list(model.parameters())
    zero1_shards = _zero1_params(model)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        loss = model(idx, idx)
        live = tracker.get_tracker_snapshot()[torch.device("cpu")]  # the end of forward
    # FSDP swaps the modules it keeps gathered (ZeRO-2) to their whole parameters until
    # backward: those, beside the shards, are the parameters held at the end of forward.
    ids = {id(p) for p in sharded}
    gathered = _bytes(p for p in model.parameters() if id(p) not in ids)
    kinds = _kinds()
    params = _bytes(sharded) + gathered
    # MemTracker files the gathered copies under parameters or activations depending on the
    # mesh; what is neither model state is the activations.
    activations = int(live[kinds.PARAM] + live[kinds.ACT] + live[kinds.OTH]) - params
    if step:
        loss.backward()
        optimizer.step()
        grads = _bytes(p.grad for p in sharded if p.grad is not None)
        moments = _bytes(t for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    else:  # ZeRO-1 accumulates whole gradients: the size of its gathered weights
        whole = _bytes(_zero1_params(model)) - _bytes(zero1_shards)
        grads, moments = _bytes(sharded) + whole, 2 * _bytes(sharded)
    return {"params": params, "grads": grads, "optimizer": moments, "activations": activations}


def _zero1_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ZeRO-1 groups as the modules hold them now (shards, or whole ones
    between forward and backward)."""
    found = {}
    for module in model.modules():
        if getattr(module, "_tidal_zero1", False):
            found.update((id(p), p) for p in module.parameters())
    return list(found.values())


def _kinds() -> Any:
    from torch.distributed._tools.mem_tracker import _MemRefType  # private: pinned to torch 2.13

    return _MemRefType


def _rank_worker(plans: list[dict[str, Any]]) -> list[dict[str, int]]:
    return [held_bytes(p) for p in plans]


def _plans(devices: int) -> dict[str, Plan]:
    graph = measure_gpt(CONFIG, micro_batch=MICRO_BATCH, dtype=torch.float32)
    cluster = ClusterSpec(devices=devices, devices_per_node=8)
    found = {}
    for tp in sorted({t for t in (1, 2, 8) if devices % t == 0 and t <= devices}):
        # a generous slowdown: the tiny model's fastest plans split nothing (latency dominates)
        config = PlannerConfig(pipelines=False, tp=tp, eps=10.0, pareto=(), baselines=(), **BYTES)
        found[f"planner tp {tp}"] = make_plan(graph, cluster, config).plan
    spec = TrainingSpec(**BYTES)
    mega = baseline("megatron_sp", graph, cluster, lambda mesh: spec, min(devices, 8))
    found["megatron_sp"] = to_plan(graph, mega.solution.assignment, mega.costed, spec)
    return found


def _compare(plan: Plan, held: dict[str, int]) -> list[str]:
    predicted = plan.memory
    total_predicted = predicted.resident + predicted.activations
    total_held = sum(held.values())
    problems = []
    if abs(total_predicted - total_held) > TOLERANCE * total_held:
        problems.append(f"total predicted {total_predicted:.0f} held {total_held}")
    for kind in ("params", "grads", "optimizer", "activations"):
        mine = getattr(predicted, kind)
        if abs(mine - held[kind]) > CATEGORY_TOLERANCE * max(held[kind], total_held / 20):
            problems.append(f"{kind} predicted {mine:.0f} held {held[kind]}")
    return problems


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, tuple[Plan, list[dict[str, int]]]]:
    plans = _plans(2)
    names = list(plans)
    per_rank = run_on_ranks(
        _rank_worker, world_size=2, args=([plans[n].to_dict() for n in names],), timeout_s=240
    )
    return {n: (plans[n], [per_rank[r][i] for r in range(2)]) for i, n in enumerate(names)}


@pytest.mark.parametrize("name", ["planner tp 1", "planner tp 2", "megatron_sp"])
def test_predicted_memory_within_10_percent_on_2_ranks(two_rank_results, name: str) -> None:
    plan, held = two_rank_results[name]
    assert all(u.zero != 1 for u in plan.units)  # see held_bytes: one micro-batch per step
    for rank, counts in enumerate(held):
        assert not _compare(plan, counts), (name, rank, counts, plan.memory.to_dict())


def _fake_worker(world_size: int) -> dict[str, tuple[dict[str, Any], dict[str, int]]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The harness's one-rank gloo group gives way to a fake group of world_size ranks (which the
    # harness then tears down in its place).
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    plans = _plans(world_size)
    return {name: (p.to_dict(), held_bytes(p.to_dict(), step=False)) for name, p in plans.items()}


@pytest.mark.parametrize("world_size", [8, 16, 32, 64])
def test_fake_process_group_dry_run_agrees_with_the_prediction(world_size: int) -> None:
    """Rank 0 of a world of 8 to 64 on one CPU: the collectives are fakes, the shapes and
    allocations are those of the real ranks."""
    (results,) = run_on_ranks(_fake_worker, world_size=1, args=(world_size,), timeout_s=240)
    for name, (data, held) in results.items():
        plan = Plan.from_dict(data)
        assert plan.devices == world_size
        assert not _compare(plan, held), (name, held, plan.memory.to_dict())


def test_the_comparison_can_fail() -> None:
    plan = _plans(2)["planner tp 2"]
    held = dataclasses.asdict(plan.memory)
    held = {k: int(held[k]) for k in ("params", "grads", "optimizer", "activations")}
    assert not _compare(plan, held)
    held["activations"] *= 2
    assert _compare(plan, held)
