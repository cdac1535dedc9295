"""Chunk placement as data: the moves to make before each moment of a trace, and their traffic.

:func:`plan_moment` is a pure function of (trace, residency, budget) returning moves; the runtime
executes them. So placement is testable without a GPU, and :func:`simulate` can replay a trace and
compare a policy with the offline optimum (:func:`optimal_traffic`) on the same access sequence.

[Note: placement]
A moment (:class:`tidal.memory.trace.Moment`) is a point of the iteration at which a set of
chunks must be on the device: just before a module's forward or backward, or the optimizer step.
While moment ``k`` runs the device holds the resident chunks plus that moment's non-model bytes
(activations, workspaces, measured at its peak in the warm-up iteration), so the budget equation is

    bytes(resident chunks after the moves for k) + non_model_bytes[k] <= device_budget_bytes

and the chunks get ``device_budget_bytes - non_model_bytes[k]``. Moves are made *before* the
moment runs because its non-model memory is allocated while it runs: evicting afterwards would be
too late, the peak would already have overflowed (PatrickStar's ``adjust_chunk_layout`` evicts
before the next operator's activations arrive for the same reason). A prefetched chunk is resident
during the moment it is fetched in, so it counts against that moment's budget. Within a plan,
evictions come first, then fetches, then prefetches, the order the runtime issues them in. There
are no ratios or headroom factors here: the budget is whatever the engine measured and passed in,
and a moment that cannot fit raises before training starts.

[Note: prefetch never changes demand]
A prefetch fetches a chunk for one of the next ``prefetch_depth`` moments into room that is free
now. It never evicts anything, and it is accepted only if replaying the on-demand plan over the
moments until the chunk's use, with and without the chunk, evicts exactly the same chunks. Then the
run with prefetch makes the same evictions as the run without it and fetches the same chunks, only
earlier, whatever the policy and however non-model bytes vary between moments: the only extra
traffic is prefetches for moments the run never reaches. A weaker rule that lets a prefetch evict a
chunk used later than the prefetched one can add traffic when a later moment has more room than
this one (the evicted chunk would have stayed), or when a chunk used in between needs the room.

[Note: one placement]
The runtime (:class:`tidal.memory.store.ChunkStore`) makes no placement decision of its own: it
asks :func:`choose_victims` which chunks to evict and :func:`choose_prefetch` which to fetch
ahead, and :func:`plan_moment` (so :func:`simulate`, the benches and the pinning choice) is built
on the same two functions, so a replay of the trace predicts the runtime move for move (tested).
Before a trace exists (the warm-up iteration), or once an iteration has left its trace, there are
no next uses to read: victims are then the least recently used (``last_use``), lowest index on
ties, whatever the policy, and nothing is prefetched. What the runtime adds is only what a pure
function cannot know: which chunks are on the device, which an enclosing module holds, and the
room left after the device's other allocations (gradient and state chunks, a step's buffers),
which it passes in as the budget.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tidal.memory.trace import AccessTrace

__all__ = [
    "Move",
    "MoveKind",
    "Policy",
    "Residency",
    "SimulationResult",
    "choose_prefetch",
    "choose_victims",
    "optimal_traffic",
    "plan_moment",
    "resident_chunks",
    "simulate",
    "static_offload_traffic",
    "traffic_lower_bound",
]

Policy = Literal["belady", "lru", "static"]
MoveKind = Literal["fetch", "evict", "prefetch"]
Residency = Mapping[int, bool]

_POLICIES = ("belady", "lru", "static")
_MIB = 1 << 20


@dataclass(frozen=True)
class Move:
    chunk: int
    kind: MoveKind


def resident_chunks(residency: Residency) -> frozenset[int]:
    return frozenset(chunk for chunk, on_device in residency.items() if on_device)


@dataclass(frozen=True)
class _Rule:
    """How victims are chosen; ``recency`` is the lru clock (bigger is more recent)."""

    policy: Policy
    recency: Mapping[int, int]
    static_resident: frozenset[int]
    pinned: frozenset[int] = frozenset()  # never victims

    def used(self, chunks: frozenset[int], clock: int) -> _Rule:
        if self.policy != "lru":
            return self
        return replace(self, recency={**self.recency, **dict.fromkeys(chunks, clock)})


@dataclass(frozen=True)
class _Step:
    fetch: frozenset[int]
    evict: tuple[int, ...]
    resident: frozenset[int]


def _victim_order(trace: AccessTrace, index: int, candidates: set[int], rule: _Rule) -> list[int]:
    if rule.policy == "lru":
        return _least_recent_first(candidates, rule.recency)
    return _furthest_first(candidates, trace, index)


def _least_recent_first(candidates: Iterable[int], recency: Mapping[int, int]) -> list[int]:
    return sorted(candidates, key=lambda c: (recency.get(c, -1), c))


def _furthest_first(candidates: Iterable[int], trace: AccessTrace, index: int) -> list[int]:
    def key(chunk: int) -> tuple[float, int, int]:
        next_index = trace.next_use(chunk, index)
        distance = math.inf if next_index is None else next_index - index
        return (-distance, -trace.chunk_bytes[chunk], chunk)

    return sorted(candidates, key=key)


def _take_until(order: Iterable[int], excess_bytes: int, chunk_bytes: Sequence[int]) -> list[int]:
    """The shortest prefix of ``order`` whose bytes cover ``excess_bytes`` (all of it if none)."""
    taken = []
    for chunk in order if excess_bytes > 0 else ():
        if excess_bytes <= 0:
            break
        taken.append(chunk)
        excess_bytes -= chunk_bytes[chunk]
    return taken


def choose_victims(
    candidates: Iterable[int],
    excess_bytes: int,
    *,
    chunk_bytes: Sequence[int],
    policy: Policy,
    trace: AccessTrace | None = None,
    moment_index: int = -1,
    last_use: Mapping[int, int] | None = None,
) -> tuple[int, ...]:
    """The chunks to evict, in order, to free ``excess_bytes`` ([Note: one placement]).

    ``belady`` with a ``trace`` and a ``moment_index`` in it evicts the chunk used furthest
    ahead first (never-used chunks first, then bigger chunks, then the lower index); ``lru``, or
    any policy without a trace to follow, the least recently used by ``last_use`` (lowest index
    on ties). Returns every candidate, in that order, when they cannot free that much.
    """
    if policy not in ("belady", "lru"):
        raise ValueError(f"choose_victims takes policy 'belady' or 'lru', got {policy!r}")
    if policy == "belady" and trace is not None and 0 <= moment_index < len(trace):
        order = _furthest_first(candidates, trace, moment_index)
    else:
        order = _least_recent_first(candidates, last_use or {})
    return tuple(_take_until(order, excess_bytes, chunk_bytes))


def _demand_step(
    trace: AccessTrace, index: int, resident: frozenset[int], budget_bytes: int, rule: _Rule
) -> _Step:
    """Fetch the moment's chunks and evict by the rule until the chunks fit (if they can)."""
    moment = trace.moments[index]
    held = set(resident | moment.chunks)
    candidates = held - moment.chunks - rule.pinned
    if rule.policy == "static":
        evict = sorted(candidates - rule.static_resident)
    else:
        excess_bytes = trace.bytes_of(held) - (budget_bytes - moment.non_model_bytes)
        # Ordering victims is the expensive part and most moments evict nothing.
        order = _victim_order(trace, index, candidates, rule) if excess_bytes > 0 else ()
        evict = _take_until(order, excess_bytes, trace.chunk_bytes)
    return _Step(moment.chunks - resident, tuple(evict), frozenset(held.difference(evict)))


def _lookahead(
    trace: AccessTrace,
    index: int,
    resident: frozenset[int],
    budget_bytes: int,
    rule: _Rule,
    steps: int,
    clock: int,
) -> tuple[tuple[int, ...], ...]:
    """The evictions of the on-demand plan for the ``steps`` moments after ``index``."""
    evictions = []
    rule = rule.used(trace.moments[index].chunks, clock)
    for step in range(1, steps + 1):
        at = (index + step) % len(trace)
        planned = _demand_step(trace, at, resident, budget_bytes, rule)
        evictions.append(planned.evict)
        resident = planned.resident
        rule = rule.used(trace.moments[at].chunks, clock + step)
    return tuple(evictions)


def _prefetch(
    trace: AccessTrace,
    index: int,
    resident: frozenset[int],
    budget_bytes: int,
    rule: _Rule,
    depth: int,
) -> list[int]:
    """Chunks of the next moments to fetch now, in order of need (see [Note: prefetch never ...])."""
    window = min(depth, len(trace) - 1)
    wanted: list[int] = []
    for step in range(1, window + 1):
        upcoming = trace.moments[(index + step) % len(trace)].chunks
        wanted.extend(sorted(upcoming - resident - set(wanted)))
    room_bytes = budget_bytes - trace.moments[index].non_model_bytes - trace.bytes_of(resident)
    clock = max(rule.recency.values(), default=-1) + 1
    baseline = _lookahead(trace, index, resident, budget_bytes, rule, window - 1, clock)
    chosen: list[int] = []
    for chunk in wanted:
        if trace.chunk_bytes[chunk] > room_bytes:
            break
        trial = _lookahead(trace, index, resident | {chunk}, budget_bytes, rule, window - 1, clock)
        if trial != baseline:
            break
        chosen.append(chunk)
        resident |= {chunk}
        room_bytes -= trace.chunk_bytes[chunk]
    return chosen


def choose_prefetch(
    trace: AccessTrace,
    moment_index: int,
    resident: frozenset[int],
    *,
    device_budget_bytes: int,
    policy: Policy,
    prefetch_depth: int = 1,
    last_use: Mapping[int, int] | None = None,
    pinned: frozenset[int] = frozenset(),
) -> list[int]:
    """The chunks of the next ``prefetch_depth`` moments to fetch during moment
    ``moment_index``, once ``resident`` (its own chunks included) is on the device, in order of
    need ([Note: prefetch never changes demand]). The moments wrap around into the next
    iteration; a runtime that ends its iteration passes a depth that stops at the last moment."""
    if prefetch_depth <= 0:
        return []
    rule = _make_rule(policy, last_use, None, pinned)
    return _prefetch(
        trace, moment_index, frozenset(resident), device_budget_bytes, rule, prefetch_depth
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / _MIB:.2f} MiB)"


def _check_moment_fits(trace: AccessTrace, index: int, budget_bytes: int) -> None:
    moment = trace.moments[index]
    needed_bytes = trace.moment_device_bytes(index)
    if needed_bytes > budget_bytes:
        raise ValueError(
            f"device budget below the minimum: moment {index} {moment.label!r} needs "
            f"{_mib(needed_bytes)} ({_mib(trace.bytes_of(moment.chunks))} of chunks "
            f"{sorted(moment.chunks)} + {_mib(moment.non_model_bytes)} of non-model data), "
            f"but the device budget is {_mib(budget_bytes)}; this trace needs at least "
            f"{_mib(trace.min_device_bytes())}"
        )


def _make_rule(
    policy: Policy,
    last_use: Mapping[int, int] | None,
    static_resident: frozenset[int] | None,
    pinned: frozenset[int] = frozenset(),
) -> _Rule:
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
    if policy == "lru" and last_use is None:
        # An empty mapping is a valid "nothing used yet"; a missing one would silently order
        # victims by chunk id, PatrickStar's warm-up behaviour with all keys 0.
        raise ValueError("policy 'lru' needs last_use (chunk -> index of its last use)")
    return _Rule(policy, dict(last_use or {}), frozenset(static_resident or ()), frozenset(pinned))


def plan_moment(
    trace: AccessTrace,
    moment_index: int,
    resident: frozenset[int],
    *,
    device_budget_bytes: int,
    policy: Policy,
    prefetch_depth: int = 1,
    last_use: Mapping[int, int] | None = None,
    static_resident: frozenset[int] | None = None,
    pinned: frozenset[int] = frozenset(),
) -> list[Move]:
    """The moves to make before moment ``moment_index`` runs (see [Note: placement]).

    Evictions follow ``policy``: ``belady`` evicts the chunk whose next use is furthest away
    (never-used chunks first, then bigger chunks on ties), ``lru`` the least recently used by
    ``last_use`` (any clock that grows, such as ``iteration * len(trace) + index``), ``static``
    every chunk not in ``static_resident`` as soon as a moment does not need it. ``pinned``
    chunks are never evicted (the store's chunks kept on the device with their optimizer
    state). Raises ``ValueError`` when the moment cannot fit the budget even alone.
    """
    if not 0 <= moment_index < len(trace):
        raise ValueError(f"moment_index must be in [0, {len(trace)}), got {moment_index}")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
    rule = _make_rule(policy, last_use, static_resident, pinned)
    _check_moment_fits(trace, moment_index, device_budget_bytes)
    step = _demand_step(trace, moment_index, frozenset(resident), device_budget_bytes, rule)
    moment = trace.moments[moment_index]
    held_bytes = trace.bytes_of(step.resident) + moment.non_model_bytes
    if held_bytes > device_budget_bytes:
        raise ValueError(
            f"static_resident or pinned chunks do not fit: moment {moment_index} "
            f"{moment.label!r} would hold {_mib(held_bytes)} on a device budget of "
            f"{_mib(device_budget_bytes)}"
        )
    prefetch = _prefetch(
        trace, moment_index, step.resident, device_budget_bytes, rule, prefetch_depth
    )
    return [
        *(Move(chunk, "evict") for chunk in step.evict),
        *(Move(chunk, "fetch") for chunk in sorted(step.fetch)),
        *(Move(chunk, "prefetch") for chunk in prefetch),
    ]


@dataclass(frozen=True)
class SimulationResult:
    """Traffic of a replayed trace, per iteration; prefetches are part of the fetch figures."""

    fetched_bytes: tuple[int, ...]
    prefetched_bytes: tuple[int, ...]
    evicted_bytes: tuple[int, ...]
    fetches: tuple[int, ...]
    evictions: tuple[int, ...]
    peak_device_bytes: int
    # Prefetched chunks no simulated moment used: fetched for a moment after the last one.
    unused_prefetch_bytes: int

    @property
    def total_fetched_bytes(self) -> int:
        return sum(self.fetched_bytes)

    @property
    def total_evicted_bytes(self) -> int:
        return sum(self.evicted_bytes)

    @property
    def total_fetches(self) -> int:
        return sum(self.fetches)

    @property
    def total_evictions(self) -> int:
        return sum(self.evictions)


def simulate(
    trace: AccessTrace,
    *,
    device_budget_bytes: int,
    policy: Policy,
    prefetch_depth: int = 1,
    iterations: int = 2,
    initially_resident: frozenset[int] = frozenset(),
    static_resident: frozenset[int] | None = None,
    pinned: frozenset[int] = frozenset(),
) -> SimulationResult:
    """Replay ``iterations`` iterations of ``trace`` under ``plan_moment``, checking the budget.

    Every eviction costs the chunk's bytes device -> host: model data is dirty after the optimizer
    step, and telling clean from dirty chunks is not worth the complexity here.
    """
    resident = frozenset(initially_resident)
    last_use: dict[int, int] = {}
    pending: set[int] = set()  # prefetched, not used yet
    unused_bytes = peak_bytes = 0
    tallies: list[Counter[str]] = [Counter() for _ in range(iterations)]
    for iteration, tally in enumerate(tallies):
        for moment in trace.moments:
            moves = plan_moment(
                trace,
                moment.index,
                resident,
                device_budget_bytes=device_budget_bytes,
                policy=policy,
                prefetch_depth=prefetch_depth,
                last_use=last_use,
                static_resident=static_resident,
                pinned=pinned,
            )
            for move in moves:
                size = trace.chunk_bytes[move.chunk]
                tally[move.kind] += 1
                tally[f"{move.kind}_bytes"] += size
                if move.kind == "evict":
                    resident -= {move.chunk}
                    unused_bytes += size if move.chunk in pending else 0
                    pending.discard(move.chunk)
                else:
                    resident |= {move.chunk}
                    pending |= {move.chunk} if move.kind == "prefetch" else set()
            device_bytes = trace.bytes_of(resident) + moment.non_model_bytes
            if not moment.chunks <= resident or device_bytes > device_budget_bytes:
                raise AssertionError(
                    f"plan for moment {moment.index} {moment.label!r} broke its contract: "
                    f"missing {sorted(moment.chunks - resident)}, {device_bytes} bytes held "
                    f"on a budget of {device_budget_bytes}"
                )
            peak_bytes = max(peak_bytes, device_bytes)
            pending -= moment.chunks
            last_use.update(dict.fromkeys(moment.chunks, iteration * len(trace) + moment.index))

    def column(*keys: str) -> tuple[int, ...]:
        return tuple(sum(tally[key] for key in keys) for tally in tallies)

    return SimulationResult(
        fetched_bytes=column("fetch_bytes", "prefetch_bytes"),
        prefetched_bytes=column("prefetch_bytes"),
        evicted_bytes=column("evict_bytes"),
        fetches=column("fetch", "prefetch"),
        evictions=column("evict"),
        peak_device_bytes=peak_bytes,
        unused_prefetch_bytes=unused_bytes + trace.bytes_of(pending),
    )


def _used_chunks(trace: AccessTrace) -> frozenset[int]:
    return frozenset().union(*(moment.chunks for moment in trace.moments))


def optimal_traffic(trace: AccessTrace, *, device_budget_bytes: int, iterations: int = 2) -> int:
    """The fewest host -> device bytes any plan needs for ``iterations`` iterations from empty.

    Exact only when all used chunks have the same size: then this is Belady's MIN (evict the
    chunk used furthest ahead, fetch on demand), which minimises the number of fetches even with a
    per-moment capacity and several chunks per moment (the exchange argument of the classic proof
    carries over; the tests check it against exhaustive search on small traces). With unequal sizes the problem is NP-hard in general, so this raises; use
    :func:`traffic_lower_bound` there.
    """
    sizes = {trace.chunk_bytes[chunk] for chunk in _used_chunks(trace)}
    if len(sizes) > 1:
        raise ValueError(
            f"optimal_traffic is exact only for equal chunk sizes, got {sorted(sizes)}; "
            "use traffic_lower_bound for a bound"
        )
    result = simulate(
        trace,
        device_budget_bytes=device_budget_bytes,
        policy="belady",
        prefetch_depth=0,
        iterations=iterations,
    )
    return result.total_fetched_bytes


def traffic_lower_bound(
    trace: AccessTrace, *, device_budget_bytes: int, iterations: int = 2
) -> int:
    """A lower bound on the host -> device bytes of any plan, for any chunk sizes, from empty.

    It is the exact optimum of the fractional relaxation in which part of a chunk may stay on the
    device: every byte becomes a unit page that shares its chunk's uses, and for unit pages
    Belady's MIN (evict the bytes used furthest ahead) is optimal. Any real plan is also a
    fractional plan, so none moves fewer bytes; with equal sizes it can still be below
    :func:`optimal_traffic` when the room for chunks is not a multiple of the chunk size.
    """
    belady = _Rule("belady", {}, frozenset())
    held: dict[int, int] = {}
    fetched_bytes = 0
    for _ in range(iterations):
        for moment in trace.moments:
            _check_moment_fits(trace, moment.index, device_budget_bytes)
            for chunk in moment.chunks:
                fetched_bytes += trace.chunk_bytes[chunk] - held.get(chunk, 0)
                held[chunk] = trace.chunk_bytes[chunk]
            excess_bytes = sum(held.values()) - (device_budget_bytes - moment.non_model_bytes)
            candidates = {chunk for chunk, size in held.items() if size} - moment.chunks
            for chunk in _victim_order(trace, moment.index, candidates, belady):
                if excess_bytes <= 0:
                    break
                dropped = min(held[chunk], excess_bytes)
                held[chunk] -= dropped
                excess_bytes -= dropped
    return fetched_bytes


def static_offload_traffic(trace: AccessTrace) -> int:
    """Host -> device bytes per iteration when every used chunk moves in and out once per
    iteration, as ZeRO-Offload does; device -> host traffic is the same figure."""
    return trace.bytes_of(_used_chunks(trace))
