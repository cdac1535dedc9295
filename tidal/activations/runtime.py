"""The swaps that carry out savers: what a module saves goes to the host tier
(:class:`HostSwap`) or to a peer (:class:`PeerSwap`); apply.py puts them, and recompute, on a
model's submodules ([Note: savers in place] there).

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
tensor, so its memory is not reused before the copy ends). The copies back run ahead of the
backward ([Note: host swap prefetch]).

Host and peer swaps hand what they leave in place (parameters and views of them) to the hooks
that were on top when the submodule's forward began (:func:`outer_saved_tensor_hooks`): under an
asynchronous schedule those are the stage's weight-version redirection ([Note: saved-tensor
redirection] in tidal/runtime/weights.py), so the backward still sees the weights it should,
and the swaps run under every schedule.

[Note: host swap prefetch]
A backward runs a stage's blocks in the reverse order of its forward, and microbatches in the
order they were forwarded (1F1B, GPipe), so what one swapped submodule's forward saved (a
*group*) is needed next after the group saved just before it in the same forward of the model
(a *run*), and the first group of a run is followed by the last group of the oldest run whose
backward has not begun. When the backward first reads a group, the one it will read next starts
its copy back on a stream of its own (host to device; the copies out keep theirs), so it lands
while this group's backward computes, or while the forwards between two backwards run; a read
waits only for its own copy's event. A group a backward already read, or whose tensors are gone,
is never fetched. At most one group is fetched ahead at a time (one not yet read when the next is
fetched is dropped, and counted: a schedule that reads in another order costs copies, not
memory), so a rank holds at most one group beyond the one its backward reads: the planner
counts that (``Links.host_prefetch``: the largest host-swapped item beside the largest moved
one). On the CPU the host tier is the device's memory: nothing is copied, but the groups
are chosen alike (``groups_fetched`` counts them).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tidal.activations.costs import Stripe
from tidal.memory.tiers import Tier

__all__ = ["HostSwap", "PeerSwap", "around_forward", "outer_saved_tensor_hooks"]


SavedHooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def outer_saved_tensor_hooks() -> SavedHooks | None:
    """The saved-tensor hooks on top now (torch has no public accessor): hooks about to be
    installed inside them hand them what they do not take themselves, so the hooks of a stage
    (weight-version redirection, a memory meter) still see every parameter its parts save."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


@dataclass(frozen=True, slots=True)
class _Outer:
    packed: Any
    unpack: Callable[[Any], torch.Tensor]


def _stays(tensor: torch.Tensor, outer: SavedHooks | None) -> Any:
    """What a swap does with a tensor it leaves where it is: the outer hooks get it."""
    return tensor if outer is None else _Outer(outer[0](tensor), outer[1])


@dataclass(frozen=True, slots=True)
class _Distributed:
    """A DTensor a swap saved: its local share, packed, and its placement on the mesh."""

    local: Any
    spec: Any


def _dtensor_class() -> Any:
    """DTensor, where something has loaded it (a plan's layout); else None: no saved tensor
    can be one, and a swap does not load it."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _a_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (``weight.t()``), as a module holds it
    while its forward runs: FSDP2's gathered weights among them, whose storage FSDP2 frees after
    the forward and fills again for the backward."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _back(packed: Any) -> torch.Tensor:
    return packed.unpack(packed.packed) if isinstance(packed, _Outer) else packed


@dataclass(slots=True)
class HostSwap:
    """The host side of ``HOST`` savers: the tier the saved tensors go to, and counters
    ([Note: host swap by storage], [Note: host swap prefetch])."""

    tier: Tier
    tensors_out: int = 0
    tensors_back: int = 0
    storages_out: int = 0
    bytes_out: int = 0  # of the storages copied to the host
    groups_fetched: int = 0  # groups chosen to fetch ahead of the backward
    storages_fetched: int = 0  # of their storages, those a copy back was started for
    storages_unread: int = 0  # fetched ahead, then dropped before the backward read them
    _streams: dict[tuple[torch.device, str], Any] = field(default_factory=dict)
    _open: dict[tuple[torch.device, int], tuple[_HostStorage, torch.Tensor]] | None = None
    _group: _Group | None = None  # the group the open forward fills
    _last: weakref.ref[_Group] | None = None  # the group the last forward filled, in this chain
    _ahead: list[weakref.ref[_HostStorage]] = field(default_factory=list)
    _run: _Run | None = None  # the model's forward now running
    _runs: collections.deque[_Run] = field(default_factory=collections.deque)  # oldest first

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One forward of the model the savers are on (a *run*: its groups chain)."""
        if self._run is not None:  # already inside one
            yield
            return
        while self._runs and self._runs[0].done():  # nothing of theirs left to fetch
            self._runs.popleft()
        self._run, self._last = _Run(), None
        self._runs.append(self._run)
        try:
            yield
        finally:
            self._run = None

    @contextlib.contextmanager
    def swapping(self, params: frozenset[int]) -> Iterator[None]:
        """Saved tensors to the host while open (one submodule's forward)."""
        assert self._open is None, "host swaps do not nest ([Note: savers in place])"
        self._open, self._group = {}, _Group(self._last)
        outer = outer_saved_tensor_hooks()
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self.pack(t, params, outer), self.unpack
            ):
                yield
        finally:
            self._last = weakref.ref(self._group)
            if self._run is not None:
                self._run.top = self._last
            self._open = self._group = None  # the device tensors may go: their copies are queued

    def pack(self, tensor: torch.Tensor, params: frozenset[int],
             outer: SavedHooks | None = None) -> Any:  # fmt: skip
        distributed = _dtensor_class()
        if distributed is not None and isinstance(tensor, distributed):  # its local share moves
            spec = tensor._spec
            return _Distributed(self.pack(tensor._local_tensor, params, outer), spec)
        storage = tensor.untyped_storage()
        if storage.data_ptr() in params or tensor.layout is not torch.strided:
            return _stays(tensor, outer)  # a parameter or a view of one (or a sparse tensor)
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
            stream = self._side_stream(tensor.device, "out")
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                flat.copy_(source, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            source.record_stream(stream)
        else:
            flat.copy_(source)
        self.storages_out += 1
        self.bytes_out += storage.nbytes()
        group = self._group if self._group is not None else _Group(None)
        held = _HostStorage(flat, tensor.device, copied, group)
        group.storages.append(weakref.ref(held))
        weakref.finalize(held, self._give_back, flat)
        return held

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Distributed):
            local, spec = self.unpack(packed.local), packed.spec
            return _dtensor_class().from_local(local, spec.mesh, spec.placements, run_check=False,
                                               shape=spec.shape, stride=spec.stride)  # fmt: skip
        if not isinstance(packed, _OnHost):
            return _back(packed)
        self.tensors_back += 1
        group = packed.storage.group
        if not group.read:
            self._read(group)
        flat = packed.storage.on_device()
        return torch.empty(0, dtype=packed.dtype, device=flat.device).set_(
            flat.untyped_storage(), packed.offset, packed.shape, packed.stride
        )

    def _read(self, group: _Group) -> None:
        """The backward reached ``group``: fetch the one it reads next ([Note: host swap
        prefetch])."""
        group.read = True
        if self._run is None:
            self._last = None  # a backward began: the next forward starts a new chain
        before = group.before() if group.before is not None else None
        if before is None or before.read:
            before = self._next_top(group)
        if before is None:
            return
        self.groups_fetched += 1
        for ref in self._ahead:  # at most one group ahead of the one read now
            held = ref()
            if held is not None and held.group is not group and held.drop_fetched():
                self.storages_unread += 1
        self._ahead = []
        for ref in before.storages:
            held = ref()
            if held is not None and held.fetch(self._side_stream):
                self.storages_fetched += 1
                self._ahead.append(ref)

    def _next_top(self, group: _Group) -> _Group | None:
        """The last group of the oldest run whose backward has not begun (not ``group``'s)."""
        while self._runs and self._runs[0] is not self._run:
            if self._runs[0].done():  # its backward began, or it saved nothing that is left
                self._runs.popleft()
                continue
            top = self._runs[0].top_group()
            return None if top is group else top
        return None

    def _side_stream(self, device: torch.device, direction: str = "back") -> Any:
        if (device, direction) not in self._streams:
            self._streams[device, direction] = torch.cuda.Stream(device)
        return self._streams[device, direction]

    def _give_back(self, flat: torch.Tensor) -> None:
        if self.tier.holds(flat):
            self.tier.free(flat)


class _Run:
    """One forward of the model: its last group (the first its backward reads)."""

    __slots__ = ("top",)

    def __init__(self) -> None:
        self.top: weakref.ref[_Group] | None = None

    def top_group(self) -> _Group | None:
        return self.top() if self.top is not None else None

    def done(self) -> bool:
        top = self.top_group()
        return top is None or top.read


class _Group:
    """The storages one forward of a swapped submodule saved, and the group saved just before it
    in the same run of forwards ([Note: host swap prefetch]). Its storages hold it alive."""

    __slots__ = ("__weakref__", "before", "read", "storages")

    def __init__(self, before: weakref.ref[_Group] | None) -> None:
        self.before = before
        self.read = False
        self.storages: list[weakref.ref[_HostStorage]] = []


class _HostStorage:
    """One device storage's bytes on the host; its copy back is shared by the tensors that
    view it while any of them is alive."""

    def __init__(self, flat: torch.Tensor, device: torch.device, copied: Any,
                 group: _Group) -> None:  # fmt: skip
        self.flat = flat
        self.device = device
        self.copied = copied  # the CUDA event the copy out records; None where it was synchronous
        self.group = group
        self._back: weakref.ref[torch.Tensor] | None = None
        self._fetched: tuple[torch.Tensor, Any] | None = None  # a copy back under way, its event

    def _alive(self) -> torch.Tensor | None:
        return self._back() if self._back is not None else None

    def fetch(self, stream_for: Callable[[torch.device], Any]) -> bool:
        """Start the copy back on the device's fetch stream; False where there is nothing to
        copy (the CPU, or a copy back already there or under way)."""
        if (
            self.flat.device == self.device
            or self._fetched is not None
            or self._alive() is not None
        ):
            return False
        stream = stream_for(self.device)
        if self.copied is not None:
            stream.wait_event(self.copied)
        with torch.cuda.stream(stream):  # allocated for this stream: no wait on the backward
            back = torch.empty_like(self.flat, device=self.device)
            back.copy_(self.flat, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
        self._fetched = (back, landed)
        return True

    def drop_fetched(self) -> bool:
        """Give up a copy back fetched ahead and not yet read (True if there was one)."""
        dropped, self._fetched = self._fetched is not None, None
        return dropped

    def on_device(self) -> torch.Tensor:
        if self.flat.device == self.device:
            return self.flat
        back = self._alive()
        if back is None and self._fetched is not None:
            back, landed = self._fetched
            self._fetched = None
            current = torch.cuda.current_stream(self.device)
            current.wait_event(landed)
            back.record_stream(current)  # used here too: not reused before this stream is done
            self._back = weakref.ref(back)
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


class PeerSwap:
    """A stage's ``PEER`` savers ([Note: lending] in tidal/pipeline/lending.py): while a lent
    submodule's forward runs, its saved tensors' storages join the open bundle of its stripe
    (its lenders, [Note: stripes] in costs.py); the schedule's ``LO`` to a lender closes every
    open bundle that lender is in into one flat buffer (the device tensors go with it) and sends
    the lender its share of each as one message; its ``LI`` brings the share back, and once
    every share of a bundle is back the backward reads views of them joined."""

    _ALIGN = 64  # each storage starts on a multiple of this in the message: any dtype can view it

    def __init__(self) -> None:
        self._open: dict[Stripe, dict[tuple[torch.device, int], _LentStorage]] = {}
        self._shares: dict[int, list[tuple[_Bundle, int, torch.Tensor]]] = {}  # lender -> unsent
        self.storages_lent = 0
        self.bytes_lent = 0

    def swapping(
        self, stripe: Stripe, params: frozenset[int]
    ) -> contextlib.AbstractContextManager[None]:
        outer = outer_saved_tensor_hooks()
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self.pack(t, stripe, params, outer), self.unpack
        )

    def pack(self, tensor: torch.Tensor, stripe: Stripe, params: frozenset[int],
             outer: SavedHooks | None = None) -> Any:  # fmt: skip
        if _a_parameter(tensor):  # FSDP2's gathered weights: freed after the forward, gathered
            return _stays(tensor, outer)  # again for the backward, never lent
        distributed = _dtensor_class()
        if distributed is not None and isinstance(tensor, distributed):  # its local share goes
            return _Distributed(self.pack(tensor._local_tensor, stripe, params, outer),
                                tensor._spec)  # fmt: skip
        storage = tensor.untyped_storage()
        if storage.data_ptr() in params or tensor.layout is not torch.strided:
            return _stays(tensor, outer)
        bundle = self._open.setdefault(stripe, {})
        key = (tensor.device, storage.data_ptr())  # held until the bundle closes: no reuse
        if key not in bundle:
            bundle[key] = _LentStorage(torch.empty(0, dtype=torch.uint8,
                                                   device=tensor.device).set_(storage))  # fmt: skip
        return _Lent(bundle[key], tensor.dtype, tuple(tensor.shape), tensor.stride(),
                     int(tensor.storage_offset()))  # fmt: skip

    def lend(self, tensors: Sequence[torch.Tensor],
             stripe: Stripe) -> Callable[[], list[torch.Tensor]]:  # fmt: skip
        """``tensors`` (a forward's weight version: [Note: stashes on a peer] in
        tidal/runtime/weights.py) join the open bundle of ``stripe``, whose ``LO`` copies their
        bytes as they are then; returns what reads them back once it has come home."""
        packed = [self.pack(t.detach(), stripe, frozenset()) for t in tensors]
        return lambda: [self.unpack(x) for x in packed]

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Distributed):
            local, spec = self.unpack(packed.local), packed.spec
            return _dtensor_class().from_local(local, spec.mesh, spec.placements, run_check=False,
                                               shape=spec.shape, stride=spec.stride)  # fmt: skip
        if not isinstance(packed, _Lent):
            return _back(packed)
        flat, start = packed.storage.back()
        assert start % packed.dtype.itemsize == 0 and flat.storage_offset() == 0
        return torch.empty(0, dtype=packed.dtype, device=flat.device).set_(
            flat.untyped_storage(), start // packed.dtype.itemsize + packed.offset, packed.shape,
            packed.stride,
        )  # fmt: skip

    def close(self, lender: int) -> tuple[torch.Tensor, object]:
        """What ``lender`` takes now as one uint8 message (its share of every open bundle it is
        a lender of), and what :meth:`restore` needs when it comes back."""
        for stripe in [stripe for stripe in self._open if lender in stripe.lenders]:
            self._seal(stripe)
        shares = self._shares.pop(lender, [])
        return _joined([part for _, _, part in shares]), [
            (bundle, index, part.numel()) for bundle, index, part in shares
        ]

    def _seal(self, stripe: Stripe) -> None:
        """The open bundle of ``stripe`` in one flat buffer, split into its lenders' shares."""
        entries = list(self._open.pop(stripe).values())
        starts, size = [], 0
        for entry in entries:
            starts.append(size)
            size += -(-entry.num_bytes // self._ALIGN) * self._ALIGN
        flat = torch.empty(size, dtype=torch.uint8, device=entries[0].source.device)
        for entry, start in zip(entries, starts, strict=True):
            flat[start : start + entry.num_bytes].copy_(entry.source)
            entry.leave(start)
        self.storages_lent += len(entries)
        self.bytes_lent += size
        bundle = _Bundle(entries, len(stripe.lenders))
        for index, (to, part) in enumerate(
            zip(stripe.lenders, flat.split(list(stripe.split(size))), strict=True)
        ):
            self._shares.setdefault(to, []).append((bundle, index, part))

    def restore(self, bundle: object, flat: torch.Tensor) -> None:
        assert isinstance(bundle, list)
        for (whole, index, _), part in zip(bundle, flat.split([n for _, _, n in bundle]),
                                           strict=True):  # fmt: skip
            whole.arrive(index, part)


class _Bundle:
    """What one stripe of a stage lent for one microbatch: its storages, and its shares as they
    come back; whole, the storages read from them joined."""

    def __init__(self, entries: list[_LentStorage], num_shares: int) -> None:
        self.entries = entries
        self.shares: list[torch.Tensor | None] = [None] * num_shares

    def arrive(self, index: int, share: torch.Tensor) -> None:
        assert self.shares[index] is None, "a share of a lent bundle came back twice"
        self.shares[index] = share
        if any(s is None for s in self.shares):
            return
        parts = [s for s in self.shares if s is not None]
        home = parts[0] if len(parts) == 1 else torch.cat(parts)
        if home.storage_offset():  # a view into a message carrying other bundles too
            home = home.clone()
        for entry in self.entries:
            entry.home = home


class _LentStorage:
    """One storage a lent submodule saved: on this device until its bundle closes, then away,
    then back as a slice of the message that brought it home."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.num_bytes = source.numel()
        self.start = -1
        self.home: torch.Tensor | None = None

    def leave(self, start: int) -> None:
        self.start = start
        self.source = torch.empty(0, dtype=torch.uint8)  # the device bytes go

    def back(self) -> tuple[torch.Tensor, int]:
        if self.home is None:
            raise RuntimeError(
                "a lent tensor was read before it came back: the schedule needs its lending "
                "actions ([Note: lending] in tidal/pipeline/lending.py)"
            )
        return self.home, self.start


@dataclass(frozen=True, slots=True)
class _Lent:
    storage: _LentStorage
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


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


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (flat uint8) as one message: the one part itself, else their concatenation
    (an empty message where there are none)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
