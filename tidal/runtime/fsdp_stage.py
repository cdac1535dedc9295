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

from tidal.runtime.shares import ShardedStageWeights

__all__ = ["Fsdp2StageWeights", "fsdp2_stage"]


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


class Fsdp2StageWeights(ShardedStageWeights):
    """The weights of a stage :func:`fsdp2_stage` sharded; see [Note: FSDP2 stages]."""

    sharded_by_fsdp2 = True

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
