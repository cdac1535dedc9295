"""Dynamic loss scaling for fp16: the scale as a pure value updated after every step.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a
large scale before backward. Too large a scale overflows instead. The rule (the one torch's
GradScaler follows): on a step whose gradients are not all finite, skip the update and halve the
scale; after ``growth_interval`` clean steps in a row, double it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["LossScale"]


@dataclass(kw_only=True, frozen=True, slots=True)
class LossScale:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0  # consecutive steps without overflow since the last change
    skipped_steps: int = 0  # steps skipped for overflow, in all

    def after_step(self, *, overflow: bool) -> LossScale:
        """The scale for the next step."""
        if overflow:
            return replace(
                self,
                scale=self.scale * self.backoff_factor,
                clean_steps=0,
                skipped_steps=self.skipped_steps + 1,
            )
        if self.clean_steps + 1 >= self.growth_interval:
            return replace(self, scale=self.scale * self.growth_factor, clean_steps=0)
        return replace(self, clean_steps=self.clean_steps + 1)
