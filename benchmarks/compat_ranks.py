"""The rank cases of ``tidal bench compat``: a zoo family under the sharded engine on gloo ranks,
each on its share of the batch rows, against one process ([Note: compat modes] and [Note: the
data-parallel reference] in benchmarks/compat_cases.py)."""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.compat_cases import (
    FP32_RTOL,
    SGD,
    Case,
    SatOut,
    cached,
    judge,
    quiet_transformers,
    training,
)
from tidal.memory.config import ChunkConfig
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.parallel.verbs import shard
from tidal.sharding.config import ShardingConfig
from tidal.testing import RankFailure, run_on_ranks
from tidal.testing.zoo import Batch, ZooModel, find_family, run_steps, seed_step
from tidal.train import ReferenceEngine, TrainingConfig

__all__ = ["RanksFailed", "ranks_case"]


class RanksFailed(RuntimeError):
    """A rank failed; the first line names the rank and the cause, the rest is every rank's."""


def ranks_case(case: Case, family: ZooModel) -> dict[str, Any]:
    want = cached(("ranks-reference", case.family, case.mode.ranks),
                  lambda: _reference(case, family))  # fmt: skip
    unlimited = cached(("ranks", case.family, case.mode.ranks, None),
                       lambda: _on_ranks(case, None))  # fmt: skip
    # [Note: ranks decide alike] in tidal/sharding/store.py: one budget that every rank fits.
    budget = max(r["min_device_bytes"] for r in unlimited) if case.mode.tight else None
    ranks = _on_ranks(case, budget) if case.mode.tight else unlimited
    losses = ranks[0]["losses"]
    row = {"budget_bytes": budget, **judge(losses, want["losses"], FP32_RTOL)}
    if case.mode.tight:
        row["same_as_unlimited"] = losses == unlimited[0]["losses"]
    return row | {
        "peak_device_bytes": max(r["peak_device_bytes"] for r in ranks),
        "min_device_bytes": max(r["min_device_bytes"] for r in ranks),
        "evictions": max(r["evictions"] for r in ranks),
        "num_chunks": ranks[0]["num_chunks"],
        "params_without_grad": want["sat_out"],
        "wall_s": max(r["wall_s"] for r in ranks),
        "reference_wall_s": want["wall_s"],
        "losses": losses,
        "reference_losses": want["losses"],
    }


def share(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s rows of every tensor of ``batch``."""
    rows = next(iter(batch.values())).shape[0]
    if rows % world_size:
        raise ValueError(f"{rows} batch rows do not split over {world_size} ranks")
    size = rows // world_size
    return {key: value[rank * size : (rank + 1) * size] for key, value in batch.items()}


def _reference(case: Case, family: ZooModel) -> dict[str, Any]:
    """One process: the ranks' shares as micro-batches, or the whole batch for a family whose
    forward counts its calls ([Note: the data-parallel reference])."""
    world = case.mode.ranks
    accum = 1 if family.one_call_per_step else world
    engine = ReferenceEngine(family.build(0), optimizer=SGD, training=training(case, "fp32", accum))
    recorder = SatOut(engine)
    started = time.perf_counter()
    if family.one_call_per_step:
        losses = run_steps(recorder, family, case.steps)
    else:
        losses = []
        for step in range(case.steps):
            total = 0.0
            for rank in range(world):
                seed_step(step)  # as every rank does
                loss = recorder(**share(family.batch(step), rank, world))
                recorder.backward(loss)
                recorder.step()
                total += loss.item()
            losses.append(total / world)
    wall_s = time.perf_counter() - started
    return {"losses": losses, "wall_s": wall_s, "sat_out": len(recorder.names)}


def _on_ranks(case: Case, budget: int | None) -> list[dict[str, Any]]:
    args = (case.family, case.steps, case.chunk_elements, budget)
    try:
        return run_on_ranks(_rank_run, world_size=case.mode.ranks, args=args,
                            timeout_s=case.ranks_timeout_s)  # fmt: skip
    except RankFailure as failure:
        raise RanksFailed(f"{_first_failure(failure)}\n{failure}") from None


def _first_failure(failure: RankFailure) -> str:
    """The root cause's rank and cause in one line (the outcomes come root cause first)."""
    bad = next(o for o in failure.outcomes if o.status != "ok")
    if bad.status == "signal" and bad.exitcode is not None:
        number = -bad.exitcode
        return f"rank {bad.rank}: killed by signal {number} ({signal.Signals(number).name})"
    lines = bad.detail.strip().splitlines()
    return f"rank {bad.rank}: {lines[0].removeprefix('raised ') if lines else bad.status}"


class _Share:
    """An engine that gives the sharded one this rank's rows of each batch."""

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.engine(**share(batch, dist.get_rank(), dist.get_world_size()))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


def _rank_run(spec: str, steps: int, chunk_elements: int, budget: int | None) -> dict[str, Any]:
    """One rank's run (called by run_on_ranks): the mean loss over the ranks per step."""
    quiet_transformers()
    family = find_family(spec)
    engine = shard(
        family.build(0),
        optimizer=SGD,
        training=TrainingConfig(device="cpu", steps=steps),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=chunk_elements),
        sharding=ShardingConfig(),
    )
    started = time.perf_counter()
    local = run_steps(_Share(engine), family, steps)
    wall_s = time.perf_counter() - started
    totals = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(totals)
    stats = engine.stats()
    return {
        "losses": (totals / dist.get_world_size()).tolist(),
        "min_device_bytes": stats["min_device_bytes"],
        "peak_device_bytes": stats["peak_device_bytes"],
        "evictions": stats["evictions"],
        "num_chunks": stats["num_chunks"],
        "wall_s": wall_s,
    }
