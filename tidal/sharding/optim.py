"""The sharded optimizer: gradients reduce-scattered chunk by chunk, updates on this rank's shards.

[Note: sharded gradients]
A chunk's gradient is complete once the post-accumulate-grad hook has fired for every trainable
parameter in it (each fires once per backward, after the parameter's last use). Gradients are
copied into a transient fp32 buffer of the whole chunk on the device tier as they arrive; when
the chunk is complete its buffer is reduce-scattered, asynchronously, into a shard-sized buffer,
and the backward goes on while the reduction runs. :meth:`ShardedOptimizer.finish_backward`
waits for every reduction, divides by the world size (each rank's loss is the mean over its
slice of the global batch, so the mean of the ranks' gradients is the global batch's) and adds
the result into this rank's fp32 gradient shard, so accumulation sums micro-batches exactly as
on one process. Every rank completes its chunks in the same order (the same autograd graph),
which is the order the collectives need ([Note: ranks decide alike] in store.py). Reductions
run in fp32 whatever the parameters' precision: with bf16 parameter chunks each gradient is
rounded once, as on one process, and the sum over ranks adds no rounding of its own.

[Note: updates on pieces]
A shard cuts parameters anywhere, so this rank's part of a parameter is a *piece*: the flat
range where the parameter's slot and this rank's shard overlap, at most one per parameter and
rank. torch's AdamW, Adam and SGD are elementwise, so running the rule over pieces gives every
element exactly the update it gets over whole tensors; what is not elementwise is handled once
for the whole model: the gradient norm is the square root of the sum over ranks of each rank's
sum of squares (all-reduced), and the step counters (one per parameter, as torch keeps them)
advance on every rank, holding a piece or not, so each rank can save them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal.memory.optim import MissingGradientError
from tidal.memory.optim_rules import STATE_KEYS, OptimizerEntry, UpdateRule, clip_coefficient
from tidal.memory.tiers import Tier
from tidal.sharding.store import ShardedChunkStore
from tidal.sharding.swap import GRAD, GRAD_WRITES, PARAM, ShardList, StateSwapper

MASTER = "master"  # the masters' name among the shard lists (the state kinds use torch's keys)

__all__ = ["ShardedOptimizer", "make_master_shards"]


def make_master_shards(
    model: nn.Module,
    store_layout: Any,
    *,
    rank: int,
    world_size: int,
    host_tier: Tier,
    swapper: StateSwapper | None = None,
) -> list[torch.Tensor | None]:
    """fp32 shards of the trainable chunks' weights; None where a chunk has none trainable (or,
    with ``swapper``, where they went to disk). Call before the store converts the parameters
    to a lower precision.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    masters: list[torch.Tensor | None] = []
    on_disk = swapper.plan.state if swapper is not None else frozenset()
    for spec in store_layout.chunks:
        if not any(params[info.names[0]].requires_grad for info in spec.slots):
            masters.append(None)
            continue
        numel = spec.capacity // world_size
        start, shard = rank * numel, host_tier.allocate(numel, torch.float32)
        shard.zero_()
        for info in spec.slots:
            lo, hi = max(info.offset, start), min(info.offset + info.numel, start + numel)
            if lo < hi:
                flat = params[info.names[0]].detach().reshape(-1).float()
                shard[lo - start : hi - start].copy_(flat[lo - info.offset : hi - info.offset])
        masters.append(shard)
        if swapper is not None and spec.index in on_disk:
            swapper.offload(ShardList(MASTER, masters, torch.float32, on_disk), spec.index)
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
        self.max_pending = max_pending
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
        self.grads_on_disk = store.on_disk & self.trainable
        # Gradients on disk: the norm of each one's latest value (the step's clipping needs
        # the global norm before it reads them back) and the writes in flight.
        self._disk_grad_norms: dict[int, torch.Tensor] = {}
        self._grad_writes: list[tuple[Future[None], torch.Tensor]] = []
        self._pieces = [p for i, e in enumerate(self._entries) if (p := self._piece(i, e))]
        self._piece_of = {p.entry: p for p in self._pieces}
        self.states = {kind: self._zero_shards(STATE_KEYS[kind]) for kind in rule.state_kinds}
        self.grads: list[torch.Tensor | None] = [None] * len(store.chunks)
        self._grad_tiers: dict[int, Tier] = {}  # where each present gradient shard was allocated
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self._entries]
        if not rule.counts_steps:
            self.steps = []
        self._lazy = rule.lazy_state and bool(rule.state_kinds)
        self._has_state = [not self._lazy] * len(self._entries)
        self._entries_in: dict[int, list[int]] = {}  # chunk index -> its entries
        for i, e in enumerate(self._entries):
            self._entries_in.setdefault(e.chunk, []).append(i)
        self._params_in = {i: len(entries) for i, entries in self._entries_in.items()}
        self._arrived: dict[int, int] = {}  # chunk index -> gradients arrived this backward
        self._got_grad: set[int] = set()  # id(param) with a gradient since the last step
        self._full: dict[int, torch.Tensor] = {}  # chunk index -> its gradient, being collected
        self._pending: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        # Bytes of gradient buffers held on the device now, and the most held at once.
        self._transient_bytes = 0
        self.peak_transient_bytes = 0
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
        lists = self.state_lists()
        if self.masters is not None:
            lists.append(self._master_list())
        lists.append(ShardList(GRAD, self.grads, torch.float32, self.grads_on_disk, write=False))
        lists.append(self.param_list())
        return lists

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
            for shards in self._shard_lists():
                shard = shards[index]
                if shard is not None and source is not tier:
                    shards[index] = tier.allocate(shard.numel(), shard.dtype)
                    shards[index].copy_(shard)  # type: ignore[union-attr]
                    source.free(shard)
                    source.record_move(out_bytes=shard.nbytes)
                    tier.record_move(in_bytes=shard.nbytes)
        self.steps = [s.to(tier.device) for s in self.steps]
        self.on_device = indices if tier is self.store.device_tier else frozenset()

    def _shard_lists(self) -> list[list[torch.Tensor | None]]:
        lists = list(self.states.values())
        if self.masters is not None:
            lists.append(self.masters)
        return lists

    @property
    def state_bytes(self) -> int:
        shards = [s for shards in self._shard_lists() for s in shards if s is not None]
        return sum(s.nbytes for s in shards) + 4 * len(self.steps)

    @property
    def grad_bytes(self) -> int:
        return sum(g.nbytes for g in self.grads if g is not None)

    def full_grad_bytes(self) -> int:
        """The largest transient gradient buffer of one chunk (fp32, whole chunk)."""
        return max((4 * self.store.chunks[i].spec.capacity for i in self.trainable), default=0)

    # -- gradients ([Note: sharded gradients]) ---------------------------------------------------

    def collect(self, param: nn.Parameter) -> None:
        grad = param.grad
        assert grad is not None
        index, slot = self.store.slot_of[id(param)]
        full = self._full.get(index)
        if full is None:
            full = self._full[index] = self._allocate_full(index)
        self.store.chunks[index].view_in(full, slot).copy_(grad)
        param.grad = None
        self._got_grad.add(id(param))
        self._arrived[index] = arrived = self._arrived.get(index, 0) + 1
        assert arrived <= self._params_in[index], f"a second gradient in one backward: {index}"
        if arrived == self._params_in[index]:
            self._reduce(index)

    def _allocate_full(self, index: int) -> torch.Tensor:
        tier, num_bytes = self.store.device_tier, 4 * self.store.chunks[index].spec.capacity
        if not tier.can_fit(num_bytes):
            self._wait_reductions()  # their buffers go
        self.store.make_device_room(num_bytes)
        full = tier.allocate(num_bytes // 4, torch.float32, own_mapping=False)
        self._count_transient(full.nbytes)
        return full.zero_()  # padding, and slots whose gradient comes later

    def _reduce(self, index: int) -> None:
        full = self._full.pop(index)
        tier = self.store.device_tier
        if not tier.can_fit(full.nbytes // self.comm.world_size):
            self._wait_reductions()
        self.store.make_device_room(full.nbytes // self.comm.world_size)
        out = tier.allocate(full.numel() // self.comm.world_size, torch.float32, own_mapping=False)
        self._count_transient(out.nbytes)
        work = self.comm.reduce_scatter(out, full, async_op=True)
        self._pending.append((index, work, full, out))
        if len(self._pending) > self.max_pending:
            self._wait_reductions(keep=self.max_pending)

    def _count_transient(self, num_bytes: int) -> None:
        self._transient_bytes += num_bytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient_bytes)

    def _wait_reductions(self, *, keep: int = 0) -> None:
        """Wait for all but the newest ``keep`` reductions, oldest first."""
        tier = self.store.device_tier
        done = self._pending[: len(self._pending) - keep]
        for index, work, full, out in done:
            if work is not None:  # None: done already (one process)
                work.wait()
            tier.free(full)
            out.div_(self.comm.world_size)
            grad = self.grads[index]
            if index in self.grads_on_disk:
                self._spill_grad(index, out)
            elif grad is None:
                target = self.store.shard_tiers[index]
                grad = self.grads[index] = target.allocate(out.numel(), torch.float32)
                self._grad_tiers[index] = target
                grad.copy_(out)
                if target is not tier:
                    tier.record_move(out_bytes=out.nbytes)
                    target.record_move(in_bytes=out.nbytes)
            else:
                grad.add_(out.to(grad.device))
            tier.free(out)
            self._transient_bytes -= full.nbytes + out.nbytes
        del self._pending[: len(done)]

    def _spill_grad(self, index: int, reduced: torch.Tensor) -> None:
        """Write a reduced gradient shard to disk (added to the one there when accumulating),
        keeping its norm for the step ([Note: nvme placement] in swap.py)."""
        assert self.swapper is not None
        host, device = self.store.host_tier, self.store.device_tier
        staging = host.allocate(reduced.numel(), torch.float32, own_mapping=False)
        if index in self._disk_grad_norms:  # the same operations as for a gradient in memory
            self.swapper.read_now(GRAD, index, staging)
            staging.add_(reduced.to(staging.device))
        else:
            staging.copy_(reduced)
        if device is not host:
            device.record_move(out_bytes=reduced.nbytes)
            host.record_move(in_bytes=reduced.nbytes)
        self._disk_grad_norms[index] = torch._foreach_norm([staging], 2.0)[0]
        self._grad_writes.append((self.swapper.write_async(GRAD, index, staging), staging))
        if len(self._grad_writes) > GRAD_WRITES:
            self._finish_grad_writes(keep=GRAD_WRITES)

    def _finish_grad_writes(self, *, keep: int = 0) -> None:
        done = self._grad_writes[: len(self._grad_writes) - keep]
        for future, staging in done:
            future.result()
            self.store.host_tier.free(staging)
        del self._grad_writes[: len(done)]

    def finish_backward(self) -> None:
        """Wait for this backward's reductions; every trainable chunk must have been reduced."""
        incomplete = [i for i in sorted(self.trainable) if i in self._full or i in self._arrived
                      and self._arrived[i] < self._params_in[i]]  # fmt: skip
        if incomplete:
            self._missing(incomplete)
        self._wait_reductions()
        self._finish_grad_writes()
        self._arrived.clear()

    def _missing(self, indices: list[int]) -> None:
        missing = [e.name for e in self._entries
                   if e.chunk in indices and id(e.param) not in self._got_grad]  # fmt: skip
        raise MissingGradientError(
            f"no gradient reached {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + " in this backward: sharded data parallelism reduces a chunk's gradients once all "
            "of its trainable parameters have one (set requires_grad=False on parameters the "
            "model does not use)"
        )

    def zero_grad(self) -> None:
        self._wait_reductions()
        self._finish_grad_writes()
        self._disk_grad_norms.clear()
        for index, grad in enumerate(self.grads):
            if grad is not None:
                self._grad_tiers.pop(index).free(grad)
                self.grads[index] = None
        for index in list(self._full):
            full = self._full.pop(index)
            self.store.device_tier.free(full)
            self._transient_bytes -= full.nbytes
        self._arrived.clear()
        self._got_grad.clear()
        for e in self._entries:
            e.param.grad = None

    # -- the step ([Note: updates on pieces]) ----------------------------------------------------

    def step(self, *, lr: float, max_grad_norm: float, loss_scale: float = 1.0) -> float | None:
        """Unscale, clip, update this rank's shards; the global gradient norm, or None (and
        nothing updated) when a gradient on any rank was not finite."""
        self.finish_backward()
        self.store.drop_gathered()  # stale once the shards change
        self.store.drop_read_ahead()
        self.store.wait_for_copies()
        absent = [i for i in sorted(self.trainable)
                  if self.grads[i] is None and i not in self._disk_grad_norms]  # fmt: skip
        if absent:
            self._missing(absent)
        grads = [g for g in self.grads if g is not None]
        norms = dict(zip((i for i, g in enumerate(self.grads) if g is not None),
                         torch._foreach_norm(grads, 2.0) if grads else [], strict=True))  # fmt: skip
        norms.update(self._disk_grad_norms)
        squares = torch.stack([norms[i].double().cpu() ** 2 for i in sorted(norms)]).sum()
        self.comm.all_reduce_sum(squares)
        norm = squares.sqrt().float()
        if not torch.isfinite(norm):
            self.zero_grad()
            return None
        norm, coefficient = clip_coefficient(norm, max_grad_norm, loss_scale)
        if coefficient is not None:
            for grad in grads:
                grad.mul_(coefficient.to(grad.device))
        in_memory = [p for p in self._pieces if p.chunk not in self.on_disk]
        self._update_pieces(in_memory, lr)
        self._copy_masters(self.trainable - self.on_disk)
        if self.swapper is not None and self.on_disk:
            numels = {i: self.store.shard_numel(i) for i in self.on_disk & self.trainable}
            for index in self.swapper.stream(self._step_lists(), numels):
                grad = self.grads[index]
                if coefficient is not None and index in self.grads_on_disk:
                    assert grad is not None
                    grad.mul_(coefficient.to(grad.device))
                self._update_pieces([p for p in self._pieces if p.chunk == index], lr)
                self._copy_masters({index})
        for i in range(len(self._entries)):
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
        lists = [*self.state_lists(), self.param_list()]
        if self.masters is not None:
            lists.append(self._master_list())
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
