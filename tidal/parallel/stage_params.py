"""What a pipeline stage's parameters must do for the executor: the stage-parameter protocol.

[Note: the stage-parameter protocol]
The executor and the one train step around it never read ``.data`` or ``.grad``: a stage's
parameters may be plain ``nn.Parameter``s with a torch optimizer (:class:`StageWeights`), slots
of tidal's chunks that move between tiers and are sharded over the data-parallel group, or
whatever another transform makes of them. Each implements :class:`StageParams`:

- ``forward(mb)`` / ``backward(mb)``: context managers around the microbatch's forward and
  backward (weight versions, saved-tensor redirection, a chunk store's moments);
- ``reduce_gradients()``: the data-parallel reduction of the step's gradients, once, after the
  stage's last backward of the step and before anything reads them (a group of one does
  nothing); afterwards every gradient is the mean over the data-parallel group;
- ``grad_squares(skip)``: the sum of squared gradient entries of this rank's share (the second
  copy of a tied matrix named in ``skip``), an fp32 scalar on the CPU, so the global norm is one
  all-reduce over the whole mesh whatever each stage holds;
- ``scale_grads(factor)``: multiply every gradient (clipping);
- ``gradient(name)`` / ``set_gradient(name, value)``: a parameter's whole gradient, the same on
  each of the stage's dp replicas (None where no gradient reached it), and writing it back
  whole: the tied-matrix sum. A stage that shards gradients gathers the whole (collective over
  its dp group: every replica calls both) and keeps its share of what is set;
- ``value(name)`` / ``set_value(name, value)``: a parameter's whole current weights (fp32,
  gathered where sharded: collective, every replica calls both) and writing them, the same on
  every replica: how the second copy of a tied matrix follows its owner under an asynchronous
  schedule ([Note: tied matrices without a flush] in tidal/runtime/tied.py), whose gradient
  ``drop_gradient(name)`` takes out of the update (a holder that updates parameters one by one
  leaves it and its optimizer state as they are; one that updates whole chunks moves it by a
  zero gradient, and the caller writes its value afterwards);
- ``step(lr, step)``: the update, which also drops the gradients; returns the rate it used;
- ``skip_step()``: in its place, drop the gradients without an update (an fp16 overflow:
  [Note: pipeline mixed precision] in precision.py); the version advances as a step's would.

A data-parallel reduction inside ``backward`` would run once per microbatch; a reduction in
``step`` would come after clipping had read unreduced gradients. So the order of one step is
fixed here and nowhere else: every backward, ``reduce_gradients``, the tied sum, the norm and
``scale_grads``, ``step`` (or ``skip_step``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "StageParams",
    "all_reduce_mean",
    "average_over",
    "like",
    "local_nbytes",
    "plain_grad_squares",
    "plain_scale_grads",
    "reshard_stage",
    "whole",
]


class StageParams(Protocol):
    """[Note: the stage-parameter protocol]."""

    @property
    def version(self) -> int: ...

    def forward(
        self, microbatch: int, *, version: int | None = None
    ) -> AbstractContextManager[object]: ...

    def backward(self, microbatch: int, *, last: bool = True) -> AbstractContextManager[object]: ...

    def reduce_gradients(self) -> None: ...

    def grad_squares(self, *, skip: frozenset[str] = frozenset()) -> torch.Tensor: ...

    def scale_grads(self, factor: torch.Tensor) -> None: ...

    def gradient(self, name: str) -> torch.Tensor | None: ...

    def set_gradient(self, name: str, value: torch.Tensor) -> None: ...

    def value(self, name: str) -> torch.Tensor: ...

    def set_value(self, name: str, value: torch.Tensor) -> None: ...

    def drop_gradient(self, name: str) -> None: ...

    def step(self, *, lr: float, step: int) -> float: ...

    def skip_step(self) -> None: ...


def _is_dtensor(t: torch.Tensor) -> bool:
    # No tensor is a DTensor before its module is loaded, and loading it costs about a second
    # (sympy) that a run without DTensors should not pay.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def reshard_stage(module: nn.Module) -> None:
    """Back to the shards after a forward without a backward (validation), which leaves an
    FSDP2-sharded module's own parameters gathered; nothing where FSDP2 sharded nothing (a
    process that never loaded it has no shards to go back to)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for sharded in module.modules():  # a plan's model is its stage's one layer
        if isinstance(sharded, fsdp.FSDPModule):
            sharded.reshard()


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of this rank's share of ``t`` (all of it when plain)."""
    share = t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]
    return share.numel() * share.element_size()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's or its state's whole value (gathered over the dp group when sharded: every
    replica calls it)."""
    return t.full_tensor() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (whole) laid out as ``param`` is: this rank's shard of it for a DTensor."""
    if not _is_dtensor(param):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)  # type: ignore[attr-defined]


def plain_grad_squares(
    named: Iterable[tuple[str, nn.Parameter]], *, skip: frozenset[str] = frozenset()
) -> torch.Tensor:
    """Sum of squared gradient entries of ``named`` (``skip``'s names left out)."""
    total = torch.zeros((), dtype=torch.float32)
    for name, p in named:
        if p.grad is not None and name not in skip:
            total = total + torch.linalg.vector_norm(p.grad.float()).square().cpu()
    return total


def plain_scale_grads(params: Iterable[nn.Parameter], factor: torch.Tensor) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor.to(p.grad.device, p.grad.dtype))


def all_reduce_mean(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Each gradient of ``params`` becomes its mean over ``group`` (:func:`average_over`)."""
    average_over([p.grad for p in params if p.grad is not None], group)


def average_over(grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Each of ``grads`` (plain tensors: a DTensor's local one) becomes its mean over ``group``,
    in one flat all-reduce per dtype (every rank must hold gradients for the same parameters,
    as data parallelism over replicas of one stage does)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        same = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        if dist.get_backend(group) != "nccl":
            flat = flat.cpu()
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
