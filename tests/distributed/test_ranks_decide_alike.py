"""Ranks with different activations place chunks alike under ZeRO-3 ([Note: ranks decide alike]
in tidal/sharding/store.py).

Rank 1 trains on sequences twice as long as rank 0's, so its activations, and so every non-model
figure its meter reads, are larger at every moment. The budget is tight: the warm-up iteration
evicts on rank 1 what rank 0 could keep, and a trace of rank 0's own figures would let it
prefetch what rank 1 has no room for. Either would make the ranks gather different chunks (a
hang, or RanksDiverged from the gather check). With the figures agreed both ranks finish, gather
the same chunks in the same order, and, once they follow the agreed trace, make the very same
moves; the agreed trace is rank 1's, the larger.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.parallel.verbs import shard
from tidal.sharding.config import ShardingConfig
from tidal.testing import run_on_ranks
from tidal.train import OptimizerConfig, TrainingConfig

STEPS = 3


def _engine(budget: int | None) -> ChunkEngine:
    return shard(
        build_gpt(preset("tiny"), seed=0),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=128),
        sharding=ShardingConfig(),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = 32 * (1 + dist.get_rank())  # rank 1's activations are about twice rank 0's
    tokens = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(4))
    return tokens[:, :-1], tokens[:, 1:]


def _step(engine: ChunkEngine) -> None:
    engine.backward(engine(*_batch()))
    engine.step()


def _own_peak_bytes() -> int:
    """This rank's own largest non-model figure, from a one-process run of its batch."""
    probe = ChunkEngine(
        build_gpt(preset("tiny"), seed=0),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=128),
    )
    _step(probe)
    return probe.stats()["peak_non_model_bytes"]


def _run() -> dict[str, Any]:
    own_peak = _own_peak_bytes()
    probe = _engine(None)
    _step(probe)
    least = probe.stats()["min_device_bytes"]
    engine = _engine(least + probe.store.model_bytes // 4)
    engine.store.move_log = []
    iterations = []
    for _ in range(STEPS):
        start = len(engine.store.move_log)
        _step(engine)
        iterations.append(engine.store.move_log[start:])
    trace = engine.store.trace
    assert trace is not None
    return {
        "own_peak": own_peak,
        "agreed_peak": trace.peak_non_model_bytes,
        "traces": engine.store.num_traces,
        "iterations": iterations,
        "evictions": engine.stats()["evictions"],
    }


def test_ranks_with_different_activations_gather_alike() -> None:
    ranks = run_on_ranks(_run, world_size=2, timeout_s=600)
    short, long = ranks
    assert long["own_peak"] > short["own_peak"]  # the ranks did read different figures
    assert short["agreed_peak"] == long["agreed_peak"] >= long["own_peak"]
    assert short["traces"] == long["traces"]
    for moves_short, moves_long in zip(short["iterations"], long["iterations"], strict=True):
        gathers = [(i, m) for i, m in moves_short if m.kind != "evict"]
        assert gathers == [(i, m) for i, m in moves_long if m.kind != "evict"]
    warm_up = short["iterations"][0]
    assert any(m.kind == "evict" for _, m in warm_up)
    # Following the agreed trace, every move is the same, evictions included.
    assert short["iterations"][1:] == long["iterations"][1:]
    assert any(m.kind == "prefetch" for _, m in short["iterations"][-1])
