"""The non-model meter on CPU: saved-tensor bytes, counted once, model data left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.memory.activations import SavedTensorMeter


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
