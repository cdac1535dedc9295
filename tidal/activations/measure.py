"""What submodules save for backward, measured in one forward (a saved-tensor meter each)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal.activations.runtime import around_forward
from tidal.memory.activations import SavedTensorMeter

__all__ = ["Saves", "measure_saves", "saved_bytes"]


@dataclass(frozen=True, slots=True)
class Saves:
    """One forward's saves: per submodule what it saved and the bytes of its inputs (what a
    recompute of it keeps), and what was saved outside every submodule named (a stage's loss)."""

    saved_bytes: dict[str, int]
    input_bytes: dict[str, int]
    outside_bytes: int


def measure_saves(model: nn.Module, paths: Sequence[str], forward: Callable[[], Any]) -> Saves:
    """What each submodule of ``model`` at ``paths`` (which must not nest) has saved for
    backward when ``forward()`` returns (storages counted once per submodule, parameters not at
    all: [Note: non-model memory] in tidal/memory/activations.py), the bytes of its inputs, and
    what the model saved outside them (its meter is outermost, so a submodule's wins inside)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    meters = {path: SavedTensorMeter(is_model_storage=params.__contains__) for path in paths}
    outside = SavedTensorMeter(is_model_storage=params.__contains__)
    inputs = dict.fromkeys(paths, 0)

    def count_inputs(path: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            storages = {a.untyped_storage()._cdata: a.untyped_storage().nbytes() for a in args
                        if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in params}  # fmt: skip
            inputs[path] += sum(storages.values())

        return hook

    hooks = around_forward(model, outside.tracking)
    for path, meter in meters.items():
        module = model.get_submodule(path)
        hooks += around_forward(module, meter.tracking)
        hooks.append(module.register_forward_pre_hook(count_inputs(path)))
    try:
        output = forward()
        measured = Saves(saved_bytes={path: m.live_bytes() for path, m in meters.items()},
                         input_bytes=inputs, outside_bytes=outside.live_bytes())  # fmt: skip
        del output
        return measured
    finally:
        for hook in hooks:
            hook.remove()


def saved_bytes(
    model: nn.Module, paths: Sequence[str], forward: Callable[[], Any]
) -> dict[str, int]:
    """The bytes each submodule of ``model`` at ``paths`` has saved (:func:`measure_saves`)."""
    return measure_saves(model, paths, forward).saved_bytes
