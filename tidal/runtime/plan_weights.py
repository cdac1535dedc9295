"""A model laid out by a plan as one stage of the train step: :class:`PlanStageWeights`.

[Note: plan stages]
``tidal train --plan`` realises the plan on the model in place (``plan_apply.apply``: DTensor
on ``mesh["tp"]``, FSDP2 on ``mesh["dp"]`` at each unit's ZeRO level, recomputation), makes
the model the one stage of a one-stage schedule (:func:`~tidal.pipeline.split.whole_model_stage`,
the model itself, so the layout's hooks stay in force) and trains it with the executor and the
one update every other run takes. This holder is the stage-parameter protocol over what the
plan made ([Note: the stage-parameter protocol] in tidal/parallel/stage_params.py):

- the data-parallel reduction is the layout's own, inside each backward: FSDP reduce-scatters
  ZeRO-2 and -3 units' gradients and the layout's hooks all-reduce ZeRO-0 units' and finish the
  tensor axis's partial sums, each microbatch, as the plan priced them; ZeRO-1 units accumulate
  unsynchronised until the step's last backward (``set_accumulating``). So
  :meth:`PlanStageWeights.reduce_gradients` has nothing left to do;
- the squared norm is each parameter's local squares summed over the mesh dimensions it is
  sharded along (:func:`~tidal.parallel.tensor_stage.tensor_grad_squares`), the one-process
  norm; clipping scales the local tensors;
- the optimizer's groups are split mesh by mesh ([Note: one mesh per list] in
  plan_layout.py); the update and its rate are :class:`StageWeights`';
- a checkpoint is the one format: whole tensors in the one-process layout (the fused qkv's
  rows in the model's order, ``REORDERED`` under the stage's names), so a plan run resumes on
  any mesh, plan or none, and any run resumes under a plan.

A pipelined plan's stages are each one of these, under the plan's synchronous schedule
([Note: planned pipeline stages] in tidal/train/plan_stage.py); a stage's ZeRO-1 units
accumulate over the step's microbatches on that stage alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from tidal.parallel.plan_apply import set_accumulating
from tidal.parallel.tensor_axis import REORDERED
from tidal.runtime.shares import ShardedStageWeights

__all__ = ["PlanStageWeights", "name_reordered_rows"]


def name_reordered_rows(stage: nn.Module, model: nn.Module, prefix: str) -> None:
    """Record on ``stage`` the rows the layout reordered in ``model`` (its ``prefix``-named
    submodule), under the stage's own names, as a tensor-parallel stage records them."""
    reordered = getattr(model, REORDERED, {})
    setattr(stage, REORDERED, {f"{prefix}{name}": rows for name, rows in reordered.items()})


class PlanStageWeights(ShardedStageWeights):
    """:class:`StageWeights` of a model a plan laid out; see [Note: plan stages]."""

    def __init__(self, *args: Any, microbatches_per_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.microbatches_per_step = microbatches_per_step

    @contextlib.contextmanager
    def backward(self, microbatch: int, *, last: bool = True) -> Iterator[None]:
        """ZeRO-1 units reduce in the step's last backward only ([Note: plan stages])."""
        final = len(self._pending) + 1 >= self.microbatches_per_step
        set_accumulating(self.module, not final)
        with super().backward(microbatch, last=last):
            yield

    def reduce_gradients(self) -> None:
        """The layout reduced every backward's gradients already ([Note: plan stages])."""
