"""Models tidal did not write under ZeRO-3 on 2 gloo ranks, against one process.

Parameters that sit out a step ([Note: sharded gradients] in tidal/sharding/grads.py): a chunk
only some of whose parameters got a gradient is reduced when the backward ends, one none of
whose parameters did is not reduced, and the step leaves every parameter without a gradient
alone, on every rank. Each rank trains on its half of the batch; the layerdrop draws are the
same on both (the RNG is seeded per step). And a user's own code on the sharded parameters
([Note: parameter uses] in tidal/memory/uses.py): ``model.state_dict()`` on every rank gathers
the weights, ``load_state_dict`` writes each rank's shards, a read between iterations of a
chunk that is not gathered is refused. One spawn runs every case.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.memory.config import ChunkConfig
from tidal.memory.uses import ParameterUseError
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.parallel.verbs import shard
from tidal.sharding.config import ShardingConfig
from tidal.sharding.store import RanksDiverged
from tidal.testing import run_on_ranks
from tidal.testing.zoo import run_steps, zoo_model
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

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

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        rank, rows = dist.get_rank(), next(iter(batch.values())).shape[0] // WORLD
        return self.engine(**{k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()})

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


ADAMW = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=0, weight_decay=0.1)


def _sharded(name: str, budget: int | None, optimizer: OptimizerConfig = OPTIMIZER) -> ChunkEngine:
    return shard(
        zoo_model(name).build(0),
        optimizer=optimizer,
        training=TrainingConfig(device="cpu", steps=STEPS),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=2048),
        sharding=ShardingConfig(),
    )


def _run(engine: ChunkEngine, name: str) -> list[float]:
    losses = []
    for loss in run_steps(_Half(engine), zoo_model(name), STEPS):
        total = torch.tensor(loss)
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return losses


def _users_code() -> dict[str, Any]:
    """What a user's own code gets from the sharded parameters of a trained tiny GPT."""
    engine = shard(
        build_gpt(preset("tiny"), seed=0),
        optimizer=OPTIMIZER,
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=1024),
        sharding=ShardingConfig(),
    )
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 17), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    saved = io.BytesIO()
    torch.save(engine.model.state_dict(), saved)  # every rank: the state dict gathers
    saved.seek(0)
    fresh = build_gpt(preset("tiny"), seed=5)
    fresh.load_state_dict(torch.load(saved))
    weights = engine.model_state_dict()
    param = engine.model.blocks[0].mlp.fc.weight
    try:
        param.sum()  # between iterations, not gathered: would need every rank
        refused = ""
    except ParameterUseError as err:
        refused = str(err)
    other = build_gpt(preset("tiny"), seed=9).state_dict()
    engine.model.load_state_dict(other)  # every rank writes its shards
    return {
        "reloaded_equal": all(torch.equal(v, weights[k]) for k, v in fresh.state_dict().items()),
        "refused": refused,
        "loaded": engine.model_state_dict(),
        "other": other,
    }


class _ExpertPerRank(torch.nn.Module):
    """Two experts; each rank routes to its own (what a mixture of experts does when its tokens
    choose differently), so the ranks run different modules. Unchecked, experts of one shape
    mix their shards silently and experts of two shapes abort gloo (SIGABRT)."""

    def __init__(self, same_shape: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        wide = torch.nn.Linear(32, 32) if same_shape else torch.nn.Linear(32, 96)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32), wide])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.experts[dist.get_rank() % 2](self.embed(ids)).square().mean()


def _diverging_ranks(same_shape: bool) -> str:
    engine = shard(
        _ExpertPerRank(same_shape),
        optimizer=OPTIMIZER,
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=1024),  # each expert in a chunk of its own, of one size
        sharding=ShardingConfig(),
    )
    try:
        engine.backward(engine(torch.randint(0, 64, (2, 8))))
    except RanksDiverged as err:
        return str(err)
    return ""


def _all_cases() -> dict[str, Any]:
    results: dict[str, Any] = {
        "users_code": _users_code(),
        "diverged": [_diverging_ranks(same_shape) for same_shape in (True, False)],
    }
    for name in ("opt-layerdrop", "bert-unused-pooler"):  # AdamW's per-parameter step counts
        engine = _sharded(name, None, ADAMW)
        _run(engine, name)
        results[f"{name}/adamw-steps"] = engine.optimizer.step_counts()
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


def test_users_code_on_sharded_parameters(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        got = rank["users_code"]
        assert got["reloaded_equal"]  # torch.save(model.state_dict()) of the gathered weights
        assert "blocks.0.mlp.fc.weight" in got["refused"] and "every rank" in got["refused"]
        for name, value in got["other"].items():
            assert torch.equal(got["loaded"][name], value), name


@pytest.mark.parametrize("name", ["opt-layerdrop", "bert-unused-pooler"])
def test_adamw_counts_only_the_steps_a_parameter_took(
    ranks: list[dict[str, Any]], name: str
) -> None:
    """torch's AdamW advances a parameter's step count only when it has a gradient; so do the
    shards on every rank (the values themselves are compared with SGD above: Adam magnifies
    the rounding of a gradient that is zero in theory, such as an attention key bias's)."""
    family = zoo_model(name)
    reference = ReferenceEngine(
        family.build(0), optimizer=ADAMW, training=TrainingConfig(device="cpu", steps=STEPS)
    )
    run_steps(reference, family, STEPS)
    params = dict(reference.model.named_parameters())
    want = {n: float(reference.optimizer.state[p]["step"]) if reference.optimizer.state.get(p)
            else 0.0 for n, p in params.items()}  # fmt: skip
    assert min(want.values()) < STEPS  # some parameter sat out a step
    for rank in ranks:
        assert rank[f"{name}/adamw-steps"] == want


def test_ranks_that_run_different_modules_stop_with_an_error(
    ranks: list[dict[str, Any]],
) -> None:
    """Not a hang, and not one expert's shards mixed with the other's: every rank raises."""
    for rank in ranks:
        for message in rank["diverged"]:
            assert "experts.0.weight" in message and "experts.1.weight" in message, message
            assert "same modules" in message
