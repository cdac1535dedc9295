"""Micro-batch counting, one object every engine holds; a global micro-batch's rows per rank.

[Note: accumulation boundary]
Engines take DeepSpeed's calling convention: ``step()`` is called after every micro-batch and
steps the optimizer only on every ``grad_accum_steps``-th call, the boundary. ``backward``
divides the loss by ``grad_accum_steps`` so that accumulated gradients are the mean over the
micro-batches. On the boundary an engine unscales, clips, updates, sets the next learning rate
and zeroes the gradients. The schedule is a pure function of ``global_step`` (optimizer steps
done), which is all a checkpoint needs to resume it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError

__all__ = ["StepCounter", "rank_rows", "split_rows"]


@dataclass(kw_only=True, slots=True)
class StepCounter:
    """``micro_step`` and ``global_step``; see [Note: accumulation boundary]."""

    grad_accum_steps: int
    micro_step: int = 0
    global_step: int = 0

    def is_boundary(self) -> bool:
        """Whether the next ``step()`` call steps the optimizer."""
        return (self.micro_step + 1) % self.grad_accum_steps == 0

    def count_micro_batch(self) -> bool:
        """Count one micro-batch; True when it closes an accumulation window."""
        boundary = self.is_boundary()
        self.micro_step += 1
        return boundary

    def drop_window(self) -> None:
        """Forget the micro-batches of the open window (their gradients were dropped)."""
        self.micro_step -= self.micro_step % self.grad_accum_steps

    def state(self) -> dict[str, int]:
        return {"global_step": self.global_step, "micro_step": self.micro_step}

    def restore(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.micro_step = int(state["micro_step"])


def split_rows(batch_size: int, *, index: int, parts: int, over: str, fix: str) -> slice:
    """Part ``index``'s contiguous rows of a global batch split into ``parts`` equal ones
    ([Note: global batch] in tidal/train/trainer.py); ``over`` names the parts and ``fix`` how
    else to make them divide, in the error when they do not."""
    if batch_size % parts:
        lower = batch_size - batch_size % parts
        hint = f"{lower} or {lower + parts}" if lower else str(parts)
        raise ConfigError(
            "training.batch_size",
            f"{batch_size} sequences do not split evenly over {over}; set it to a multiple of "
            f"{parts}, e.g. {hint}{fix}",
        )
    rows = batch_size // parts
    return slice(index * rows, (index + 1) * rows)


def rank_rows(batch_size: int, *, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s rows of a global batch of ``batch_size`` split over ``world_size``
    replicas ([Note: global batch] in tidal/train/trainer.py)."""
    over = (f"{world_size} ranks (it is the global micro-batch; each rank trains on "
            f"batch_size / world size of its rows)")  # fmt: skip
    fix = ", or run on a world size that divides it"
    return split_rows(batch_size, index=rank, parts=world_size, over=over, fix=fix)
