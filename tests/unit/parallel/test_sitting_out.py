"""Parameters that sit out a step train exactly as ``torch.optim`` trains them.

[Note: parameters without a gradient] in tidal/memory/optim.py: no update, no weight decay, no
moment change for a parameter without a gradient this step. Each zoo model here leaves some
parameters without a gradient in some steps: a branch taken on alternate steps, Hugging Face
OPT's ``layerdrop`` and BERT's pooler under a head that reads the token states. The chunk engine
must equal the reference engine (``torch.optim.AdamW`` with weight decay, ``SGD`` with
momentum) bit for bit, at an unlimited and at the minimum budget.
"""

from __future__ import annotations

import pytest
import torch

from tidal.memory.config import ChunkConfig
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.testing.zoo import run_steps, zoo_model
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

STEPS = 6
OPTIMIZERS = {
    "adamw": OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=0, weight_decay=0.1),
    "sgd": OptimizerConfig(name="sgd", lr=5e-2, warmup_steps=0, weight_decay=0.1, momentum=0.9),
}


def _chunk(model, optimizer: OptimizerConfig, budget: int | None) -> ChunkEngine:
    return ChunkEngine(
        model,
        optimizer=optimizer,
        training=TrainingConfig(device="cpu", steps=STEPS),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=2048),  # several chunks, each holding a few parameters
    )


def _reference(name: str, config: OptimizerConfig) -> tuple[list[float], ReferenceEngine, set[str]]:
    """The reference run, and the parameters that had no gradient at some step."""
    family = zoo_model(name)
    engine = ReferenceEngine(
        family.build(0), optimizer=config, training=TrainingConfig(device="cpu", steps=STEPS)
    )
    losses, sat_out = [], set()
    for step in range(STEPS):
        torch.manual_seed(step)  # as run_steps does
        loss = engine(**family.batch(step))
        engine.backward(loss)
        sat_out |= {n for n, p in engine.model.named_parameters() if p.grad is None}
        engine.step()
        losses.append(loss.item())
    return losses, engine, sat_out


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", ["alternating-branch", "opt-layerdrop", "bert-unused-pooler"])
def test_parameters_without_a_gradient_are_left_alone(name: str, optimizer: str) -> None:
    family, config = zoo_model(name), OPTIMIZERS[optimizer]
    if "transformers" in family.needs:
        pytest.importorskip("transformers")
    want, reference, sat_out = _reference(name, config)
    assert sat_out and set(family.sits_out) <= sat_out, (name, sorted(sat_out))
    want_state = reference.model.state_dict()
    torch_state = {
        n: reference.optimizer.state[p]
        for n, p in reference.model.named_parameters()
        if reference.optimizer.state.get(p)
    }
    initial = family.build(0).state_dict()
    for never in family.never_trained:  # no update, no decay either
        assert never not in torch_state and torch.equal(want_state[never], initial[never])

    probe = _chunk(family.build(0), config, None)
    assert run_steps(probe, family, STEPS) == want
    minimum = probe.stats()["min_device_bytes"]
    for budget in (None, minimum):
        engine = _chunk(family.build(0), config, budget)
        assert run_steps(engine, family, STEPS) == want, budget
        got = engine.model_state_dict()
        for key, value in want_state.items():
            assert torch.equal(got[key], value), (budget, key)
        chunk_state = engine.optimizer.state_dict()
        for param_name, state in torch_state.items():
            for key, value in state.items():
                assert torch.equal(chunk_state[param_name][key], value), (param_name, key)
        if budget is not None:
            assert engine.stats()["peak_device_bytes"] <= budget
            assert engine.stats()["evictions"] > 0
