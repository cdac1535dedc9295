"""What submodules save for backward, measured in one forward (a saved-tensor meter each), and
what a backward allocates for a while beside them.

[Note: backward temporaries]
A backward allocates tensors that live only while it runs: the gradients of activations, and
what a kernel needs (the logits' gradient of an LM head, as large as the logits). They are
not saved tensors, so no meter of saves sees them, yet the allocator holds them at the moment
a stage's saves peak (its first backward). :func:`backward_temporary_bytes` runs one backward
under a dispatch mode that counts the storages each op creates until they are freed, and
reports the most alive at once, less what is still alive when the backward returns (the
parameters' gradients, which model data already counts).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tidal.activations.runtime import around_forward
from tidal.memory.activations import SavedTensorMeter

__all__ = ["Saves", "backward_temporary_bytes", "measure_saves", "saved_bytes"]


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


class _Allocations(TorchDispatchMode):
    """Counts the bytes of the storages ops create while it is on, until each is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tensors: dict[int, int] = {}  # storage address -> tensors of it still alive

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address == 0:
            return
        if address not in self._tensors:
            self._tensors[address] = 0
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._tensors[address] += 1
        weakref.finalize(tensor, self._release, address, storage.nbytes())

    def _release(self, address: int, num_bytes: int) -> None:
        self._tensors[address] -= 1
        if self._tensors[address] == 0:
            del self._tensors[address]
            self.live_bytes -= num_bytes


def backward_temporary_bytes(backward: Callable[[], None]) -> int:
    """The most bytes ``backward()`` holds at once beyond what it leaves behind ([Note:
    backward temporaries]); a storage is counted from the op that made it until no tensor that
    an op returned on it is alive (views of a saved tensor are not new storages)."""
    mode = _Allocations()
    with mode:
        backward()
    return max(0, mode.peak_bytes - mode.live_bytes)
