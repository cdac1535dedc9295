"""Model data on the NVMe tier: what goes there, and how it passes through host memory.

[Note: nvme placement]
Each chunk index's shards are placed on one of three levels, chosen once at construction by
:func:`plan_nvme` from the host budget (every rank chooses alike: the choice depends only on
the layout and the budgets, which are the same everywhere, so the streaming needs no
collective):

1. everything in memory (host, or the device when it has no budget);
2. *state on disk*: the fp32 master and optimizer-state shards, touched once per step, live in
   files; parameter and gradient shards stay in memory. Indices go to this level first, as few
   as the budget allows (in index order);
3. *everything on disk*: when the host cannot hold the parameter and gradient shards of every
   index even with all optimizer state on disk, the largest indices also keep their parameter
   shard and their gradient shard in files. A parameter shard is then read before each gather
   (twice per step with ``reshard_after_forward``), ahead of time along the trace
   (:class:`ShardReader`); a gradient shard is written when its reduction completes and read
   back at the step.

What the host must hold besides the shards in memory is staging (:func:`nvme_staging_bytes`),
counted in the plan: three indices' worth for the streamed step, and at the third level
``read_ahead + 1`` parameter shards being read and ``GRAD_WRITES`` gradient shards being
written. A budget below that even with everything on disk is a one-line error that gives the
minimum.

A share instead of a budget (``state_fraction``, ``memory.nvme_state_fraction``): the state of
that fraction of the optimizer's bytes goes to disk, the last indices first, to the nearest
index (second level only). A plan says so ([Note: chunk stages in plans] in
tidal/planner/model_data.py): its host figure was priced per parameter, without the chunks'
padding, which a budget would take out of the state the plan keeps in memory.

[Note: streamed optimizer]
An index on disk has, between steps, no host memory for what is on disk: the shard lists hold
``None`` there. At the step the indices on disk are updated one after another through a
three-slot pipeline: while index ``k`` is updated, index ``k+1`` is read and index ``k-1``
written, all on the NVMe tier's threads, so a step costs about ``max(update, read, write)`` per
index rather than their sum, and the host holds at most three indices' shards. Each list says
whether the update needs what is on disk (gradients and weights, yes; bf16 parameter shards,
which the update overwrites from the masters, no) and whether what the update changed goes back
(gradients, which the step consumes, do not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tidal.config import ConfigError, format_bytes
from tidal.memory.nvme import NvmeTier
from tidal.memory.tiers import Tier

__all__ = [
    "GRAD",
    "GRAD_WRITES",
    "PARAM",
    "NvmePlan",
    "ShardList",
    "ShardReader",
    "StateSwapper",
    "nvme_key",
    "nvme_staging_bytes",
    "plan_nvme",
]

STAGING_GROUPS = 3  # being read, being updated, being written
GRAD_WRITES = 2  # gradient shards written to disk at once during the backward
PARAM = "param"  # the file names of parameter and gradient shards (the state kinds use torch's)
GRAD = "grad"


@dataclass(frozen=True, slots=True)
class NvmePlan:
    """The chunk indices on disk at each level of [Note: nvme placement]."""

    state: frozenset[int] = frozenset()  # optimizer state (and masters) on disk
    params: frozenset[int] = frozenset()  # parameter and gradient shards on disk too

    @property
    def indices(self) -> frozenset[int]:
        return self.state | self.params


def plan_nvme(
    *,
    state_bytes: list[int],
    param_bytes: list[int],
    grad_bytes: list[int],
    host_budget_bytes: int | None,
    read_ahead: int,
    state_fraction: float | None = None,
) -> NvmePlan:
    """Which indices go to disk at which level ([Note: nvme placement]); per index the bytes of
    its optimizer state (masters included; 0: none), parameter shard and gradient shard;
    ``state_fraction``: that share of the state on disk, whatever the host's budget."""
    if state_fraction is not None:
        return NvmePlan(state=_state_share(state_bytes, state_fraction))
    if host_budget_bytes is None:
        return NvmePlan()
    in_memory = sum(param_bytes) + sum(grad_bytes)
    room = host_budget_bytes - in_memory - STAGING_GROUPS * max(state_bytes, default=0)
    if room >= 0:
        return NvmePlan(state=_state_beyond(state_bytes, room))
    groups = [s + p + g for s, p, g in zip(state_bytes, param_bytes, grad_bytes, strict=True)]
    staging = (
        STAGING_GROUPS * max(groups, default=0)
        + (read_ahead + 1) * max(param_bytes, default=0)
        + GRAD_WRITES * max(grad_bytes, default=0)
    )
    if staging > host_budget_bytes:
        raise ConfigError(
            "memory.host_budget",
            f"{format_bytes(host_budget_bytes)} is below what this rank's host memory must hold "
            f"even with every parameter, gradient and optimizer shard on disk: "
            f"{format_bytes(staging)} of staging ({STAGING_GROUPS} chunks of model data for the "
            f"streamed step, {read_ahead + 1} parameter shards read ahead, {GRAD_WRITES} "
            f"gradient shards being written); raise it to at least {format_bytes(staging)}, "
            f"lower chunk.size or memory.nvme_read_ahead, or add ranks",
        )
    params: set[int] = set()
    for index in sorted(range(len(groups)), key=lambda i: (-(param_bytes[i] + grad_bytes[i]), i)):
        if in_memory + staging <= host_budget_bytes:
            break
        params.add(index)
        in_memory -= param_bytes[index] + grad_bytes[index]
    state = frozenset(i for i, num_bytes in enumerate(state_bytes) if num_bytes)
    return NvmePlan(state=state, params=frozenset(params))


def nvme_staging_bytes(plan: NvmePlan, *, state_bytes: list[int], param_bytes: list[int],
                       grad_bytes: list[int], read_ahead: int) -> int:  # fmt: skip
    """The host bytes ``plan``'s disk traffic stages besides the shards kept in memory ([Note:
    nvme placement]): three indices' state at the second level, the third level's whole
    staging."""
    if plan.params:
        return (STAGING_GROUPS * max(map(sum, zip(state_bytes, param_bytes, grad_bytes, strict=True)))
                + (read_ahead + 1) * max(param_bytes) + GRAD_WRITES * max(grad_bytes))  # fmt: skip
    return STAGING_GROUPS * max((state_bytes[i] for i in plan.state), default=0)


def _state_share(state_bytes: list[int], fraction: float) -> frozenset[int]:
    """The last indices whose state comes nearest ``fraction`` of it all (an index goes to disk
    when at least half of it is within the share)."""
    assert 0 <= fraction <= 1, fraction
    share, on_disk = fraction * sum(state_bytes), set()
    for index in reversed(range(len(state_bytes))):
        num_bytes = state_bytes[index]
        if num_bytes and num_bytes / 2 <= share:
            on_disk.add(index)
            share -= num_bytes
    return frozenset(on_disk)


def _state_beyond(state_bytes: list[int], room: int) -> frozenset[int]:
    """Keep optimizer state in memory, in index order, while it fits ``room``; the rest."""
    on_disk = set()
    for index, num_bytes in enumerate(state_bytes):
        if num_bytes == 0:
            continue
        if num_bytes <= room:
            room -= num_bytes
        else:
            on_disk.add(index)
    return frozenset(on_disk)


@dataclass(frozen=True, slots=True)
class ShardList:
    """One kind of shard by chunk index (a moment, the masters, the weights, the gradients),
    with the indices whose entry lives on disk; see [Note: streamed optimizer]."""

    name: str
    shards: list[torch.Tensor | None]
    dtype: torch.dtype
    on_disk: frozenset[int]
    read: bool = True  # the update needs what is on disk
    write: bool = True  # what the update changed goes back to disk


class StateSwapper:
    """Moves shard lists' entries between the host and the NVMe tier."""

    def __init__(self, nvme: NvmeTier, host_tier: Tier, plan: NvmePlan) -> None:
        self.nvme = nvme
        self.host_tier = host_tier
        self.plan = plan

    @property
    def indices(self) -> frozenset[int]:
        return self.plan.indices

    def offload(self, shards: ShardList, index: int) -> None:
        """Write ``index``'s entry to disk and give back its host memory."""
        assert index in shards.on_disk, (shards.name, index)
        shard = shards.shards[index]
        assert shard is not None
        self.nvme.write(nvme_key(shards.name, index), shard).result()
        self.host_tier.free(shard)
        shards.shards[index] = None

    def _bring(
        self, lists: list[ShardList], index: int, numel: int, *, streaming: bool
    ) -> list[Future[None]]:
        """Host memory for ``index``'s entries on disk, read unless the update overwrites them."""
        futures = []
        for shards in lists:
            if index not in shards.on_disk:
                continue
            assert shards.shards[index] is None, (shards.name, index)
            shard = self.host_tier.allocate(numel, shards.dtype, own_mapping=False)
            shards.shards[index] = shard
            if shards.read or not streaming:
                futures.append(self.nvme.read(nvme_key(shards.name, index), shard))
        return futures

    def stream(self, lists: list[ShardList], numels: dict[int, int]) -> Iterator[int]:
        """Yield each index some list keeps on disk, with its entries in host memory; what the
        caller changed is written back after it moves on ([Note: streamed optimizer])."""
        order = sorted(set().union(*(s.on_disk for s in lists)) & numels.keys())
        pending_read = (
            self._bring(lists, order[0], numels[order[0]], streaming=True) if order else []
        )
        writing: tuple[int, list[Future[None]]] | None = None
        for position, index in enumerate(order):
            for future in pending_read:
                future.result()
            if position + 1 < len(order):
                following = order[position + 1]
                pending_read = self._bring(lists, following, numels[following], streaming=True)
            yield index
            if writing is not None:
                self._finish(lists, *writing)
            writing = (index, self._write(lists, index))
        if writing is not None:
            self._finish(lists, *writing)

    def _write(self, lists: list[ShardList], index: int) -> list[Future[None]]:
        return [self.nvme.write(nvme_key(s.name, index), s.shards[index])  # type: ignore[arg-type]
                for s in lists if s.write and index in s.on_disk]  # fmt: skip

    def _finish(self, lists: list[ShardList], index: int, futures: list[Future[None]]) -> None:
        for future in futures:
            future.result()
        for shards in lists:
            shard = shards.shards[index]
            if index in shards.on_disk and shard is not None:
                self.host_tier.free(shard)
                shards.shards[index] = None

    @contextlib.contextmanager
    def one(
        self, lists: list[ShardList], index: int, numel: int, *, write_back: bool = False
    ) -> Iterator[None]:
        """``index``'s entries in host memory for the duration; written back if ``write_back``."""
        for future in self._bring(lists, index, numel, streaming=False):
            future.result()
        try:
            yield
        finally:
            self._finish(lists, index, self._write(lists, index) if write_back else [])

    def read_now(self, name: str, index: int, out: torch.Tensor) -> None:
        self.nvme.read(nvme_key(name, index), out).result()

    def write_async(self, name: str, index: int, shard: torch.Tensor) -> Future[None]:
        return self.nvme.write(nvme_key(name, index), shard)


class ShardReader:
    """Parameter shards on disk ([Note: nvme placement], level 3), read into host staging
    ahead of the gathers that need them: at most ``depth`` reads in flight or waiting to be
    taken, plus the one a gather that was not read ahead reads on demand."""

    def __init__(
        self, swapper: StateSwapper, *, numels: list[int], dtype: torch.dtype, depth: int
    ) -> None:
        self.swapper = swapper
        self.indices = swapper.plan.params
        self.numels = numels
        self.dtype = dtype
        self.depth = depth
        self._ahead: dict[int, tuple[Future[None], torch.Tensor]] = {}
        self.num_read_ahead = 0
        self.num_read_on_demand = 0

    @property
    def full(self) -> bool:
        return len(self._ahead) >= self.depth

    @property
    def ahead_bytes(self) -> int:
        """Bytes read (or being read) ahead and not taken yet."""
        return sum(staging.nbytes for _, staging in self._ahead.values())

    def has_ahead(self, index: int) -> bool:
        return index in self._ahead

    def request(self, index: int) -> None:
        """Start reading ``index``'s shard unless it is being read or the reader is full."""
        assert index in self.indices, index
        if index in self._ahead or self.full:
            return
        self._ahead[index] = self._start(index)
        self.num_read_ahead += 1

    def _start(self, index: int) -> tuple[Future[None], torch.Tensor]:
        staging = self.swapper.host_tier.allocate(self.numels[index], self.dtype, own_mapping=False)
        return self.swapper.nvme.read(nvme_key(PARAM, index), staging), staging

    def take(self, index: int) -> torch.Tensor:
        """``index``'s shard in host staging (read now if it was not read ahead); hand it back
        with :meth:`release` once copied."""
        pending = self._ahead.pop(index, None)
        if pending is None:
            pending = self._start(index)
            self.num_read_on_demand += 1
        future, staging = pending
        future.result()
        return staging

    def release(self, staging: torch.Tensor) -> None:
        self.swapper.host_tier.free(staging)

    def drop(self) -> None:
        """Forget every read ahead: the shards on disk are about to change (a step, a load)."""
        for future, staging in self._ahead.values():
            future.result()
            self.release(staging)
        self._ahead.clear()


def nvme_key(name: str, index: int) -> str:
    """The NVMe tier's file of list ``name``'s shard of chunk ``index``."""
    return f"{name}-{index:06d}"
