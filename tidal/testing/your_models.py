"""Models and batches of a user's own, for the tests of ``tidal.Trainer(model, config,
train_data=...)`` on every engine: an MLP on a regression, a small CNN on images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["cnn", "cnn_run", "images", "mlp", "regression", "run_config"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def mlp(outputs: int = 1) -> nn.Module:
    """16 features in, ``outputs`` out, two hidden layers of 64; the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, outputs))  # fmt: skip


def cnn(*, batch_norm: bool) -> nn.Module:
    """Two convolutions on 1 x 12 x 12 images, 10 classes; BatchNorm or GroupNorm after the
    first (BatchNorm normalises each rank's or microbatch's rows, GroupNorm each row)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(8) if batch_norm else nn.GroupNorm(2, 8)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), norm, nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )  # fmt: skip


def regression(batch: int, outputs: int = 1) -> Batches:
    """Five batches of ``mlp``'s inputs; target ``k`` is ``k + 1`` times the sum of the first
    four features."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, 16, generator=g) for _ in range(5)]
    return [(x, torch.stack([x[:, :4].sum(1) * (k + 1) for k in range(outputs)], dim=1))
            for x in xs]  # fmt: skip


def images(batch: int) -> Batches:
    """Four batches of ``cnn``'s images with random labels."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, 1, 12, 12, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(4)]  # fmt: skip


def run_config(run_dir: Path, *, steps: int, batch: int) -> dict[str, Any]:
    """A short run on the CPU: validation and a checkpoint every 2 steps, a line a step."""
    return {
        "run_dir": str(run_dir),
        "training": {"steps": steps, "batch_size": batch, "val_every": 2, "log_every": 1,
                     "device": "cpu"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1, "decay_steps": 6},
        "checkpoint": {"every_steps": 2},
    }  # fmt: skip


def cnn_run() -> tuple[nn.Module, Batches, Batches]:
    """The shipped recipe ``cnn-tiny``'s ``[custom] factory``: the CNN with BatchNorm, its
    training batches of 8 images and two of them for validation."""
    return cnn(batch_norm=True), images(8), images(8)[:2]
