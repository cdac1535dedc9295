"""Carry out savers on a module, in place: recompute, or swap what it saves to the host tier.

[Note: savers in place]
:func:`apply_savers` changes the named submodules of a model (or of a pipeline stage) and
returns the handles that undo it:

- ``RECOMPUTE``: torch's composable non-reentrant checkpoint on the submodule: its forward keeps
  only its inputs, and its backward runs the forward again (same kernels, same inputs: the
  gradients are bit for bit the same in fp32 with deterministic ops).
- savers name disjoint submodules: one inside another's would take the tensors the outer one's
  hooks must see (a recompute's own saved-tensor hooks, or the host copies), so that is refused.
- ``HOST``: while the submodule's forward runs, autograd's saved tensors go through
  ``saved_tensors_hooks``: each is copied, with its strides, into a buffer of the host tier (byte
  budgeted: past the budget, :class:`~tidal.memory.tiers.TierBudgetError` before anything is
  copied) and copied back when its backward reads it; the host buffer is given back when
  autograd drops the saved tensor. Parameters (and views of them) are not copied: they stay
  where they are, and autograd gets them back as they were saved.

On CUDA the host tier is pinned and the copy back is queued on the current stream; the copy out
waits for its transfer (no side stream or prefetch ahead of the backward yet: that is what the
planner's idle windows are for, and it is not measured on a GPU). Both are for synchronous
schedules: an asynchronous stage's backward must see the weights its
forward used, which a recompute would not (it reads the current ones) and which the stage's own
saved-tensor redirection provides (a submodule's hooks would replace it); :func:`check_schedule`
refuses them. Peer swap needs sends and receives placed in the schedule and is not built here.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint

from tidal.activations.plan import Saver
from tidal.config import ConfigError
from tidal.memory.tiers import Tier

__all__ = ["HostSwap", "SaverHandles", "apply_savers", "around_forward", "check_schedule"]


@dataclass(slots=True)
class HostSwap:
    """The host side of ``HOST`` savers: the tier the saved tensors go to, and counters."""

    tier: Tier
    tensors_out: int = 0
    tensors_back: int = 0

    def pack(self, tensor: torch.Tensor, params: frozenset[int]) -> Any:
        if tensor.untyped_storage().data_ptr() in params:
            return tensor  # a parameter or a view of one: it stays where it is
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        span = span if tensor.numel() else 0
        flat = self.tier.allocate(span, tensor.dtype)
        host = flat.as_strided(tensor.shape, tensor.stride())
        host.copy_(tensor)
        weakref.finalize(host, self._give_back, flat)
        self.tensors_out += 1
        return _OnHost(host, tensor.device)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _OnHost):
            return packed
        self.tensors_back += 1
        host = packed.host
        if host.device == packed.device:
            return host
        back = torch.empty_strided(
            host.shape, host.stride(), dtype=host.dtype, device=packed.device
        )
        return back.copy_(host, non_blocking=True)

    def _give_back(self, flat: torch.Tensor) -> None:
        if self.tier.holds(flat):
            self.tier.free(flat)


@dataclass(frozen=True, slots=True)
class _OnHost:
    host: torch.Tensor
    device: torch.device


@dataclass(slots=True)
class SaverHandles:
    """What :func:`apply_savers` did, to count and to undo."""

    host: HostSwap | None
    recomputed: tuple[str, ...]
    swapped: tuple[str, ...]
    _hooks: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def apply_savers(model: nn.Module, savers: Mapping[str, Saver], *,
                 host: Tier | None = None) -> SaverHandles:  # fmt: skip
    """Recompute or host-swap the submodules ``savers`` names ([Note: savers in place]);
    ``host``: the tier host swaps use (needed when any is asked)."""
    unknown = sorted(set(savers) - {name for name, _ in model.named_modules()})
    if unknown:
        raise ConfigError("pipeline.memory", f"no submodule {unknown[0]!r} in the model to save on")
    moves = {path: saver for path, saver in savers.items() if saver is not Saver.KEEP}
    if any(s is Saver.PEER for s in moves.values()):
        raise ConfigError(
            "pipeline.memory", "peer swap is not available yet; use recompute or host"
        )
    for outer, inner in itertools.permutations(moves, 2):
        if inner.startswith(outer + ".") or outer == "":
            raise ConfigError("pipeline.memory", f"savers on {outer or 'the model'!r} and on "
                              f"{inner!r}, inside it: name one of them, not both")  # fmt: skip
    swaps = [path for path, saver in moves.items() if saver is Saver.HOST]
    if swaps and host is None:
        raise ConfigError("memory.host_budget", "host swaps need a host tier to swap to")
    handles = SaverHandles(
        host=HostSwap(host) if host is not None and swaps else None,
        recomputed=tuple(p for p, s in moves.items() if s is Saver.RECOMPUTE),
        swapped=tuple(swaps),
    )
    for path in handles.recomputed:
        checkpoint(model.get_submodule(path))
    if handles.host is not None:
        params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
        for path in swaps:
            handles._hooks += _swap_saved(model.get_submodule(path), handles.host, params)
    return handles


def _swap_saved(module: nn.Module, host: HostSwap, params: frozenset[int]) -> list[Any]:
    """Hooks that hold ``host``'s saved-tensor hooks around each forward of ``module``."""
    return around_forward(
        module,
        lambda: torch.autograd.graph.saved_tensors_hooks(
            lambda t: host.pack(t, params), host.unpack
        ),
    )


def around_forward(
    module: nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]
) -> list[Any]:
    """Hooks that hold a fresh ``context()`` open around each forward of ``module`` (the
    context a submodule's forward opens is innermost, so its saved-tensor hooks win there)."""
    open_contexts: list[contextlib.AbstractContextManager[Any]] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        opened = context()
        opened.__enter__()
        open_contexts.append(opened)

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        open_contexts.pop().__exit__(None, None, None)

    return [
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(leave, always_call=True),
    ]


ASYNCHRONOUS_SCHEDULES_REFUSED = "recompute and host swap run under synchronous schedules only"


def check_schedule(savers: Mapping[str, Saver], *, asynchronous: bool, schedule: str) -> None:
    """Refuse savers under an asynchronous schedule ([Note: savers in place])."""
    if asynchronous and any(s is not Saver.KEEP for s in savers.values()):
        raise ConfigError(
            "pipeline.memory",
            f"{ASYNCHRONOUS_SCHEDULES_REFUSED} (gpipe, 1f1b, interleaved), not {schedule!r}: "
            "its backward must see the weights its forward used",
        )
