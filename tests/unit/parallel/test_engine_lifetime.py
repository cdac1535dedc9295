"""A chunk engine's chunks go when its last reference goes ([Note: an engine can be collected]
in tidal/memory/uses.py): on CUDA a leaked engine's device bytes were counted as the next
engine's activations, and a notebook that builds engines in a loop ran out of memory."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.train import OptimizerConfig, TrainingConfig


def _trained(budget: int | None, accum: int) -> ChunkEngine:
    engine = ChunkEngine(
        build_gpt(preset("tiny"), seed=0),
        optimizer=OptimizerConfig(lr=3e-3),
        training=TrainingConfig(device="cpu", steps=4, grad_accum_steps=accum),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=128),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(2 * accum):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    return engine


@pytest.mark.parametrize(("budget", "accum"), [(None, 1), (3 << 20, 2)], ids=["all", "tight"])
def test_a_trained_engine_is_collected_with_its_model(budget: int | None, accum: int) -> None:
    engine = _trained(budget, accum)
    refs = [weakref.ref(x) for x in (engine, engine.store, engine.model, engine.store.chunks[0])]
    del engine
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_the_model_keeps_its_engine_and_a_lone_parameter_says_why_it_cannot() -> None:
    engine = _trained(3 << 20, 1)
    model, ref = engine.model, weakref.ref(engine)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
    del engine
    gc.collect()
    assert ref() is not None  # the model's hooks hold it
    with torch.no_grad():
        assert torch.equal(model(tokens), want)
    weight = model.lm_head.weight
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match="engine and model were deleted"):
        weight.sum()
