"""Chunk payloads, views, the state machine of [Note: chunk states], and tier residency."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.memory.chunk import Chunk, ChunkKind, ChunkState, TensorState
from tidal.memory.layout import plan_layout, unique_parameters
from tidal.memory.tiers import Tier, TierBudgetError, TierKind

CPU = torch.device("cpu")


def _model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(3, 10, bias=False))
    return model


def _chunk(kind: ChunkKind = ChunkKind.PARAM, dtype: torch.dtype = torch.float32) -> Chunk:
    layout = plan_layout(unique_parameters(_model()), chunk_size=1024, align=4)
    assert layout.num_chunks == 1
    return Chunk(layout.chunks[0], kind=kind, dtype=dtype)


def _tiers(device_budget: int | None = None) -> tuple[Tier, Tier]:
    device = Tier(TierKind.DEVICE, CPU, budget_bytes=device_budget)
    host = Tier(TierKind.HOST, CPU, budget_bytes=None)
    return device, host


def test_views_share_the_payload_at_the_layout_offsets() -> None:
    model = _model()
    chunk = _chunk()
    device, _ = _tiers()
    chunk.allocate(device)
    params = list(model.parameters())
    for slot, param in enumerate(params):
        chunk.write(slot, param.detach())
    for slot, (param, info) in enumerate(zip(params, chunk.spec.slots, strict=True)):
        view = chunk.view(slot)
        assert view.shape == param.shape and torch.equal(view, param)
        assert view.data_ptr() == chunk.payload.data_ptr() + 4 * info.offset
    assert device.held_bytes == chunk.num_bytes == 4 * chunk.spec.capacity


def test_state_is_derived_from_slots() -> None:
    chunk = _chunk()
    assert chunk.state is ChunkState.RELEASED
    device, _ = _tiers()
    chunk.allocate(device)
    assert chunk.state is ChunkState.FREE
    chunk.write(0, torch.zeros(10, 4))
    assert chunk.state is ChunkState.HOLD
    chunk.acquire(0)
    assert chunk.state is ChunkState.COMPUTE and chunk.slot_state(0) is TensorState.COMPUTE
    chunk.release_slot(0)
    assert chunk.state is ChunkState.HOLD
    chunk.discard_slot(0)
    assert chunk.state is ChunkState.FREE


def test_shared_use_is_counted() -> None:
    chunk = _chunk()
    chunk.allocate(_tiers()[0])
    chunk.fill_free_slots(0.0)
    chunk.acquire(0)
    chunk.acquire(0)  # e.g. tied embedding: input layer and LM head
    chunk.release_slot(0)
    assert chunk.slot_state(0) is TensorState.COMPUTE
    chunk.release_slot(0)
    assert chunk.slot_state(0) is TensorState.HOLD
    with pytest.raises(AssertionError, match="release without acquire"):
        chunk.release_slot(0)


@pytest.mark.parametrize(
    "illegal",
    [
        lambda c: c.acquire(0),  # FREE -> COMPUTE: using data that was never written
        lambda c: c.discard_slot(0),  # FREE -> FREE
    ],
)
def test_illegal_transitions_assert(illegal) -> None:
    chunk = _chunk()
    chunk.allocate(_tiers()[0])
    with pytest.raises(AssertionError, match="illegal tensor state change"):
        illegal(chunk)


def test_moves_keep_data_and_count_bytes() -> None:
    device, host = _tiers()
    chunk = _chunk()
    chunk.allocate(device)
    chunk.fill_free_slots(3.0)
    assert chunk.move_to(host) == chunk.num_bytes
    assert chunk.tier is host and device.held_bytes == 0 and host.held_bytes == chunk.num_bytes
    assert device.bytes_out == host.bytes_in == chunk.num_bytes
    assert torch.all(chunk.view(1) == 3.0)
    assert chunk.move_to(host) == 0  # already there: nothing moves
    chunk.acquire(1)
    with pytest.raises(AssertionError, match="in use"):
        chunk.move_to(device)


def test_budget_refuses_a_move_and_keeps_the_source() -> None:
    chunk = _chunk()
    device, host = _tiers(device_budget=chunk.num_bytes - 1)
    chunk.allocate(host)
    chunk.fill_free_slots(1.0)
    with pytest.raises(TierBudgetError):
        chunk.move_to(device)
    assert chunk.tier is host and torch.all(chunk.view(0) == 1.0)
    assert device.held_bytes == 0


def test_release_refuses_to_drop_model_data() -> None:
    device, _ = _tiers()
    chunk = _chunk(ChunkKind.GRAD, torch.bfloat16)
    chunk.allocate(device)
    assert chunk.num_bytes == 2 * chunk.spec.capacity
    chunk.fill_free_slots(0.0)
    with pytest.raises(AssertionError, match="would lose its data"):
        chunk.release()
    chunk.release(discard=True)
    assert chunk.state is ChunkState.RELEASED and device.held_bytes == 0


def test_device_views_survive_eviction_and_autograd() -> None:
    """[Note: persistent buffers]: views bound once stay valid across evict/fetch cycles."""
    device, host = _tiers()
    model = _model()
    reference = [p.detach().clone() for p in model.parameters()]
    chunk = _chunk()
    chunk.allocate(host)
    for slot, param in enumerate(model.parameters()):
        chunk.write(slot, param.detach())
        param.data = chunk.device_view(slot, device)
    chunk.move_to(device)
    x = torch.randint(0, 10, (5,))
    loss = model(x).square().sum()  # autograd saves the Linear weights (views of the buffer)
    chunk.move_to(host)  # evicted between forward and backward
    assert device.held_bytes == 0
    with pytest.raises(RuntimeError, match="storage"):
        model(x)  # a use while evicted fails instead of reading freed memory
    chunk.move_to(device)
    loss.backward()

    plain = _model()
    for param, value in zip(plain.parameters(), reference, strict=True):
        param.data = value.clone()
    plain(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours.detach(), theirs.detach())
        assert torch.allclose(ours.grad, theirs.grad)
    assert device.bytes_in == 2 * chunk.num_bytes and device.bytes_out == chunk.num_bytes


def test_regrow_respects_the_budget() -> None:
    chunk = _chunk()
    device, host = _tiers(device_budget=chunk.num_bytes)
    chunk.allocate(device)
    chunk.fill_free_slots(2.0)
    chunk.move_to(host)
    blocker = device.allocate(1, torch.uint8)  # one byte short now
    with pytest.raises(TierBudgetError):
        chunk.move_to(device)
    assert chunk.tier is host and torch.all(chunk.view(0) == 2.0)
    device.free(blocker)
    chunk.move_to(device)
    assert torch.all(chunk.view(0) == 2.0) and device.held_bytes == chunk.num_bytes


def test_slots_reached_by_views_of_the_device_buffer() -> None:
    """Backward's unpack fetches only the slots a saved view reaches (store._model_unpacked)."""
    chunk = _chunk()
    device, _ = _tiers()
    chunk.allocate(device)
    slots = chunk.spec.slots  # embedding [10, 4], linear weight [3, 4] and bias [3], head [10, 3]
    weight = chunk.view(1)
    assert chunk.slots_reached(weight) == {1}
    assert chunk.slots_reached(weight.t()) == {1}  # a transposed view reaches the same range
    assert chunk.slots_reached(chunk.view(3)[2:4]) == {3}
    across = chunk.payload.narrow(0, slots[1].offset, slots[2].offset - slots[1].offset + 1)
    assert chunk.slots_reached(across) == {1, 2}
    assert chunk.slots_reached(weight.to(torch.bfloat16)) == {0, 1, 2, 3}  # cannot tell: all
