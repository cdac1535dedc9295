"""Mixed precision in a pipeline: bf16 and fp16 compute on fp32 parameters.

[Note: pipeline mixed precision]
- The parameters stay fp32: they are the masters each stage's optimizer updates. A stage's
  forward runs under the reference engine's ``autocast`` (``StageWeights(precision=...)``, the
  stage's forward context), so each stage computes what the reference engine computes for its
  layers, and its backward what autograd derives from that.
- fp16 scales the loss by a dynamic :class:`~tidal.parallel.loss_scale.LossScale` (the chunk
  engine's rule). The last stage backpropagates ``loss * share * scale``
  (:class:`~tidal.runtime.executor.StageRunner`); at the synchronous pre-update every gradient
  is multiplied once by ``clip / scale`` (:func:`update_factor`), after the data-parallel
  reduction and the tied sum, which are linear, so the norm and the clipping read unscaled
  gradients as the reference's ``GradScaler.unscale_`` gives them.
- An overflow is a non-finite sum of squared gradients. That sum is all-reduced over the
  pipeline group for the global norm anyway, so every rank sees the same verdict without
  another collective: all skip the step together (gradients dropped, no update), halve the
  scale, and the schedule and the weights' version advance as after a step, as torch's
  ``GradScaler`` and the chunk engine do.
- Asynchronous schedules stay fp32. Under autocast the low-precision copy of a weight that a
  matmul saves is a new tensor, not a view of the parameter, so the saved-tensor redirection
  cannot reach it ([Note: saved-tensor redirection] in weights.py): PipeMare's backward would
  run on the forward's weights, not the current or corrected ones. And an fp16 skip would need
  every stage's gradients of one step at once, which only a flush gives.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from tidal.config import require
from tidal.memory.optim_rules import clip_factor
from tidal.parallel.loss_scale import LossScale

__all__ = ["PRECISIONS", "LossScaler", "update_factor"]

PRECISIONS = ("fp32", "bf16", "fp16")


def update_factor(squares: torch.Tensor, *, max_norm: float | None, scale: float) -> torch.Tensor:
    """What every gradient is multiplied by before the update: ``1 / scale`` times the clip
    coefficient of the unscaled global norm (1 without clipping). ``squares``: the sum of the
    squared scaled gradient entries over the whole pipeline."""
    if max_norm is None:
        return torch.full_like(squares, 1.0 / scale)
    return clip_factor(squares.sqrt() / scale, max_norm) / scale


class LossScaler:
    """The loss scale of a synchronous pipeline, one per process, the same on every rank:
    [Note: pipeline mixed precision]. Scales nothing (1.0) unless ``precision`` is fp16."""

    def __init__(self, precision: str) -> None:
        require(
            precision in PRECISIONS,
            "training.precision",
            f"must be one of {', '.join(PRECISIONS)}, got {precision!r}",
        )
        self.state: LossScale | None = LossScale() if precision == "fp16" else None
        self._skipped: set[int] = set()

    @property
    def scaling(self) -> bool:
        return self.state is not None

    @property
    def scale(self) -> float:
        return 1.0 if self.state is None else self.state.scale

    @property
    def skipped_steps(self) -> int:
        return 0 if self.state is None else self.state.skipped_steps

    def decide(
        self, step: int, squares: torch.Tensor, *, max_norm: float | None
    ) -> torch.Tensor | None:
        """Step ``step``'s factor for every gradient (:func:`update_factor`), or None when its
        gradients overflowed and its update is skipped; moves the scale on."""
        overflow = self.state is not None and not bool(torch.isfinite(squares))
        factor = None if overflow else update_factor(squares, max_norm=max_norm, scale=self.scale)
        if self.state is not None:
            self.state = self.state.after_step(overflow=overflow)
        if overflow:
            self._skipped.add(step)
        return factor

    def skips(self, step: int) -> bool:
        """Whether step ``step``'s update is skipped (asked once, at each stage's ``U``)."""
        return step in self._skipped

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.state is None else asdict(self.state)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.state is not None and state is not None:
            self.state = LossScale(**state)
