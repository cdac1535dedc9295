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
process writes plain tensors under the same keys, so the two load each other's checkpoints.
Tied parameters are stored once, under their first name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tidal.memory.optim_rules import STATE_KEYS

if TYPE_CHECKING:
    from tidal.sharding.optim import ShardedOptimizer

__all__ = ["model_key", "optim_key", "sharded_tensors"]


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


def sharded_tensors(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """Every key of [Note: checkpoint tensors] as ShardedTensors over views of this rank's shards
    (save from them, or load into them in place). Optimizer state only where it was written."""
    store, rank = optimizer.store, optimizer.comm.rank
    masters = optimizer.masters
    tensors: dict[str, Any] = {}
    written = optimizer.names_with_state()
    for index, spec in enumerate(store.layout.chunks):
        master = masters[index] if masters is not None else None
        weights = master if master is not None else store.shards[index]
        for info in spec.slots:
            name = info.names[0]
            ranges = list(_ranges(optimizer, index, info.offset, info.numel))
            tensors[model_key(name)] = _sharded(weights, ranges, rank, info.numel)
            if name in written:
                for kind, shards in optimizer.states.items():
                    shard = shards[index]
                    assert shard is not None
                    key = optim_key(name, STATE_KEYS[kind])
                    tensors[key] = _sharded(shard, ranges, rank, info.numel)
    return tensors


def _sharded(shard: torch.Tensor, ranges: list[tuple], rank: int, numel: int) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    device = shard.device.type
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
        tensor_properties=TensorProperties(dtype=shard.dtype),
    )
    with warnings.catch_warnings():  # the sharded-tensor API's deprecation notice
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)
