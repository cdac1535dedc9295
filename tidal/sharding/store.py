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

The store's residency machinery is the single-process one ([Note: chunk store] in
tidal/memory/store.py); only what a move means changes:

- *fetch* (a chunk comes to the device) is an all-gather of the shards into the chunk's
  persistent device buffer, issued asynchronously; the first use of the chunk waits for it
  (:meth:`ShardedChunkStore._await_arrival`), so prefetched gathers overlap the compute of the
  moment before, as copies do on one process;
- *evict* drops the gathered copy without copying anything back: weights do not change between
  a gather and the next optimizer step, and the step drops every gathered copy before it
  updates the shards (the copies would be stale).

A shard the NVMe tier holds ([Note: nvme placement] in swap.py, level 3) is first read into
host staging: ahead of time, while following the trace, for the chunks the next moments need
that are not on the device (:meth:`ShardedChunkStore._read_ahead`), else on demand. The fetch
copies it into this rank's own range of the chunk buffer and gathers in place.

[Note: ranks decide alike]
A collective needs every rank, so every rank must gather the same chunks in the same order.
Placement decisions are a deterministic function of the model, the config (budgets are the
same on every rank: the engine takes the smallest), the trace and the measured activation bytes,
which are the same on every rank when each rank's micro-batch has the same shape (the trainer
gives every rank an equal slice of the global batch). The model must also run the same modules
on every rank, as under FSDP: a mixture of experts whose experts run only when a token chose
them does not, and ranks that gather different chunks would wait on each other for ever or,
with chunks of one size, mix one chunk's shards with another's. So each gather first checks that
every rank gathers the same chunk (``sharding.check_gathers``, a two-number all-reduce on a CPU
group), and ranks that differ all raise :class:`RanksDiverged`, naming both chunks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tidal.distributed.collectives import Collectives
from tidal.memory.chunk import Chunk, ChunkState
from tidal.memory.layout import TensorSlot
from tidal.memory.materialize import feed_chunks
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier, TierBudgetError
from tidal.sharding.swap import PARAM, ShardList, ShardReader

__all__ = ["RanksDiverged", "ShardedChunkStore", "copy_into_shard"]

# How far ahead of the current moment the trace is searched for shards to read from disk.
READ_AHEAD_MOMENTS = 32


class RanksDiverged(RuntimeError):
    """Ranks were about to gather different chunks ([Note: ranks decide alike])."""


class ShardedChunkStore(ChunkStore):
    """A :class:`ChunkStore` whose chunks are sharded over ranks; see [Note: sharded chunks]."""

    def __init__(
        self, model: nn.Module, *, comm: Collectives, reader: ShardReader | None = None,
        check_gathers: bool = True, **kwargs: Any,
    ) -> None:  # fmt: skip
        self.comm = comm
        self.reader = reader
        self.check_gathers = check_gathers
        # Per chunk index: this rank's shard (a tier allocation; None while on disk) and the
        # tier it is on when in memory.
        self.shards: list[torch.Tensor | None] = []
        self.shard_tiers: list[Tier] = []
        self._gathers: dict[int, Any] = {}  # chunk index -> work handle of its pending gather
        super().__init__(model, **kwargs)

    # -- shards ----------------------------------------------------------------------------------

    def shard_numel(self, index: int) -> int:
        capacity = self.layout.chunks[index].capacity
        assert capacity % self.comm.world_size == 0, (capacity, self.comm.world_size)
        return capacity // self.comm.world_size

    def shard_start(self, index: int) -> int:
        """Where this rank's shard of chunk ``index`` starts, in elements of the chunk."""
        return self.comm.rank * self.shard_numel(index)

    def shard_bytes(self, index: int) -> int:
        return self.shard_numel(index) * self.chunks[index].dtype.itemsize

    @property
    def model_bytes(self) -> int:
        """Bytes of parameters this rank keeps: its shards (in memory or on disk)."""
        return sum(self.shard_bytes(i) for i in range(len(self.chunks)))

    @property
    def on_disk(self) -> frozenset[int]:
        """The chunk indices whose parameter shard lives on the NVMe tier."""
        return self.reader.indices if self.reader is not None else frozenset()

    def _load_parameters(
        self, model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Keep this rank's shard of every chunk, filled as the values arrive ([Note: deferred
        construction] in tidal/memory/materialize.py); the chunks start with no payload."""
        self._register_slots(model)
        self.shards = [None] * len(self.chunks)
        self.shard_tiers = [self.host_tier] * len(self.chunks)

        def begin(index: int) -> None:
            shard = self.host_tier.allocate(self.shard_numel(index), self.chunks[index].dtype)
            self.shards[index] = shard.zero_()  # padding stays zero

        def write(index: int, slot: int, value: torch.Tensor) -> None:
            copy_into_shard(self.shards[index], value, self.layout.chunks[index].slots[slot],
                            start=self.shard_start(index))  # fmt: skip

        def end(index: int) -> None:
            if index in self.on_disk:
                assert self.reader is not None
                shards = ShardList(PARAM, self.shards, self.chunks[index].dtype, self.on_disk)
                self.reader.swapper.offload(shards, index)

        feed_chunks(self.layout, values, begin=begin, write=write, end=end)
        self._repoint()

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

    def _fetch(self, index: int, needed: frozenset[int]) -> None:
        if self.check_gathers:
            self._check_same_chunk(index)
        chunk = self.chunks[index]
        try:
            chunk.allocate(self.device_tier)
        except TierBudgetError as err:  # only if the accounting and can_fit disagree
            raise self._too_small(needed) from err
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
        self.device_tier.record_move(in_bytes=chunk.num_bytes)
        self.num_fetches += 1

    def _check_same_chunk(self, index: int) -> None:
        """Every rank is about to gather chunk ``index``, or all raise ([Note: ranks decide
        alike])."""
        least, most = self.comm.min_max(index)
        if least == most:
            return
        other = most if least == index else least

        def names(i: int) -> str:
            slots = self.layout.chunks[i].slots
            return ", ".join(s.names[0] for s in slots[:3]) + (" ..." if len(slots) > 3 else "")

        raise RanksDiverged(
            f"rank {self.comm.rank} was about to gather chunk {index} ({names(index)}) during "
            f"{self._label} while another rank gathers chunk {other} ({names(other)}): the ranks "
            f"ran different modules. ZeRO-3 gathers every chunk on every rank at once, so each "
            f"rank must run the same modules in the same order, as FSDP requires (a mixture of "
            f"experts that calls only the experts its tokens chose does not: call every expert "
            f"on every rank, with no tokens if none chose it, or train on one process)"
        )

    def _prefetch_next(self, moment: int, reserve_bytes: int) -> None:
        super()._prefetch_next(moment, reserve_bytes)
        if self.reader is not None:
            self._read_ahead(moment)

    def _read_ahead(self, moment: int) -> None:
        """Start reading the shards on disk that the next moments will gather (those not on
        the device now), in the order they are needed, while the reader has room."""
        assert self.trace is not None and self.reader is not None
        moments = self.trace.moments[moment + 1 : moment + 1 + READ_AHEAD_MOMENTS]
        for upcoming in moments:
            for index in sorted(upcoming.chunks & self.on_disk):
                if self.reader.full:
                    return
                if not self.chunks[index].on_device:
                    self.reader.request(index)

    def read_ahead_from_start(self) -> None:
        """Start reading what the next iteration gathers first (after a step wrote the shards)."""
        if self.reader is not None and self.trace is not None and self.prefetch:
            self._read_ahead(-1)

    def drop_read_ahead(self) -> None:
        """Forget the shards read ahead: the step or a load is about to change them."""
        if self.reader is not None:
            self.reader.drop()

    def _await_arrival(self, indices: Iterable[int]) -> None:
        for index in indices:
            work = self._gathers.pop(index, None)
            if work is not None:
                work.wait()

    def evict(self, index: int) -> None:
        """Drop the gathered copy: the shards hold the weights ([Note: sharded chunks])."""
        self._await_arrival([index])  # the gather still writes into the buffer
        chunk: Chunk = self.chunks[index]
        chunk.release(discard=True)
        self.num_evictions += 1

    def wait_for_copies(self) -> None:
        self._await_arrival(list(self._gathers))
        super().wait_for_copies()

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

    def adopt_layout(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("relayout of sharded chunks: the engine turns relayout off")


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
