"""Model and optimizer state as flat per-parameter tensors for torch.distributed.checkpoint.

[Note: checkpoint tensors]
A checkpoint must load at any world size and any chunk layout, so it is written per parameter,
never per chunk: key ``model/<name>`` holds a parameter's weights (fp32 where there is an fp32
copy: the masters of a bf16 run), ``optim/<name>/<state>`` its optimizer state, every one
flattened to 1-D. Flat, because a rank's share of a parameter is a flat range
([Note: updates on pieces] in optim.py) that is not a block of the parameter's shape in
general; the shapes are recorded beside (meta.json) for whoever reads the checkpoint whole.
Sharded, a key is a :class:`Pieces`: this rank's pieces of the key, each a *view* of its piece
in this rank's shard, given to DCP through its checkpointable protocol (the hooks DTensor
implements: ``__create_write_items__``, ``__create_chunk_list__``), with the checkpoint planners
of planners.py finding each piece by where it starts. Ranks plan only their own pieces (all ranks
know the layout, so nothing is exchanged); DCP then writes each rank's pieces from that rank, in
parallel, and on load reads into each piece exactly the bytes it covers, whatever world size
wrote them. The reference and chunk engines on one process write plain tensors under the same
keys, so all of them load each other's checkpoints.
Tied parameters are stored once, under their first name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.sharding.swap import nvme_key

if TYPE_CHECKING:
    from tidal.sharding.optim import ShardedOptimizer

__all__ = ["DiskPiece", "Pieces", "model_key", "optim_key", "sharded_tensors"]


@dataclass(frozen=True, slots=True)
class DiskPiece:
    """A local piece of a checkpoint key whose shard is on the NVMe tier: the file, where the
    piece starts in it, its length and dtype."""

    file: str
    offset_bytes: int
    numel: int
    dtype: torch.dtype


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim/{name}/{state}"


def _ranges(optimizer: ShardedOptimizer, index: int, offset: int, numel: int) -> Iterator[tuple]:
    """(rank, begin in the parameter, begin in the rank's shard, length) of each rank's piece."""
    shard = optimizer.store.shard_numel(index)
    for rank in range(optimizer.comm.world_size):
        lo, hi = max(offset, rank * shard), min(offset + numel, (rank + 1) * shard)
        if lo < hi:
            yield rank, lo - offset, lo - rank * shard, hi - lo


class Pieces:
    """This rank's pieces of one flat checkpoint key ([Note: checkpoint tensors]): the key's
    length and dtype, and each piece by where it begins in the key: a view of this rank's shard
    or, for a shard on the NVMe tier, where the piece lies in its file ([Note: checkpoint pieces
    on disk] in planners.py). A rank may hold none of a key's pieces."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel = numel
        self.dtype = dtype
        self.pieces: dict[int, torch.Tensor | DiskPiece] = {}

    def size(self) -> torch.Size:
        """The key's shape, which DCP compares with the saved one before a load."""
        return torch.Size([self.numel])

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size([begin]), sizes=torch.Size([_length(p)]))
                for begin, p in self.pieces.items()]  # fmt: skip

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties,
                                                      size=self.size()))
                for chunk in self.__create_chunk_list__()]  # fmt: skip


def _length(piece: torch.Tensor | DiskPiece) -> int:
    return piece.numel() if isinstance(piece, torch.Tensor) else piece.numel


def sharded_tensors(optimizer: ShardedOptimizer) -> dict[str, Pieces]:
    """Every key of [Note: checkpoint tensors] as this rank's :class:`Pieces` (save from them, or
    load into them in place), optimizer state only where it was written."""
    store, rank = optimizer.store, optimizer.comm.rank
    tensors: dict[str, Pieces] = {}
    written = optimizer.names_with_state()
    for index, spec in enumerate(store.layout.chunks):
        for info in spec.slots:
            name = info.names[0]
            lists = [(model_key(name), optimizer.weight_list(index))]
            if name in written:
                lists += [(optim_key(name, s.name), s) for s in optimizer.state_lists()]
            mine = [
                r[1:] for r in _ranges(optimizer, index, info.offset, info.numel) if r[0] == rank
            ]
            for key, shards in lists:
                pieces = tensors[key] = Pieces(info.numel, shards.dtype)
                shard = shards.shards[index]
                for param_begin, shard_begin, length in mine:
                    pieces.pieces[param_begin] = (
                        shard.narrow(0, shard_begin, length)
                        if shard is not None
                        else DiskPiece(nvme_key(shards.name, index),
                                       shard_begin * shards.dtype.itemsize, length, shards.dtype)
                    )  # fmt: skip
    return tensors
