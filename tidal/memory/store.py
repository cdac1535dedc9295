"""The chunk store: a model's parameters in chunks, and which chunks are on the device.

[Note: chunk store]
At construction every parameter's data is copied into a PARAM chunk on the host tier, and the
parameter is re-pointed (``param.data``) at its slot in the chunk's persistent device buffer
([Note: persistent buffers] in tiers.py). From then on a parameter is usable exactly while its
chunk is on the device; the hooks call :meth:`ChunkStore.access` before a module runs (forward
or backward) and :meth:`ChunkStore.release` after.

``access`` is where placement happens. Each call is one *moment*: the chunks a module needs. The
store fetches missing chunks and, when the device tier would go over its budget, evicts chunks
that are neither needed now nor in use (COMPUTE: an enclosing module still running). Which ones,
and which chunks to fetch ahead, the store does not decide: it asks the policy
(:func:`tidal.memory.policy.choose_victims` and :func:`~tidal.memory.policy.choose_prefetch`,
[Note: one placement] in policy.py), which evicts the chunk whose next use is furthest away in
the trace of the last iteration (Belady) or, before a trace exists or once this iteration has
left it, the least recently used, and executes the moves it returns, evictions first, through
its transport ([Note: transports] in transport.py). The device tier's own accounting refuses to
exceed the budget, so a policy bug fails loudly instead of using memory it was not given.

Every iteration's moments are recorded. A moment's chunk set is every chunk that must be on
the device while it lasts: the chunks of the parameters it acquires and of those still held by
enclosing modules (a module runs inside its ancestors' forward, whose own parameters stay in
use). A release is a moment too (labelled ``end:`` and the label it closes), holding only what
is still held after it: the activations made after a module returned (a residual add, the loss)
do not need that module's chunks, so the trace charges them to the release moment, which is
what makes :meth:`AccessTrace.min_device_bytes` the least budget the iteration runs in ([Note:
the least budget]). While the moments match the stored trace, its next-use figures drive
eviction; at the first moment that differs (another sequence length, eval instead of train, a
data-dependent branch) the store falls back to LRU for the rest of that iteration, and the
newly recorded sequence becomes the trace ([Note: trace validity] in trace.py). A trace whose
sequence matches but whose non-model figures differ (a longer sequence with the same modules)
is replaced too, so the room the store leaves for activations is the latest measured.

Non-model bytes ([Note: non-model memory] in activations.py) share the budget. At each moment
the store leaves room for what the trace says the moment will add, and whenever the meter sees
the non-model bytes grow past the budget it evicts chunks (the same victim rule) before the
bytes are counted. So no moment, the first iteration's included, takes the device past its
budget.

[Note: copy streams]
On CUDA every move runs on one side stream, queued after the work already on the compute stream
(so a chunk leaves only once the kernels that read it are done), and the caching allocator is
told the device block is in use by that stream (``record_stream``), so an evicted chunk's memory
is not handed out again before its copy has read it. A fetched chunk's arrival is an event that
the compute stream waits for at the chunk's first use; the host waits for the whole stream
(:meth:`ChunkStore.wait_for_copies`) before it reads host payloads: the host-side optimizer
update and checkpoints. Prefetching is what makes the side stream pay: while following the
trace, after a moment's own chunks are in, the next moment's chunks are fetched into room that is
free after the trace's activation figure for this moment, so they copy while this moment
computes. A prefetch never evicts, so it moves the same bytes the on-demand fetch would have
moved one moment later ([Note: prefetch never changes demand] in policy.py, depth 1). On a CPU
the same code runs with inline copies.

[Note: why one file]
The store is one state machine: its chunks' residency, the open iteration's moments, and the
held parameters change together at every access and release, so its steps read best side by side.
What could leave has left: the placement rule (policy.py), moves (transport.py), shortfall
messages (shortfall.py), pinning (pinning.py). Next to go, if it grows: the uses outside the
module hooks and relayout's adopt_layout, once they stop touching the residency directly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tidal.memory.activations import make_meter
from tidal.memory.chunk import Chunk, ChunkKind, ChunkState, TensorState
from tidal.memory.layout import ChunkLayout
from tidal.memory.materialize import repoint, values_of
from tidal.memory.policy import Move, MoveKind, choose_prefetch, choose_victims
from tidal.memory.shortfall import (
    DeviceBudgetTooSmall,
    Shortfall,
    another_rank_short,
    chunk_size_advice,
    moment_too_small,
)
from tidal.memory.tiers import Tier, TierBudgetError, TierKind
from tidal.memory.trace import AccessTrace, TraceRecorder
from tidal.memory.transport import ChunkTransport, LocalTransport

__all__ = ["ChunkStore", "DeviceBudgetTooSmall"]


class ChunkStore:
    """Parameter chunks of one model and their residency; see [Note: chunk store]."""

    # id(param) in the order the last completed iteration first accessed them ([Note: relayout]
    # in relayout.py); parameters no hook accessed are not in it.
    first_use_order: tuple[int, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: ChunkLayout,
        device_tier: Tier,
        host_tier: Tier,
        dtype: torch.dtype = torch.float32,
        policy: str = "belady",
        prefetch: bool = True,
        values: Iterable[tuple[str, torch.Tensor]] | None = None,
        transport: ChunkTransport | None = None,
    ) -> None:
        assert device_tier.kind is TierKind.DEVICE and host_tier.kind is TierKind.HOST
        assert policy in ("belady", "lru"), policy
        self.policy = policy
        self.prefetch = prefetch
        self.prefetch_depth = 1  # moments ahead ([Note: prefetch never changes demand])
        self.num_prefetches = 0
        # Every move executed, with the index of the moment it was made for (-1 outside an
        # iteration), while this is a list: tests compare it with a replay of the trace.
        self.move_log: list[tuple[int, Move]] | None = None
        # [Note: transports] in transport.py: what a fetch and an eviction are.
        self.transport: ChunkTransport = LocalTransport() if transport is None else transport
        self.layout = layout
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.chunks = [Chunk(spec, kind=ChunkKind.PARAM, dtype=dtype) for spec in layout.chunks]
        self.slot_of: dict[int, tuple[int, int]] = {}  # id(param) -> (chunk index, slot)
        self.params: dict[int, nn.Parameter] = {}  # id(param) -> param
        # [Note: deferred construction] in materialize.py: the values, if not the model's own.
        self._register_slots(model)
        self.transport.attach(self)
        self.transport.load(values_of(model) if values is None else values)
        self._repoint()
        self.trace: AccessTrace | None = None
        # Per moment of ``trace``: id(param) of every parameter held then (relayout translates
        # the trace through them); recorded only while ``keep_trace_params`` (the engine turns
        # it off once relayout is behind it).
        self.trace_params: tuple[frozenset[int], ...] = ()
        self.keep_trace_params = True
        self._recorder = TraceRecorder([c.num_bytes for c in self.chunks])
        self._recorded_params: list[frozenset[int]] = []
        # [Note: the least budget] in shortfall.py: the largest figures over every iteration
        # seen, and the measuring of an iteration that ran short.
        self.least_budget_bytes = 0
        self.peak_non_model_bytes = 0
        self._shortfall = Shortfall(device_tier, advice=chunk_size_advice(self.chunks))
        self._following_trace = False
        self._clock = 0
        self._last_use = [-1] * len(self.chunks)
        self.num_evictions = 0
        self.num_fetches = 0
        # Chunks that stay on the device for good: their optimizer state lives there too.
        self.pinned: frozenset[int] = frozenset()
        self.num_traces = 0  # traces adopted: 1 + how often the sequence or its bytes changed
        # Called when the pinned chunks are given up for room (the optimizer's state leaves).
        self.on_unpin: Callable[[], None] | None = None
        self.num_unpins = 0
        # id(param) whose slot holds its gradient, not its weights, until the optimizer step
        # ([Note: gradients in parameter chunks] in optim.py): a moment that needs one raises.
        self.grads_in_slots: set[int] = set()
        self._moment = -1
        self._label = "before the first moment"
        self._param_storages = _storage_keys(self.chunks, device_tier)
        self._pids_in = _pids_by_chunk(self.slot_of, len(self.chunks))
        self._held: dict[int, int] = {}  # id(param) -> acquires not yet released
        self._forward_depth = 0  # the model's own forward is running (hooks.py)
        # Parameters held since backward unpacked them ([Note: parameter uses] in uses.py).
        self._unpack_held: list[nn.Parameter] = []
        self._unpacking = False
        self.meter = make_meter(
            device_tier.device,
            device_tier,
            is_model_storage=self._is_param_storage,
            on_change=self._non_model_changed,
            on_model_unpack=self._model_unpacked,
        )

    def _register_slots(self, model: nn.Module) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        for spec in self.layout.chunks:
            for slot, info in enumerate(spec.slots):
                param = params[info.names[0]]
                self.slot_of[id(param)] = (spec.index, slot)
                self.params[id(param)] = param

    def _repoint(self) -> None:
        """Every parameter becomes a view of its chunk's device buffer, once all were copied
        (a tied parameter appears once)."""
        for pid, (index, slot) in self.slot_of.items():
            repoint(self.params[pid], self.chunks[index].device_view(slot, self.device_tier))

    # -- queries ---------------------------------------------------------------------------------

    def chunks_of(self, params: Iterable[nn.Parameter]) -> frozenset[int]:
        return frozenset(self.slot_of[id(p)][0] for p in params if id(p) in self.slot_of)

    @property
    def model_bytes(self) -> int:
        """Bytes of parameters this process keeps (a rank's shards under ZeRO-3)."""
        return self.transport.kept_bytes()

    @property
    def moment_label(self) -> str:
        """The label of the moment being placed (for error messages)."""
        return self._label

    def min_device_bytes(self) -> int:
        """Bytes the largest moment of the last trace needs; the largest chunk before one."""
        if self.trace is not None:
            return self.trace.min_device_bytes()
        return max(c.num_bytes for c in self.chunks)

    def in_use(self, param: nn.Parameter) -> bool:
        """Whether a moment holds ``param`` now (its module is running)."""
        return id(param) in self._held

    def on_device(self, param: nn.Parameter) -> bool:
        return self.chunks[self.slot_of[id(param)][0]].on_device

    @property
    def model_running(self) -> bool:
        """An iteration is open, or the model's own forward is running ([Note: parameter
        uses] in uses.py)."""
        return self._recorder.recording or self._forward_depth > 0

    def enter_forward(self) -> None:
        self._forward_depth += 1

    def leave_forward(self) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)

    def unpinned_chunk_views(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` is a view of a parameter chunk that is not pinned."""
        for tensor in tensors:
            index = self._param_storages.get(tensor.untyped_storage()._cdata)
            if index is not None and index not in self.pinned:
                return True
        return False

    # -- iterations and moments ------------------------------------------------------------------

    def begin_iteration(self) -> None:
        self._recorder.begin_iteration()
        self._recorded_params = []
        self._first_use_now: dict[int, None] = {}  # id(param), in order of first access
        self._following_trace = self.trace is not None and self.policy == "belady"

    def end_iteration(self) -> None:
        """Keep the iteration just recorded as the trace if it differs from the stored one;
        raise :class:`DeviceBudgetTooSmall` if it did not fit ([Note: the least budget])."""
        if not self._recorder.recording:
            return
        self._recorder.raise_last(self.meter.take_peak_bytes())
        # [Note: ranks decide alike] in tidal/sharding/store.py: every rank keeps one trace.
        recorded, ran_short = self.transport.agree_trace(
            self._recorder.finish(), ran_short=self._shortfall.measuring
        )
        self.first_use_order = tuple(self._first_use_now)
        if self.trace is None or recorded.differs_from(self.trace):
            self.trace = recorded
            self.trace_params = tuple(self._recorded_params) if self.keep_trace_params else ()
            self.num_traces += 1
        self._following_trace = False
        self._moment, self._label = -1, "between iterations"
        self.least_budget_bytes = max(self.least_budget_bytes, recorded.min_device_bytes())
        self.peak_non_model_bytes = max(self.peak_non_model_bytes, recorded.peak_non_model_bytes)
        if self._shortfall.measuring:
            self._evict_all_unpinned()
            raise self._shortfall.end(recorded)
        if ran_short:
            raise another_rank_short(recorded, self.device_tier, self._shortfall.advice)

    def abandon_iteration(self) -> None:
        """Drop the iteration being recorded (its forward raised): its partial sequence is no
        trace, and a budget it lifted comes back."""
        self.release_all()
        if self._recorder.recording:
            self._recorder.finish()
        self._following_trace = False
        self._moment, self._label = -1, "between iterations"
        if self._shortfall.measuring:
            self._evict_all_unpinned()
            self._shortfall.end(None)

    def access(self, label: str, params: Iterable[nn.Parameter]) -> None:
        """One moment: bring the params' chunks to the device and mark the params in use."""
        params = [p for p in params if id(p) in self.slot_of]
        if self.grads_in_slots:
            self._refuse_gradient_slots(label, params)
        if not self._unpacking:  # a module moment: the operations that unpacked them are done
            self._release_unpack_held()
        needed = self.chunks_of(params)
        moment = self._begin_moment(label, needed | self._held_chunks(), params)
        reserve_bytes = self._expected_growth_bytes(moment, self.meter.live_bytes())
        # Evictions first, then fetches, then prefetches ([Note: placement] in policy.py).
        missing = [i for i in needed if not self.chunks[i].on_device]
        missing_bytes = sum(self.chunks[i].num_bytes for i in missing)
        self._make_room(missing_bytes + reserve_bytes, needed, required_bytes=missing_bytes)
        prefetch_budget_bytes = self._agree(moment)
        for index in sorted(i for i in needed if not self.chunks[i].on_device):
            self._fetch(index, needed, kind="fetch")
        self.transport.await_arrival(needed)
        self._prefetch_next(moment, prefetch_budget_bytes)
        self._clock += 1
        for index in needed:
            self._last_use[index] = self._clock
        for p in params:
            index, slot = self.slot_of[id(p)]
            self.chunks[index].acquire(slot)
            self._held[id(p)] = self._held.get(id(p), 0) + 1

    def release(self, params: Iterable[nn.Parameter], *, label: str | None = None) -> None:
        """Undo an :meth:`access`; with the access's ``label``, the release is a moment of
        the trace (see the module doc)."""
        for p in params:
            if id(p) in self.slot_of:
                index, slot = self.slot_of[id(p)]
                self.chunks[index].release_slot(slot)
                self._held[id(p)] -= 1
                if not self._held[id(p)]:
                    del self._held[id(p)]
        if label is None or not self._recorder.recording:
            return
        held = self._held_chunks()
        moment = self._begin_moment("end:" + label, held, [])
        reserve_bytes = self._expected_growth_bytes(moment, self.meter.live_bytes())
        self._make_room(reserve_bytes, held, required_bytes=0)
        self._prefetch_next(moment, self._agree(moment))

    @contextlib.contextmanager
    def holding(self, label: str, params: list[nn.Parameter]) -> Iterator[None]:
        """``params`` on the device and held for the duration: a moment and its release."""
        self.access(label, params)
        try:
            yield
        finally:
            self.release(params, label=label)

    def release_all(self) -> None:
        """Return every slot still in use to HOLD (modules whose post hook did not run)."""
        self._unpack_held = []
        self._held.clear()
        for chunk in self.chunks:
            for slot in range(len(chunk.spec.slots)):
                while chunk.slot_state(slot) is TensorState.COMPUTE:
                    chunk.release_slot(slot)

    def _held_chunks(self) -> frozenset[int]:
        return frozenset(self.slot_of[pid][0] for pid in self._held)

    def _begin_moment(self, label: str, chunks: frozenset[int], params: list[nn.Parameter]) -> int:
        """Record a moment holding ``chunks`` (``params`` about to be acquired, and every
        parameter held now) and make the meter's figure count; the moment's index, or -1
        outside an iteration."""
        live_bytes = self.meter.live_bytes()
        moment = -1
        if self._recorder.recording:
            self._recorder.raise_last(self.meter.take_peak_bytes())
            moment = self._recorder.record(label, chunks, live_bytes).index
            if self.keep_trace_params:
                self._recorded_params.append(frozenset(self._held) | {id(p) for p in params})
            self._first_use_now.update(dict.fromkeys(map(id, params)))  # seen ones keep their place
            if self._following_trace and not self._matches_trace(moment, label, chunks):
                self._following_trace = False
        self._moment, self._label = moment, label
        self._non_model_changed(live_bytes)
        return moment

    def _refuse_gradient_slots(self, label: str, params: list[nn.Parameter]) -> None:
        held = [p for p in params if id(p) in self.grads_in_slots]
        if held:
            index, slot = self.slot_of[id(held[0])]
            name = self.layout.chunks[index].slots[slot].names[0]
            raise RuntimeError(
                f"{label} needs {name}, whose low-precision storage holds its gradient, not its "
                f"weights, from the backward that produced it until step() copies the fp32 "
                f"master back ([Note: gradients in parameter chunks] in tidal/memory/optim.py): "
                f"call step() (or zero_grad() to drop the gradients) before running the model "
                f"again, set training.grad_accum_steps to the number of backwards per step, or "
                f"set chunk.grads_in_params = false"
            )

    def _matches_trace(self, moment: int, label: str, chunks: frozenset[int]) -> bool:
        # Earlier moments of this iteration already matched, so only the newest is compared:
        # checking the whole prefix each time would cost O(moments^2) per iteration.
        assert self.trace is not None
        if moment >= len(self.trace.moments):
            return False
        stored = self.trace.moments[moment]
        return stored.label == label and stored.chunks == chunks

    # -- placement -------------------------------------------------------------------------------

    def _expected_growth_bytes(self, moment: int, live_bytes: int) -> int:
        """Non-model bytes the trace says this moment will add to what is live now."""
        if not self._following_trace or self.trace is None or moment < 0:
            return 0
        return max(0, self.trace.moments[moment].non_model_bytes - live_bytes)

    def _make_room(self, want_bytes: int, needed: frozenset[int], *, required_bytes: int) -> None:
        """Evict the policy's victims until ``want_bytes`` fit; fewer is fine once
        ``required_bytes`` fit."""
        tier = self.device_tier
        while not tier.can_fit(want_bytes):
            assert tier.budget_bytes is not None
            self._evict_victims(needed, tier.held_bytes + want_bytes - tier.budget_bytes)
            if tier.can_fit(want_bytes) or tier.can_fit(required_bytes):
                return
            if self._unpin():
                continue
            self._short(needed)
            return

    def make_device_room(self, num_bytes: int) -> None:
        """Evict unpinned chunks not in use until ``num_bytes`` more fit on the device."""
        self._make_room(num_bytes, frozenset(), required_bytes=num_bytes)

    def _evict_victims(self, needed: frozenset[int], excess_bytes: int) -> None:
        """Evict what the policy chooses to free ``excess_bytes`` ([Note: one placement] in
        policy.py): every chunk on the device that is not needed, in use or pinned is a
        candidate."""
        candidates = [
            c.index
            for c in self.chunks
            if c.on_device
            and c.index not in needed
            and c.index not in self.pinned
            and c.state is not ChunkState.COMPUTE
        ]
        victims = choose_victims(
            candidates,
            excess_bytes,
            chunk_bytes=[c.num_bytes for c in self.chunks],
            policy=self.policy,  # type: ignore[arg-type]
            trace=self.trace if self._following_trace else None,
            moment_index=self._moment,
            last_use=dict(enumerate(self._last_use)),
        )
        for index in victims:
            self.evict(index)

    def _fetch(self, index: int, needed: frozenset[int], *, kind: MoveKind) -> None:
        try:
            self.transport.fetch(index)
        except TierBudgetError as err:  # only if the accounting and can_fit disagree
            raise self._too_small(needed) from err
        self.num_fetches += 1
        self._log(index, kind)

    def _log(self, index: int, kind: MoveKind) -> None:
        if self.move_log is not None:
            self.move_log.append((self._moment, Move(index, kind)))

    def _agree(self, moment: int) -> int | None:
        """Make the residency the same on every rank (evict what another rank evicted) and
        return the budget to prefetch in, the least over ranks ([Note: ranks decide alike] in
        tidal/sharding/store.py). Only inside an iteration, whose moments every rank records
        alike; None with one rank (it agrees with itself) or with no device budget, where no
        decision reads a per-rank figure (nothing is evicted for room, and every rank's prefetch
        budget is unlimited): the moments themselves are still compared at every gather
        (``sharding.check_gathers``) and at the iteration's end (``agree_trace``)."""
        if moment < 0 or not self.transport.has_peers or self.device_tier.budget_bytes is None:
            return None
        resident = frozenset(c.index for c in self.chunks if c.on_device)
        budget_bytes = self._prefetch_budget_bytes(moment, resident)
        everywhere, budget_bytes = self.transport.agree_moment(
            self._recorder.moments[moment], resident, budget_bytes
        )
        for index in sorted(resident - everywhere):
            self.evict(index)
        return budget_bytes

    def _prefetch_budget_bytes(self, moment: int, resident: frozenset[int]) -> int:
        planned_bytes = 0
        if self._following_trace and self.trace is not None and moment >= 0:
            planned_bytes = self.trace.moments[moment].non_model_bytes
        return self._chunk_budget_bytes(resident, planned_non_model_bytes=planned_bytes)

    def _prefetch_next(self, moment: int, budget_bytes: int | None) -> None:
        """Fetch what the policy chooses for the next moments into room that is free now (see
        [Note: copy streams]); only while following the trace, and never past its last moment:
        the step after it evicts every unpinned chunk. ``budget_bytes`` is the device budget
        as the policy sees it (:meth:`_chunk_budget_bytes`) agreed over ranks, None to read
        this process's own."""
        if not (self.prefetch and self._following_trace) or moment < 0:
            return
        trace = self.trace
        assert trace is not None
        self.transport.read_ahead(moment)
        depth = min(self.prefetch_depth, len(trace) - 1 - moment)
        if depth <= 0:
            return
        resident = frozenset(c.index for c in self.chunks if c.on_device)
        if budget_bytes is None:
            budget_bytes = self._prefetch_budget_bytes(moment, resident)
        chosen = choose_prefetch(
            trace,
            moment,
            resident,
            device_budget_bytes=budget_bytes,
            policy=self.policy,  # type: ignore[arg-type]
            prefetch_depth=depth,
            pinned=self.pinned,
        )
        for index in chosen:
            self._fetch(index, frozenset(), kind="prefetch")
            self.num_prefetches += 1

    def _chunk_budget_bytes(self, resident: frozenset[int], *, planned_non_model_bytes: int) -> int:
        """The device budget as the policy sees it ([Note: placement] in policy.py), which
        plans with the trace's non-model figure ``planned_non_model_bytes``: the tier's budget
        less what it holds besides chunks and non-model bytes (gradient and state chunks, a
        step's buffers) and less the non-model bytes live now beyond the plan; unlimited as the
        largest int."""
        tier = self.device_tier
        if tier.budget_bytes is None:
            return sys.maxsize
        live_bytes = tier.non_model_bytes
        other_bytes = tier.held_bytes - live_bytes - sum(self.chunks[i].num_bytes for i in resident)
        return tier.budget_bytes - other_bytes - max(0, live_bytes - planned_non_model_bytes)

    def ready_for_write(self, index: int) -> None:
        """Order a write into chunk ``index``'s payload after the moves queued for it ([Note:
        copy streams]): on the device after its arrival, on the host after every queued copy
        (an eviction's may still be landing there)."""
        if self.chunks[index].on_device:
            self.transport.await_arrival([index])
        else:
            self.wait_for_copies()

    def wait_for_copies(self) -> None:
        """Block until every queued move has landed: before the host reads a payload."""
        self.transport.wait_for_copies()

    def _non_model_changed(self, live_bytes: int) -> None:
        """The meter's figure moved to ``live_bytes``: make room, then count it (see module doc)."""
        tier = self.device_tier
        while tier.budget_bytes is not None and (
            tier.allocated_bytes + live_bytes > tier.budget_bytes
        ):
            self._evict_victims(frozenset(), tier.allocated_bytes + live_bytes - tier.budget_bytes)
            if tier.allocated_bytes + live_bytes <= tier.budget_bytes:
                break
            if self._unpin():
                continue
            self._short(frozenset(), non_model_bytes=live_bytes)
            break
        tier.set_non_model_bytes(live_bytes)

    def evict(self, index: int) -> None:
        self.transport.evict(index)
        self.num_evictions += 1
        self._log(index, "evict")

    def evict_unpinned(self) -> None:
        for chunk in self.chunks:
            if chunk.on_device and chunk.index not in self.pinned:
                self.evict(chunk.index)

    def _unpin(self) -> bool:
        """Give up every pinned chunk for room, when a moment needs more than the pinning was
        chosen for (activations grew: a longer sequence); False if nothing was pinned. The
        engine chooses again from the new trace at the next step."""
        if not self.pinned or self.on_unpin is None:
            return False
        self.pinned = frozenset()
        self.on_unpin()
        self.num_unpins += 1
        return True

    def pin(self, indices: Iterable[int]) -> None:
        """Keep ``indices`` on the device from now on; every other chunk goes to the host."""
        self.pinned |= frozenset(indices)
        self.evict_unpinned()
        self._moment, self._label = -1, "pin"
        for index in sorted(self.pinned):
            if not self.chunks[index].on_device:
                self._make_room(self.chunks[index].num_bytes, self.pinned,
                                required_bytes=self.chunks[index].num_bytes)  # fmt: skip
                self._fetch(index, self.pinned, kind="fetch")

    def _short(self, needed: frozenset[int], *, non_model_bytes: int | None = None) -> None:
        """Nothing more can leave the device: raise outside an iteration, else measure the
        rest of it over the budget ([Note: the least budget] in shortfall.py)."""
        error = self._too_small(needed, non_model_bytes=non_model_bytes)
        if not self._recorder.recording:
            raise error
        self._shortfall.begin(error)

    def _evict_all_unpinned(self) -> None:
        """Between iterations, after measuring: back under the budget (pinned chunks too if
        need be; nothing is in use)."""
        self.evict_unpinned()
        if not self._shortfall.fits() and self._unpin():
            self.evict_unpinned()

    def _too_small(
        self, needed: frozenset[int], *, non_model_bytes: int | None = None
    ) -> DeviceBudgetTooSmall:
        stuck = [c for c in self.chunks if c.on_device and c.index not in needed
                 and (c.state is ChunkState.COMPUTE or c.index in self.pinned)]  # fmt: skip
        return moment_too_small(
            self._label, self.device_tier, chunks=self.chunks, needed=needed, stuck=stuck,
            non_model_bytes=non_model_bytes,
        )  # fmt: skip

    # -- uses outside the module hooks ([Note: parameter uses] in uses.py) ----------------------

    def names_of(self, params: Iterable[nn.Parameter]) -> list[str]:
        names = []
        for p in params:
            index, slot = self.slot_of[id(p)]
            names.append(self.layout.chunks[index].slots[slot].names[0])
        return names

    def _model_unpacked(self, key: int, tensor: torch.Tensor) -> None:
        """Backward unpacked ``tensor``, a view of chunk ``_param_storages[key]``: unless a
        moment holds them, access the parameters it covers and hold them until the next module
        moment. Only those: with gradients in the parameter chunks another slot of the chunk
        may already hold its gradient, which is no use of it."""
        index = self._param_storages[key]
        if all(pid in self._held for pid, _ in self._pids_in[index]):
            return  # the usual case: the module whose backward this is holds them
        reached = self.chunks[index].slots_reached(tensor)
        under = [pid for pid, slot in self._pids_in[index] if slot in reached]
        idle = [self.params[pid] for pid in under if pid not in self._held]
        if not idle:
            return
        self._unpacking = True
        try:
            self.access("unpack:" + ",".join(self.names_of(idle)), idle)
        finally:
            self._unpacking = False
        self._unpack_held += idle

    def _release_unpack_held(self) -> None:
        held, self._unpack_held = self._unpack_held, []
        self.release(held)

    # -- relayout ([Note: relayout] in relayout.py) ---------------------------------------------

    def _is_param_storage(self, key: int) -> bool:
        # Looked up through ``self``: a relayout replaces the set with the new chunks' storages.
        return key in self._param_storages

    def adopt_layout(
        self,
        layout: ChunkLayout,
        chunks: list[Chunk],
        slot_of: dict[int, tuple[int, int]],
        *,
        trace: AccessTrace,
    ) -> None:
        """Switch to ``chunks`` laid out as ``layout``, already holding every parameter's data;
        ``slot_of`` and ``trace`` are the old ones over the new chunk indices."""
        assert not self.pinned and not self._recorder.recording, "relayout inside an iteration"
        assert self.transport.supports_relayout, "relayout with a transport that cannot"
        last_use = [-1] * len(chunks)  # a new chunk was last used when its latest source was
        for pid, (index, _) in slot_of.items():
            last_use[index] = max(last_use[index], self._last_use[self.slot_of[pid][0]])
        self.layout, self.chunks, self.slot_of, self._last_use = layout, chunks, slot_of, last_use
        for pid, (index, slot) in slot_of.items():
            repoint(self.params[pid], chunks[index].device_view(slot, self.device_tier))
        self._param_storages = _storage_keys(chunks, self.device_tier)
        self._pids_in = _pids_by_chunk(slot_of, len(chunks))
        self.trace = trace
        self._recorder = TraceRecorder([c.num_bytes for c in chunks])
        self.transport.forget_arrivals()  # events of the old chunks, waited for by the caller


def _pids_by_chunk(
    slot_of: dict[int, tuple[int, int]], num_chunks: int
) -> list[list[tuple[int, int]]]:
    """Per chunk index, (id(param), slot) of its parameters."""
    pids: list[list[tuple[int, int]]] = [[] for _ in range(num_chunks)]
    for pid, (index, slot) in slot_of.items():
        pids[index].append((pid, slot))
    return pids


def _storage_keys(chunks: list[Chunk], device_tier: Tier) -> dict[int, int]:
    """Storage key (``untyped_storage()._cdata``, stable across resizes) -> chunk index."""
    return {c.device_handle(device_tier).untyped_storage()._cdata: c.index for c in chunks}
