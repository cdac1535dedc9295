"""The saved-tensor redirection of a pipeline stage's forward ([Note: saved-tensor redirection]
in tidal/runtime/weights.py): the pack and unpack pair that replaces each saved view of a
parameter by a token and rebuilds it on the stage's backward weights."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from tidal.activations.runtime import outer_saved_tensor_hooks

__all__ = ["Packer", "ParamToken", "RedirectedWeights", "SavedRef", "clone_like",
           "storage_extent", "storage_ptr"]  # fmt: skip


class RedirectedWeights(Protocol):
    """What a :class:`Packer` needs of a stage's weights (``StageWeights``)."""

    params: list[nn.Parameter]

    def note_unredirected(self, microbatch: int) -> None: ...

    def backward_view(self, token: ParamToken) -> torch.Tensor: ...


class ParamToken:
    """What autograd keeps instead of a saved view of a parameter."""

    __slots__ = ("index", "microbatch", "rel_offset", "size", "stride", "version", "weights")

    def __init__(
        self,
        weights: RedirectedWeights,
        index: int,
        t: torch.Tensor,
        base: torch.Tensor,
        microbatch: int,
        version: int,
    ) -> None:
        self.weights = weights
        self.index = index
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.rel_offset = t.storage_offset() - base.storage_offset()
        self.microbatch = microbatch
        self.version = version


class SavedRef:
    """A non-parameter saved tensor, detached (no cycle through grad_fn) with its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.version = t._version


def storage_extent(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last storage element a strided tensor can address."""
    first = int(t.storage_offset())  # a real tensor's, never symbolic
    last = first + sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True))
    return first, int(last) + 1


def storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, some subclasses: no storage
        return 0


def clone_like(p: torch.Tensor) -> torch.Tensor:
    # Same strides as the parameter, so a token's relative offset addresses the same element.
    out = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
    return out.copy_(p.detach())


class Packer:
    """The pack/unpack pair of one ``forward(mb)``; see [Note: saved-tensor redirection]."""

    def __init__(self, weights: RedirectedWeights, microbatch: int, version: int) -> None:
        self.weights = weights
        self.microbatch = microbatch
        self.version = version
        self.outer = outer_saved_tensor_hooks()
        # storage pointer -> (param index, first element, end element, dtype, live tensor)
        self.by_storage: dict[int, list[tuple[int, int, int, torch.dtype, torch.Tensor]]] = {}
        self.shapes: set[tuple[tuple[int, ...], torch.dtype]] = set()
        for index, p in enumerate(weights.params):
            ptr = storage_ptr(p)
            if ptr != 0 and p.numel() > 0:
                lo, hi = storage_extent(p)
                self.by_storage.setdefault(ptr, []).append((index, lo, hi, p.dtype, p))
            if p.dim() >= 2:  # weight matrices: a vector's shape matches too many activations
                self.shapes.add((tuple(p.shape), p.dtype))
                self.shapes.add((tuple(reversed(p.shape)), p.dtype))

    def _find(self, t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        if t.numel() == 0 or t.layout is not torch.strided:
            return None
        candidates = self.by_storage.get(storage_ptr(t))
        if not candidates:
            return None
        lo, hi = storage_extent(t)
        for index, p_lo, p_hi, dtype, p in candidates:
            if dtype == t.dtype and p_lo <= lo and hi <= p_hi:
                return index, p
        return None

    def pack(self, t: torch.Tensor) -> Any:
        found = self._find(t)
        if found is not None:
            index, base = found
            return ParamToken(self.weights, index, t, base, self.microbatch, self.version)
        shape = (tuple(t.shape), t.dtype)
        if (
            t.is_floating_point()
            and t.dim() >= 2  # matrices: a vector activation may match a bias by chance
            and shape not in self.shapes
            and any(shape[0] == s for s, _ in self.shapes)
        ):
            self.weights.note_unredirected(self.microbatch)
        if self.outer is not None:
            return self.outer[0](t)
        return SavedRef(t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, ParamToken):
            return packed.weights.backward_view(packed)
        if isinstance(packed, SavedRef):
            if packed.tensor._version != packed.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation (saved at version {packed.version}, now "
                    f"{packed.tensor._version}); clone it before modifying it in place"
                )
            return packed.tensor
        assert self.outer is not None, "a foreign packed value without outer hooks"
        return self.outer[1](packed)
