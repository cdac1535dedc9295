"""Gradients written into the gathered payloads of fp32 chunks, until their reduction.

[Note: gradients in gathered chunks]
Under a device budget an fp32 chunk needs no gradient buffer of its own. Once the hook has fired
for a parameter, autograd is done with its weights in this backward, and those weights are only
a gathered copy of the shards (the authoritative ones), so the gradient goes into the
parameter's own slot of the gathered payload (PatrickStar's trick, which one process applies to
bf16 chunks: [Note: gradients in parameter chunks] in tidal/memory/optim.py). When the chunk's
gradient is complete, the slots without one and the padding are zeroed and the payload is
reduce-scattered in place, into this rank's own range of it (NCCL and gloo both take an output
that is the input's ``rank``-th shard); once that range is added to the gradient shard the
payload holds no weights, and it is dropped.

The store still places the chunk as it would any other: nothing here holds it, so the moments
and the least budget are those of one process. If the store drops a payload that holds
gradients (room for another chunk: the chunk is used again further down the backward), the
transport first calls :meth:`GatheredGradients.stash`, which copies them into a host buffer
(one chunk of fp32, on the host tier); a gradient that arrives while its chunk is off the device
goes there too; and the reduction restores them into a payload, re-allocated on the device if
need be (never gathered: only the gradients matter). A drop while the payload's own reduction
is in flight first waits for it. So a rank's device holds, for gradients, nothing beyond the
chunks the moments need: its least budget is at most one process's.

The price is a gather: accumulating, a gathered copy that would have stayed on the device for
the next micro-batch's forward is gone. So this runs under a device budget only; without one,
where memory is not what is short, fp32 chunks use the buffer of [Note: sharded gradients] in
grads.py, as bf16 and fp16 chunks always do (their reductions run in fp32).
"""

from __future__ import annotations

import torch

from tidal.memory.chunk import Chunk
from tidal.memory.layout import TensorSlot
from tidal.sharding.store import ShardedChunkStore

__all__ = ["GatheredGradients", "takes_gradients"]


def takes_gradients(chunk: Chunk) -> bool:
    """Whether ``chunk``'s gathered payload can hold its gradients: fp32, the reduction's dtype."""
    return chunk.dtype == torch.float32


class GatheredGradients:
    """The gradients of this backward that sit in gathered payloads, or in host stashes of
    payloads the store dropped; see [Note: gradients in gathered chunks]."""

    def __init__(self, store: ShardedChunkStore) -> None:
        self.store = store
        self._slots: dict[int, set[int]] = {}  # chunk index -> slots its payload holds
        self._stashes: dict[int, tuple[torch.Tensor, set[int]]] = {}  # host buffer, its slots
        self.num_stashes = 0  # payloads whose gradients went to the host before a drop

    def __contains__(self, index: int) -> bool:
        return index in self._slots or index in self._stashes

    def write(self, index: int, slot: int, grad: torch.Tensor) -> None:
        chunk = self.store.chunks[index]
        if chunk.on_device:
            chunk.view(slot).copy_(grad)
            self._slots.setdefault(index, set()).add(slot)
        else:
            buffer, stashed = self._stash_of(index)
            chunk.view_in(buffer, slot).copy_(grad)
            stashed.add(slot)
            self._count_move(grad.nbytes)

    def stash(self, index: int) -> None:
        """Chunk ``index``'s payload is about to be dropped: its gradients go to the host."""
        slots = self._slots.pop(index, None)
        if not slots:
            return
        chunk = self.store.chunks[index]
        buffer, stashed = self._stash_of(index)
        for slot in slots:
            chunk.view_in(buffer, slot).copy_(chunk.view(slot))
        stashed |= slots
        self.num_stashes += 1
        self._count_move(sum(4 * chunk.spec.slots[s].numel for s in slots))

    def payload_for_reduction(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s device payload holding exactly its gradients, zeros elsewhere."""
        chunk = self.store.chunks[index]
        if not chunk.on_device:  # dropped: a payload for the gradients only, not gathered
            self.store.make_device_room(chunk.num_bytes)
            chunk.allocate(self.store.device_tier)
        keep = self._slots.pop(index, set())
        if index in self._stashes:
            buffer, stashed = self._stashes.pop(index)
            for slot in stashed:
                chunk.view(slot).copy_(chunk.view_in(buffer, slot))
            self.store.host_tier.free(buffer)
            self._count_move(sum(4 * chunk.spec.slots[s].numel for s in stashed), to_device=True)
            keep |= stashed
        payload = chunk.payload
        assert payload is not None
        zero_outside(payload, chunk.spec.slots, keep)
        return payload

    def indices(self) -> set[int]:
        """The chunk indices with gradients held here."""
        return self._slots.keys() | self._stashes.keys()

    def forget(self) -> set[int]:
        """Drop every gradient held (a backward that raised); the indices whose payloads
        still hold some, which must be dropped: they are no weights."""
        on_device = set(self._slots)
        self._slots.clear()
        for buffer, _ in self._stashes.values():
            self.store.host_tier.free(buffer)
        self._stashes.clear()
        return on_device

    def _stash_of(self, index: int) -> tuple[torch.Tensor, set[int]]:
        if index not in self._stashes:
            numel = self.store.chunks[index].spec.capacity
            buffer = self.store.host_tier.allocate(numel, torch.float32, own_mapping=False)
            self._stashes[index] = (buffer, set())
        return self._stashes[index]

    def _count_move(self, num_bytes: int, *, to_device: bool = False) -> None:
        device, host = self.store.device_tier, self.store.host_tier
        if device is host:
            return
        source, target = (host, device) if to_device else (device, host)
        source.record_move(out_bytes=num_bytes)
        target.record_move(in_bytes=num_bytes)


def zero_outside(payload: torch.Tensor, slots: tuple[TensorSlot, ...], keep: set[int]) -> None:
    """Zero every element of ``payload`` outside the ``keep`` slots (slots are in offset order)."""
    start = 0
    for slot, info in enumerate(slots):
        if slot in keep:
            if info.offset > start:
                payload[start : info.offset].zero_()
            start = info.offset + info.numel
    if start < payload.numel():
        payload[start:].zero_()
