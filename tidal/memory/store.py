"""The chunk store: a model's parameters in chunks, and which chunks are on the device.

[Note: chunk store]
At construction every parameter's data is copied into a PARAM chunk on the host tier, and the
parameter is re-pointed (``param.data``) at its slot in the chunk's persistent device buffer
([Note: persistent buffers] in tiers.py). From then on a parameter is usable exactly while its
chunk is on the device; the hooks call :meth:`ChunkStore.access` before a module runs (forward
or backward) and :meth:`ChunkStore.release` after.

``access`` is where placement happens. Each call is one *moment*: the chunks a module needs. The
store fetches missing chunks and, when the device tier would go over its budget, evicts chunks
that are neither needed now nor in use (COMPUTE: an enclosing module still running), choosing
the one whose next use is furthest away in the trace of the last iteration (Belady) or, before a
trace exists or once this iteration has left it, the least recently used. The device tier's own
accounting refuses to exceed the budget, so a policy bug fails loudly instead of using memory it
was not given.

Every iteration's moments are recorded. While they match the stored trace, its next-use figures
drive eviction; at the first moment that differs (another sequence length, eval instead of
train, a data-dependent branch) the store falls back to LRU for the rest of that iteration, and
the newly recorded sequence becomes the trace ([Note: trace validity] in trace.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.config import format_bytes
from tidal.memory.chunk import Chunk, ChunkKind, ChunkState, TensorState
from tidal.memory.layout import ChunkLayout
from tidal.memory.tiers import Tier, TierBudgetError, TierKind
from tidal.memory.trace import AccessTrace, TraceRecorder

__all__ = ["ChunkStore", "DeviceBudgetTooSmall"]


class DeviceBudgetTooSmall(ValueError):
    """A moment's chunks cannot all be on the device within its budget."""


class ChunkStore:
    """Parameter chunks of one model and their residency; see [Note: chunk store]."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: ChunkLayout,
        device_tier: Tier,
        host_tier: Tier,
        dtype: torch.dtype = torch.float32,
        policy: str = "belady",
    ) -> None:
        assert device_tier.kind is TierKind.DEVICE and host_tier.kind is TierKind.HOST
        assert policy in ("belady", "lru"), policy
        self.policy = policy
        self.layout = layout
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.chunks = [Chunk(spec, kind=ChunkKind.PARAM, dtype=dtype) for spec in layout.chunks]
        self.slot_of: dict[int, tuple[int, int]] = {}  # id(param) -> (chunk index, slot)
        self.params: dict[int, nn.Parameter] = {}  # id(param) -> param
        self._load_parameters(model)
        self.trace: AccessTrace | None = None
        self._recorder = TraceRecorder([c.num_bytes for c in self.chunks])
        self._following_trace = False
        self._clock = 0
        self._last_use = [-1] * len(self.chunks)
        self.num_evictions = 0
        self.num_fetches = 0
        # Chunks that stay on the device for good: their optimizer state lives there too.
        self.pinned: frozenset[int] = frozenset()

    def _load_parameters(self, model: nn.Module) -> None:
        params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
        for chunk in self.chunks:
            chunk.allocate(self.host_tier)
            for slot, info in enumerate(chunk.spec.slots):
                param = params[info.names[0]]
                chunk.write(slot, param.detach().to(chunk.dtype))
                self.slot_of[id(param)] = (chunk.index, slot)
                self.params[id(param)] = param
        # Re-point every parameter only once all were copied: a tied parameter appears once.
        for pid, (index, slot) in self.slot_of.items():
            chunk = self.chunks[index]
            self.params[pid].data = chunk.device_view(slot, self.device_tier)

    # -- queries ---------------------------------------------------------------------------------

    def chunks_of(self, params: Iterable[nn.Parameter]) -> frozenset[int]:
        return frozenset(self.slot_of[id(p)][0] for p in params if id(p) in self.slot_of)

    @property
    def model_bytes(self) -> int:
        return sum(c.num_bytes for c in self.chunks)

    def min_device_bytes(self) -> int:
        """Bytes the largest moment needs: from the trace, else the largest chunk."""
        if self.trace is not None:
            return self.trace.min_device_bytes()
        return max(c.num_bytes for c in self.chunks)

    # -- iterations and moments ------------------------------------------------------------------

    def begin_iteration(self) -> None:
        self._recorder.begin_iteration()
        self._following_trace = self.trace is not None and self.policy == "belady"

    def end_iteration(self) -> None:
        """Keep the iteration just recorded as the trace if it differs from the stored one."""
        if not self._recorder.recording:
            return
        recorded = self._recorder.finish()
        if self.trace is None or recorded.signature() != self.trace.signature():
            self.trace = recorded
        self._following_trace = False

    def access(self, label: str, params: Iterable[nn.Parameter]) -> None:
        """One moment: bring the params' chunks to the device and mark the params in use."""
        params = [p for p in params if id(p) in self.slot_of]
        needed = self.chunks_of(params)
        if self._recorder.recording:
            moment = self._recorder.record(label, needed, 0).index
            if self._following_trace and not self._matches_trace(moment, label, needed):
                self._following_trace = False
        else:
            moment = -1
        for index in sorted(needed):
            self._ensure_on_device(index, needed, moment, label)
        self._clock += 1
        for index in needed:
            self._last_use[index] = self._clock
        for p in params:
            index, slot = self.slot_of[id(p)]
            self.chunks[index].acquire(slot)

    def _matches_trace(self, moment: int, label: str, needed: frozenset[int]) -> bool:
        # Earlier moments of this iteration already matched, so only the newest is compared:
        # checking the whole prefix each time would cost O(moments^2) per iteration.
        assert self.trace is not None
        if moment >= len(self.trace.moments):
            return False
        stored = self.trace.moments[moment]
        return stored.label == label and stored.chunks == needed

    def release(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            if id(p) in self.slot_of:
                index, slot = self.slot_of[id(p)]
                self.chunks[index].release_slot(slot)

    def release_all(self) -> None:
        """Return every slot still in use to HOLD (modules whose post hook did not run)."""
        for chunk in self.chunks:
            for slot in range(len(chunk.spec.slots)):
                while chunk.slot_state(slot) is TensorState.COMPUTE:
                    chunk.release_slot(slot)

    # -- placement -------------------------------------------------------------------------------

    def _ensure_on_device(
        self, index: int, needed: frozenset[int], moment: int, label: str
    ) -> None:
        chunk = self.chunks[index]
        if chunk.on_device:
            return
        while not self.device_tier.can_fit(chunk.num_bytes):
            victim = self._pick_victim(needed, moment)
            if victim is None:
                raise self._too_small(needed, label)
            self.evict(victim)
        try:
            chunk.move_to(self.device_tier)
        except TierBudgetError as err:  # only if the accounting and can_fit disagree
            raise self._too_small(needed, label) from err
        self.num_fetches += 1

    def _pick_victim(self, needed: frozenset[int], moment: int) -> int | None:
        candidates = [
            c.index
            for c in self.chunks
            if c.on_device
            and c.index not in needed
            and c.index not in self.pinned
            and c.state is not ChunkState.COMPUTE
        ]
        if not candidates:
            return None
        if self._following_trace and self.trace is not None and moment >= 0:
            trace = self.trace

            def next_use(index: int) -> float:
                found = trace.next_use(index, moment)
                return float("inf") if found is None else float(found)

            return max(candidates, key=lambda i: (next_use(i), -i))
        return min(candidates, key=lambda i: (self._last_use[i], i))

    def evict(self, index: int) -> None:
        self.chunks[index].move_to(self.host_tier)
        self.num_evictions += 1

    def evict_unpinned(self) -> None:
        for chunk in self.chunks:
            if chunk.on_device and chunk.index not in self.pinned:
                self.evict(chunk.index)

    def pin(self, indices: Iterable[int]) -> None:
        """Keep ``indices`` on the device from now on; every other chunk goes to the host."""
        self.pinned |= frozenset(indices)
        self.evict_unpinned()
        for index in sorted(self.pinned):
            self._ensure_on_device(index, self.pinned, -1, "pin")

    def _too_small(self, needed: frozenset[int], label: str) -> DeviceBudgetTooSmall:
        need_bytes = sum(self.chunks[i].num_bytes for i in needed)
        in_use = sum(c.num_bytes for c in self.chunks if c.state is ChunkState.COMPUTE)
        budget = self.device_tier.budget_bytes or 0
        return DeviceBudgetTooSmall(
            f"memory.device_budget: {label} needs {need_bytes:,} bytes "
            f"({format_bytes(need_bytes)}) of parameter chunks on the device, with "
            f"{in_use:,} bytes in use by enclosing modules, but the budget is {budget:,} bytes "
            f"({format_bytes(budget)}); raise memory.device_budget or lower chunk.size"
        )
