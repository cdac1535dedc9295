"""The sharded optimizer: updates on this rank's shards, with gradients from grads.py.

[Note: updates on pieces]
A shard cuts parameters anywhere, so this rank's part of a parameter is a *piece*: the flat
range where the parameter's slot and this rank's shard overlap, at most one per parameter and
rank. torch's AdamW, Adam and SGD are elementwise, so running the rule over pieces gives every
element exactly the update it gets over whole tensors; what is not elementwise is handled once
for the whole model: the gradient norm is the square root of the sum over ranks of each rank's
sum of squares (all-reduced), and the step counters (one per parameter, as torch keeps them)
advance on every rank, holding a piece or not, so each rank can save them. A parameter without a
gradient this step is left alone, on every rank ([Note: parameters without a gradient] in
tidal/memory/optim.py; [Note: sharded gradients] in grads.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.materialize import feed_chunks
from tidal.memory.optim_rules import STATE_KEYS, OptimizerEntry, UpdateRule, clip_coefficient
from tidal.memory.tiers import Tier
from tidal.sharding.grads import ShardedGradients
from tidal.sharding.store import ShardedChunkStore, copy_into_shard
from tidal.sharding.swap import PARAM, ShardList, StateSwapper

MASTER = "master"  # the masters' name among the shard lists (the state kinds use torch's keys)

__all__ = ["ShardedOptimizer", "make_master_shards"]


def make_master_shards(
    model: nn.Module,
    store_layout: Any,
    *,
    rank: int,
    world_size: int,
    host_tier: Tier,
    values: Iterable[tuple[str, torch.Tensor]],
    swapper: StateSwapper | None = None,
) -> list[torch.Tensor | None]:
    """fp32 shards of the trainable chunks' weights, filled from ``values`` ([Note: deferred
    construction] in tidal/memory/materialize.py); None where a chunk has none trainable (or,
    with ``swapper``, where they went to disk)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    trainable = {spec.index for spec in store_layout.chunks
                 if any(params[info.names[0]].requires_grad for info in spec.slots)}  # fmt: skip
    on_disk = swapper.plan.state if swapper is not None else frozenset()
    masters: list[torch.Tensor | None] = [None] * len(store_layout.chunks)

    def begin(index: int) -> None:
        if index in trainable:
            numel = store_layout.chunks[index].capacity // world_size
            masters[index] = host_tier.allocate(numel, torch.float32).zero_()

    def write(index: int, slot: int, value: torch.Tensor) -> None:
        if index in trainable:
            start = rank * store_layout.chunks[index].capacity // world_size
            copy_into_shard(masters[index], value, store_layout.chunks[index].slots[slot],
                            start=start)  # fmt: skip

    def end(index: int) -> None:
        if swapper is not None and index in on_disk:
            swapper.offload(ShardList(MASTER, masters, torch.float32, on_disk), index)

    feed_chunks(store_layout, values, begin=begin, write=write, end=end)
    return masters


@dataclass(frozen=True, slots=True)
class _Piece:
    """Entry ``entry``'s elements ``[param_start, param_start + numel)`` (flat), found at
    ``[start, start + numel)`` of chunk ``chunk``'s shard ([Note: updates on pieces])."""

    entry: int
    chunk: int
    start: int
    param_start: int
    numel: int


class ShardedOptimizer:
    """Collect gradients from the grad hook, reduce-scatter them, update this rank's shards."""

    def __init__(
        self,
        store: ShardedChunkStore,
        *,
        names: dict[int, str],
        rule: UpdateRule,
        weight_decay: float,
        fused: bool | None,
        decays: Callable[[nn.Parameter], bool] = lambda p: p.dim() >= 2,
        masters: list[torch.Tensor | None] | None = None,
        max_pending: int = 2,
        swapper: StateSwapper | None = None,
    ) -> None:
        self.store = store
        # [Note: nvme placement] in swap.py: the indices with shards on disk, at either level.
        self.swapper = swapper
        self.on_disk = swapper.indices if swapper is not None else frozenset()
        self._state_on_disk = swapper.plan.state if swapper is not None else frozenset()
        self.comm = store.comm
        self.rule = rule
        self.masters = masters
        self.weight_decay = weight_decay
        self.fused = True if fused is None else fused
        self.grads_in_params = False  # the engine's figures ask
        self._entries = [
            OptimizerEntry(names[pid], param, *store.slot_of[pid], decay=decays(param))
            for pid, param in store.params.items()
            if param.requires_grad
        ]
        self.trainable = frozenset(e.chunk for e in self._entries)
        self.gradients = ShardedGradients(store, self._entries, max_pending=max_pending,
                                          swapper=swapper)  # fmt: skip
        self._pieces = [p for i, e in enumerate(self._entries) if (p := self._piece(i, e))]
        self._piece_of = {p.entry: p for p in self._pieces}
        self._entry_of = {id(e.param): i for i, e in enumerate(self._entries)}
        self.states = {kind: self._zero_shards(STATE_KEYS[kind]) for kind in rule.state_kinds}
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self._entries]
        if not rule.counts_steps:
            self.steps = []
        self._lazy = rule.lazy_state and bool(rule.state_kinds)
        self._has_state = [not self._lazy] * len(self._entries)
        self._entries_in: dict[int, list[int]] = {}  # chunk index -> its entries
        for i, e in enumerate(self._entries):
            self._entries_in.setdefault(e.chunk, []).append(i)
        self.on_device: frozenset[int] = frozenset()

    def _piece(self, i: int, e: OptimizerEntry) -> _Piece | None:
        info = self.store.layout.chunks[e.chunk].slots[e.slot]
        start, numel = self.store.shard_start(e.chunk), self.store.shard_numel(e.chunk)
        lo, hi = max(info.offset, start), min(info.offset + info.numel, start + numel)
        if lo >= hi:
            return None
        return _Piece(i, e.chunk, lo - start, lo - info.offset, hi - lo)

    def _zero_shards(self, name: str) -> list[torch.Tensor | None]:
        shards: list[torch.Tensor | None] = []
        for index in range(len(self.store.chunks)):
            shard = None
            if index in self.trainable:
                tier = self.store.shard_tiers[index]
                shard = tier.allocate(self.store.shard_numel(index), torch.float32)
                shard.zero_()
            shards.append(shard)
            if self.swapper is not None and index in self._state_on_disk:
                on_disk = ShardList(name, shards, torch.float32, self._state_on_disk)
                self.swapper.offload(on_disk, index)
        return shards

    # -- shards on disk ([Note: nvme placement], [Note: streamed optimizer] in swap.py) ---------

    def state_lists(self) -> list[ShardList]:
        """The optimizer-state shard lists, by torch's state names."""
        return [ShardList(STATE_KEYS[kind], shards, torch.float32, self._state_on_disk)
                for kind, shards in self.states.items()]  # fmt: skip

    def weight_list(self, index: int) -> ShardList:
        """Where chunk ``index``'s full-precision weights live: its masters, if it has any,
        else its parameter shards."""
        if self.masters is not None and index in self.trainable:
            return self._master_list()
        return self.param_list()

    def _master_list(self) -> ShardList:
        assert self.masters is not None
        return ShardList(MASTER, self.masters, torch.float32, self._state_on_disk)

    def param_list(self) -> ShardList:
        """The parameter shards; with masters, the update writes them without reading them."""
        store = self.store
        return ShardList(PARAM, store.shards, store.chunks[0].dtype, store.on_disk,
                         read=self.masters is None)  # fmt: skip

    def _step_lists(self) -> list[ShardList]:
        """What the step streams: state, masters, gradients (read, not written back) and
        parameter shards."""
        return [*self._optimizer_lists(), self.gradients.shard_list(), self.param_list()]

    def _optimizer_lists(self) -> list[ShardList]:
        """What the optimizer owns: its state and, in bf16, the fp32 masters."""
        masters = [self._master_list()] if self.masters is not None else []
        return [*self.state_lists(), *masters]

    def in_memory(
        self, index: int, lists: list[ShardList], *, write_back: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """``lists``' shards of ``index`` in memory for the duration, written back after if
        ``write_back``."""
        if self.swapper is None or index not in self.on_disk:
            return contextlib.nullcontext()
        numel = self.store.shard_numel(index)
        return self.swapper.one(lists, index, numel, write_back=write_back)

    # -- placement and figures -------------------------------------------------------------------

    def place(self, indices: frozenset[int], tier: Tier) -> None:
        """Keep the shards of ``indices`` (weights, masters, state) on ``tier``."""
        for index in sorted(indices):
            source = self.store.shard_tiers[index]
            self.store.move_shard(index, tier)
            for shards in (s.shards for s in self._optimizer_lists()):
                shard = shards[index]
                if shard is not None and source is not tier:
                    shards[index] = tier.allocate(shard.numel(), shard.dtype)
                    shards[index].copy_(shard)  # type: ignore[union-attr]
                    source.free(shard)
                    source.record_move(out_bytes=shard.nbytes)
                    tier.record_move(in_bytes=shard.nbytes)
        self.steps = [s.to(tier.device) for s in self.steps]
        self.on_device = indices if tier is self.store.device_tier else frozenset()

    @property
    def state_bytes(self) -> int:
        shards = [s for lst in self._optimizer_lists() for s in lst.shards if s is not None]
        return sum(s.nbytes for s in shards) + 4 * len(self.steps)

    # -- gradients ([Note: sharded gradients] in grads.py) --------------------------------------

    def collect(self, param: nn.Parameter) -> None:
        self.gradients.collect(param)

    def finish_backward(self) -> None:
        self.gradients.finish_backward()

    def zero_grad(self) -> None:
        self.gradients.zero()

    @property
    def grads(self) -> list[torch.Tensor | None]:
        return self.gradients.shards

    @property
    def grad_bytes(self) -> int:
        return self.gradients.num_bytes

    @property
    def peak_transient_bytes(self) -> int:
        return self.gradients.peak_transient_bytes

    @property
    def peak_required_transient_bytes(self) -> int:
        return self.gradients.peak_required_transient_bytes

    def grad_piece(self, param: nn.Parameter) -> tuple[torch.Tensor, int] | None:
        """This rank's share of ``param``'s reduced gradient, a flat view into its shard, and
        where the share starts in the flattened parameter; None where the shard holds none of
        it. A parameter's shares over the ranks are disjoint and cover it."""
        entry = self._entry_of.get(id(param))
        if entry is None or (piece := self._piece_of.get(entry)) is None:
            return None
        shard = self.grads[piece.chunk]
        if shard is None:
            if piece.chunk in self.gradients.on_disk:
                raise ConfigError(
                    "memory.host_budget",
                    f"{self._entries[entry].name}'s gradient is read where it is kept (a tied "
                    "matrix's two copies are summed), but its shard is on the NVMe tier; raise "
                    "memory.host_budget so that gradient shards stay in memory",
                )
            return None
        return shard[piece.start : piece.start + piece.numel], piece.param_start

    # -- the step ([Note: updates on pieces]) ----------------------------------------------------

    def step(
        self,
        *,
        lr: float,
        max_grad_norm: float,
        loss_scale: float = 1.0,
        grad_factor: torch.Tensor | None = None,
    ) -> float | None:
        """Unscale, clip, update this rank's shards; the global gradient norm, or None (and
        nothing updated) when a gradient on any rank was not finite. ``grad_factor``: a scale
        the caller decided (a pipeline's clipping), applied with the clip coefficient as each
        shard is read, so that shards on disk are scaled without an extra pass over them."""
        self.finish_backward()
        self.store.drop_gathered()  # stale once the shards change
        self.store.drop_read_ahead()
        self.store.wait_for_copies()
        norms = self.gradients.norms()
        squares = torch.zeros((), dtype=torch.float64)  # no gradient at all on this rank
        if norms:
            squares = torch.stack([norms[i].double().cpu() ** 2 for i in sorted(norms)]).sum()
        self.comm.all_reduce_sum(squares)
        norm = squares.sqrt().float()
        if not torch.isfinite(norm):
            self.zero_grad()
            return None
        norm, coefficient = clip_coefficient(norm, max_grad_norm, loss_scale)
        if grad_factor is not None:
            coefficient = grad_factor if coefficient is None else coefficient * grad_factor
        if coefficient is not None:
            for grad in self.gradients.in_memory():
                grad.mul_(coefficient.to(grad.device))
        present = {i for i, e in enumerate(self._entries) if self.gradients.has_gradient(e.param)}
        pieces = [p for p in self._pieces if p.entry in present]
        reduced = {i for i in self.trainable if self.gradients.reduced(i)}
        self._update_pieces([p for p in pieces if p.chunk not in self.on_disk], lr)
        self._copy_masters(reduced - self.on_disk)
        if self.swapper is not None and self.on_disk:
            numels = {i: self.store.shard_numel(i) for i in self.on_disk & reduced}
            for index in self.swapper.stream(self._step_lists(), numels):
                shard_grad = self.grads[index]
                if coefficient is not None and index in self.gradients.on_disk:
                    assert shard_grad is not None
                    shard_grad.mul_(coefficient.to(shard_grad.device))
                self._update_pieces([p for p in pieces if p.chunk == index], lr)
                self._copy_masters({index})
        for i in present:
            if self.steps and i not in self._piece_of:
                self.steps[i] += 1
            self._has_state[i] = True
        self.zero_grad()
        self.store.read_ahead_from_start()
        return float(norm)

    def _update_pieces(self, pieces: list[_Piece], lr: float) -> None:
        for decay in (True, False):
            for group in self._update_groups([p for p in pieces if self._decays(p) == decay]):
                self._update(group, lr, decay)

    def _copy_masters(self, indices: set[int] | frozenset[int]) -> None:
        if self.masters is None:
            return
        for index in indices:
            master, shard = self.masters[index], self.store.shards[index]
            assert master is not None and shard is not None
            shard.copy_(master)

    def _decays(self, piece: _Piece) -> bool:
        return self._entries[piece.entry].decay

    def _update_groups(self, pieces: list[_Piece]) -> Iterator[list[_Piece]]:
        """Pieces with state written, then those whose state the rule creates (lazy)."""
        ready = [p for p in pieces if self._has_state[p.entry]]
        if ready:
            yield ready
        lazy = [p for p in pieces if not self._has_state[p.entry]]
        if lazy:
            yield lazy

    def _update(self, pieces: list[_Piece], lr: float, decay: bool) -> None:
        weights = self.masters if self.masters is not None else self.store.shards
        written = self._has_state[pieces[0].entry]
        states: list[list[torch.Tensor | None]] = [
            [_view(shards, p) if written else None for p in pieces]
            for shards in self.states.values()
        ]
        self.rule.apply(
            [_view(weights, p) for p in pieces],
            [_view(self.grads, p) for p in pieces],
            states,
            [self.steps[p.entry] for p in pieces] if self.steps else [],
            lr=lr,
            weight_decay=self.weight_decay if decay else 0.0,
            fused=self.fused,
        )
        if not written:
            for shards, values in zip(self.states.values(), states, strict=True):
                for p, value in zip(pieces, values, strict=True):
                    assert value is not None, "the update created no state"
                    _view(shards, p).copy_(value)

    # -- full (unsharded) state: every rank calls these, they are collective --------------------

    def full_weights(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s weights at full precision (masters where there are), gathered."""
        if self.masters is not None and index in self.trainable:
            with self.in_memory(index, [self._master_list()]):
                master = self.masters[index]
                assert master is not None
                return self._gather(master)
        return self.store.full_chunk(index).float()

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(shard.numel() * self.comm.world_size, dtype=shard.dtype,
                           device=shard.device)  # fmt: skip
        self.comm.all_gather(full, shard, async_op=False)
        return full.cpu()

    def state_dict(self) -> dict[str, Any]:
        """torch's per-parameter keys (as the chunk optimizer's), gathered from every rank."""
        gathered: dict[Any, dict[int, torch.Tensor]] = {kind: {} for kind in self.states}
        for index in sorted(self.trainable):
            with self.in_memory(index, self.state_lists()):
                for kind, shards in self.states.items():
                    shard = shards[index]
                    assert shard is not None
                    gathered[kind][index] = self._gather(shard)
        state: dict[str, Any] = {}
        for i, e in enumerate(self._entries):
            saved: dict[str, torch.Tensor] = {}
            if self.steps:
                saved["step"] = self.steps[i].detach().cpu().clone()
            if self._has_state[i]:
                chunk = self.store.chunks[e.chunk]
                for kind in self.states:
                    saved[STATE_KEYS[kind]] = chunk.view_in(gathered[kind][e.chunk], e.slot).clone()
            if saved:
                state[e.name] = saved
        return state

    def load_full(self, weights: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Take this rank's pieces of full weights (``model.state_dict()`` names) and of a full
        optimizer state (any world size saved them), a chunk index at a time."""
        for i, e in enumerate(self._entries):
            saved = state.get(e.name, {})
            if self.steps:
                self.steps[i].copy_(saved["step"])
            self._has_state[i] = not self._lazy or bool(set(saved) - {"step"})
        lists = [*self._optimizer_lists(), self.param_list()]
        for index, spec in enumerate(self.store.layout.chunks):
            with self.in_memory(index, lists, write_back=True):
                for slot, info in enumerate(spec.slots):
                    self._load_weights(index, slot, weights[info.names[0]])
                for i in self._entries_in.get(index, []):
                    piece = self._piece_of.get(i)
                    if piece is None or not self._has_state[i]:
                        continue
                    saved = state[self._entries[i].name]
                    for kind, shards in self.states.items():
                        _view(shards, piece).copy_(_flat_piece(saved[STATE_KEYS[kind]], piece))

    def write_weights(self, index: int, slot: int, value: torch.Tensor) -> None:
        """This rank's piece of a full weight, wherever its shards are (disk included)."""
        with self.in_memory(index, [*self._optimizer_lists(), self.param_list()], write_back=True):
            self._load_weights(index, slot, value)

    def _load_weights(self, index: int, slot: int, value: torch.Tensor) -> None:
        """This rank's piece of a full weight into its master and parameter shards."""
        info = self.store.layout.chunks[index].slots[slot]
        start, numel = self.store.shard_start(index), self.store.shard_numel(index)
        lo, hi = max(info.offset, start), min(info.offset + info.numel, start + numel)
        if lo >= hi:
            return
        flat = value.reshape(-1)[lo - info.offset : hi - info.offset]
        shard = self.store.shards[index]
        assert shard is not None
        shard[lo - start : hi - start].copy_(flat)
        if self.masters is not None and (master := self.masters[index]) is not None:
            master[lo - start : hi - start].copy_(flat)

    def names_with_state(self) -> set[str]:
        """The trainable parameters whose optimizer state has been written (all of them but
        a lazy rule's before its first update)."""
        return {e.name for i, e in enumerate(self._entries) if self._has_state[i]}

    def step_counts(self) -> dict[str, float]:
        """Each parameter's update count (torch's ``step``), the same on every rank."""
        return {e.name: float(self.steps[i]) for i, e in enumerate(self._entries) if self.steps}

    def set_step_counts(self, counts: dict[str, float]) -> None:
        for i, e in enumerate(self._entries):
            if self.steps:
                self.steps[i].fill_(counts[e.name])

    def set_written(self, names: set[str]) -> None:
        """The parameters whose optimizer state a checkpoint holds; the others' is created by
        their next update ([Note: lazy optimizer state] in tidal/memory/optim_rules.py)."""
        for i, e in enumerate(self._entries):
            self._has_state[i] = not self._lazy or e.name in names

    def weights_loaded(self) -> None:
        """The masters changed under the parameter shards (a checkpoint): copy them over,
        streaming the indices on disk."""
        if self.masters is None:
            return
        self._copy_masters(self.trainable - self.on_disk)
        if self.swapper is not None:
            lists = [dataclasses.replace(self._master_list(), write=False), self.param_list()]
            numels = {i: self.store.shard_numel(i) for i in self.on_disk & self.trainable}
            for index in self.swapper.stream(lists, numels):
                self._copy_masters({index})


def _view(shards: list[torch.Tensor | None] | list[torch.Tensor], piece: _Piece) -> torch.Tensor:
    shard = shards[piece.chunk]
    assert shard is not None
    return shard.narrow(0, piece.start, piece.numel)


def _flat_piece(value: torch.Tensor, piece: _Piece) -> torch.Tensor:
    return value.reshape(-1).narrow(0, piece.param_start, piece.numel)
