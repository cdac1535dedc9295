"""What submodules save for backward, measured in one forward (a saved-tensor meter each)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from tidal.activations.runtime import around_forward
from tidal.memory.activations import SavedTensorMeter

__all__ = ["saved_bytes"]


def saved_bytes(
    model: nn.Module, paths: Sequence[str], forward: Callable[[], Any]
) -> dict[str, int]:
    """The bytes each submodule of ``model`` at ``paths`` (which must not nest) has saved for
    backward when ``forward()`` returns: storages counted once per submodule, parameters not at
    all ([Note: non-model memory] in tidal/memory/activations.py)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    meters = {path: SavedTensorMeter(is_model_storage=params.__contains__) for path in paths}
    hooks = [hook for path, meter in meters.items()
             for hook in around_forward(model.get_submodule(path), meter.tracking)]  # fmt: skip
    try:
        output = forward()
        measured = {path: meter.live_bytes() for path, meter in meters.items()}
        del output
        return measured
    finally:
        for hook in hooks:
            hook.remove()
