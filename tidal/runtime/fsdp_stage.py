"""A pipeline stage sharded by FSDP2 over its data-parallel replicas: :func:`fsdp2_stage`.

[Note: FSDP2 stages]
The alternative to replicating a stage on ``mesh["dp"]`` (``parallel.fsdp2``): ``fully_shard``
on each of the stage's blocks and on the stage itself, as torchtitan composes FSDP2 with its
pipelines. The parameters stay ``nn.Parameter``s (DTensors sharded on dim 0), so the stage's
torch optimizer updates only this rank's shards, and FSDP2 gathers the weights for each forward
and backward. The dp reduction runs once per step: the step's earlier backwards sum their
gradients unsharded (``set_requires_gradient_sync(False)``, as torch's pipelining stages do) and
its last reduce-scatters the sum into the shards (the price: one unsharded gradient of the
stage is held through the step). So :meth:`Fsdp2StageWeights.reduce_gradients` has nothing left to do,
and the stage-parameter protocol's other reads go to the local shards: the squared norm summed
over the dp group (the same on every replica, as the pipeline's global norm expects of a
stage), the clip factor applied to each shard, a tied matrix's gradient gathered whole to be
summed with its other copy's and each rank's shard of the sum kept. A checkpoint holds whole tensors
(gathered, :func:`whole`), and a resumed stage takes its shards of them. Only synchronous schedules run:
the saved-tensor redirection of asynchronous ones needs the parameters' own storage, which
FSDP2 replaces by gathered copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from tidal.parallel.stage_params import whole
from tidal.parallel.tensor_stage import tensor_grad_squares
from tidal.runtime.weights import StageWeights

__all__ = ["Fsdp2StageWeights", "fsdp2_stage", "reshard_stage", "set_share"]


def fsdp2_stage(module: nn.Module, dp_mesh: DeviceMesh, *, offload: bool = False) -> nn.Module:
    """``fully_shard`` each block of a stage (its ``layers``, or a whole GPT's ``blocks``, if
    any) and the stage itself, in place, over ``dp_mesh``; ``offload``: the shards, their
    gradients and the optimizer's step on the host (``CPUOffloadPolicy``); returns
    ``module``."""
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = getattr(module, "layers", None) or getattr(module, "blocks", None) or ()
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module


def reshard_stage(module: nn.Module) -> None:
    """Back to the shards after a forward without a backward (validation), which leaves the
    stage's own parameters gathered; nothing for a stage FSDP2 did not shard."""
    for sharded in module.modules():  # a plan's model is its stage's one layer
        if isinstance(sharded, FSDPModule):
            sharded.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Fsdp2StageWeights(StageWeights):
    """:class:`StageWeights` of a stage :func:`fsdp2_stage` sharded; see [Note: FSDP2 stages]."""

    def __init__(self, *args: Any, microbatches_per_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.microbatches_per_step = microbatches_per_step

    @contextlib.contextmanager
    def backward(self, microbatch: int, *, last: bool = True) -> Iterator[None]:
        """The step's last backward reduce-scatters what every one summed ([Note: FSDP2
        stages]); the earlier ones keep their gradients unsharded."""
        assert isinstance(self.module, FSDPModule), "fsdp2_stage shards the module first"
        final = len(self._pending) + 1 >= self.microbatches_per_step
        self.module.set_requires_gradient_sync(final)
        with super().backward(microbatch, last=last):
            yield

    def reduce_gradients(self) -> None:
        """FSDP2 reduce-scattered every backward's gradients into the shards already."""

    def grad_squares(self, *, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        return tensor_grad_squares(self._named(), skip=skip)  # the shards summed over dp

    def scale_grads(self, factor: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is not None:
                grad = _local(p.grad)
                grad.mul_(factor.to(grad.device, grad.dtype))

    def gradient(self, name: str) -> torch.Tensor | None:
        """The whole gradient, gathered from the shards (every replica calls it)."""
        grad = super().gradient(name)
        return None if grad is None else whole(grad)

    def set_gradient(self, name: str, value: torch.Tensor) -> None:
        """This rank's shard of ``value`` (whole, the same on every replica: no collective)."""
        grad = super().gradient(name)
        assert grad is not None, f"{name} has no gradient to replace"
        set_share(grad, value)


def set_share(grad: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's share of ``value`` (whole, the same on every rank: no collective) into
    ``grad``, a DTensor or a plain tensor."""
    if not isinstance(grad, DTensor):
        grad.copy_(value)
        return
    share = distribute_tensor(value.to(grad.device), grad.device_mesh, grad.placements,
                              src_data_rank=None)  # fmt: skip
    grad.to_local().copy_(share.to_local())
