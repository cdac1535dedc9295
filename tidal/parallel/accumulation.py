"""Micro-batch counting shared by every engine.

[Note: accumulation boundary]
Engines take DeepSpeed's calling convention: ``step()`` is called after every micro-batch and
steps the optimizer only on every ``grad_accum_steps``-th call, the boundary. ``backward``
divides the loss by ``grad_accum_steps`` so that accumulated gradients are the mean over the
micro-batches. On the boundary an engine unscales, clips, updates, sets the next learning rate
and zeroes the gradients. The schedule is a pure function of ``global_step`` (optimizer steps
done), which is all a checkpoint needs to resume it.
"""

from __future__ import annotations

__all__ = ["AccumulationCounter"]


class AccumulationCounter:
    """``micro_step`` and ``global_step`` bookkeeping; see [Note: accumulation boundary]."""

    grad_accum_steps: int
    micro_step: int
    global_step: int

    def is_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` call steps the optimizer."""
        return (self.micro_step + 1) % self.grad_accum_steps == 0

    def _count_micro_batch(self) -> bool:
        """Count one micro-batch; True when it closes an accumulation window."""
        boundary = self.is_accumulation_boundary()
        self.micro_step += 1
        return boundary
