"""How a chunk store's moves are carried out: copies on one process, or collectives over ranks.

[Note: transports]
The store ([Note: chunk store] in store.py) decides *which* chunks move, from the policy ([Note:
one placement] in policy.py); a transport decides *what a move is*. Both halves stay apart so
ZeRO-3 is not a second store that overrides the first one's private steps, but the same store
with another transport:

- :class:`LocalTransport` (one process): the chunks' authoritative payloads live on the host
  tier; a fetch copies a chunk to the device (on CUDA on the side stream of [Note: copy streams]
  in store.py), an eviction copies it back.
- ``ShardedTransport`` (tidal/sharding/store.py): each rank keeps a shard of every chunk; a
  fetch all-gathers the shards into the device buffer, an eviction drops the gathered copy.

World size 1 is served by either. The chunk engine uses the local transport, which moves whole
chunks between two tiers of one process and supports relayout; the sharded one at world size 1
is a mesh of one (a gather of one shard is a copy), which the sharded engine keeps so its byte
counts and optimizer paths read the same at every world size. The transport never decides: it
is handed the indices to fetch or evict, in the policy's order, and reports nothing back but
arrival. So the same decisions drive every transport, and ranks that feed the policy the same
figures make the same collectives ([Note: ranks decide alike] in tidal/sharding/store.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from tidal.memory.chunk import Chunk
from tidal.memory.layout import ChunkLayout
from tidal.memory.materialize import feed_chunks
from tidal.memory.tiers import Tier
from tidal.memory.trace import AccessTrace, Moment

__all__ = ["ChunkHost", "ChunkTransport", "LocalTransport"]


class ChunkHost(Protocol):
    """What a transport reads of the store it serves (the store is one; naming only this keeps
    the store and its transports apart: the store imports them, never the other way)."""

    layout: ChunkLayout
    chunks: list[Chunk]
    device_tier: Tier
    host_tier: Tier
    trace: AccessTrace | None

    @property
    def moment_label(self) -> str: ...


class ChunkTransport(Protocol):
    """What a move of a chunk store is; see [Note: transports]."""

    @property
    def supports_relayout(self) -> bool:
        """Whether the store may swap its chunks for a new layout ([Note: relayout])."""
        ...

    @property
    def has_peers(self) -> bool:
        """Whether other ranks move the same chunks, so placement must be agreed with them."""
        ...

    def attach(self, store: ChunkHost) -> None:
        """Serve ``store`` (called once, from its constructor, before :meth:`load`)."""
        ...

    def load(self, values: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Give every chunk its parameters' values ([Note: deferred construction] in
        materialize.py); the store registered the slots and repoints the parameters after."""
        ...

    def fetch(self, index: int) -> None:
        """Start bringing chunk ``index`` to the device; it may land later (:meth:`await_arrival`).
        Raises ``TierBudgetError`` if the device tier refuses it."""
        ...

    def await_arrival(self, indices: Iterable[int]) -> None:
        """Make the compute that follows wait until ``indices`` (fetched) have landed."""
        ...

    def evict(self, index: int) -> None:
        """Take chunk ``index`` off the device, keeping its weights where they live."""
        ...

    def wait_for_copies(self) -> None:
        """Block until every move queued so far has landed (before the host reads payloads)."""
        ...

    def read_ahead(self, moment: int) -> None:
        """The store follows its trace at ``moment``: start slow reads the next moments need."""
        ...

    def forget_arrivals(self) -> None:
        """Drop the arrival records (the caller waited for them; the chunks are replaced)."""
        ...

    def kept_bytes(self) -> int:
        """Bytes of model data this process keeps (in memory or on disk)."""
        ...

    def agree_moment(
        self, moment: Moment, resident: frozenset[int], budget_bytes: int
    ) -> tuple[frozenset[int], int]:
        """The chunks on the device on every rank, and the least ``budget_bytes`` over ranks,
        for ``moment`` (collective where there are ranks: [Note: ranks decide alike])."""
        ...

    def agree_trace(self, trace: AccessTrace, *, ran_short: bool) -> tuple[AccessTrace, bool]:
        """``trace`` with each moment's non-model figure the largest over ranks, and whether
        any rank ran short of its budget (collective where there are ranks)."""
        ...


class LocalTransport:
    """Whole chunks copied between the host and the device tier of one process."""

    supports_relayout = True
    has_peers = False

    def __init__(self) -> None:
        self._store: ChunkHost | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._arrivals: dict[int, torch.cuda.Event] = {}

    @property
    def store(self) -> ChunkHost:
        assert self._store is not None, "transport used before attach()"
        return self._store

    def attach(self, store: ChunkHost) -> None:
        assert self._store is None, "a transport serves one store"
        self._store = store
        device = store.device_tier.device
        # [Note: copy streams] in store.py: CUDA moves run here; an arrival event guards first use.
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def load(self, values: Iterable[tuple[str, torch.Tensor]]) -> None:
        store = self.store
        for chunk in store.chunks:
            chunk.allocate(store.host_tier)

        def write(index: int, slot: int, value: torch.Tensor) -> None:
            store.chunks[index].write(slot, value.to(store.chunks[index].dtype))

        feed_chunks(store.layout, values, write=write)

    def fetch(self, index: int) -> None:
        store = self.store
        store.chunks[index].move_to(store.device_tier, stream=self._copy_stream)
        if self._copy_stream is not None:
            self._arrivals[index] = self._copy_stream.record_event()

    def await_arrival(self, indices: Iterable[int]) -> None:
        for index in indices:
            event = self._arrivals.pop(index, None)
            if event is not None:
                torch.cuda.current_stream(self.store.device_tier.device).wait_event(event)

    def evict(self, index: int) -> None:
        self._arrivals.pop(index, None)  # the copy out is queued after the copy in
        self.store.chunks[index].move_to(self.store.host_tier, stream=self._copy_stream)

    def wait_for_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def read_ahead(self, moment: int) -> None:
        return None  # the host tier is memory: nothing slower to read from

    def forget_arrivals(self) -> None:
        self._arrivals.clear()

    def kept_bytes(self) -> int:
        return sum(c.num_bytes for c in self.store.chunks)

    def agree_moment(
        self, moment: Moment, resident: frozenset[int], budget_bytes: int
    ) -> tuple[frozenset[int], int]:
        return resident, budget_bytes  # one process agrees with itself

    def agree_trace(self, trace: AccessTrace, *, ran_short: bool) -> tuple[AccessTrace, bool]:
        return trace, ran_short
