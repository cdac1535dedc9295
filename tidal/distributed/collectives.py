"""Collectives over flat buffers, with the bytes each rank sends or receives counted.

[Note: collective byte counts]
The counters are per rank and count what crosses the network in a ring implementation, which
is what the ZeRO papers' formulas count: an all-gather of a buffer of ``B`` bytes brings each
rank the ``B * (N-1)/N`` bytes it does not hold; a reduce-scatter of a ``B``-byte buffer sends
``B * (N-1)/N`` of it; an all-reduce of ``B`` bytes is a reduce-scatter plus an all-gather,
``2 * B * (N-1)/N``. So ZeRO-3's per-step volume, an all-gather of the parameters for the
forward, another for the backward and a reduce-scatter of the gradients, reads directly off
``bytes_all_gathered + bytes_reduce_scattered``. The counts are exact integers: buffers are
whole multiples of the world size (each rank holds an equal shard).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collectives", "FunctionalCollectiveBytes"]

# all_gather_single / reduce_scatter_single replaced the *_tensor names in later torch
# releases; the device machine runs an older one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _cpu_group(group: Any) -> Any:
    """``group`` if it runs on the CPU (gloo), else a gloo group of the same ranks; every rank
    of the default group must build its collectives at the same point (a new group is a
    collective)."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


class Collectives:
    """The collectives of one process group, counting bytes ([Note: collective byte counts])."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        # One process without a process group: the collectives are copies (the NVMe tier runs
        # the sharded engine on one process).
        self.local = group is None and not (dist.is_available() and dist.is_initialized())
        self.rank = 0 if self.local else dist.get_rank(group)
        self.world_size = 1 if self.local else dist.get_world_size(group)
        # Small checks go through a CPU group: they never wait for the device's queue.
        self._cpu_group = None if self.local else _cpu_group(group)
        self.bytes_all_gathered = 0
        self.bytes_reduce_scattered = 0
        self.bytes_all_reduced = 0
        self.num_all_gathers = 0
        self.num_reduce_scatters = 0

    def _peer_bytes(self, num_bytes: int) -> int:
        assert num_bytes % self.world_size == 0, (num_bytes, self.world_size)
        return num_bytes // self.world_size * (self.world_size - 1)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool) -> Any:
        """Every rank's ``shard`` into ``output`` (rank order); a work handle if ``async_op``."""
        assert output.numel() == shard.numel() * self.world_size, (output.shape, shard.shape)
        self.bytes_all_gathered += self._peer_bytes(output.nbytes)
        self.num_all_gathers += 1
        if self.local:
            output.copy_(shard)
            return None
        return _all_gather(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, *, async_op: bool) -> Any:
        """The sum over ranks of ``full``'s ``rank``-th shard into ``shard``."""
        assert full.numel() == shard.numel() * self.world_size, (full.shape, shard.shape)
        self.bytes_reduce_scattered += self._peer_bytes(full.nbytes)
        self.num_reduce_scatters += 1
        if self.local:
            shard.copy_(full)
            return None
        return _reduce_scatter(shard, full, group=self.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks in place (small tensors: norms, flags)."""
        self.bytes_all_reduced += 2 * tensor.nbytes * (self.world_size - 1) // self.world_size
        if self.local:
            return
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def min_max(self, value: int) -> tuple[int, int]:
        """The least and the largest ``value`` over the ranks (collective)."""
        if self.local:
            return value, value
        both = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return -int(both[1]), int(both[0])

    def max_each(self, values: list[int]) -> list[int]:
        """The largest of each of ``values`` over the ranks (collective; every rank passes the
        same number of values). The least is ``-max(-value)``: one call can carry both."""
        if self.local:
            return list(values)
        both = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return [int(v) for v in both]

    def stats(self) -> dict[str, int]:
        return {
            "bytes_all_gathered": self.bytes_all_gathered,
            "bytes_reduce_scattered": self.bytes_reduce_scattered,
            "bytes_all_reduced": self.bytes_all_reduced,
            "all_gathers": self.num_all_gathers,
            "reduce_scatters": self.num_reduce_scatters,
        }


class FunctionalCollectiveBytes(TorchDispatchMode):
    """While active, counts the bytes of the functional collectives run on this thread (those
    DTensor issues for tensor parallelism, in the forward and in the backward autograd runs
    from it) by the ring formulas of [Note: collective byte counts], into the same three
    counters as :class:`Collectives`; other operations pass through untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_all_gathered = 0
        self.bytes_reduce_scattered = 0
        self.bytes_all_reduced = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional":
            self._count(func.__name__.split(".")[0], args)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: tuple[Any, ...]) -> None:
        tensor, group_name = args[0], args[-1]
        if not isinstance(tensor, torch.Tensor) or not isinstance(group_name, str):
            return  # wait_tensor and the like move nothing
        size = dist.distributed_c10d._resolve_process_group(cast(Any, group_name)).size()
        nbytes = tensor.numel() * tensor.element_size()
        if name == "all_reduce":
            self.bytes_all_reduced += 2 * nbytes * (size - 1) // size
        elif name == "all_gather_into_tensor":  # the input is this rank's shard
            self.bytes_all_gathered += nbytes * (size - 1)
        elif name == "reduce_scatter_tensor":
            self.bytes_reduce_scattered += nbytes * (size - 1) // size

    def stats(self) -> dict[str, int]:
        return {
            "bytes_all_gathered": self.bytes_all_gathered,
            "bytes_reduce_scattered": self.bytes_reduce_scattered,
            "bytes_all_reduced": self.bytes_all_reduced,
        }
