"""Chunk stages (tidal/parallel/chunk_stage.py) under ``PipelineRuntime`` on 2 gloo ranks.

Each rank holds its stages' parameters in chunks under the least budget an unlimited run
measured, and trains three clipped steps with the tied embedding summed over the wire; the
result must equal ``run_local`` of the same chunk stages in one process (1e-5: the global norm's
all-reduce may sum in another order). Each rank computes its reference in its own process.
Then 2 stages x ZeRO-3 over 2 replicas on 4 ranks must equal one replica over the whole batch,
under 1F1B and under PipeMare ([Note: PipeMare on chunk stages]), whose weight delays must be the
simulator's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.parallel.chunk_stage import ChunkStageConfig, ChunkStageParams, zero3_parts
from tidal.parallel.config import MemoryConfig, OptimizerConfig
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import even_ranges, tied_parameters
from tidal.runtime.distributed import PipelineRuntime, RuntimeConfig
from tidal.runtime.executor import UpdateRules
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, WeightMode
from tidal.testing import run_on_ranks

ATOL = 1e-5
STEPS = 3
MAX_NORM = 0.5
OPTIMIZER = OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1)
CASES = (("1f1b", 4, 1), ("interleaved", 2, 2))  # (schedule, microbatches, virtual stages)


def lr_at(step: int) -> float:
    return 1e-2 * (1.0 + step) / STEPS


def tiny_gpt(*, tie: bool = True) -> nn.Module:
    config = GPTConfig(
        vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16, tie_embeddings=tie
    )
    return build_gpt(config, seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (4, 9), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def chunk_stage(
    stage: nn.Module,
    budget: int | None,
    dp_group: dist.ProcessGroup | None = None,
    weights: AsyncConfig | None = None,
) -> ChunkStageParams:
    config = ChunkStageConfig(optimizer=OPTIMIZER, memory=MemoryConfig(device_budget=budget),
                              chunk=ChunkConfig(size=256, align=16))  # fmt: skip
    parts = None if dp_group is None else zero3_parts(config, dp_group)
    return ChunkStageParams(stage, config, parts=parts, weights=weights)


def _local(name: str, m: int, virtual: int, budgets: list[int | None]):
    schedule = make_schedule(name, stages=2, microbatches=m, virtual=virtual, steps=STEPS)
    stages = split_gpt(tiny_gpt(), even_ranges(4, schedule.num_stages))
    weights = [chunk_stage(stage, b) for stage, b in zip(stages, budgets, strict=True)]
    rules = UpdateRules(max_grad_norm=MAX_NORM, tied=tuple(tied_parameters(stages)))
    return weights, run_local(schedule, stages, weights, batch, lr_at, rules=rules)


def _case(name: str, m: int, virtual: int) -> dict[str, Any]:
    num_stages = 2 * virtual
    probes, _ = _local(name, m, virtual, [None] * num_stages)
    budgets: list[int | None] = [int(w.stats()["min_device_bytes"]) for w in probes]
    local, want = _local(name, m, virtual, budgets)

    stages = split_gpt(tiny_gpt(), even_ranges(4, num_stages))
    mine = list(range(dist.get_rank(), num_stages, 2))
    weights = {s: chunk_stage(stages[s], budgets[s]) for s in mine}
    config = RuntimeConfig(schedule=name, microbatches=m, virtual_stages=virtual,
                           max_grad_norm=MAX_NORM)  # fmt: skip
    runtime = PipelineRuntime(config, stages=[stages[s] for s in mine],
                              weights=[weights[s] for s in mine],
                              tied=tied_parameters(stages))  # fmt: skip
    losses = runtime.train(STEPS, batch, lr_at)
    param_diff = 0.0
    for s in mine:
        got, ref = weights[s].model_state_dict(), local[s].model_state_dict()
        param_diff = max(param_diff, *((got[k] - ref[k]).abs().max().item() for k in ref))
    stats = [weights[s].stats() for s in mine]
    over = [st["peak_device_bytes"] - budgets[s] for st, s in zip(stats, mine, strict=True)]
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, want.losses, strict=True)),
        "losses_distinct": len(set(losses)),
        "param_diff": param_diff,
        "evictions": [st["evictions"] for st in stats],
        "over_budget": over,
        "versions": [weights[s].version for s in mine],
    }


def _worker() -> dict[str, dict[str, Any]]:
    return {name: _case(name, m, virtual) for name, m, virtual in CASES}


def test_runtime_chunk_stages_equal_run_local():
    per_rank = run_on_ranks(_worker, world_size=2, timeout_s=180)
    for rank, results in enumerate(per_rank):
        for name, _, _ in CASES:
            r = results[name]
            assert r["loss_diff"] <= ATOL and r["param_diff"] <= ATOL, (rank, name, r)
            assert r["losses_distinct"] == STEPS, (rank, name, r)
            assert all(e > 0 for e in r["evictions"]), (rank, name, r)
            assert all(over <= 0 for over in r["over_budget"]), (rank, name, r)
            assert set(r["versions"]) == {STEPS}, (rank, name, r)


# ---------------------------------------------------------------------------------------------
# 2 stages x ZeRO-3 over 2 replicas each, on 4 ranks: rank r holds stage r % 2 of replica r // 2

DP_BUDGET = 120_000  # every stage gathers, evicts and reduces within it


def _full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, 64, (8, 9), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# PipeMare's rates divided by the measured delays for the whole run (T1 past it)
PIPEMARE = AsyncConfig(weights=WeightMode.CURRENT, lr_rescheduling=True, lr_warmup_steps=8)


def _dp_worker() -> dict[str, dict[str, Any]]:
    rank = dist.get_rank()
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {name: _dp_case(name, pipes[rank // 2], dps[rank % 2]) for name in ("1f1b", "pipemare")}


def _dp_case(name: str, pipe: dist.ProcessGroup, dp: dist.ProcessGroup) -> dict[str, Any]:
    """Rank r: stage r % 2 of replica r // 2, 2 microbatches of 2 rows a step. The reference is
    one replica over the whole batch in one process; under 1F1B in microbatches of 2 rows, under
    PipeMare (where a microbatch's place sets the weights it sees) in 2 microbatches of 4, the
    j-th holding both replicas' j-th."""
    rank = dist.get_rank()
    replica, s = rank // 2, rank % 2
    weights_config = PIPEMARE if name == "pipemare" else None

    def my_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, targets = _full_batch(step)
        rows = slice(4 * replica, 4 * replica + 4)
        return idx[rows], targets[rows]

    def interleaved_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, targets = _full_batch(step)
        order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # microbatch j: each replica's j-th
        return idx[order], targets[order]

    stages = split_gpt(tiny_gpt(tie=False), even_ranges(4, 2))
    weights = chunk_stage(stages[s], DP_BUDGET, dp, weights_config)
    config = RuntimeConfig(schedule=name, microbatches=2, max_grad_norm=MAX_NORM)
    runtime = PipelineRuntime(config, stages=[stages[s]], weights=[weights], group=pipe)
    losses = runtime.train(STEPS, my_rows, lr_at)

    local = split_gpt(tiny_gpt(tie=False), even_ranges(4, 2))
    local_weights = [chunk_stage(stage, None, weights=weights_config) for stage in local]
    m, rows = (2, interleaved_rows) if name == "pipemare" else (4, _full_batch)
    schedule = make_schedule(name, stages=2, microbatches=m, steps=STEPS)
    want = run_local(schedule, local, local_weights, rows, lr_at,
                     rules=UpdateRules(max_grad_norm=MAX_NORM))  # fmt: skip
    got, ref = weights.model_state_dict(), local_weights[s].model_state_dict()
    stats = weights.stats()
    return {
        "losses": losses,
        "want_losses": want.losses,
        "param_diff": max((got[k] - ref[k]).abs().max().item() for k in ref),
        "world_size": stats["world_size"],
        "over_budget": stats["peak_device_bytes"] - DP_BUDGET,
        "evictions": stats["evictions"],
        "version": weights.version,
        "max_delay": max(weights.delays.values()),
        "want_max_delay": simulate(schedule).delay[s],
    }


def test_zero3_stages_equal_one_replica_over_the_whole_batch():
    per_rank = run_on_ranks(_dp_worker, world_size=4, timeout_s=240)
    for name in ("1f1b", "pipemare"):
        for rank, r in enumerate(runs[name] for runs in per_rank):
            assert r["world_size"] == 2 and r["version"] == STEPS, (name, rank, r)
            assert r["param_diff"] <= ATOL, (name, rank, r)
            assert r["over_budget"] <= 0 and r["evictions"] > 0, (name, rank, r)
            assert r["max_delay"] == r["want_max_delay"], (name, rank, r)
        # each replica's loss is over its half of the rows: their mean is the whole batch's
        first, second = per_rank[0][name], per_rank[2][name]
        for step in range(STEPS):
            mean = (first["losses"][step] + second["losses"][step]) / 2
            assert abs(mean - first["want_losses"][step]) <= ATOL, (name, step, first)
        assert first["losses"] != second["losses"]  # the replicas saw other rows
    assert per_rank[0]["pipemare"]["max_delay"] == 1  # stage 0 ran backwards on newer weights
