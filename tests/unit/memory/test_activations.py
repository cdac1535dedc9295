"""The non-model meter on CPU: saved-tensor bytes, counted once, model data left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.memory.activations import AllocatorMeter, SavedTensorMeter
from tidal.memory.tiers import Tier, TierKind


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def test_counts_each_saved_storage_once_and_drops_it_with_the_graph() -> None:
    weight = torch.randn(8, 4, requires_grad=True)
    meter = SavedTensorMeter(is_model_storage={_storage_key(weight)}.__contains__)
    x = torch.randn(16, 4, requires_grad=True)
    with meter.tracking():
        h = F.linear(x, weight)  # saves x (and the weight, which is model data)
        y = (h * h).sum() + (h.exp()).sum()  # h is saved by two ops; exp saves its output
    h_bytes = h.numel() * h.element_size()
    x_bytes = x.numel() * x.element_size()
    assert meter.live_bytes() == x_bytes + h_bytes + h_bytes  # x, h (once), exp(h)
    assert meter.take_peak_bytes() == meter.live_bytes()
    y.backward()
    assert meter.live_bytes() == 0
    assert meter.take_peak_bytes() == x_bytes + 2 * h_bytes  # the peak since the last take
    assert meter.take_peak_bytes() == 0  # restarted from the live figure


def test_a_refused_growth_counts_nothing() -> None:
    seen: list[int] = []

    def refuse_above(live_bytes: int) -> None:
        if live_bytes > 100:
            raise MemoryError(f"{live_bytes} bytes")
        seen.append(live_bytes)

    meter = SavedTensorMeter(is_model_storage=lambda key: False, on_change=refuse_above)
    x = torch.randn(64, requires_grad=True)  # 256 bytes once saved
    with meter.tracking(), pytest.raises(MemoryError):
        x.exp()
    assert meter.live_bytes() == 0 and seen == []
    small = torch.randn(4, requires_grad=True)
    with meter.tracking():
        out = small.exp()
    assert meter.live_bytes() == 16 and seen == [16]
    del out
    assert meter.live_bytes() == 0 and seen == [16, 0]


class _FakeAllocator:
    """The CUDA allocator's nested statistics, as torch.cuda.memory_stats_as_nested_dict
    gives them, for a machine without a GPU."""

    def __init__(self) -> None:
        self.current = self.peak = 0
        self.devices: list[object] = []

    def allocate(self, num_bytes: int) -> None:
        self.current += num_bytes
        self.peak = max(self.peak, self.current)

    def stats(self, device: object = None) -> dict:
        self.devices.append(device)
        return {"allocated_bytes": {"all": {"current": self.current, "peak": self.peak}}}

    def reset_peak(self, device: object = None) -> None:
        self.devices.append(device)
        self.peak = self.current


def test_the_allocator_meter_reads_one_nested_record_per_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake.stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", None)  # flattens every statistic: slow
    tier = Tier(TierKind.DEVICE, torch.device("cuda", 0), budget_bytes=None)
    meter = AllocatorMeter(torch.device("cuda", 0), tier, is_model_storage=lambda _key: False)
    fake.allocate(1000)  # non-model: the tier holds nothing
    assert meter.live_bytes() == 1000
    fake.allocate(500)
    fake.allocate(-700)
    assert meter.take_peak_bytes() == 1500 and fake.peak == fake.current == 800
    assert meter.take_peak_bytes() == 800  # the peak was reset
    assert set(fake.devices) == {0}  # an index: a bare "cuda" is resolved by torch every call
