"""The ``[chunk]`` section: how model data is cut into chunks and placed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tidal.config import require

__all__ = ["ChunkConfig"]


@dataclass(kw_only=True, slots=True)
class ChunkConfig:
    """Chunking and placement for ``engine = "chunk"``.

    Attributes:
        size: elements per chunk; ``None`` searches the size that wastes the least padding.
        max_size: the largest size that search may choose (``None``: the layout's default
            ceiling); a parameter larger than it gets a chunk of its own. A moment holds whole
            chunks: smaller ones let a tight device budget run, at more padding and more
            copies.
        align: slot offsets are multiples of this many elements.
        policy: which chunk leaves the device when room is needed: ``belady`` (the one whose
            next use in the last iteration's trace is furthest away) or ``lru``.
        prefetch: while a moment runs, fetch the next moment's chunks into room the trace says
            is free (on CUDA the copies run on a side stream and overlap the compute; the bytes
            moved are the same as without it).
        relayout: re-pack parameters in first-use order after the first iteration (at the first
            optimizer step; see [Note: relayout] in tidal/memory/relayout.py); before there is a
            trace the layout follows construction order. One process only: sharded chunks
            (ZeRO-3, or the NVMe tier) stay where they are.
        grads_in_params: with bf16/fp16 parameters (fp32 masters) and no gradient accumulation,
            write each gradient into its parameter's own low-precision slot instead of an fp32
            gradient chunk ([Note: gradients in parameter chunks] in tidal/memory/optim.py).
            One process only: sharded, gradients are reduced in fp32 gradient buffers.

    ``relayout`` and ``grads_in_params`` are on where they apply when left unset (``None``);
    ``false`` turns them off, and ``true`` where they cannot apply (sharded) is refused.
    """

    size: int | None = None
    max_size: int | None = None
    align: int = 64
    policy: Literal["belady", "lru"] = "belady"
    prefetch: bool = True
    relayout: bool | None = None
    grads_in_params: bool | None = None

    def __post_init__(self) -> None:
        if self.size is not None:
            require(self.size >= 1, "size", f"must be >= 1 element, got {self.size}")
        if self.max_size is not None:
            require(self.size is None, "max_size", "bounds the size search; with chunk.size "
                    "set there is none: set one of them")  # fmt: skip
            require(self.max_size >= 1, "max_size", f"must be >= 1 element, got {self.max_size}")
        require(self.align >= 1, "align", f"must be >= 1, got {self.align}")
