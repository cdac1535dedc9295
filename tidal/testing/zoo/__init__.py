"""Models tidal did not write, small enough to train in a test, each with its batches.

A :class:`ZooModel` builds a module whose forward returns the loss (Hugging Face models are
wrapped: ``model(**batch).loss``) and gives the batch of each step, the same on every call, so
two engines can be compared step for step on the same seeds. Hugging Face models are built
offline from a config (``transformers`` is an optional dependency, imported when one is built).
The families cover what breaks hook-based offload: parameters that sit out a step (a branch
taken on alternate steps, ``layerdrop``, an unused pooler, experts without tokens), parameters
read outside their module, ``weight.dtype`` reads, tied and shared weights, a module called
several times, frozen parts, activation checkpointing, BatchNorm buffers, encoders and
encoder-decoders, mixture-of-experts routing.

``hf.py`` holds the Hugging Face text families, ``vision.py`` the image ones and ``special.py``
the cases written here to isolate one behaviour.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from tidal.testing.zoo.base import Batch, LossOf, ZooModel
from tidal.testing.zoo.hf import HF_FAMILIES
from tidal.testing.zoo.special import SPECIAL_FAMILIES
from tidal.testing.zoo.vision import VISION_FAMILIES

__all__ = [
    "ZOO",
    "Batch",
    "LossOf",
    "ZooModel",
    "find_family",
    "run_steps",
    "seed_step",
    "zoo_model",
]

ZOO: dict[str, ZooModel] = {
    model.name: model for model in (*HF_FAMILIES, *VISION_FAMILIES, *SPECIAL_FAMILIES)
}


def zoo_model(name: str) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"no zoo model {name!r}; known: {', '.join(ZOO)}")
    return ZOO[name]


def find_family(spec: str) -> ZooModel:
    """A zoo name, or ``module:ATTR`` / ``path/to/file.py:ATTR`` naming a :class:`ZooModel`
    defined elsewhere (your own model, or a test's)."""
    if ":" not in spec:
        return zoo_model(spec)
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        loaded = importlib.util.spec_from_file_location(f"_zoo_{path.stem}", path)
        if loaded is None or loaded.loader is None or not path.is_file():
            raise ValueError(f"{spec!r}: no Python file {where}")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    family = getattr(module, attr, None)
    if not isinstance(family, ZooModel):
        raise ValueError(f"{spec!r}: {attr} in {where} is not a ZooModel")
    return family


def seed_step(step: int, *, seed: int = 0) -> None:
    """Seed the global RNG for ``step`` as :func:`run_steps` does."""
    torch.manual_seed(seed * 1_000 + step)


def run_steps(engine: Any, model: ZooModel, steps: int, *, seed: int = 0) -> list[float]:
    """Train ``steps`` steps with any engine's calling convention; the global RNG is reseeded
    before each step, so random choices in the forward (layerdrop) are the same for every
    engine."""
    losses = []
    for step in range(steps):
        seed_step(step, seed=seed)
        loss = engine(**model.batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
