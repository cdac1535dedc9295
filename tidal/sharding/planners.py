"""DCP planners for sharded checkpoints: they find each rank's pieces ([Note: checkpoint
tensors] in state.py), in memory or on the NVMe tier.

[Note: checkpoint pieces on disk]
A rank whose shards are partly on disk ([Note: nvme placement] in swap.py) has less host memory
than its share of the model, so a checkpoint must not bring those shards in. Such a piece is a
:class:`~tidal.sharding.state.DiskPiece` (its file, offset, length and dtype) where a piece in
memory is a view, and the planners serve it from the file through DCP's documented extension
points: saving, :meth:`PieceSavePlanner.lookup_object` reads the piece when DCP is about to write
it (DCP writes one item at a time, so the host holds one piece at once); loading,
:meth:`PieceLoadPlanner.resolve_tensor` gives DCP a fresh buffer for the bytes it read and
:meth:`PieceLoadPlanner.commit_tensor` writes them at their place in the file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from tidal.memory.nvme import NvmeTier
from tidal.sharding.state import DiskPiece, Pieces

__all__ = ["PieceLoadPlanner", "PieceSavePlanner"]


def _piece(state: dict[str, Any], index: MetadataIndex) -> torch.Tensor | DiskPiece | None:
    """The piece ``index`` names, if its key is a :class:`Pieces` (else None: a plain tensor)."""
    value = state[index.fqn]
    if not isinstance(value, Pieces):
        return None
    assert index.offset is not None and len(index.offset) == 1, index
    return value.pieces[int(index.offset[0])]


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading each rank's pieces (from disk where they are there)."""

    def __init__(self, nvme: NvmeTier | None) -> None:
        super().__init__()
        self.nvme = nvme

    def lookup_object(self, index: MetadataIndex) -> Any:
        piece = _piece(self.state_dict, index)
        if piece is None:
            return super().lookup_object(index)
        if isinstance(piece, torch.Tensor):
            return piece
        assert self.nvme is not None
        out = torch.empty(piece.numel, dtype=piece.dtype)
        self.nvme.read(piece.file, out, offset_bytes=piece.offset_bytes).result()
        return out


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading into each rank's pieces (on disk where they are)."""

    def __init__(self, nvme: NvmeTier | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.nvme = nvme

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:  # fmt: skip
        # DCP's own set-up rebuilds the values it knows and drops the rest (Pieces): the
        # checkpoint's keys are flat and in memory already, so nothing is left for it to do.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = _piece(self.state_dict, index)
        if piece is None:
            return super().lookup_tensor(index)
        assert isinstance(piece, torch.Tensor), index  # resolve_tensor serves the others
        return piece

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = _piece(self.state_dict, read_item.dest_index)
        if isinstance(piece, DiskPiece):
            return torch.empty(read_item.lengths, dtype=piece.dtype)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        piece = _piece(self.state_dict, read_item.dest_index)
        if not isinstance(piece, DiskPiece):
            return super().commit_tensor(read_item, tensor)
        assert self.nvme is not None
        (begin,) = read_item.dest_offsets  # within this rank's piece
        offset_bytes = piece.offset_bytes + int(begin) * piece.dtype.itemsize
        self.nvme.write(piece.file, tensor.contiguous(), offset_bytes=offset_bytes).result()
