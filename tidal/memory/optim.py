"""The chunk optimizer: gradients, optimizer state and the update, mirroring the parameter chunks.

Gradient, state and master chunks have the parameter chunks' layout (same index, same offsets), so
a parameter's gradient and state are found by its parameter slot. They exist only for the chunk
indices that hold trainable parameters ([Note: frozen parameters] in layout.py): each kind is a
list indexed by chunk index with ``None`` at the frozen ones. Each chunk index is updated where
its parameter chunk is at step time: the indices the engine pinned to the device
(:meth:`ChunkOptimizer.place_on_device`, chosen from the margin the trace leaves) keep gradients
and state there and never move; every other parameter chunk goes to the host before the step,
where its gradients and state live.

The algorithm is an :class:`~tidal.memory.optim_rules.UpdateRule` (AdamW, Adam, SGD): torch's
functional update over the slot views, so its arithmetic is the reference engine's, element for
element. Everything else (gradient collection, clipping, loss-scale unscaling, masters,
placement, checkpoints) is shared here.

[Note: parameters without a gradient]
A trainable parameter may get no gradient in a step: a branch the model took on other steps, a
layer Hugging Face's ``layerdrop`` skipped, a pooler the loss does not read. ``torch.optim``
leaves such a parameter alone (its ``.grad`` is None): no update, no weight decay, no change to
its moments or step count, and ``clip_grad_norm_`` leaves it out of the norm. So does the chunk
optimizer: a step takes only the entries a gradient reached since the last step (any
micro-batch of the window), and a gradient chunk whose slots got no gradient is never read for
them. The arithmetic over the others is unchanged, so the result equals ``torch.optim``'s bit
for bit.

[Note: gradient chunk lifetime]
Gradients are needed only from the backward that produces them to the step that consumes them, so
a gradient chunk gets its payload when the first gradient of its index arrives (zeros, then that
gradient) and gives it back at ``zero_grad``, the chunk engine's counterpart of torch's
``set_to_none``. Between a step and the next backward, which includes the forward with its
activations at their peak, no gradient memory is held on either tier, as with plain PyTorch.
A pinned index's gradient chunk is allocated on the device, after the store has made room (its
bytes were part of the margin the pinning was chosen for); every other one on the host. With
gradients in the parameter chunks (below) there are no gradient chunks at all.

[Note: gradients in parameter chunks]
With bf16/fp16 parameter chunks the weights' authoritative copy is the fp32 master, so once
autograd is done with a parameter its low-precision slot is free to hold the gradient until the
step copies the master back (PatrickStar's trick). ``collect`` runs from the post-accumulate-grad
hook, which fires after every use of the parameter in this backward (tied uses included), and
copies ``param.grad`` (the slot's dtype: exact) into the slot wherever the chunk is, counting
device-to-host bytes when it is on the host. Then no fp32 gradient chunk exists: 4 bytes per
parameter less on whichever tier the gradient chunk would have lived, and a gradient reaches the
host inside its parameter chunk's eviction, not as a copy of its own.

Until the step the slot holds no weights: the store keeps the parameter's id in
``grads_in_slots`` and a moment that needs it raises, so a forward between backward and step
fails loudly (the engine says so before it starts one), as does a second gradient before the
step. Only without accumulation (``grad_accum_steps == 1``): summing micro-batches in bf16 would
lose precision, so accumulation keeps fp32 gradient chunks; fp32 runs keep them too (there the
parameters are the weights).

The step sees fp32 gradients one chunk at a time: a transient fp32 buffer of one chunk per tier
(allocated through the tier, so budgets count it; the pinning leaves room for it) is filled from
the parameter chunk, which holds the bf16 gradient exactly as an fp32 gradient chunk would. A
first pass takes each gradient's norm (``torch._foreach_norm``, as ``get_total_norm`` does, and
the total over them in its grouping by device), a second multiplies by the clip and unscale
coefficient, runs the rule over that chunk's entries and copies the master into the parameter
chunk. The arithmetic is elementwise per parameter, so the result is bit for bit the one of
gradient chunks. An overflow (fp16), and ``zero_grad``, copy the masters back without updating.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tidal.memory.chunk import Chunk, ChunkKind
from tidal.memory.layout import ChunkLayout
from tidal.memory.materialize import feed_chunks
from tidal.memory.optim_rules import (
    STATE_KEYS,
    OptimizerEntry,
    UpdateRule,
    by_device,
    clip_coefficient,
    state_value,
    total_norm_of,
)
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier, TierKind

__all__ = ["ChunkOptimizer", "make_master_chunks"]


def make_master_chunks(
    model: nn.Module,
    layout: ChunkLayout,
    host_tier: Tier,
    values: Iterable[tuple[str, torch.Tensor]],
) -> list[Chunk | None]:
    """fp32 copies of the trainable parameters, laid out like the parameter chunks, on the
    host, filled from the full-precision ``values`` ([Note: deferred construction] in
    materialize.py).

    ``None`` for a chunk index without trainable parameters: a frozen weight is never updated,
    so its low-precision chunk is all there is of it.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    masters: list[Chunk | None] = [None] * len(layout.chunks)
    for spec in layout.chunks:
        if any(params[info.names[0]].requires_grad for info in spec.slots):
            masters[spec.index] = Chunk(spec, kind=ChunkKind.MASTER, dtype=torch.float32)

    def begin(index: int) -> None:
        if (chunk := masters[index]) is not None:
            chunk.allocate(host_tier)

    def write(index: int, slot: int, value: torch.Tensor) -> None:
        if (chunk := masters[index]) is not None:
            chunk.write(slot, value.float())

    def end(index: int) -> None:
        if (chunk := masters[index]) is not None:
            chunk.fill_free_slots(0.0)  # padding between slots

    feed_chunks(layout, values, begin=begin, write=write, end=end)
    return masters


class ChunkOptimizer:
    """An optimizer whose state lives in chunks; call ``collect`` from the grad hook, then ``step``.

    Weight decay applies to the parameters ``decays`` picks (matrices by default), as the
    reference engine's two parameter groups do.
    """

    def __init__(
        self,
        store: ChunkStore,
        *,
        names: dict[int, str],
        rule: UpdateRule,
        weight_decay: float,
        fused: bool | None,
        decays: Callable[[nn.Parameter], bool] = lambda p: p.dim() >= 2,
        masters: list[Chunk | None] | None = None,
        grads_in_params: bool = False,
    ) -> None:
        assert masters is not None or not grads_in_params, "gradients in parameters need masters"
        self.store = store
        # See [Note: gradients in parameter chunks]; then self.grads holds no chunk at all.
        self.grads_in_params = grads_in_params
        self.rule = rule
        # fp32 master weights when the parameter chunks hold a lower precision (see
        # make_master_chunks); the update runs on them and is copied into the parameter chunks.
        self.masters = masters
        self.weight_decay = weight_decay
        self.fused = True if fused is None else fused
        self._entries = [
            OptimizerEntry(names[pid], param, *store.slot_of[pid], decay=decays(param))
            for pid, param in store.params.items()
            if param.requires_grad
        ]
        self.trainable: frozenset[int] = frozenset(e.chunk for e in self._entries)
        self.grads: list[Chunk | None] = (
            [None] * len(store.chunks)
            if grads_in_params
            else self._mirror(ChunkKind.GRAD, allocate=False)
        )
        self.states = {kind: self._mirror(kind) for kind in rule.state_kinds}
        # One step counter per parameter where the rule counts them, as torch's Adam keeps them
        # (float32 scalars).
        num_steps = len(self._entries) if rule.counts_steps else 0
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in range(num_steps)]
        # Per entry: whether its state was ever written; see [Note: lazy optimizer state].
        self._lazy = rule.lazy_state and bool(rule.state_kinds)
        self._has_state = [not self._lazy] * len(self._entries)
        self._fresh = {id(e.param): True for e in self._entries}
        self.on_device: frozenset[int] = frozenset()

    def _mirror(self, kind: ChunkKind, *, allocate: bool = True) -> list[Chunk | None]:
        chunks: list[Chunk | None] = []
        for parameter_chunk in self.store.chunks:
            if parameter_chunk.index not in self.trainable:
                chunks.append(None)
                continue
            chunk = Chunk(parameter_chunk.spec, kind=kind, dtype=torch.float32)
            if allocate:
                chunk.allocate(self.store.host_tier)
                chunk.fill_free_slots(0.0)
            chunks.append(chunk)
        return chunks

    def place_on_device(self, indices: frozenset[int]) -> None:
        """Keep the gradients and state of ``indices`` on the device tier from now on."""
        device_tier = self.store.device_tier
        for index in sorted(indices - self.on_device):
            for chunk in self.chunks_at(index):
                if chunk.payload is not None:  # else allocated there when needed
                    chunk.move_to(device_tier)
        for i, entry in enumerate(self._entries):
            if self.steps and entry.chunk in indices:
                self.steps[i] = self.steps[i].to(device_tier.device)
        self.on_device |= indices

    def place_on_host(self) -> None:
        """Undo :meth:`place_on_device` for every index: gradients and state go to the host
        (the store gave up its pinned chunks; see [Note: optimizer placement] in pinning.py)."""
        host_tier = self.store.host_tier
        for index in sorted(self.on_device):
            for chunk in self.chunks_at(index):
                if chunk.payload is not None and chunk.on_device:
                    chunk.move_to(host_tier)
        for i, entry in enumerate(self._entries):
            if entry.chunk in self.on_device:
                entry.param.grad = None  # a view of a device slot that is gone; summed below
                if self.steps:
                    self.steps[i] = self.steps[i].to(host_tier.device)
        self.on_device = frozenset()

    def adopt_layout(
        self,
        *,
        grads: list[Chunk | None],
        states: dict[ChunkKind, list[Chunk | None]],
        masters: list[Chunk | None] | None,
    ) -> None:
        """Take chunks re-laid out like the store's new parameter chunks ([Note: relayout] in
        relayout.py); call after the store adopted its layout, whose ``slot_of`` it reads."""
        assert not self.on_device and states.keys() == self.states.keys()
        self.grads, self.states, self.masters = grads, states, masters
        # Same entries in the same order (the gradient norm sums in it; step counters and
        # lazy-state flags are per entry), only their place changes.
        entries = []
        for e in self._entries:
            index, slot = self.store.slot_of[id(e.param)]
            entries.append(dataclasses.replace(e, chunk=index, slot=slot))
        self._entries = entries
        self.trainable = frozenset(e.chunk for e in self._entries)

    # -- figures -------------------------------------------------------------------------------

    def chunks_at(self, index: int) -> list[Chunk]:
        """Every chunk of ``index`` besides the parameters: gradient, state, master (if any)."""
        lists = [self.grads, *self.states.values()]
        if self.masters is not None:
            lists.append(self.masters)
        return [chunk for chunks in lists if (chunk := chunks[index]) is not None]

    def state_bytes_of(self, index: int) -> int:
        """Bytes of :meth:`chunks_at`; 0 for a chunk index without trainable parameters."""
        return sum(chunk.num_bytes for chunk in self.chunks_at(index))

    @property
    def state_bytes(self) -> int:
        """Optimizer state and masters, and the step counters (4 bytes each)."""
        lists = [*self.states.values(), *([self.masters] if self.masters is not None else [])]
        return sum(c.num_bytes for c in _present(lists)) + 4 * len(self.steps)

    @property
    def grad_bytes(self) -> int:
        return sum(c.num_bytes for c in _present([self.grads]))

    def step_buffer_bytes(self, indices: frozenset[int]) -> int:
        """The transient fp32 gradient buffer a step needs on the tier of ``indices``: one chunk
        of the largest trainable one with gradients in parameter chunks, else none."""
        if not self.grads_in_params:
            return 0
        trainable = indices & self.trainable
        return max((4 * self.store.chunks[i].spec.capacity for i in trainable), default=0)

    # -- gradients -------------------------------------------------------------------------------

    def collect(self, param: nn.Parameter) -> None:
        """Move ``param.grad`` into its gradient slot (summing within an accumulation window),
        or into its parameter slot ([Note: gradients in parameter chunks])."""
        grad = param.grad
        assert grad is not None
        if self.grads_in_params:
            self._collect_into_param(param, grad)
            param.grad = None
            return
        index, slot = self.store.slot_of[id(param)]
        chunk = self.grads[index]
        assert chunk is not None, f"a gradient for {param.shape} in frozen chunk {index}"
        if chunk.payload is None:
            self._allocate_grad(chunk)
        target = chunk.view(slot)
        if grad.data_ptr() == target.data_ptr():
            pass  # autograd summed into the slot itself (below)
        elif self._fresh[id(param)]:
            target.copy_(grad)
        else:  # add_ does not cross devices the way copy_ does: a host slot takes a copy
            target.add_(grad.to(target.device))
        self._fresh[id(param)] = False
        if not chunk.on_device:
            num_bytes = grad.numel() * grad.element_size()
            self.store.device_tier.record_move(out_bytes=num_bytes)
            self.store.host_tier.record_move(in_bytes=num_bytes)
        # A gradient slot on the device in the parameter's dtype becomes ``param.grad``: the
        # next micro-batch's gradient is then summed into it by autograd itself, in place, as
        # plain PyTorch does, instead of arriving in a new tensor to be copied. zero_grad()
        # takes it away before the chunk goes.
        same_kind = chunk.on_device and target.dtype == param.dtype
        param.grad = target if same_kind else None

    def _collect_into_param(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        pid = id(param)
        index, slot = self.store.slot_of[pid]
        chunk = self.store.chunks[index]
        if not self._fresh[pid]:
            name = chunk.spec.slots[slot].names[0]
            raise RuntimeError(
                f"a second gradient reached {name} before step(): its storage already holds "
                f"the first ([Note: gradients in parameter chunks] in tidal/memory/optim.py); "
                f"to sum several backwards per step set training.grad_accum_steps"
            )
        self.store.ready_for_write(index)
        chunk.view(slot).copy_(grad)
        if not chunk.on_device:
            num_bytes = grad.numel() * grad.element_size()
            self.store.device_tier.record_move(out_bytes=num_bytes)
            self.store.host_tier.record_move(in_bytes=num_bytes)
        self._fresh[pid] = False
        self.store.grads_in_slots.add(pid)

    def _restore_weights(self) -> None:
        """Copy the masters into every parameter chunk with a slot holding a gradient; see
        [Note: gradients in parameter chunks]."""
        held = self.store.grads_in_slots
        for index in sorted({self.store.slot_of[pid][0] for pid in held}):
            self._copy_master(index)
        held.clear()

    def _copy_master(self, index: int) -> None:
        """The fp32 master of ``index`` into its parameter chunk (rounded to its dtype)."""
        assert self.masters is not None
        chunk, master = self.store.chunks[index], self.masters[index]
        assert master is not None and master.payload is not None and chunk.payload is not None
        self.store.ready_for_write(index)
        if chunk.tier is master.tier:
            chunk.payload.copy_(master.payload)
            return
        # Only a zero_grad between backward and step finds them apart (the step has evicted
        # every unpinned chunk): converted where the master is, the weights cross in their dtype.
        assert chunk.tier is not None and master.tier is not None
        weights = master.payload.to(chunk.dtype)
        chunk.payload.copy_(weights)
        master.tier.record_move(out_bytes=weights.nbytes)
        chunk.tier.record_move(in_bytes=weights.nbytes)

    def _allocate_grad(self, chunk: Chunk) -> None:
        """See [Note: gradient chunk lifetime]."""
        if chunk.index in self.on_device:
            self.store.make_device_room(chunk.num_bytes)
            chunk.allocate(self.store.device_tier, own_mapping=False)
        else:
            chunk.allocate(self.store.host_tier, own_mapping=False)
        chunk.fill_free_slots(0.0)

    def zero_grad(self) -> None:
        """Drop every gradient chunk's payload; see [Note: gradient chunk lifetime]. Gradients
        in parameter chunks are dropped by copying the masters back."""
        if self.store.grads_in_slots:
            self._restore_weights()
        for entry in self._entries:
            entry.param.grad = None
        for chunk in _present([self.grads]):
            if chunk.payload is not None:
                chunk.release(discard=True)
        self._fresh = dict.fromkeys(self._fresh, True)

    # -- gradients read before the step (a pipeline's global norm and tied sums) -----------------

    def gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view of its fp32 gradient slot) of each parameter a gradient reached since
        the last step, in entry order: read and written in place until :meth:`step`."""
        assert not self.grads_in_params, "a gradient in a parameter slot is not an fp32 view"
        for i in self._with_gradients():
            yield self._entries[i].name, self._view(self.grads, self._entries[i])

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient slot (a view), or None where no gradient reached it."""
        assert not self.grads_in_params, "a gradient in a parameter slot is not an fp32 view"
        if self._fresh.get(id(param), True):
            return None
        index, slot = self.store.slot_of[id(param)]
        chunk = self.grads[index]
        assert chunk is not None and chunk.payload is not None
        return chunk.view(slot)

    def squares_in_params(self) -> torch.Tensor:
        """The sum of the squared gradient entries held in the parameter chunks, in fp32 on the
        CPU, read through the step's fp32 buffers ([Note: gradients in parameter chunks]): a
        norm taken outside the step, as a pipeline takes it over every stage."""
        assert self.grads_in_params, "the gradients are in fp32 gradient chunks: gradients()"
        self.store.wait_for_copies()
        by_chunk: dict[int, list[int]] = {}
        for i in self._with_gradients():
            by_chunk.setdefault(self._entries[i].chunk, []).append(i)
        total = torch.zeros((), dtype=torch.float32)
        with self._fp32_buffers(by_chunk) as fp32_grads:
            for index, picked in by_chunk.items():
                norms = torch._foreach_norm(fp32_grads(index, picked), 2.0)
                total += torch.stack(norms).float().square().sum().cpu()
        return total

    def scale_gradients(self, factor: torch.Tensor) -> None:
        """Multiply every gradient held by ``factor`` (clipping by a norm taken elsewhere)."""
        grads = [grad for _, grad in self.gradients()]
        for device, group in by_device(grads).items():
            torch._foreach_mul_(group, factor.to(device))

    def _with_gradients(self) -> list[int]:
        """The entries a gradient reached since the last step ([Note: parameters without a
        gradient]), in entry order."""
        return [i for i, e in enumerate(self._entries) if not self._fresh[id(e.param)]]

    # -- the step --------------------------------------------------------------------------------

    def step(self, *, lr: float, max_grad_norm: float, loss_scale: float = 1.0) -> float | None:
        """Unscale, clip to ``max_grad_norm`` (0: off), update in place.

        Returns the (unscaled) gradient norm, or None when a gradient was not finite: then
        nothing is updated and the gradients are dropped (fp16 overflow; the caller lowers the
        loss scale).
        """
        self.store.evict_unpinned()
        self.store.wait_for_copies()  # host-side updates read what the evictions brought
        present = self._with_gradients()
        if self.grads_in_params:
            return self._step_in_params(
                present, lr=lr, max_grad_norm=max_grad_norm, loss_scale=loss_scale
            )
        grads = {i: self._view(self.grads, self._entries[i]) for i in present}
        norm = torch.nn.utils.get_total_norm(list(grads.values()))
        if not torch.isfinite(norm):
            self.zero_grad()
            return None
        norm, coefficient = clip_coefficient(norm, max_grad_norm, loss_scale)
        if coefficient is not None:
            for device, group in by_device(list(grads.values())).items():
                torch._foreach_mul_(group, coefficient.to(device))
        for decay in (True, False):
            for on_device in (True, False):
                picked = [
                    i
                    for i in present
                    if self._entries[i].decay == decay
                    and (self._entries[i].chunk in self.on_device) == on_device
                ]
                for indices in self._update_groups(picked):
                    self._update(indices, lr, decay, [grads[i] for i in indices])
        if self.masters is not None:
            for index in self.trainable:
                master, param = self.masters[index], self.store.chunks[index]
                assert master is not None and master.payload is not None
                assert param.payload is not None, f"{param!r} is resident during the step"
                param.payload.copy_(master.payload)
        self.zero_grad()
        return float(norm)

    def _step_in_params(
        self, present: list[int], *, lr: float, max_grad_norm: float, loss_scale: float
    ) -> float | None:
        """:meth:`step` with the gradients in the parameter chunks, one chunk at a time in fp32;
        see [Note: gradients in parameter chunks]. Only ``present`` entries' slots hold one."""
        by_chunk: dict[int, list[int]] = {}
        for i in present:
            by_chunk.setdefault(self._entries[i].chunk, []).append(i)
        with self._fp32_buffers(by_chunk) as fp32_grads:
            norms: dict[int, torch.Tensor] = {}
            for index, picked in by_chunk.items():
                found = torch._foreach_norm(fp32_grads(index, picked), 2.0)
                norms.update(zip(picked, found, strict=True))
            norm = total_norm_of([norms[i] for i in present])
            if not torch.isfinite(norm):
                self.zero_grad()  # copies the masters back: the weights are as they were
                return None
            norm, coefficient = clip_coefficient(norm, max_grad_norm, loss_scale)
            for index, picked in by_chunk.items():
                grads = fp32_grads(index, picked)
                if coefficient is not None:
                    torch._foreach_mul_(grads, coefficient.to(grads[0].device))
                grad_of = dict(zip(picked, grads, strict=True))
                for decay in (True, False):
                    same = [i for i in picked if self._entries[i].decay == decay]
                    for group in self._update_groups(same):
                        self._update(group, lr, decay, [grad_of[i] for i in group])
                self._copy_master(index)
                self.store.grads_in_slots.difference_update(
                    id(self._entries[i].param) for i in picked
                )
        self.zero_grad()
        return float(norm)

    @contextlib.contextmanager
    def _fp32_buffers(
        self, by_chunk: dict[int, list[int]]
    ) -> Iterator[Callable[[int, list[int]], list[torch.Tensor]]]:
        """A function giving the fp32 gradients of a chunk's entries, copied into a transient
        buffer of one chunk on the chunk's tier (valid until the next call on that tier)."""
        store = self.store
        buffers: dict[TierKind, tuple[Tier, torch.Tensor]] = {}
        try:
            for tier in (store.device_tier, store.host_tier):
                here = frozenset(i for i in by_chunk if store.chunks[i].tier is tier)
                if here:
                    num_bytes = self.step_buffer_bytes(here)
                    if tier is store.device_tier:
                        store.make_device_room(num_bytes)
                    buffers[tier.kind] = (tier, tier.allocate(num_bytes // 4, torch.float32))

            def fp32_grads(index: int, picked: list[int]) -> list[torch.Tensor]:
                chunk = store.chunks[index]
                assert chunk.tier is not None and chunk.payload is not None
                buffer = buffers[chunk.tier.kind][1].narrow(0, 0, chunk.spec.capacity)
                buffer.copy_(chunk.payload)
                return [chunk.view_in(buffer, self._entries[i].slot) for i in picked]

            yield fp32_grads
        finally:
            for tier, buffer in buffers.values():
                tier.free(buffer)

    def _update_groups(self, picked: list[int]) -> Iterator[list[int]]:
        """``picked`` split so each call sees state all written or all lazy.

        Lazy state is created by the update itself, one temporary per parameter until it is
        copied into its chunk ([Note: lazy optimizer state]); updating those chunk by chunk
        keeps the temporaries to one chunk's worth.
        """
        ready = [i for i in picked if self._has_state[i]]
        if ready:
            yield ready
        lazy: dict[int, list[int]] = {}
        for i in picked:
            if not self._has_state[i]:
                lazy.setdefault(self._entries[i].chunk, []).append(i)
        yield from lazy.values()

    def _update(self, picked: list[int], lr: float, decay: bool, grads: list[torch.Tensor]) -> None:
        entries = [self._entries[i] for i in picked]
        weights = self.masters if self.masters is not None else self.store.chunks
        written = [self._has_state[i] for i in picked]
        states: list[list[torch.Tensor | None]] = [
            [self._view(chunks, e) if w else None for e, w in zip(entries, written, strict=True)]
            for chunks in self.states.values()
        ]
        self.rule.apply(
            [self._view(weights, e) for e in entries],
            grads,
            states,
            [self.steps[i] for i in picked] if self.steps else [],
            lr=lr,
            weight_decay=self.weight_decay if decay else 0.0,
            fused=self.fused,
        )
        for chunks, values in zip(self.states.values(), states, strict=True):
            for e, w, value in zip(entries, written, values, strict=True):
                if not w:
                    assert value is not None, f"the update created no state for {e.name}"
                    self._view(chunks, e).copy_(value)
        for i in picked:
            self._has_state[i] = True

    @staticmethod
    def _view(chunks: list[Chunk | None] | list[Chunk], entry: OptimizerEntry) -> torch.Tensor:
        chunk = chunks[entry.chunk]
        assert chunk is not None, f"{entry.name} has no chunk of this kind"
        return chunk.view(entry.slot)

    # -- state -----------------------------------------------------------------------------------

    def weight(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's value at full precision where there is one: its master slot, else
        its parameter slot (fp32 runs, and frozen parameters)."""
        index, slot = self.store.slot_of[id(param)]
        master = self.masters[index] if self.masters is not None else None
        return (master if master is not None else self.store.chunks[index]).view(slot)

    def state_dict(self) -> dict[str, Any]:
        """Per parameter name, torch's keys: ``step``, ``exp_avg``, ``exp_avg_sq`` (Adam, AdamW)
        or ``momentum_buffer`` (SGD, once written); copies. Parameters without state are left
        out, as in torch (plain SGD has none)."""
        state: dict[str, Any] = {}
        for i, e in enumerate(self._entries):
            saved: dict[str, torch.Tensor] = {}
            if self.steps:
                saved["step"] = self.steps[i].clone()
            if self._has_state[i]:
                for kind, chunks in self.states.items():
                    saved[STATE_KEYS[kind]] = self._view(chunks, e).clone()
            if saved:
                state[e.name] = saved
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {STATE_KEYS[kind] for kind in self.states} | ({"step"} if self.steps else set())
        for i, e in enumerate(self._entries):
            saved = state.get(e.name, {})
            if unknown := set(saved) - expected:
                raise ValueError(
                    f"optimizer state for {e.name} holds {sorted(unknown)}, which "
                    f"{type(self.rule).__name__} does not keep: a checkpoint of another optimizer?"
                )
            if self.steps:
                self.steps[i].copy_(state_value(saved, "step", e.name))
            if self._lazy and not (set(saved) & expected):
                self._has_state[i] = False  # never written: the next update creates it
                continue
            for kind, chunks in self.states.items():
                self._view(chunks, e).copy_(state_value(saved, STATE_KEYS[kind], e.name))
            self._has_state[i] = True


def _present(lists: list[list[Chunk | None]]) -> list[Chunk]:
    return [chunk for chunks in lists for chunk in chunks if chunk is not None]
