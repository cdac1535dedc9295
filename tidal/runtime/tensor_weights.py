"""A pipeline stage split over ``mesh["tp"]``: :class:`TensorStageWeights` ([Note: tensor-parallel
stages] in tidal/parallel/tensor_stage.py).

The stage-parameter protocol on a stage :func:`~tidal.parallel.tensor_stage.tensor_parallel_stage`
split: the parameters are DTensors (split or replicated over the tp ranks) or, outside the
blocks, plain replicated tensors, and the stage's torch optimizer updates each rank's share.
Every read and write of a gradient goes to the local tensor: the dp reduction averages them over
``mesh["dp"]`` once per step (the replicas of one tp rank hold the same shares), clipping scales
them, and the squared norm counts a split parameter's shares once over the tp group and a
replicated parameter once (:func:`~tidal.parallel.tensor_stage.tensor_grad_squares`). A tied
embedding is replicated, so ``gradient(name)`` hands its whole gradient as plain stages do.
Only synchronous schedules run: the saved-tensor redirection of asynchronous ones finds a
parameter by its storage, which a DTensor's local shard hides. The tensor-parallel collectives
of every forward and backward are counted (``stats()``: [Note: collective byte counts] in
tidal/distributed/collectives.py), as chunk stages count their dp ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tidal.distributed.collectives import FunctionalCollectiveBytes
from tidal.parallel.stage_params import average_over
from tidal.runtime.fsdp_stage import Fsdp2StageWeights
from tidal.runtime.shares import ShardedStageWeights, local

__all__ = ["Fsdp2TensorStageWeights", "TensorStageWeights"]


class _CountsTensorBytes:
    """Counts the tensor-parallel collectives of every forward and backward (``stats()``)."""

    tp_bytes: FunctionalCollectiveBytes

    @contextlib.contextmanager
    def forward(self, microbatch: int, *, version: int | None = None) -> Iterator[None]:
        with super().forward(microbatch, version=version), self.tp_bytes:  # type: ignore[misc]
            yield

    @contextlib.contextmanager
    def backward(self, microbatch: int, *, last: bool = True) -> Iterator[None]:
        with super().backward(microbatch, last=last), self.tp_bytes:  # type: ignore[misc]
            yield

    def stats(self) -> dict[str, int]:
        """This rank's tensor-parallel collective bytes so far."""
        return self.tp_bytes.stats()


class TensorStageWeights(_CountsTensorBytes, ShardedStageWeights):
    """The weights of a tensor-parallel stage; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp_bytes = FunctionalCollectiveBytes()

    def reduce_gradients(self) -> None:
        average_over([local(p.grad) for p in self.params if p.grad is not None], self.dp_group)


class Fsdp2TensorStageWeights(_CountsTensorBytes, Fsdp2StageWeights):
    """A stage split over ``mesh["tp"]`` whose shares FSDP2 then shards over ``mesh["dp"]``
    (torchtitan's 2D composition): FSDP2's once-per-step reduction and shard reads ([Note:
    FSDP2 stages]), the norm of DTensors on the two-dimensional mesh
    (:func:`~tidal.parallel.tensor_stage.tensor_grad_squares`), the tp collectives counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp_bytes = FunctionalCollectiveBytes()
