"""Stage weights whose parameters are DTensor shares: :class:`ShardedStageWeights`.

FSDP2's shards (fsdp_stage.py), the tensor axis's splits (tensor_weights.py) and a plan's layout
(plan_weights.py) all leave a stage's parameters as DTensors (or plain tensors beside them),
sharded or replicated along the mesh dimensions their placements name. The stage-parameter
protocol's reads and writes of their gradients are the same for all three, so they are written
here once: the squared norm counts each parameter's local squares once per mesh dimension it is
split along (:func:`~tidal.parallel.tensor_stage.tensor_grad_squares`, the one-process norm),
clipping scales the local tensors, a gradient is read whole (gathered: every rank of the stage
calls it) and written back as each rank's share.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from tidal.parallel.stage_params import whole
from tidal.parallel.tensor_stage import tensor_grad_squares
from tidal.runtime.weights import StageWeights

__all__ = ["ShardedStageWeights", "local", "set_share"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``t`` (``t`` itself when plain)."""
    return t.to_local() if isinstance(t, DTensor) else t


def set_share(grad: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's share of ``value`` (whole, the same on every rank: no collective) into
    ``grad``, a DTensor or a plain tensor."""
    if not isinstance(grad, DTensor):
        grad.copy_(value)
        return
    share = distribute_tensor(value.to(grad.device), grad.device_mesh, grad.placements,
                              src_data_rank=None)  # fmt: skip
    grad.to_local().copy_(share.to_local())


class ShardedStageWeights(StageWeights):
    """:class:`StageWeights` over DTensor shares; see the module docstring."""

    def grad_squares(self, *, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        return tensor_grad_squares(self._named(), skip=skip)

    def scale_grads(self, factor: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is not None:
                grad = local(p.grad)
                grad.mul_(factor.to(grad.device, grad.dtype))

    def gradient(self, name: str) -> torch.Tensor | None:
        """The whole gradient, gathered from the shares (every rank of the stage calls it)."""
        grad = super().gradient(name)
        return None if grad is None else whole(grad)

    def set_gradient(self, name: str, value: torch.Tensor) -> None:
        """This rank's share of ``value`` (whole, the same on every rank: no collective)."""
        grad = super().gradient(name)
        assert grad is not None, f"{name} has no gradient to replace"
        set_share(grad, value)
