"""Parameters that sit out a step under ZeRO-3 on 2 gloo ranks, against one process.

[Note: sharded gradients] in tidal/sharding/grads.py: a chunk only some of whose parameters got
a gradient is reduced when the backward ends, one none of whose parameters did is not reduced,
and the step leaves every parameter without a gradient alone, on every rank. Each rank trains on
its half of the batch; the layerdrop draws are the same on both (the RNG is seeded per step).
One spawn runs every case.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.engine import OptimizerConfig, ReferenceEngine, TrainingConfig
from tidal.engine.config import MemoryConfig
from tidal.engine.sharded_engine import ShardedEngine
from tidal.memory.config import ChunkConfig
from tidal.sharding.config import ShardingConfig
from tidal.testing import run_on_ranks
from tidal.testing.zoo import run_steps, zoo_model

pytest.importorskip("transformers")

WORLD = 2
STEPS = 5
TOL = 1e-5
# SGD: Adam divides by the root of the second moment, so a gradient that is zero up to rounding
# (an attention key bias) moves by the whole learning rate in a direction the rounding picks,
# and two ranks sum in another order than one process. Weight decay and momentum are there to
# show a parameter that sits out is not decayed and keeps its buffer.
OPTIMIZER = OptimizerConfig(name="sgd", lr=5e-2, warmup_steps=0, weight_decay=0.1, momentum=0.9)
NAMES = ("alternating-branch", "opt-layerdrop", "bert-unused-pooler")


class _Half:
    """An engine that gives the wrapped one this rank's half of each batch's rows."""

    def __init__(self, engine: ShardedEngine) -> None:
        self.engine = engine

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        rank, rows = dist.get_rank(), next(iter(batch.values())).shape[0] // WORLD
        return self.engine(**{k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()})

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


def _sharded(name: str, budget: int | None) -> ShardedEngine:
    return ShardedEngine(
        zoo_model(name).build(0),
        optimizer=OPTIMIZER,
        training=TrainingConfig(device="cpu", steps=STEPS),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=2048),
        sharding=ShardingConfig(),
    )


def _run(engine: ShardedEngine, name: str) -> list[float]:
    losses = []
    for loss in run_steps(_Half(engine), zoo_model(name), STEPS):
        total = torch.tensor(loss)
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


def _all_cases() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in NAMES:
        probe = _sharded(name, None)
        _run(probe, name)
        minimum = probe.stats()["min_device_bytes"]
        for label, budget in (("unlimited", None), ("minimum", minimum)):
            engine = _sharded(name, budget)
            losses = _run(engine, name)
            stats = engine.stats()
            results[f"{name}/{label}"] = {
                "losses": losses,
                "state": engine.model_state_dict(),
                "budget": budget,
                "peak": stats["peak_device_bytes"],
                "evictions": stats["evictions"],
            }
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, world_size=WORLD, timeout_s=240)


@pytest.mark.parametrize("budget", ["unlimited", "minimum"])
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_one_process(ranks: list[dict[str, Any]], name: str, budget: str) -> None:
    family = zoo_model(name)
    reference = ReferenceEngine(
        family.build(0), optimizer=OPTIMIZER, training=TrainingConfig(device="cpu", steps=STEPS)
    )
    want = run_steps(reference, family, STEPS)
    want_state = reference.model.state_dict()
    initial = family.build(0).state_dict()
    for rank in ranks:
        got = rank[f"{name}/{budget}"]
        assert got["losses"] == pytest.approx(want, abs=TOL, rel=0)
        for key, value in want_state.items():
            torch.testing.assert_close(got["state"][key], value, atol=TOL, rtol=0, msg=key)
        for key in family.never_trained:  # exactly as built: no update, no decay
            assert torch.equal(got["state"][key], initial[key]), key
        if got["budget"] is not None:
            assert got["peak"] <= got["budget"] and got["evictions"] > 0
