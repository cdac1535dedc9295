"""DCP planners for checkpoint pieces whose shards live on the NVMe tier.

[Note: checkpoint pieces on disk]
A rank whose shards are partly on disk ([Note: nvme placement] in swap.py) has less host memory
than its share of the model, so a checkpoint must not bring those shards in. The checkpoint
tensors ([Note: checkpoint tensors] in state.py) are the same ShardedTensors as for shards in
memory, except that a local piece on disk is a view of a stand-in buffer (one shard long, per
dtype, filled with NaN) that only gives DCP the size, dtype and device it plans with. The
planners serve those pieces from the files instead, through DCP's documented extension points:
saving, :meth:`DiskSavePlanner.resolve_data` reads a piece from its file when DCP is about to
write it (DCP writes one item at a time, so the host holds one piece at once); loading,
:meth:`DiskLoadPlanner.resolve_tensor` gives DCP a fresh buffer for the bytes it read and
:meth:`DiskLoadPlanner.commit_tensor` writes them at their place in the file. Pieces in memory
take DCP's default path. A piece the planners did not serve would write the stand-in's NaNs,
which the resume tests would see.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from tidal.memory.nvme import NvmeTier
from tidal.sharding.state import DiskPiece, PieceKey

__all__ = ["DiskLoadPlanner", "DiskSavePlanner"]


def _piece_key(index: MetadataIndex) -> PieceKey:
    assert index.offset is not None and len(index.offset) == 1, index
    return index.fqn, int(index.offset[0])


class DiskSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading the pieces on disk as they are written."""

    def __init__(self, nvme: NvmeTier, pieces: dict[PieceKey, DiskPiece]) -> None:
        super().__init__()
        self.nvme = nvme
        self.pieces = pieces

    def resolve_data(self, write_item: WriteItem) -> Any:
        piece = self.pieces.get(_piece_key(write_item.index))
        if piece is None:
            return super().resolve_data(write_item)
        out = torch.empty(piece.numel, dtype=piece.dtype)
        self.nvme.read(piece.file, out, offset_bytes=piece.offset_bytes).result()
        return out


class DiskLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, writing the pieces on disk as they are read."""

    def __init__(self, nvme: NvmeTier, pieces: dict[PieceKey, DiskPiece]) -> None:
        super().__init__()
        self.nvme = nvme
        self.pieces = pieces

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.pieces.get(_piece_key(read_item.dest_index))
        if piece is None:
            return super().resolve_tensor(read_item)
        return torch.empty(read_item.lengths, dtype=piece.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        piece = self.pieces.get(_piece_key(read_item.dest_index))
        if piece is None:
            return super().commit_tensor(read_item, tensor)
        (begin,) = read_item.dest_offsets  # within this rank's piece
        offset_bytes = piece.offset_bytes + int(begin) * piece.dtype.itemsize
        self.nvme.write(piece.file, tensor.contiguous(), offset_bytes=offset_bytes).result()
