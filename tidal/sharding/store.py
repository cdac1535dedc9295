"""Sharded parameter chunks: each rank keeps 1/N of every chunk and gathers the whole on use.

[Note: sharded chunks]
Every chunk, not chunk groups, is split into ``N`` equal shards, and rank ``r`` keeps shard
``r`` (elements ``[r*s, (r+1)*s)`` of the chunk, ``s = capacity / N``) for good: it is the
authoritative copy of those weights. PatrickStar's alternative, a group of ``N`` consecutive
chunks of which rank ``r`` owns chunk ``r`` whole, communicates in the same volume but makes the
unit of gathering ``N`` chunks: the device must hold a whole group at once (``N`` times the
working set of one chunk, growing with the world size), the first use of any chunk waits for
the group, and the optimizer's work is as unbalanced as the chunks' sizes (one embedding chunk
lands on one rank). Sharding each chunk keeps the unit of placement the chunk at any ``N``, so
the trace, Belady eviction, prefetch and the device budget work exactly as on one process, and
gives every rank the same share of every chunk's update. Chunk capacities are multiples of
``N`` (the layout's alignment is), so shards are equal and the collectives are single flat
calls.

The store is the single-process one ([Note: chunk store] in tidal/memory/store.py), with its
placement decisions ([Note: one placement] in policy.py); only what a move means changes, which
is the store's transport, :class:`ShardedTransport` ([Note: transports] in transport.py):

- *fetch* (a chunk comes to the device) is an all-gather of the shards into the chunk's
  persistent device buffer, issued asynchronously; the first use of the chunk waits for it
  (:meth:`ShardedTransport.await_arrival`), so prefetched gathers overlap the compute of the
  moment before, as copies do on one process;
- *evict* drops the gathered copy without copying anything back: weights do not change between
  a gather and the next optimizer step, and the step drops every gathered copy before it
  updates the shards (the copies would be stale).

A shard the NVMe tier holds ([Note: nvme placement] in swap.py, level 3) is first read into
host staging: ahead of time, while following the trace, for the chunks the next moments need
that are not on the device (:meth:`ShardedTransport.read_ahead`), else on demand. The fetch
copies it into this rank's own range of the chunk buffer and gathers in place.

[Note: ranks decide alike]
A collective needs every rank, so every rank must gather the same chunks in the same order,
and the gathers follow from placement decisions ([Note: one placement] in
tidal/memory/policy.py). Those are a pure function of the trace, the chunks on the device, the
budget and the non-model bytes, and the last two are read per rank: activations differ when
ranks' micro-batches do (another length, a data-dependent branch that saves one more tensor),
and on CUDA the allocator's figures differ between ranks by its own caching. Budgets themselves
are the same (the engine takes the smallest). So the store makes every rank feed the policy the
same figures:

- once per trace: when an iteration ends, its trace's per-moment non-model figures are replaced
  by their largest over the ranks (one all-reduce MAX, :meth:`ShardedTransport.agree_trace`,
  after one that checks every rank recorded the same sequence and tells whether any rank ran
  short of its budget; if one did, all raise). Every rank then keeps the same trace, so pinning
  and the least budget are the same too, and plans made from it leave room for the rank with
  the most activations;
- at every moment of an iteration, with more than one rank
  (:meth:`ShardedTransport.agree_moment`, one all-reduce MAX of a few numbers and a flag per
  chunk, on the CPU group): what stays per rank is the meter's reaction to activations growing
  past the budget inside a moment, which evicts on the rank that grew (the warm-up iteration
  has no trace to leave room by, and a longer sequence can outgrow the trace), and the room a
  rank's other allocations leave. So after its evictions each rank also evicts every chunk
  another rank evicted (a dropped copy costs nothing but its re-gather), and prefetches into
  the least room of any rank. The fetches that follow are then the same on every rank. The
  same all-reduce compares the moments themselves, so ranks that run different modules all
  raise :class:`RanksDiverged` at the first moment that differs, before any gather.

The model must run the same modules on every rank, as under FSDP: a mixture of experts whose
experts run only when a token chose them does not, and ranks that gather different chunks would
wait on each other for ever or, with chunks of one size, mix one chunk's shards with another's.
Besides the moment check, each gather first checks that every rank gathers the same chunk
(``sharding.check_gathers``, a two-number all-reduce on a CPU group), and ranks that differ all
raise :class:`RanksDiverged`, naming both chunks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tidal.distributed.collectives import Collectives
from tidal.memory.chunk import ChunkState
from tidal.memory.layout import TensorSlot
from tidal.memory.materialize import feed_chunks
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier
from tidal.memory.trace import AccessTrace, Moment
from tidal.memory.transport import ChunkHost
from tidal.sharding.swap import PARAM, ShardList, ShardReader

__all__ = ["RanksDiverged", "ShardedChunkStore", "ShardedTransport", "copy_into_shard"]

# How far ahead of the current moment the trace is searched for shards to read from disk.
READ_AHEAD_MOMENTS = 32


class RanksDiverged(RuntimeError):
    """Ranks reached different moments or were about to gather different chunks, or recorded
    different iterations ([Note: ranks decide alike])."""


class ShardedTransport:
    """Moves of sharded chunks: gather on fetch, drop on eviction; see [Note: sharded chunks]."""

    supports_relayout = False  # the sharded engine turns relayout off

    def __init__(
        self, comm: Collectives, *, reader: ShardReader | None = None, check_gathers: bool = True
    ) -> None:
        self.comm = comm
        self.reader = reader
        self.check_gathers = check_gathers
        # Per chunk index: this rank's shard (a tier allocation; None while on disk) and the
        # tier it is on when in memory.
        self.shards: list[torch.Tensor | None] = []
        self.shard_tiers: list[Tier] = []
        self._gathers: dict[int, Any] = {}  # chunk index -> work handle of its pending gather
        # Called before a payload is dropped: it may hold gradients ([Note: gradients in
        # gathered chunks] in gathered_grads.py).
        self.before_drop: Callable[[int], None] | None = None
        self._store: ChunkHost | None = None

    @property
    def store(self) -> ChunkHost:
        assert self._store is not None, "transport used before attach()"
        return self._store

    @property
    def has_peers(self) -> bool:
        return self.comm.world_size > 1

    def attach(self, store: ChunkHost) -> None:
        assert self._store is None, "a transport serves one store"
        self._store = store

    # -- shards ----------------------------------------------------------------------------------

    def shard_numel(self, index: int) -> int:
        capacity = self.store.layout.chunks[index].capacity
        assert capacity % self.comm.world_size == 0, (capacity, self.comm.world_size)
        return capacity // self.comm.world_size

    def shard_start(self, index: int) -> int:
        """Where this rank's shard of chunk ``index`` starts, in elements of the chunk."""
        return self.comm.rank * self.shard_numel(index)

    def shard_bytes(self, index: int) -> int:
        return self.shard_numel(index) * self.store.chunks[index].dtype.itemsize

    def kept_bytes(self) -> int:
        """Bytes of parameters this rank keeps: its shards (in memory or on disk)."""
        return sum(self.shard_bytes(i) for i in range(len(self.store.chunks)))

    @property
    def on_disk(self) -> frozenset[int]:
        """The chunk indices whose parameter shard lives on the NVMe tier."""
        return self.reader.indices if self.reader is not None else frozenset()

    def load(self, values: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep this rank's shard of every chunk, filled as the values arrive ([Note: deferred
        construction] in tidal/memory/materialize.py); the chunks start with no payload."""
        store = self.store
        self.shards = [None] * len(store.chunks)
        self.shard_tiers = [store.host_tier] * len(store.chunks)

        def begin(index: int) -> None:
            shard = store.host_tier.allocate(self.shard_numel(index), store.chunks[index].dtype)
            self.shards[index] = shard.zero_()  # padding stays zero

        def write(index: int, slot: int, value: torch.Tensor) -> None:
            copy_into_shard(self.shards[index], value, store.layout.chunks[index].slots[slot],
                            start=self.shard_start(index))  # fmt: skip

        def end(index: int) -> None:
            if index in self.on_disk:
                assert self.reader is not None
                shards = ShardList(PARAM, self.shards, store.chunks[index].dtype, self.on_disk)
                self.reader.swapper.offload(shards, index)

        feed_chunks(store.layout, values, begin=begin, write=write, end=end)

    def move_shard(self, index: int, tier: Tier) -> None:
        """Keep chunk ``index``'s shard on ``tier`` from now on (optimizer placement)."""
        source = self.shard_tiers[index]
        if tier is source:
            return
        shard = self.shards[index]
        assert shard is not None, f"chunk {index}'s shard is on disk"
        self.wait_for_copies()  # a pending gather may still read it
        moved = tier.allocate(shard.numel(), shard.dtype)
        moved.copy_(shard)
        source.free(shard)
        source.record_move(out_bytes=shard.nbytes)
        tier.record_move(in_bytes=shard.nbytes)
        self.shards[index], self.shard_tiers[index] = moved, tier

    # -- moves: gather and drop ------------------------------------------------------------------

    def fetch(self, index: int) -> None:
        if self.check_gathers:
            self._check_same_chunk(index)
        store = self.store
        chunk = store.chunks[index]
        chunk.allocate(store.device_tier)  # TierBudgetError: the store names the shortfall
        full = chunk.payload
        assert full is not None
        shard = self.shards[index]
        own = full.narrow(0, self.shard_start(index), self.shard_numel(index))
        if shard is None:  # on disk: read (or read ahead) into staging, gathered in place
            assert self.reader is not None
            staging = self.reader.take(index)
            own.copy_(staging)  # blocking: the staging goes back right after
            self.reader.release(staging)
            shard = own
        elif shard.device != full.device:  # NCCL gathers device memory: stage it in place
            own.copy_(shard, non_blocking=True)
            self.shard_tiers[index].record_move(out_bytes=shard.nbytes)
            shard = own
        self._gathers[index] = self.comm.all_gather(full, shard, async_op=True)
        chunk.mark_filled()
        store.device_tier.record_move(in_bytes=chunk.num_bytes)

    def _check_same_chunk(self, index: int) -> None:
        """Every rank is about to gather chunk ``index``, or all raise ([Note: ranks decide
        alike])."""
        least, most = self.comm.min_max(index)
        if least != most:
            raise self._diverged(index, most if least == index else least, doing="gather")

    def _diverged(self, mine: int, other: int, *, doing: str) -> RanksDiverged:
        def names(i: int) -> str:
            if i < 0:
                return "no chunk"
            slots = self.store.layout.chunks[i].slots
            return ", ".join(s.names[0] for s in slots[:3]) + (" ..." if len(slots) > 3 else "")

        return RanksDiverged(
            f"rank {self.comm.rank} was about to {doing} with chunk {mine} ({names(mine)}) "
            f"during {self.store.moment_label} while another rank has chunk {other} "
            f"({names(other)}): the ranks ran different modules. ZeRO-3 gathers every chunk on "
            f"every rank at once, so each rank must run the same modules in the same order, as "
            f"FSDP requires (a mixture of experts that calls only the experts its tokens chose "
            f"does not: call every expert on every rank, with no tokens if none chose it, or "
            f"train on one process)"
        )

    def read_ahead(self, moment: int) -> None:
        """Start reading the shards on disk that the next moments will gather (those not on
        the device now), in the order they are needed, while the reader has room."""
        trace = self.store.trace
        if self.reader is None or trace is None:
            return
        for upcoming in trace.moments[moment + 1 : moment + 1 + READ_AHEAD_MOMENTS]:
            for index in sorted(upcoming.chunks & self.on_disk):
                if self.reader.full:
                    return
                if not self.store.chunks[index].on_device:
                    self.reader.request(index)

    def await_arrival(self, indices: Iterable[int]) -> None:
        for index in indices:
            work = self._gathers.pop(index, None)
            if work is not None:
                work.wait()

    def evict(self, index: int) -> None:
        """Drop the gathered copy: the shards hold the weights ([Note: sharded chunks])."""
        self.await_arrival([index])  # the gather still writes into the buffer
        if self.before_drop is not None:
            self.before_drop(index)
        self.store.chunks[index].release(discard=True)

    def wait_for_copies(self) -> None:
        self.await_arrival(list(self._gathers))

    def forget_arrivals(self) -> None:
        raise AssertionError("sharded chunks are never relaid out")

    # -- agreement ([Note: ranks decide alike]) -------------------------------------------------

    def agree_moment(
        self, moment: Moment, resident: frozenset[int], budget_bytes: int
    ) -> tuple[frozenset[int], int]:
        """One all-reduce (MAX) on the CPU group: the moment's identity, a chunk to name if it
        differs, the least budget, and which chunks some rank does not hold."""
        num_chunks = len(self.store.chunks)
        key = _moment_key(moment)
        # The moment's lowest and highest chunk: where the moments differ, one of them does.
        low, high = min(moment.chunks, default=-1), max(moment.chunks, default=-1)
        dropped = [0 if i in resident else 1 for i in range(num_chunks)]
        agreed = self.comm.max_each([key, -key, low, -low, high, -high, -budget_bytes, *dropped])
        if agreed[0] != -agreed[1]:
            mine, most, least = (low, agreed[2], -agreed[3])
            if most == least:
                mine, most, least = (high, agreed[4], -agreed[5])
            other = most if mine == least else least
            raise self._diverged(mine, other, doing=f"reach moment {moment.index} {moment.label}")
        dropped_anywhere = {i for i, flag in enumerate(agreed[7:]) if flag}
        return resident - dropped_anywhere, -agreed[6]

    def agree_trace(self, trace: AccessTrace, *, ran_short: bool) -> tuple[AccessTrace, bool]:
        """Two all-reduces (MAX): the sequence's length and signature with whether any rank ran
        short, then every moment's non-model figure."""
        key = int(trace.signature()[:15], 16)
        length = len(trace.moments)
        agreed = self.comm.max_each([length, -length, key, -key, int(ran_short)])
        if agreed[0] != -agreed[1] or agreed[2] != -agreed[3]:
            raise RanksDiverged(
                f"rank {self.comm.rank} recorded an iteration of {length} moments that another "
                f"rank did not (moments on the ranks: {-agreed[1]} to {agreed[0]}): the ranks "
                f"ran different modules. ZeRO-3 gathers every chunk on every rank at once, so "
                f"each rank must run the same modules in the same order, as FSDP requires"
            )
        figures = self.comm.max_each([m.non_model_bytes for m in trace.moments])
        moments = tuple(
            dataclasses.replace(m, non_model_bytes=figure)
            for m, figure in zip(trace.moments, figures, strict=True)
        )
        return dataclasses.replace(trace, moments=moments), bool(agreed[4])


class ShardedChunkStore(ChunkStore):
    """A :class:`ChunkStore` over a :class:`ShardedTransport` ([Note: transports] in
    tidal/memory/transport.py), with the transport's shard accessors under the names the
    sharded engine and optimizer use; it overrides nothing of the store."""

    def __init__(
        self, model: nn.Module, *, comm: Collectives, reader: ShardReader | None = None,
        check_gathers: bool = True, **kwargs: Any,
    ) -> None:  # fmt: skip
        self.sharding = ShardedTransport(comm, reader=reader, check_gathers=check_gathers)
        super().__init__(model, transport=self.sharding, **kwargs)

    @property
    def comm(self) -> Collectives:
        return self.sharding.comm

    @property
    def reader(self) -> ShardReader | None:
        return self.sharding.reader

    @property
    def shards(self) -> list[torch.Tensor | None]:
        return self.sharding.shards

    @property
    def shard_tiers(self) -> list[Tier]:
        return self.sharding.shard_tiers

    @property
    def on_disk(self) -> frozenset[int]:
        return self.sharding.on_disk

    def shard_numel(self, index: int) -> int:
        return self.sharding.shard_numel(index)

    def shard_start(self, index: int) -> int:
        return self.sharding.shard_start(index)

    def shard_bytes(self, index: int) -> int:
        return self.sharding.shard_bytes(index)

    def move_shard(self, index: int, tier: Tier) -> None:
        self.sharding.move_shard(index, tier)

    def read_ahead_from_start(self) -> None:
        """Start reading what the next iteration gathers first (after a step wrote the shards)."""
        if self.prefetch:
            self.sharding.read_ahead(-1)

    def drop_read_ahead(self) -> None:
        """Forget the shards read ahead: the step or a load is about to change them."""
        if self.reader is not None:
            self.reader.drop()

    def drop_gathered(self) -> None:
        """Drop every gathered copy (after the forward: ZeRO-3's reshard; before a step)."""
        for chunk in self.chunks:
            if chunk.on_device and chunk.state is not ChunkState.COMPUTE:
                self.evict(chunk.index)

    def full_chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index`` gathered into a new host tensor (checkpoints, export); collective."""
        shard = self.shards[index]
        staging = None
        if shard is None:
            assert self.reader is not None
            shard = staging = self.reader.take(index)
        full = torch.empty(shard.numel() * self.comm.world_size, dtype=shard.dtype,
                           device=shard.device)  # fmt: skip
        self.comm.all_gather(full, shard, async_op=False)
        if staging is not None:
            self.reader.release(staging)  # type: ignore[union-attr]
        return full.cpu()


def _moment_key(moment: Moment) -> int:
    """A 60-bit digest of a moment's index, label and chunks (the same on every process, unlike
    ``hash``)."""
    text = f"{moment.index}|{moment.label}|{sorted(moment.chunks)}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def copy_into_shard(
    shard: torch.Tensor | None, value: torch.Tensor, info: TensorSlot, *, start: int
) -> None:
    """The part of a parameter's full ``value`` that falls in ``shard`` (elements ``[start,
    start + len)`` of the chunk), converted to the shard's dtype."""
    assert shard is not None
    lo, hi = max(info.offset, start), min(info.offset + info.numel, start + shard.numel())
    if lo < hi:
        flat = value.detach().reshape(-1)[lo - info.offset : hi - info.offset]
        shard[lo - start : hi - start].copy_(flat)
