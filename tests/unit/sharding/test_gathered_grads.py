"""[Note: gradients in gathered chunks]: a chunk's gradients reach its reduction whole, whether
they sat in its gathered payload, were stashed when the store dropped it, or arrived while it
was off the device."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tidal.memory.chunk import Chunk, ChunkKind
from tidal.memory.layout import plan_layout, unique_parameters
from tidal.memory.tiers import Tier, TierKind
from tidal.sharding.gathered_grads import GatheredGradients

CPU = torch.device("cpu")


def _store() -> SimpleNamespace:
    """What GatheredGradients reads of a sharded store: one chunk of three parameters."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    layout = plan_layout(unique_parameters(model), chunk_size=64, align=8)
    assert layout.num_chunks == 1 and len(layout.chunks[0].slots) == 3
    device = Tier(TierKind.DEVICE, CPU, budget_bytes=None)
    host = Tier(TierKind.HOST, CPU, budget_bytes=None)
    chunk = Chunk(layout.chunks[0], kind=ChunkKind.PARAM, dtype=torch.float32)
    store = SimpleNamespace(chunks=[chunk], device_tier=device, host_tier=host, room_asked=[])
    store.make_device_room = store.room_asked.append
    return store


def _gathered(store: SimpleNamespace) -> Chunk:
    """The chunk gathered: its payload full of weights (ones), as the forward left it."""
    chunk = store.chunks[0]
    chunk.allocate(store.device_tier)
    assert chunk.payload is not None
    chunk.payload.fill_(1.0)
    chunk.mark_filled()
    return chunk


def _grads(chunk: Chunk) -> list[torch.Tensor]:
    return [torch.full(info.shape, float(slot + 2)) for slot, info in enumerate(chunk.spec.slots)]


def _expected(chunk: Chunk, grads: list[torch.Tensor], slots: set[int]) -> torch.Tensor:
    """The gradients of ``slots`` at their offsets, zero elsewhere (padding, other slots)."""
    want = torch.zeros(chunk.spec.capacity)
    for slot in slots:
        chunk.view_in(want, slot).copy_(grads[slot])
    return want


def test_gradients_in_the_payload_with_the_rest_zeroed() -> None:
    store = _store()
    chunk = _gathered(store)
    grads = _grads(chunk)
    held = GatheredGradients(store)  # type: ignore[arg-type]
    held.write(0, 2, grads[2])
    held.write(0, 0, grads[0])  # slot 1 gets none: its weights must not be reduced
    assert 0 in held
    payload = held.payload_for_reduction(0)
    assert payload.data_ptr() == chunk.payload.data_ptr()  # in place, no buffer
    assert torch.equal(payload, _expected(chunk, grads, {0, 2}))
    assert 0 not in held and store.room_asked == []


def test_a_dropped_payload_keeps_its_gradients_on_the_host() -> None:
    store = _store()
    chunk = _gathered(store)
    grads = _grads(chunk)
    held = GatheredGradients(store)  # type: ignore[arg-type]
    held.write(0, 2, grads[2])
    held.stash(0)  # the store drops the payload for room ...
    chunk.release(discard=True)
    assert held.num_stashes == 1 and store.host_tier.held_bytes > 0
    _gathered(store)  # ... and gathers it again (weights) for slot 0's module
    held.write(0, 0, grads[0])
    payload = held.payload_for_reduction(0)
    assert torch.equal(payload, _expected(chunk, grads, {0, 2}))
    assert store.host_tier.held_bytes == 0  # the stash went back


def test_a_gradient_that_arrives_off_the_device_is_reduced_from_a_fresh_payload() -> None:
    store = _store()
    chunk = store.chunks[0]  # never gathered (or dropped): no payload
    grads = _grads(chunk)
    held = GatheredGradients(store)  # type: ignore[arg-type]
    held.write(0, 1, grads[1])
    assert not chunk.on_device
    payload = held.payload_for_reduction(0)
    assert chunk.on_device and store.room_asked == [chunk.num_bytes]
    assert torch.equal(payload, _expected(chunk, grads, {1}))


def test_forget_names_the_payloads_that_hold_gradients() -> None:
    store = _store()
    _gathered(store)
    held = GatheredGradients(store)  # type: ignore[arg-type]
    held.write(0, 0, torch.zeros(store.chunks[0].spec.slots[0].shape))
    assert held.forget() == {0}
    assert 0 not in held and held.indices() == set()
