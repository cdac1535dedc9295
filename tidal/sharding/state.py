"""Model and optimizer state as flat per-parameter tensors for torch.distributed.checkpoint.

[Note: checkpoint tensors]
A checkpoint must load at any world size and any chunk layout, so it is written per parameter,
never per chunk: key ``model/<name>`` holds a parameter's weights (fp32 where there is an fp32
copy: the masters of a bf16 run), ``optim/<name>/<state>`` its optimizer state, every one
flattened to 1-D. Flat, because a rank's share of a parameter is a flat range
([Note: updates on pieces] in optim.py) that is not a block of the parameter's shape in
general; the shapes are recorded beside (meta.json) for whoever reads the checkpoint whole.
Sharded, a key is a ``ShardedTensor`` whose local shard is a *view* of this rank's piece in
its shard, with the global metadata listing every rank's piece (computed, not exchanged: all
ranks know the layout). DCP then writes each rank's pieces from that rank, in parallel, and on
load reads into each piece exactly the bytes it covers, whatever world size wrote them. One
process (the reference and chunk engines, or the sharded engine with an NVMe tier and no
process group) writes plain tensors under the same keys, so all of them load each other's
checkpoints.
Tied parameters are stored once, under their first name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.sharding.swap import nvme_key

if TYPE_CHECKING:
    from tidal.sharding.optim import ShardedOptimizer

__all__ = ["DiskPiece", "PieceKey", "model_key", "optim_key", "sharded_tensors"]

PieceKey = tuple[str, int]  # (checkpoint key, where this rank's piece starts in the parameter)


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


def sharded_tensors(
    optimizer: ShardedOptimizer,
) -> tuple[dict[str, Any], dict[PieceKey, DiskPiece]]:
    """Every key of [Note: checkpoint tensors] as ShardedTensors over views of this rank's shards
    (save from them, or load into them in place), optimizer state only where it was written;
    and the pieces whose shard is on the NVMe tier ([Note: checkpoint pieces on disk])."""
    store, rank = optimizer.store, optimizer.comm.rank
    tensors: dict[str, Any] = {}
    on_disk: dict[PieceKey, DiskPiece] = {}
    stand_in = _StandIn(max((store.shard_numel(i) for i in range(len(store.chunks))), default=0))
    written = optimizer.names_with_state()
    for index, spec in enumerate(store.layout.chunks):
        for info in spec.slots:
            name = info.names[0]
            lists = [(model_key(name), optimizer.weight_list(index))]
            if name in written:
                lists += [(optim_key(name, s.name), s) for s in optimizer.state_lists()]
            ranges = list(_ranges(optimizer, index, info.offset, info.numel))
            for key, shards in lists:
                shard = shards.shards[index]
                if shard is None:  # on disk: a stand-in, and where each local piece lives
                    shard = stand_in.view(store.shard_numel(index), shards.dtype)
                    for owner, param_begin, shard_begin, length in ranges:
                        if owner == rank:
                            offset_bytes = shard_begin * shards.dtype.itemsize
                            on_disk[key, param_begin] = DiskPiece(
                                nvme_key(shards.name, index), offset_bytes, length, shards.dtype
                            )
                if optimizer.comm.local:  # no process group: the one piece is the parameter
                    ((_, _, shard_begin, _),) = ranges
                    tensors[key] = shard.narrow(0, shard_begin, info.numel)
                else:
                    tensors[key] = _sharded(shard, ranges, rank, info.numel)
    return tensors, on_disk


class _StandIn:
    """One buffer per dtype, a shard long, whose views stand in for shards on disk: DCP needs a
    tensor of the right size and device per local piece, and never touches its data when the
    planner serves the piece ([Note: checkpoint pieces on disk])."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._buffers:
            self._buffers[dtype] = torch.full((self.numel,), float("nan"), dtype=dtype)
        return self._buffers[dtype][:numel]


def _sharded(shard: torch.Tensor, ranges: list[tuple], rank: int, numel: int) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    # This rank's device for every owner: placements are checked only against local shards,
    # and DCP records offsets and sizes, not devices. A pinned host shard says so (CUDA).
    device = str(shard.device)
    shards_md, local = [], []
    for owner, param_begin, shard_begin, length in ranges:
        md = ShardMetadata(shard_offsets=[param_begin], shard_sizes=[length],
                           placement=f"rank:{owner}/{device}")  # fmt: skip
        shards_md.append(md)
        if owner == rank:
            local.append(Shard(shard.narrow(0, shard_begin, length), md))
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=torch.Size([numel]),
        tensor_properties=TensorProperties(dtype=shard.dtype, pin_memory=shard.is_pinned()),
    )
    with warnings.catch_warnings():  # the sharded-tensor API's deprecation notice
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)
