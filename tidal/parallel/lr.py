"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidal.parallel.config import OptimizerConfig, TrainingConfig

__all__ = ["WarmupCosine", "lr_schedule"]


@dataclass(kw_only=True, frozen=True, slots=True)
class WarmupCosine:
    """``lr_at(step)`` is the learning rate for the optimizer step that follows ``step`` done steps.

    The schedule is a pure function of the step count, so a checkpoint needs only that count to
    resume it exactly.
    """

    peak_lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float

    def lr_at(self, step: int) -> float:
        assert step >= 0, step
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


def lr_schedule(optimizer: OptimizerConfig, training: TrainingConfig) -> WarmupCosine:
    """The warm-up + cosine learning rate of a job's optimizer and length (every engine's)."""
    return WarmupCosine(
        peak_lr=optimizer.lr,
        warmup_steps=optimizer.warmup_steps,
        decay_steps=optimizer.decay_steps or training.steps,
        min_lr_ratio=optimizer.min_lr_ratio,
    )
