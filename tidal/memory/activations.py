"""Non-model memory: what an iteration holds on the device besides model data.

[Note: non-model memory]
A device budget is shared by chunks and by everything else the iteration allocates there, above
all the activations autograd saves for backward. PatrickStar guessed the rest with a fixed
fraction of the GPU ("warm-up ratio") and its users met out-of-memory errors when the guess was
low; here it is measured, per moment of the trace, by a meter:

- on CPU (the testable device tier), :class:`SavedTensorMeter` counts the bytes of every storage
  autograd saves, through ``torch.autograd.graph.saved_tensors_hooks``, from the moment it is
  saved until the graph drops it. Storages are counted once however many views of them are
  saved, and parameter chunks (model data, already in the tier's books) not at all. It sees
  growth as it happens, so the store can evict chunks *before* the bytes would exceed the budget:
  the warm-up iteration, which has no trace to plan from, runs within the budget too. Transient
  tensors that are not saved for backward are not counted: on a CPU they are not device memory
  anyone budgets.
- on CUDA, :class:`AllocatorMeter` reads the caching allocator: allocated bytes minus the device
  tier's own allocations, sampled at each moment, with the allocator's peak between moments.

Each moment of the trace records the peak non-model bytes from its start to the next moment's
start, which is what placement must leave room for ([Note: placement] in policy.py). The meter
reports the live figure to the device tier's non-model gauge, so the tier's peak and its budget
check cover activations.

A device tier may set aside at most ``non_model_cap_bytes`` of its budget for non-model bytes
(``memory.non_model_budget``; a plan's chunk stage sets its predicted activations: [Note: chunk
stages in plans] in tidal/planner/model_data.py). The store then sees the meter's figures capped
there (:class:`CappedMeter`): the chunks always get the budget less the cap, and non-model bytes
above it go over the budget instead of evicting the chunks or failing the iteration. The meter
keeps how far they went over (``over_cap_bytes``), which the engine reports.

Both meters also see the *model* tensors autograd saves (parameters, or views of them): those are
handed back through ``on_model_unpack(storage key, tensor)`` when backward unpacks them, which is how a
parameter used outside its own module gets its chunk back on the device in time ([Note:
functional uses] in functional.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from tidal.memory.tiers import Tier

__all__ = ["AllocatorMeter", "CappedMeter", "NonModelMeter", "SavedTensorMeter", "make_meter"]


class NonModelMeter(Protocol):
    def tracking(self) -> contextlib.AbstractContextManager[None]:
        """Count while the forward (and so the graph it builds) is made."""
        ...

    def live_bytes(self) -> int:
        """Non-model bytes held now."""
        ...

    def take_peak_bytes(self) -> int:
        """The peak since the last call (or since creation), then restart the peak from now."""
        ...


class _SavedModel:
    """What autograd keeps for a saved model tensor: the tensor and its storage key."""

    __slots__ = ("key", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int) -> None:
        self.tensor = tensor
        self.key = key


class _ModelTensorHooks:
    """Pack and unpack for model tensors: kept as they are, reported when unpacked."""

    def __init__(
        self,
        is_model_storage: Callable[[int], bool],
        on_model_unpack: Callable[[int, torch.Tensor], None] | None,
    ) -> None:
        self._is_model_storage = is_model_storage
        self._on_model_unpack = on_model_unpack

    def _pack_model(self, tensor: torch.Tensor, key: int) -> torch.Tensor | _SavedModel:
        return tensor if self._on_model_unpack is None else _SavedModel(tensor, key)

    def _unpack(self, saved: torch.Tensor | _Saved | _SavedModel) -> torch.Tensor:
        if isinstance(saved, _SavedModel):
            assert self._on_model_unpack is not None
            self._on_model_unpack(saved.key, saved.tensor)
        return saved if isinstance(saved, torch.Tensor) else saved.tensor

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _SavedModel:
        key = tensor.untyped_storage()._cdata
        return self._pack_model(tensor, key) if self._is_model_storage(key) else tensor


class _Saved:
    """What autograd keeps for a saved tensor: the tensor, and a ticket that is returned on drop."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedTensorMeter) -> None:
        self.tensor = tensor
        self.key = key
        self.meter = meter

    def __del__(self) -> None:
        self.meter._drop(self.key)


class SavedTensorMeter(_ModelTensorHooks):
    """Bytes of storages saved for backward, counted once each; see [Note: non-model memory].

    ``is_model_storage(key)`` says whether a storage (by ``untyped_storage()._cdata``, which is
    stable across the resizes of a chunk's persistent buffer) holds model data, which the meter
    leaves out. ``on_change(live_bytes)`` runs before every change is counted and may raise to
    refuse the growth (the store evicts chunks to make room, or names the shortfall).
    """

    def __init__(
        self,
        *,
        is_model_storage: Callable[[int], bool],
        on_change: Callable[[int], None] | None = None,
        on_model_unpack: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(is_model_storage, on_model_unpack)
        self._on_change = on_change
        self._refs: dict[int, list[int]] = {}  # storage key -> [saves alive, bytes]
        self._live_bytes = 0
        self._peak_bytes = 0

    def live_bytes(self) -> int:
        return self._live_bytes

    def take_peak_bytes(self) -> int:
        peak_bytes, self._peak_bytes = self._peak_bytes, self._live_bytes
        return peak_bytes

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved | _SavedModel:  # type: ignore[override]
        storage = tensor.untyped_storage()
        key = storage._cdata
        if self._is_model_storage(key):
            return self._pack_model(tensor, key)
        entry = self._refs.get(key)
        if entry is None:
            num_bytes = storage.nbytes()
            self._set_live(self._live_bytes + num_bytes)
            self._refs[key] = [1, num_bytes]
        else:
            entry[0] += 1
        # Detached: a saved output would otherwise hold its own grad_fn through the ticket, a
        # cycle only the garbage collector breaks, and its bytes would stay counted until then.
        # (Double backward through the chunk engine is not supported anyway.)
        return _Saved(tensor.detach(), key, self)

    def _drop(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self._set_live(self._live_bytes - entry[1])

    def _set_live(self, live_bytes: int) -> None:
        if self._on_change is not None:
            self._on_change(live_bytes)
        self._live_bytes = live_bytes
        self._peak_bytes = max(self._peak_bytes, live_bytes)


class AllocatorMeter(_ModelTensorHooks):
    """CUDA: allocated bytes that are not the device tier's; see [Note: non-model memory]."""

    def __init__(
        self,
        device: torch.device,
        device_tier: Tier,
        *,
        is_model_storage: Callable[[int], bool],
        on_model_unpack: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(is_model_storage, on_model_unpack)
        # An index, not a device: torch resolves a bare "cuda" at every call.
        self._index = torch.cuda.current_device() if device.index is None else device.index
        self._tier = device_tier
        torch.cuda.reset_peak_memory_stats(self._index)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _allocated_bytes(self) -> tuple[int, int]:
        """The allocator's current and peak allocated bytes, from its nested statistics.

        Not ``torch.cuda.memory_allocated``: that flattens every statistic into a new dict in
        Python first, about 0.4 ms a call, and the store reads the meter several times a
        moment; on an H200 that was most of a chunk-engine step (profile in
        benchmarks/results/device-check-h200-20261126.md)."""
        stats = torch.cuda.memory_stats_as_nested_dict(self._index)
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        return int(allocated.get("current", 0)), int(allocated.get("peak", 0))

    def live_bytes(self) -> int:
        return max(0, self._allocated_bytes()[0] - self._tier.allocated_bytes)

    def take_peak_bytes(self) -> int:
        # The tier's allocations at the allocator's peak are not known; the current ones are a
        # close stand-in, since chunks move only at moments.
        current_bytes, peak_bytes = self._allocated_bytes()
        torch.cuda.reset_peak_memory_stats(self._index)
        return max(
            0, peak_bytes - self._tier.allocated_bytes, current_bytes - self._tier.allocated_bytes
        )


class CappedMeter:
    """Another meter's figures (``inner``'s), none above ``cap_bytes`` (see [Note: non-model
    memory]); ``over_cap_bytes``: the most the figures went above it."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.over_cap_bytes = 0
        self.inner: NonModelMeter | None = None  # make_meter's, which reports through capped

    def capped(self, num_bytes: int) -> int:
        self.over_cap_bytes = max(self.over_cap_bytes, num_bytes - self.cap_bytes)
        return min(num_bytes, self.cap_bytes)

    def tracking(self) -> contextlib.AbstractContextManager[None]:
        assert self.inner is not None
        return self.inner.tracking()

    def live_bytes(self) -> int:
        assert self.inner is not None
        return self.capped(self.inner.live_bytes())

    def take_peak_bytes(self) -> int:
        assert self.inner is not None
        return self.capped(self.inner.take_peak_bytes())


def make_meter(
    device: torch.device,
    device_tier: Tier,
    *,
    is_model_storage: Callable[[int], bool],
    on_change: Callable[[int], None],
    on_model_unpack: Callable[[int, torch.Tensor], None] | None = None,
) -> NonModelMeter:
    """The meter for ``device``: the allocator's figures on CUDA, saved tensors elsewhere,
    capped at the tier's ``non_model_cap_bytes`` where it has one."""
    if device_tier.non_model_cap_bytes is None:
        return _meter(device, device_tier, is_model_storage, on_change, on_model_unpack)
    capped = CappedMeter(device_tier.non_model_cap_bytes)
    capped.inner = _meter(device, device_tier, is_model_storage,
                          lambda live_bytes: on_change(capped.capped(live_bytes)), on_model_unpack)  # fmt: skip
    return capped


def _meter(device: torch.device, device_tier: Tier, is_model_storage: Callable[[int], bool],
           on_change: Callable[[int], None],
           on_model_unpack: Callable[[int, torch.Tensor], None] | None) -> NonModelMeter:  # fmt: skip
    if device.type == "cuda":
        return AllocatorMeter(
            device, device_tier, is_model_storage=is_model_storage, on_model_unpack=on_model_unpack
        )
    return SavedTensorMeter(
        is_model_storage=is_model_storage, on_change=on_change, on_model_unpack=on_model_unpack
    )
