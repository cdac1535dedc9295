"""Gradient shards: collected from the backward, reduce-scattered chunk by chunk, summed per rank.

[Note: sharded gradients]
A chunk's gradient is complete once the post-accumulate-grad hook has fired for every trainable
parameter in it (each fires once per backward, after the parameter's last use). Gradients are
copied into a transient fp32 buffer of the whole chunk on the device tier as they arrive; when
the chunk is complete its buffer is reduce-scattered, asynchronously, into a shard-sized buffer,
and the backward goes on while the reduction runs. :meth:`ShardedGradients.finish_backward`
waits for every reduction, divides by the world size (each rank's loss is the mean over its
slice of the global batch, so the mean of the ranks' gradients is the global batch's) and adds
the result into this rank's fp32 gradient shard, so accumulation sums micro-batches exactly as
on one process. Every rank completes its chunks in the same order (the same autograd graph),
which is the order the collectives need ([Note: ranks decide alike] in store.py). Reductions
run in fp32 whatever the parameters' precision: with bf16 parameter chunks each gradient is
rounded once, as on one process, and the sum over ranks adds no rounding of its own.

Under a device budget an fp32 chunk takes its gradients in its gathered payload instead
([Note: gradients in gathered chunks] in gathered_grads.py).

A parameter may get no gradient in a backward ([Note: parameters without a gradient] in
tidal/memory/optim.py). A chunk some of whose parameters got one is reduced when the backward
ends (:meth:`ShardedGradients.finish_backward`), in chunk order, with zeros in the other slots;
a chunk none of whose parameters got one is not reduced at all, and the step leaves out every
parameter without a gradient. Every rank must use the same parameters in a backward (as FSDP
requires): the ranks then complete, and reduce, the same chunks in the same order; ranks that
differ issue different collectives.

[Note: reducing once per step]
While ``accumulating`` is set (a pipeline stage's backwards before the step's last one:
``sharding.reduce_per_step``), a complete chunk is not reduced: its gradient stays in its fp32
buffer of the whole chunk, and the next backward adds into the same buffer (every buffer starts
at zero, so the first backward's add is its copy). The gathered payload never takes gradients
then, so it keeps the weights and a later microbatch may use it without gathering again. The
backward after ``accumulating`` is cleared completes each chunk once more and reduces the sum, so
each chunk is reduce-scattered once per step; the result is the per-microbatch path's sum, added
in another order.

A chunk index whose parameter shard lives on disk ([Note: nvme placement] in swap.py, level 3)
keeps its gradient shard there too: the reduced shard is written as soon as it is ready (read
back and added to when accumulating, the same operations as in memory), and its norm is kept,
because the step needs the global norm for clipping before it reads the gradients back.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from tidal.memory.chunk import Chunk, ChunkState
from tidal.memory.optim_rules import OptimizerEntry
from tidal.memory.tiers import Tier
from tidal.sharding.gathered_grads import GatheredGradients, takes_gradients
from tidal.sharding.store import ShardedChunkStore
from tidal.sharding.swap import GRAD, GRAD_WRITES, ShardList, StateSwapper

__all__ = ["ShardedGradients"]


class ShardedGradients:
    """This rank's fp32 gradient shards, by chunk index; see [Note: sharded gradients]."""

    def __init__(
        self,
        store: ShardedChunkStore,
        entries: list[OptimizerEntry],
        *,
        max_pending: int,
        swapper: StateSwapper | None,
    ) -> None:
        self.store = store
        self.comm = store.comm
        self.max_pending = max_pending
        self.swapper = swapper
        self._entries = entries
        self.trainable = frozenset(e.chunk for e in entries)
        self.on_disk = store.on_disk & self.trainable
        self.shards: list[torch.Tensor | None] = [None] * len(store.chunks)
        self._tiers: dict[int, Tier] = {}  # where each shard in memory was allocated
        # Shards on disk: the norm of each one's latest value, and the writes in flight.
        self._disk_norms: dict[int, torch.Tensor] = {}
        self._writes: list[tuple[Future[None], torch.Tensor]] = []
        self._params_in: dict[int, int] = {}  # trainable params per chunk index
        for e in entries:
            self._params_in[e.chunk] = self._params_in.get(e.chunk, 0) + 1
        self._arrived: dict[int, int] = {}  # chunk index -> gradients arrived this backward
        self._got_grad: set[int] = set()  # id(param) with a gradient since the last step
        self._full: dict[int, torch.Tensor] = {}  # chunk index -> its gradient, being collected
        self.accumulating = False  # [Note: reducing once per step]
        self.gathered = GatheredGradients(store)  # [Note: gradients in gathered chunks]
        store.sharding.before_drop = self._before_drop
        # (chunk index, work, its fp32 buffer or None when reduced in place, the output)
        self._pending: list[tuple[int, Any, torch.Tensor | None, torch.Tensor]] = []
        self._stale: set[int] = set()  # gathered payloads holding reduced gradients, to drop
        # Bytes of gradient buffers held on the device now, and the most held at once.
        self._transient_bytes = 0
        self.peak_transient_bytes = 0
        # ... of them, those of chunks that cannot take their gradients in place.
        self._required_bytes = 0
        self.peak_required_transient_bytes = 0

    @property
    def num_bytes(self) -> int:
        """Bytes of gradient shards in memory."""
        return sum(g.nbytes for g in self.shards if g is not None)

    def shard_list(self) -> ShardList:
        """The shards as the step streams them: read from disk, not written back."""
        return ShardList(GRAD, self.shards, torch.float32, self.on_disk, write=False)

    # -- the backward ----------------------------------------------------------------------------

    def collect(self, param: nn.Parameter) -> None:
        grad = param.grad
        assert grad is not None
        index, slot = self.store.slot_of[id(param)]
        chunk = self.store.chunks[index]
        in_place = index in self.gathered or (index not in self._full and self._in_place_for(chunk))
        if in_place and not self.accumulating:
            self.gathered.write(index, slot, grad)
        else:
            full = self._full.get(index)
            if full is None:
                full = self._full[index] = self._allocate_full(index)
            chunk.view_in(full, slot).add_(grad)  # zeros, or earlier microbatches' sum
        param.grad = None
        self._got_grad.add(id(param))
        self._arrived[index] = arrived = self._arrived.get(index, 0) + 1
        assert arrived <= self._params_in[index], f"a second gradient in one backward: {index}"
        if arrived == self._params_in[index] and not self.accumulating:
            self._reduce(index)

    def _in_place_for(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` takes this backward's gradients in its gathered payload ([Note:
        gradients in gathered chunks])."""
        return takes_gradients(chunk) and self.store.device_tier.budget_bytes is not None

    def _allocate_full(self, index: int) -> torch.Tensor:
        tier, num_bytes = self.store.device_tier, 4 * self.store.chunks[index].spec.capacity
        if not tier.can_fit(num_bytes):
            self._wait_reductions()  # their buffers go
        self.store.make_device_room(num_bytes)
        full = tier.allocate(num_bytes // 4, torch.float32, own_mapping=False)
        self._count_transient(index, full.nbytes)
        return full.zero_()  # padding, and slots whose gradient comes later

    def _reduce(self, index: int) -> None:
        if index in self.gathered:
            self._reduce_in_place(index)
            return
        full = self._full.pop(index)
        tier = self.store.device_tier
        if not tier.can_fit(full.nbytes // self.comm.world_size):
            self._wait_reductions()
        self.store.make_device_room(full.nbytes // self.comm.world_size)
        out = tier.allocate(full.numel() // self.comm.world_size, torch.float32, own_mapping=False)
        self._count_transient(index, out.nbytes)
        work = self.comm.reduce_scatter(out, full, async_op=True)
        self._pending.append((index, work, full, out))
        if len(self._pending) > self.max_pending:
            self._wait_reductions(keep=self.max_pending)

    def _reduce_in_place(self, index: int) -> None:
        """Reduce-scatter chunk ``index``'s payload into its own range ([Note: gradients in
        gathered chunks] in gathered_grads.py)."""
        payload = self.gathered.payload_for_reduction(index)
        own = payload.narrow(0, self.store.shard_start(index), self.store.shard_numel(index))
        work = self.comm.reduce_scatter(own, payload, async_op=True)
        self._pending.append((index, work, None, own))
        if len(self._pending) > self.max_pending:
            self._wait_reductions(keep=self.max_pending)

    def _before_drop(self, index: int) -> None:
        """The store is dropping chunk ``index``'s payload: let its reduction finish writing
        into it, and keep the gradients it holds."""
        if any(pending[0] == index for pending in self._pending):
            self._wait_reductions(dropping=index)
        self.gathered.stash(index)

    def _count_transient(self, index: int, num_bytes: int) -> None:
        self._transient_bytes += num_bytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient_bytes)
        if not takes_gradients(self.store.chunks[index]):  # a budget would not avoid these
            self._required_bytes += num_bytes
            self.peak_required_transient_bytes = max(
                self.peak_required_transient_bytes, self._required_bytes
            )

    def _uncount_transient(self, index: int, num_bytes: int) -> None:
        self._transient_bytes -= num_bytes
        if not takes_gradients(self.store.chunks[index]):
            self._required_bytes -= num_bytes

    def _wait_reductions(self, *, keep: int = 0, dropping: int | None = None) -> None:
        """Wait for all but the newest ``keep`` reductions, oldest first (or, ``dropping``, up
        to that chunk's: the store is dropping its payload)."""
        tier = self.store.device_tier
        if dropping is not None:
            keep = len(self._pending) - 1 - [p[0] for p in self._pending].index(dropping)
        done = self._pending[: len(self._pending) - keep]
        for index, work, full, out in done:
            if work is not None:  # None: done already (one process)
                work.wait()
            if full is not None:
                tier.free(full)
            out.div_(self.comm.world_size)
            grad = self.shards[index]
            if index in self.on_disk:
                self._spill(index, out)
            elif grad is None:
                target = self.store.shard_tiers[index]
                grad = self.shards[index] = target.allocate(out.numel(), torch.float32)
                self._tiers[index] = target
                grad.copy_(out)
                if target is not tier:
                    tier.record_move(out_bytes=out.nbytes)
                    target.record_move(in_bytes=out.nbytes)
            else:
                grad.add_(out.to(grad.device))
            if full is None:  # out was the payload's own range: it holds no weights now
                self._stale.add(index)
            else:
                tier.free(out)
                self._uncount_transient(index, full.nbytes + out.nbytes)
        del self._pending[: len(done)]
        if dropping is None:  # not inside the store's own drop
            self._drop_stale()

    def _spill(self, index: int, reduced: torch.Tensor) -> None:
        """Write a reduced shard to disk (added to the one there when accumulating), keeping
        its norm for the step."""
        assert self.swapper is not None
        host, device = self.store.host_tier, self.store.device_tier
        staging = host.allocate(reduced.numel(), torch.float32, own_mapping=False)
        if index in self._disk_norms:  # the same operations as for a shard in memory
            self.swapper.read_now(GRAD, index, staging)
            staging.add_(reduced.to(staging.device))
        else:
            staging.copy_(reduced)
        if device is not host:
            device.record_move(out_bytes=reduced.nbytes)
            host.record_move(in_bytes=reduced.nbytes)
        self._disk_norms[index] = torch._foreach_norm([staging], 2.0)[0]
        self._writes.append((self.swapper.write_async(GRAD, index, staging), staging))
        if len(self._writes) > GRAD_WRITES:
            self._finish_writes(keep=GRAD_WRITES)

    def _finish_writes(self, *, keep: int = 0) -> None:
        done = self._writes[: len(self._writes) - keep]
        for future, staging in done:
            future.result()
            self.store.host_tier.free(staging)
        del self._writes[: len(done)]

    def finish_backward(self) -> None:
        """Reduce the chunks only some of whose parameters got a gradient, then wait for this
        backward's reductions (see the module doc); while ``accumulating``, nothing is
        reduced ([Note: reducing once per step])."""
        if not self.accumulating:
            for index in sorted(self._full.keys() | self.gathered.indices()):
                self._reduce(index)
        self._wait_reductions()
        self._finish_writes()
        self._drop_stale()
        self._arrived.clear()

    def _drop_stale(self) -> None:
        """Drop the payloads that hold reduced gradients, but those a module still holds (the
        backward's end drops them)."""
        for index in sorted(self._stale):
            chunk = self.store.chunks[index]
            if not chunk.on_device:  # the store dropped it meanwhile
                self._stale.discard(index)
            elif chunk.state is not ChunkState.COMPUTE:
                self.store.evict(index)
                self._stale.discard(index)

    def has_gradient(self, param: nn.Parameter) -> bool:
        """Whether ``param`` got a gradient since the last step (on this rank)."""
        return id(param) in self._got_grad

    def reduced(self, index: int) -> bool:
        """Whether chunk ``index`` holds a reduced gradient shard (in memory or on disk)."""
        return self.shards[index] is not None or index in self._disk_norms

    # -- the step --------------------------------------------------------------------------------

    def norms(self) -> dict[int, torch.Tensor]:
        """The gradient norm of each chunk index that has one (in memory or on disk)."""
        indices = [i for i, g in enumerate(self.shards) if g is not None]
        in_memory = [g for g in self.shards if g is not None]
        norms = dict(zip(indices, torch._foreach_norm(in_memory, 2.0) if in_memory else [],
                         strict=True))  # fmt: skip
        return {**norms, **self._disk_norms}

    def in_memory(self) -> list[torch.Tensor]:
        return [g for g in self.shards if g is not None]

    def zero(self) -> None:
        """Drop every gradient: those in memory, those on disk, those being collected."""
        self._wait_reductions()
        self._finish_writes()
        self._disk_norms.clear()
        for index, grad in enumerate(self.shards):
            if grad is not None:
                self._tiers.pop(index).free(grad)
                self.shards[index] = None
        for index in list(self._full):
            full = self._full.pop(index)
            self.store.device_tier.free(full)
            self._uncount_transient(index, full.nbytes)
        self._stale |= self.gathered.forget()  # a backward that raised: its gradients go
        self._drop_stale()
        self._arrived.clear()
        self._got_grad.clear()
        for e in self._entries:
            e.param.grad = None
