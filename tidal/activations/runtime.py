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
  ``saved_tensors_hooks`` to buffers of the host tier (byte budgeted: past the budget,
  :class:`~tidal.memory.tiers.TierBudgetError` before anything is copied) and come back when
  their backward reads them; a host buffer is given back when autograd drops the last saved
  tensor that uses it. Parameters (and views of them) are not copied: they stay where they
  are, and autograd gets them back as they were saved.

[Note: host swap by storage]
A saved tensor goes to the host as its whole storage, copied once per storage within one
forward of the submodule (attention saves q, k and v, three views of one projection: one copy,
not three strided ones, which on CUDA would each stage through a temporary and block); the
tensors come back as views of one copy back, shared while any of them is alive. Storages are
told apart by address only while the forward that saved them runs, and the swap holds each
saved tensor until then, so an address cannot be reused in between. This is what the
saved-tensor meter counts too (whole storages), so the plan's bytes are the bytes moved.

On CUDA the host tier is pinned; the copy out runs on a side stream after the work that made the
tensor (the forward goes on while it copies; the allocator is told the side stream uses the
tensor, so its memory is not reused before the copy ends), and the copy back waits for it on the
current stream. There is no prefetch ahead of the backward yet: a copy back is on the backward's
path, which the planner's idle windows assume hidden. Both are for synchronous
schedules: an asynchronous stage's backward must see the weights its
forward used, which a recompute would not (it reads the current ones) and which the stage's own
saved-tensor redirection provides (a submodule's hooks would replace it); :func:`check_schedule`
refuses them. Peer swap needs sends and receives placed in the schedule and is not built here.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
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
    """The host side of ``HOST`` savers: the tier the saved tensors go to, and counters
    ([Note: host swap by storage])."""

    tier: Tier
    tensors_out: int = 0
    tensors_back: int = 0
    storages_out: int = 0
    _streams: dict[torch.device, Any] = field(default_factory=dict)
    _open: dict[tuple[torch.device, int], tuple[_HostStorage, torch.Tensor]] | None = None

    @contextlib.contextmanager
    def swapping(self, params: frozenset[int]) -> Iterator[None]:
        """Saved tensors to the host while open (one submodule's forward)."""
        assert self._open is None, "host swaps do not nest ([Note: savers in place])"
        self._open = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self.pack(t, params), self.unpack
            ):
                yield
        finally:
            self._open = None  # the device tensors may go: their copies are queued

    def pack(self, tensor: torch.Tensor, params: frozenset[int]) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in params or tensor.layout is not torch.strided:
            return tensor  # a parameter or a view of one (or a sparse tensor): it stays
        key = (tensor.device, storage.data_ptr())
        opened = self._open if self._open is not None else {}
        if key not in opened:
            opened[key] = (self._copy_out(tensor), tensor)
        self.tensors_out += 1
        return _OnHost(opened[key][0], tensor.dtype, tuple(tensor.shape), tensor.stride(),
                       int(tensor.storage_offset()))  # fmt: skip

    def _copy_out(self, tensor: torch.Tensor) -> _HostStorage:
        storage = tensor.untyped_storage()
        flat = self.tier.allocate(storage.nbytes(), torch.uint8)
        source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        copied = None
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                flat.copy_(source, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            source.record_stream(stream)
        else:
            flat.copy_(source)
        self.storages_out += 1
        held = _HostStorage(flat, tensor.device, copied)
        weakref.finalize(held, self._give_back, flat)
        return held

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _OnHost):
            return packed
        self.tensors_back += 1
        flat = packed.storage.on_device()
        return torch.empty(0, dtype=packed.dtype, device=flat.device).set_(
            flat.untyped_storage(), packed.offset, packed.shape, packed.stride
        )

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _give_back(self, flat: torch.Tensor) -> None:
        if self.tier.holds(flat):
            self.tier.free(flat)


class _HostStorage:
    """One device storage's bytes on the host; its copy back is shared by the tensors that
    view it while any of them is alive."""

    def __init__(self, flat: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.flat = flat
        self.device = device
        self.copied = copied  # the CUDA event the copy out records; None where it was synchronous
        self._back: weakref.ref[torch.Tensor] | None = None

    def on_device(self) -> torch.Tensor:
        if self.flat.device == self.device:
            return self.flat
        back = self._back() if self._back is not None else None
        if back is None:
            if self.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied)
            back = torch.empty_like(self.flat, device=self.device).copy_(
                self.flat, non_blocking=True
            )
            self._back = weakref.ref(back)
        return back


@dataclass(frozen=True, slots=True)
class _OnHost:
    storage: _HostStorage
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


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
    return around_forward(module, lambda: host.swapping(params))


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
