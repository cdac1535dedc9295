"""Re-packing the chunks in first-use order once there is a trace.

Before the first iteration the only order known is construction order, and models are often not
built in the order they run (Hugging Face Llama registers each layer's norms after its attention
and MLP; a model may build its head before its body). [Note: layout order] in layout.py wants
the order of first use, so after the first iteration the chunk engine re-plans the layout in
that order and moves every chunk kind into it.

[Note: relayout]
When: once, at the first optimizer step that has a trace (the engine calls :func:`relayout`
right before it chooses the pinned chunks), between iterations, with nothing pinned and no slot
in use. Skipped when the first-use order packs into the layout there already is, or when the
new layout would not fit: a moment of the carried-over trace or a module's own chunks over the
device budget, or the transient host bytes over the host budget; both warn, naming why. So a
relayout never makes a run that worked fail.

Order: the parameters in the order the last completed iteration first accessed them
(:attr:`ChunkStore.first_use_order`; at a step boundary that is the training iteration just
ended); parameters no hook accessed (no module ran them) follow in construction order. The
layout is :func:`plan_layout` of that order with the same chunk size and alignment, so trainable
and frozen parameters still never share a chunk.

What is preserved, by parameter: the parameter chunks' data (a chunk may be on either tier; the
new chunks are made on the host tier and fetched on first use), the gradient chunks (the first
step's gradients are already collected; with gradients in the parameter chunks there are none,
and the gradients move as parameter data, the store's ``grads_in_slots`` being by parameter:
[Note: gradients in parameter chunks] in optim.py), the fp32 masters, the optimizer-state
chunks, which slots hold data (a lazy SGD buffer never written stays unwritten), the optimizer's
per-parameter entries in their order (the gradient norm sums in that order, so losses stay
bit-identical), the step counters, and each new chunk's LRU clock (the latest of the chunks its
parameters came from). The trace is *translated*, not dropped: the store keeps, for every
moment, the parameters held then (:attr:`ChunkStore.trace_params`: a module's own and its
ancestors', a functional use's, or after a release what is still held), so each moment's new
chunk set is the new chunks of those parameters, whatever kind of moment it is; the
translation re-derives each old chunk set the same way and asserts it is the recorded one.
Keeping the trace keeps Belady
eviction and pinning at the first step; dropping it would cost an LRU iteration and a deferred
placement. The stats' traffic counters include the relayout's device-to-host copies; the
engine's ``min_device_bytes`` keeps the figures measured in the old layout.

Transient memory: kinds are re-laid out one after another (parameters, masters, gradients,
state), and within a kind the old chunks are read in index order: a new chunk is allocated on
the host when its first parameter is copied into it, and an old chunk's payload is freed as soon
as all its slots are copied. The device tier only shrinks, so its budget holds throughout. The
host tier ends up holding the parameter chunks that were on the device (the step's eviction of
unpinned chunks would bring them over anyway) and whatever padding the layouts differ by; on top
of that, while a kind is being copied, it holds the new chunks still being filled and the old
chunk being read: about one chunk for reorders within a layer or of whole layers (next-fit keeps
both layouts contiguous runs of nearly the same order), never more than that kind's payload
(every old chunk could hold a parameter of every new chunk). The exact peak,
:attr:`Relayout.transient_host_bytes`, is worked out before anything moves and checked against
the host budget. On CUDA each new chunk's device buffer is made at full size and shrunk at once,
one chunk at a time, as at construction.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from tidal.memory.chunk import Chunk, ChunkKind, TensorState
from tidal.memory.layout import ChunkLayout, ParamRef, plan_layout, unique_parameters
from tidal.memory.optim import ChunkOptimizer
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier
from tidal.memory.trace import AccessTrace, Moment

__all__ = [
    "Relayout",
    "first_use_layout",
    "module_moments",
    "plan_relayout",
    "relayout",
    "translate_trace",
]

_Move = tuple[int, int, int]  # (old slot, new chunk index, new slot)
_Chunks = Sequence[Chunk | None]


@dataclass(frozen=True, slots=True)
class Relayout:
    """A planned relayout: the new layout, where each parameter goes, and what it costs."""

    layout: ChunkLayout
    slot_of: dict[int, tuple[int, int]]  # id(param) -> (new chunk index, slot)
    moves_from: dict[int, list[_Move]]  # old chunk index -> where its slots go
    trace: AccessTrace  # the stored trace over the new chunk indices
    transient_host_bytes: int  # the most the host tier grows while it is carried out


def first_use_layout(model: nn.Module, store: ChunkStore) -> ChunkLayout:
    """The layout of ``model``'s parameters in the store's first-use order; see [Note: relayout]."""
    params = dict(model.named_parameters(remove_duplicate=False))
    position = {pid: i for i, pid in enumerate(store.first_use_order)}

    def key(ref: ParamRef) -> int:
        return position.get(id(params[ref.names[0]]), len(position))

    # Stable sort of construction order: parameters no hook accessed keep their relative order.
    ordered = sorted(unique_parameters(model), key=key)
    return plan_layout(ordered, chunk_size=store.layout.chunk_size, align=store.layout.align)


def plan_relayout(
    model: nn.Module, store: ChunkStore, optimizer: ChunkOptimizer
) -> Relayout | None:
    """The relayout to first-use order; None when it changes nothing, or cannot be done safely."""
    layout = first_use_layout(model, store)
    if layout == store.layout or store.trace is None:
        return None
    slot_of = _new_slot_of(store, layout)
    chunk_bytes = [spec.capacity * store.chunks[0].dtype.itemsize for spec in layout.chunks]
    trace = translate_trace(store.trace, store.trace_params, store.slot_of, slot_of, chunk_bytes)
    moves_from: dict[int, list[_Move]] = {}
    for pid, (old_index, old_slot) in store.slot_of.items():
        moves_from.setdefault(old_index, []).append((old_slot, *slot_of[pid]))
    pairs = _kinds(store, optimizer, layout, _trainable(store, slot_of))
    growth_bytes = _transient_host_bytes(pairs.values(), moves_from, store.host_tier)
    plan = Relayout(
        layout=layout,
        slot_of=slot_of,
        moves_from=moves_from,
        trace=trace,
        transient_host_bytes=growth_bytes,
    )
    reason = _misfit(model, store, plan)
    if reason is not None:
        _skipped(reason)
        return None
    return plan


def _skipped(reason: str) -> None:
    warnings.warn(f"chunk relayout to first-use order skipped: {reason}", stacklevel=4)


def relayout(model: nn.Module, store: ChunkStore, optimizer: ChunkOptimizer) -> Relayout | None:
    """Re-lay out every chunk kind in first-use order: the plan carried out, or None if skipped.

    See [Note: relayout]. Call between iterations, before anything is pinned.
    """
    assert not store.pinned and not optimizer.on_device, "relayout after placement"
    store.wait_for_copies()  # old payloads are read below
    plan = plan_relayout(model, store, optimizer)
    if plan is None:
        return None
    pairs = _kinds(store, optimizer, plan.layout, _trainable(store, plan.slot_of))
    for old, new in pairs.values():
        _relay(old, new, plan.moves_from, store.host_tier)
    chunks = {kind: new for kind, (_, new) in pairs.items()}
    params = [c for c in chunks.pop(ChunkKind.PARAM) if c is not None]
    store.adopt_layout(plan.layout, params, plan.slot_of, trace=plan.trace)
    grads, masters = chunks.pop(ChunkKind.GRAD), chunks.pop(ChunkKind.MASTER, None)
    optimizer.adopt_layout(grads=grads, states=chunks, masters=masters)
    return plan


# -- planning ---------------------------------------------------------------------------------


def _new_slot_of(store: ChunkStore, layout: ChunkLayout) -> dict[int, tuple[int, int]]:
    pid_of = {
        store.layout.chunks[index].slots[slot].names[0]: pid
        for pid, (index, slot) in store.slot_of.items()
    }
    return {
        pid_of[info.names[0]]: (spec.index, slot)
        for spec in layout.chunks
        for slot, info in enumerate(spec.slots)
    }


def _trainable(store: ChunkStore, slot_of: dict[int, tuple[int, int]]) -> frozenset[int]:
    return frozenset(slot_of[pid][0] for pid, p in store.params.items() if p.requires_grad)


def module_moments(model: nn.Module) -> dict[str, list[int]]:
    """The parameter ids each hook moment accesses, by label (the labels hooks.py gives)."""
    moments: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        own = [id(p) for p in module.parameters(recurse=False)]
        if own:
            for phase in ("fwd", "bwd"):
                moments[f"{phase}:{name or '<root>'}"] = own
    return moments


def translate_trace(
    trace: AccessTrace,
    params: Sequence[frozenset[int]],
    old_slot_of: dict[int, tuple[int, int]],
    new_slot_of: dict[int, tuple[int, int]],
    chunk_bytes: Sequence[int],
) -> AccessTrace:
    """``trace`` over the new chunk indices, from the parameters each moment held (see [Note:
    relayout])."""
    assert len(params) == len(trace.moments), "a trace without its parameters"
    moments = []
    for moment, pids in zip(trace.moments, params, strict=True):
        old = frozenset(old_slot_of[pid][0] for pid in pids)
        assert old == moment.chunks, f"moment {moment.label!r} held {old}, not {moment.chunks}"
        chunks = frozenset(new_slot_of[pid][0] for pid in pids)
        moments.append(Moment(moment.index, chunks, moment.non_model_bytes, moment.label))
    return AccessTrace(moments=tuple(moments), chunk_bytes=tuple(chunk_bytes))


def _misfit(model: nn.Module, store: ChunkStore, plan: Relayout) -> str | None:
    """Why the new layout would not run wherever the old one ran, or None; see [Note: relayout]."""
    if not store.host_tier.can_fit(plan.transient_host_bytes):
        return f"the host tier has no room for {plan.transient_host_bytes:,} bytes of copies"
    budget_bytes = store.device_tier.budget_bytes
    if budget_bytes is None:
        return None
    chunk_bytes = plan.trace.chunk_bytes
    module_bytes = max(
        sum(chunk_bytes[i] for i in {plan.slot_of[pid][0] for pid in pids})
        for pids in module_moments(model).values()
    )
    need_bytes = max(module_bytes, plan.trace.min_device_bytes())
    if need_bytes > budget_bytes:
        return f"it needs {need_bytes:,} device bytes at once, over the budget of {budget_bytes:,}"
    return None


def _kinds(
    store: ChunkStore, optimizer: ChunkOptimizer, layout: ChunkLayout, trainable: frozenset[int]
) -> dict[ChunkKind, tuple[_Chunks, list[Chunk | None]]]:
    """Per kind, in the order they are re-laid out: (old chunks, new empty chunks)."""
    everything = frozenset(range(layout.num_chunks))
    pairs: dict[ChunkKind, tuple[_Chunks, list[Chunk | None]]] = {
        ChunkKind.PARAM: (store.chunks, _mirror(store.chunks, layout, everything))
    }
    if optimizer.masters is not None:
        pairs[ChunkKind.MASTER] = (optimizer.masters, _mirror(optimizer.masters, layout, trainable))
    pairs[ChunkKind.GRAD] = (optimizer.grads, _mirror(optimizer.grads, layout, trainable))
    for kind, old in optimizer.states.items():
        pairs[kind] = (old, _mirror(old, layout, trainable))
    return pairs


def _mirror(old: _Chunks, layout: ChunkLayout, indices: frozenset[int]) -> list[Chunk | None]:
    """Chunks (no payload yet) of ``old``'s kind and dtype for ``indices`` of ``layout``."""
    template = next((c for c in old if c is not None), None)
    if template is None:  # nothing trainable: no chunks of this kind
        return [None] * layout.num_chunks
    return [
        Chunk(spec, kind=template.kind, dtype=template.dtype) if spec.index in indices else None
        for spec in layout.chunks
    ]


def _schedule(
    old: _Chunks, moves_from: dict[int, list[_Move]]
) -> Iterator[tuple[int, list[_Move]]]:
    """The old chunks that hold a payload, in index order, with where their slots go."""
    for index, chunk in enumerate(old):
        if chunk is not None and chunk.payload is not None:
            yield index, moves_from.get(index, [])


def _transient_host_bytes(
    pairs: Iterable[tuple[_Chunks, list[Chunk | None]]],
    moves_from: dict[int, list[_Move]],
    host: Tier,
) -> int:
    """The most the host tier grows while :func:`_relay` runs over ``pairs`` in turn."""
    peak_bytes = growth_bytes = 0
    for old, new in pairs:
        allocated: set[int] = set()
        for index, moves in _schedule(old, moves_from):
            for _, new_index, _ in moves:
                target = new[new_index]
                if new_index not in allocated and target is not None:
                    allocated.add(new_index)
                    growth_bytes += target.num_bytes
            peak_bytes = max(peak_bytes, growth_bytes)
            source = old[index]
            if source is not None and source.tier is host:
                growth_bytes -= source.num_bytes
    return peak_bytes


# -- carrying it out --------------------------------------------------------------------------


def _relay(
    old: _Chunks, new: Sequence[Chunk | None], moves_from: dict[int, list[_Move]], host: Tier
) -> None:
    """Copy every slot holding data from ``old`` into ``new`` (made on ``host``), freeing each
    old chunk as soon as its slots are copied; new slots that got no data become zeros."""
    for index, moves in _schedule(old, moves_from):
        source = old[index]
        assert source is not None and source.tier is not None
        for old_slot, new_index, new_slot in moves:
            target = new[new_index]
            assert target is not None, f"slot {old_slot} of {source!r} has no new chunk"
            if target.payload is None:
                target.allocate(host)
            if source.slot_state(old_slot) is TensorState.HOLD:
                value = source.view(old_slot)
                target.write(new_slot, value)
                if source.tier is not host:  # a device-to-host copy: traffic, as an eviction
                    num_bytes = value.numel() * value.element_size()
                    source.tier.record_move(out_bytes=num_bytes)
                    host.record_move(in_bytes=num_bytes)
        source.release(discard=True)
    for chunk in new:
        if chunk is not None and chunk.payload is not None:
            chunk.fill_free_slots(0.0)
