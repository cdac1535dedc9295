"""A chunk: one flat payload on one tier, holding many tensors at fixed offsets.

Parameters (and, mirrored at the same offsets, their gradients, fp32 master copies and optimizer
moments) are views into chunk payloads. Chunks, not tensors, are what moves between tiers, so a
move is one large copy and the accounting sees a handful of allocations, not thousands.

[Note: chunk states]
Each tensor slot of a chunk has a state:

    FREE     no valid data: never written since the payload was allocated, or discarded
    HOLD     valid data, not in use: the chunk may move between tiers
    COMPUTE  in use by a running module or the optimizer: the chunk must stay where it is

and the only legal changes are

    FREE -> HOLD        written (initialised, copied in, a gradient arrived)
    HOLD -> COMPUTE     acquired for use
    COMPUTE -> HOLD     released after use
    HOLD -> FREE        discarded (gradients after the optimizer step, a resharded copy)

A tensor used twice at once (a tied embedding read by the input layer and the LM head) is
acquired twice: it stays COMPUTE until every acquire has been released, counted per slot.

The chunk's own state is derived, never stored, so it cannot drift from its slots: RELEASED
when it has no payload, else COMPUTE if any slot is COMPUTE, else HOLD if any slot is HOLD, else
FREE. Moving a payload needs a chunk that is not COMPUTE; dropping it needs one that is FREE
(or an explicit ``discard``), because dropping HOLD data would lose model data silently. Every
change goes through :meth:`Chunk._set_state`, which asserts the table above.
"""

from __future__ import annotations

import enum

import torch

from tidal.memory.layout import ChunkSpec
from tidal.memory.tiers import Tier, TierKind

__all__ = ["Chunk", "ChunkKind", "ChunkState", "TensorState"]


class TensorState(enum.Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"


class ChunkState(enum.Enum):
    RELEASED = "released"
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"


class ChunkKind(enum.Enum):
    """What a chunk's payload holds; the chunks of one layout index mirror each other."""

    PARAM = "param"
    GRAD = "grad"
    MASTER = "master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    MOMENTUM = "momentum"


_LEGAL = {
    (TensorState.FREE, TensorState.HOLD),
    (TensorState.HOLD, TensorState.COMPUTE),
    (TensorState.COMPUTE, TensorState.HOLD),
    (TensorState.HOLD, TensorState.FREE),
}


class Chunk:
    """The payload of one :class:`ChunkSpec` for one :class:`ChunkKind` and dtype."""

    def __init__(self, spec: ChunkSpec, *, kind: ChunkKind, dtype: torch.dtype) -> None:
        self.spec = spec
        self.kind = kind
        self.dtype = dtype
        # Both 1-D with spec.capacity elements of dtype. The device buffer is one object for the
        # chunk's life, its storage grown while resident and 0 bytes otherwise ([Note:
        # persistent buffers] in tiers.py); the host buffer is allocated per stay on the host.
        self._device_buffer: torch.Tensor | None = None
        self._host_buffer: torch.Tensor | None = None
        self._device_views: list[torch.Tensor] = []  # one per slot, made once with the buffer
        self._host_views: list[torch.Tensor] = []  # one per slot of the host buffer, on demand
        self.tier: Tier | None = None  # where the data is; None while RELEASED
        self._states = [TensorState.FREE] * len(spec.slots)
        self._compute_refs = [0] * len(spec.slots)

    def __repr__(self) -> str:
        where = self.tier.kind.value if self.tier else "-"
        return f"Chunk({self.kind.value} #{self.spec.index}, {self.state.value}, on {where})"

    # -- derived state -------------------------------------------------------------------------

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def num_bytes(self) -> int:
        return self.spec.capacity * self.dtype.itemsize

    @property
    def payload(self) -> torch.Tensor | None:
        if self.tier is None:
            return None
        return self._device_buffer if self.tier.kind is TierKind.DEVICE else self._host_buffer

    @property
    def on_device(self) -> bool:
        return self.tier is not None and self.tier.kind is TierKind.DEVICE

    @property
    def state(self) -> ChunkState:
        """Derived from the slots; see [Note: chunk states]."""
        if self.payload is None:
            return ChunkState.RELEASED
        if TensorState.COMPUTE in self._states:
            return ChunkState.COMPUTE
        if TensorState.HOLD in self._states:
            return ChunkState.HOLD
        return ChunkState.FREE

    def slot_state(self, slot: int) -> TensorState:
        return self._states[slot]

    def _set_state(self, slot: int, new: TensorState) -> None:
        old = self._states[slot]
        assert (old, new) in _LEGAL, (
            f"illegal tensor state change {old.value} -> {new.value} for "
            f"{self.spec.slots[slot].names[0]} in {self!r} (see [Note: chunk states])"
        )
        self._states[slot] = new

    # -- payload and residency -------------------------------------------------------------------

    def allocate(self, tier: Tier, *, own_mapping: bool = True) -> None:
        """Give a RELEASED chunk an uninitialised payload on ``tier``; every slot is FREE."""
        assert self.tier is None, f"{self!r} already has a payload"
        self._grow_on(tier, own_mapping=own_mapping)
        self.tier = tier
        self._states = [TensorState.FREE] * len(self.spec.slots)

    def device_handle(self, tier: Tier) -> torch.Tensor:
        """The persistent device buffer (made with 0 bytes if need be); views of it stay valid."""
        assert tier.kind is TierKind.DEVICE, tier
        if self._device_buffer is None:
            # torch refuses to make a view into a 0-byte storage, so the slot views are taken
            # while the new buffer still has its storage (one chunk, briefly, unaccounted),
            # then the storage is shrunk until the first fetch.
            buffer = torch.empty(self.spec.capacity, dtype=self.dtype, device=tier.device)
            self._device_views = [self._slot_of(buffer, i) for i in range(len(self.spec.slots))]
            buffer.untyped_storage().resize_(0)
            self._device_buffer = buffer
        return self._device_buffer

    def _grow_on(self, tier: Tier, *, own_mapping: bool = True) -> torch.Tensor:
        # Only storage on ``tier`` changes; TierBudgetError leaves the chunk as it was.
        if tier.kind is TierKind.DEVICE:
            buffer = self.device_handle(tier)
            tier.regrow(buffer, own_mapping=own_mapping)
            return buffer
        assert self._host_buffer is None, f"{self!r} already has a host buffer"
        self._host_buffer = tier.allocate(self.spec.capacity, self.dtype, own_mapping=own_mapping)
        self._host_views = []
        return self._host_buffer

    def _shrink_on(self, tier: Tier) -> None:
        if tier.kind is TierKind.DEVICE:
            assert self._device_buffer is not None
            tier.release_storage(self._device_buffer)
        else:
            assert self._host_buffer is not None
            tier.free(self._host_buffer)
            self._host_buffer = None
            self._host_views = []

    def move_to(self, tier: Tier, *, stream: torch.cuda.Stream | None = None) -> int:
        """Move the payload to ``tier``; returns the bytes moved (0 if already there).

        With a CUDA ``stream`` the copy is queued there, after the work already queued on the
        current stream, and this returns at once (see [Note: copy streams] in store.py); the
        caller must make readers of the new payload wait for ``stream``.
        """
        source, src = self.payload, self.tier
        assert source is not None and src is not None, f"{self!r} has no payload"
        assert self.state is not ChunkState.COMPUTE, f"cannot move {self!r} while it is in use"
        if tier is src:
            return 0
        target = self._grow_on(tier)
        if stream is None:
            target.copy_(source)
        else:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
            for tensor in (source, target):
                if tensor.is_cuda:  # its block is not reused before the copy has read it
                    tensor.record_stream(stream)
        self._shrink_on(src)
        src.record_move(out_bytes=self.num_bytes)
        tier.record_move(in_bytes=self.num_bytes)
        self.tier = tier
        return self.num_bytes

    def release(self, *, discard: bool = False) -> None:
        """Drop the payload. HOLD data is model data: dropping it needs ``discard=True``."""
        assert self.tier is not None, f"{self!r} has no payload"
        state = self.state
        assert state is not ChunkState.COMPUTE, f"cannot release {self!r} while it is in use"
        assert state is ChunkState.FREE or discard, f"releasing {self!r} would lose its data"
        self._shrink_on(self.tier)
        self.tier = None
        self._states = [TensorState.FREE] * len(self.spec.slots)

    # -- slots -----------------------------------------------------------------------------------

    def view(self, slot: int) -> torch.Tensor:
        """The slot's tensor: a view of the payload with the parameter's shape.

        Made once per payload (the device buffer's for the chunk's life, a host buffer's for
        its stay): callers read and write its data, never its shape or storage.
        """
        assert self.tier is not None, f"{self!r} has no payload"
        if self.tier.kind is TierKind.DEVICE:
            return self._device_views[slot]
        if not self._host_views:
            assert self._host_buffer is not None
            self._host_views = [
                self._slot_of(self._host_buffer, i) for i in range(len(self._states))
            ]
        return self._host_views[slot]

    def device_view(self, slot: int, tier: Tier) -> torch.Tensor:
        """The slot in the persistent device buffer: valid memory only while on the device."""
        self.device_handle(tier)
        return self._device_views[slot]

    def view_in(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:
        """The slot's tensor in ``buffer``, a 1-D tensor laid out like the payload (a transient
        copy of it in another dtype, say)."""
        assert buffer.dim() == 1 and buffer.numel() >= self.spec.capacity, buffer.shape
        return self._slot_of(buffer, slot)

    def _slot_of(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:
        info = self.spec.slots[slot]
        return buffer.narrow(0, info.offset, info.numel).view(info.shape)

    def slots_reached(self, tensor: torch.Tensor) -> set[int]:
        """The slots a view of the device buffer (``tensor``) reaches; every slot when it is
        empty or of another dtype (nothing to tell them apart by)."""
        with torch._C.DisableTorchFunctionSubclass():  # plain metadata reads of a parameter
            if tensor.numel() == 0 or tensor.dtype != self.dtype:
                return set(range(len(self.spec.slots)))
            first = tensor.storage_offset()
            sizes = zip(tensor.shape, tensor.stride(), strict=True)
            last = first + sum((n - 1) * abs(s) for n, s in sizes)
        return {i for i, info in enumerate(self.spec.slots)
                if info.offset <= last and first < info.offset + info.numel}  # fmt: skip

    def write(self, slot: int, value: torch.Tensor) -> None:
        """Copy ``value`` into the slot; a FREE slot becomes HOLD."""
        assert self._states[slot] is not TensorState.COMPUTE, "write to a slot in use"
        self.view(slot).copy_(value)
        if self._states[slot] is TensorState.FREE:
            self._set_state(slot, TensorState.HOLD)

    def fill_free_slots(self, value: float = 0.0) -> None:
        """Give every FREE slot ``value`` (zeroed gradients, fresh optimizer moments); now HOLD."""
        for slot, state in enumerate(self._states):
            if state is TensorState.FREE:
                self.view(slot).fill_(value)
                self._set_state(slot, TensorState.HOLD)

    def mark_filled(self) -> None:
        """Every FREE slot now holds data written into the payload directly (a gather)."""
        for slot, state in enumerate(self._states):
            if state is TensorState.FREE:
                self._set_state(slot, TensorState.HOLD)

    def acquire(self, slot: int) -> torch.Tensor:
        """Mark the slot in use (counted) and return its view."""
        if self._compute_refs[slot] == 0:
            self._set_state(slot, TensorState.COMPUTE)
        self._compute_refs[slot] += 1
        return self.view(slot)

    def release_slot(self, slot: int) -> None:
        """Undo one :meth:`acquire`; the last one returns the slot to HOLD."""
        assert self._compute_refs[slot] > 0, f"release without acquire in {self!r}"
        self._compute_refs[slot] -= 1
        if self._compute_refs[slot] == 0:
            self._set_state(slot, TensorState.HOLD)

    def discard_slot(self, slot: int) -> None:
        """Mark a HOLD slot's data as no longer needed."""
        self._set_state(slot, TensorState.FREE)
