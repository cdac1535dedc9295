"""The synchronous update's preparation, written once for every driver of the one train step
([Note: one train step] in tidal/train/job.py): :func:`prepare_update`.

[Note: the update's order]
The order of [Note: the stage-parameter protocol]: each stage's data-parallel reduction, the
tied-gradient sum, the squared norm of every stage summed over the pipeline (the second copy of
a tied matrix left out), then the loss scaler's decision and the clip factor applied to every
stage. What differs between drivers is only how a sum crosses stages: in one
process (``run_local``) the stages are all here; on ranks the squares are all-reduced over the
pipeline group and a tied matrix's copies are exchanged point to point; a model of one stage
has nothing to cross. So the drivers pass those two operations and share the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from tidal.parallel.stage_params import StageParams
from tidal.runtime.executor import TiedPair, UpdateRules
from tidal.runtime.precision import LossScaler

__all__ = ["prepare_update"]


def prepare_update(
    held: Mapping[int, StageParams],
    *,
    rules: UpdateRules,
    scaler: LossScaler,
    step: int,
    sum_over_pipeline: Callable[[torch.Tensor], torch.Tensor],
    sum_tied: Callable[[TiedPair], None],
) -> float | None:
    """Prepare step ``step``'s update of the stages ``held`` here (by stage index), in the
    order of [Note: the update's order]; returns the global gradient norm before clipping
    (unscaled; None when it is not finite). ``sum_over_pipeline(squares)``: the sum over every
    stage's driver of this driver's squares; ``sum_tied(pair)``: both copies' gradients made
    their sum. Afterwards each stage steps (``step``), or skips if the scaler says so."""
    for weights in held.values():
        weights.reduce_gradients()
    for pair in rules.tied:
        sum_tied(pair)
    squares = torch.zeros((), dtype=torch.float32)
    for s, weights in sorted(held.items()):
        squares = squares + weights.grad_squares(skip=rules.second_copies(s))
    squares = sum_over_pipeline(squares).cpu()
    norm = float(squares.sqrt()) / scaler.scale
    if rules.max_grad_norm is not None or scaler.scaling:
        factor = scaler.decide(step, squares, max_norm=rules.max_grad_norm)
        if factor is not None:  # None: an overflow, and every stage skips this step
            for weights in held.values():
                weights.scale_grads(factor)
    return norm if math.isfinite(norm) else None
