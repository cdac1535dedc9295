"""Optimizer shards on the NVMe tier, streamed through host memory at the step.

[Note: streamed optimizer]
A chunk index whose fp32 master and optimizer-state shards live on disk has, between steps, no
host memory at all: the shard lists hold ``None`` there. At the step the indices on disk are
updated one after another through a three-slot pipeline: while index ``k`` is updated, index
``k+1`` is read and index ``k-1`` written, all on the NVMe tier's threads, so a step costs
about ``max(update, read, write)`` per index rather than their sum, and the host holds at most
three indices' state. Every rank puts the same indices on disk (the choice depends only on the
layout and the budgets, which are the same everywhere), so the streaming needs no collective.
Which indices go to disk: :func:`plan_nvme` keeps as many as the host budget allows (in index
order) after what the host must hold anyway, and puts the rest on disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from tidal.config import ConfigError, format_bytes
from tidal.memory.nvme import NvmeTier
from tidal.memory.tiers import Tier

__all__ = ["ShardLists", "StateSwapper", "plan_nvme"]

# (name, list indexed by chunk index): the shard lists of one kind (a master, a moment)
ShardLists = list[tuple[str, list[torch.Tensor | None]]]

STAGING_GROUPS = 3  # being read, being updated, being written


def plan_nvme(
    *,
    group_bytes: list[int],
    fixed_host_bytes: int,
    host_budget_bytes: int | None,
    has_nvme: bool,
) -> frozenset[int]:
    """The chunk indices whose optimizer shards (``group_bytes[i]`` each; 0: none) go to disk."""
    if not has_nvme or host_budget_bytes is None:
        return frozenset()
    staging = STAGING_GROUPS * max(group_bytes, default=0)
    room = host_budget_bytes - fixed_host_bytes - staging
    if room < 0:
        raise ConfigError(
            "memory.host_budget",
            f"{format_bytes(host_budget_bytes)} is below what this rank's host memory must hold "
            f"even with every optimizer shard on disk: {format_bytes(fixed_host_bytes)} of "
            f"parameter and gradient shards and {format_bytes(staging)} of staging for "
            f"{STAGING_GROUPS} chunks of optimizer state; raise it to at least "
            f"{format_bytes(fixed_host_bytes + staging)}, lower chunk.size, or add ranks",
        )
    on_disk = set()
    for index, num_bytes in enumerate(group_bytes):
        if num_bytes == 0:
            continue
        if num_bytes <= room:
            room -= num_bytes
        else:
            on_disk.add(index)
    return frozenset(on_disk)


class StateSwapper:
    """Moves the shard lists' entries for ``indices`` between the host and the NVMe tier."""

    def __init__(self, nvme: NvmeTier, host_tier: Tier, indices: frozenset[int]) -> None:
        self.nvme = nvme
        self.host_tier = host_tier
        self.indices = indices

    def offload(self, lists: ShardLists, index: int) -> None:
        """Write ``index``'s shards to disk and give back their host memory."""
        assert index in self.indices
        futures = [self.nvme.write(_key(name, index), shards[index]) for name, shards in lists
                   if shards[index] is not None]  # fmt: skip
        for future in futures:
            future.result()
        for _, shards in lists:
            shard = shards[index]
            if shard is not None:
                self.host_tier.free(shard)
                shards[index] = None

    def _read(self, lists: ShardLists, index: int, numel: int) -> list[Future[None]]:
        futures = []
        for name, shards in lists:
            if self.nvme.holds(_key(name, index)):
                shards[index] = self.host_tier.allocate(numel, torch.float32, own_mapping=False)
                futures.append(self.nvme.read(_key(name, index), shards[index]))
        return futures

    def stream(self, lists: ShardLists, numels: dict[int, int]) -> Iterator[int]:
        """Yield each index on disk with its shards in host memory; what the caller changed is
        written back after it moves on ([Note: streamed optimizer])."""
        order = sorted(self.indices)
        pending_read = self._read(lists, order[0], numels[order[0]]) if order else []
        writing: tuple[int, list[Future[None]]] | None = None
        for position, index in enumerate(order):
            for future in pending_read:
                future.result()
            if position + 1 < len(order):
                following = order[position + 1]
                pending_read = self._read(lists, following, numels[following])
            yield index
            if writing is not None:
                self._finish(lists, *writing)
            writing = (index, [self.nvme.write(_key(name, index), shards[index])
                               for name, shards in lists if shards[index] is not None])  # fmt: skip
        if writing is not None:
            self._finish(lists, *writing)

    def _finish(self, lists: ShardLists, index: int, futures: list[Future[None]]) -> None:
        for future in futures:
            future.result()
        for _, shards in lists:
            shard = shards[index]
            if shard is not None:
                self.host_tier.free(shard)
                shards[index] = None

    @contextlib.contextmanager
    def one(self, lists: ShardLists, index: int, numel: int) -> Iterator[None]:
        """``index``'s shards in host memory for the duration (read only)."""
        if index not in self.indices:
            yield
            return
        for future in self._read(lists, index, numel):
            future.result()
        try:
            yield
        finally:
            self._finish(lists, index, [])

    @contextlib.contextmanager
    def resident(
        self, lists: ShardLists, numels: dict[int, int], *, write_back: bool
    ) -> Iterator[None]:
        """Every index's shards in host memory at once (checkpoints); written back after if
        ``write_back``. Needs host room for all of them."""
        for index in sorted(self.indices):
            for future in self._read(lists, index, numels[index]):
                future.result()
        try:
            yield
        finally:
            for index in sorted(self.indices):
                if write_back:
                    futures = [self.nvme.write(_key(name, index), shards[index])
                               for name, shards in lists if shards[index] is not None]  # fmt: skip
                else:
                    futures = []
                self._finish(lists, index, futures)


def _key(name: str, index: int) -> str:
    return f"{name}-{index:06d}"
