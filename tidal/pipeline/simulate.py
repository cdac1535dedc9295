"""A discrete-event simulator over the schedule IR: makespan, bubbles, memory, weight delay.

[Note: simulation model]
- Each rank runs its program in order, one action at a time. An action starts when the rank is
  free and its data is there: ``F`` of stage ``s > 0`` needs ``F`` of ``s - 1`` for the same
  microbatch, ``B`` needs that stage's ``F`` and ``B`` of ``s + 1``, ``W`` needs its ``B``.
  Across ranks the data arrives through the explicit send/receive actions: a send takes no
  rank time and never blocks (buffered); the receive blocks until the matching send has run,
  and the message lands ``p2p_s`` after it. Stages on one rank hand data over directly.
- Times are computed in program order rather than with a global clock: an action's start is
  ``max(rank free, data ready)`` and is fixed once everything it needs has run, so a sweep
  over ranks that advances none of them means a cycle: :class:`Deadlock`.
- ``busy_s`` counts ``F``, ``B``, ``W`` and ``U`` (an update is work, not idle time); receives
  waiting for data are idle. Memory, versions and delays are counted per stage in program
  order, which on one rank is also time order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from tidal.config import require
from tidal.pipeline.ir import Action, Kind, Schedule, parse_action, with_communication

__all__ = ["Deadlock", "Event", "Simulation", "StageCosts", "simulate"]

_PerStage = float | tuple[float, ...]


@dataclass(kw_only=True, frozen=True, slots=True)
class StageCosts:
    """Durations in seconds per stage: a scalar applies to every stage, a tuple gives each.

    ``backward_s`` is the full backward (input and weight gradients). When a schedule splits a
    microbatch's backward into ``B`` and ``W``, ``B`` takes ``backward_s - weight_grad_s`` and
    ``W`` takes ``weight_grad_s``. ``p2p_s`` is the latency of one activation or gradient
    message; ``activation_bytes`` what a stage keeps per in-flight microbatch.
    """

    forward_s: _PerStage = 1.0
    backward_s: _PerStage = 2.0
    weight_grad_s: _PerStage = 0.0
    update_s: _PerStage = 0.0
    p2p_s: float = 0.0
    activation_bytes: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        for key in ("forward_s", "backward_s", "weight_grad_s", "update_s", "activation_bytes"):
            value = getattr(self, key)
            values = value if isinstance(value, tuple) else (value,)
            require(len(values) > 0, key, "give one value per stage, or a single value")
            require(all(x >= 0 for x in values), key, f"must be >= 0, got {value}")
        require(self.p2p_s >= 0, "p2p_s", f"must be >= 0, got {self.p2p_s}")

    def per_stage(self, key: str, num_stages: int) -> tuple[float, ...]:
        value = getattr(self, key)
        if not isinstance(value, tuple):
            return (value,) * num_stages
        require(
            len(value) == num_stages,
            key,
            f"has {len(value)} values but the schedule has {num_stages} stages; "
            "give one per stage or a single value",
        )
        return value


class Deadlock(RuntimeError):
    """No rank can run its next action. ``blocked`` maps each blocked rank to a description."""

    def __init__(self, schedule_name: str, blocked: dict[int, str]) -> None:
        self.blocked = blocked
        lines = "; ".join(f"rank {r}: {what}" for r, what in sorted(blocked.items()))
        super().__init__(f"{schedule_name} deadlocks: {lines}")


class Event(NamedTuple):
    rank: int
    action: str  # compact form, e.g. "0F3v1"
    start_s: float
    end_s: float

    @property
    def kind(self) -> Kind:
        return parse_action(self.action).kind


class _Timed(NamedTuple):
    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(kw_only=True, frozen=True, slots=True)
class Simulation:
    """What :func:`simulate` measured. Tuples are indexed by rank (``busy_s``) or stage.

    ``bubble_fraction`` is ``1 - sum(busy_s) / (num_ranks * makespan_s)``.
    ``steady_bubble_fraction`` is the idle fraction between the latest first ``B`` over ranks
    and the earliest last ``F``: every rank has left its warm-up and none has entered its
    cool-down, so ramp-up idling (the first rank waiting for its first gradient) is left out
    and an asynchronous schedule in steady state scores 0, while flushes between synchronous
    steps still count. With no such window it equals ``bubble_fraction``.
    ``weight_versions`` counts the versions live at once on a stage (the newest plus older ones
    a pending ``B``/``W`` uses); ``delays`` maps (stage, microbatch) to tau, the version the
    stage's next update after that microbatch's ``B``/``W`` applies to minus its ``F``'s
    version; ``delay`` is the maximum per stage.
    """

    schedule: Schedule
    costs: StageCosts
    makespan_s: float
    bubble_fraction: float
    steady_bubble_fraction: float
    busy_s: tuple[float, ...]
    peak_activations: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...]
    weight_versions: tuple[int, ...]
    delay: tuple[int, ...]
    delays: dict[tuple[int, int], int] = field(repr=False)  # (stage, microbatch) -> tau
    events: tuple[Event, ...] = field(repr=False)

    def to_json(self) -> dict:
        s = self.schedule
        return {
            "schedule": s.name,
            "ranks": s.num_ranks,
            "stages": s.num_stages,
            "virtual": s.num_virtual,
            "microbatches": s.num_microbatches,
            "steps": s.num_steps,
            "asynchronous": s.asynchronous,
            "makespan": self.makespan_s,
            "bubble_fraction": self.bubble_fraction,
            "steady_bubble_fraction": self.steady_bubble_fraction,
            "busy_s": list(self.busy_s),
            "peak_activations": list(self.peak_activations),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "weight_versions": list(self.weight_versions),
            "delay": list(self.delay),
            "notes": dict(s.notes),
        }


_Key = tuple[int, Kind, int]  # (stage, kind, microbatch)


def _key(a: Action) -> _Key:
    return (a.stage, a.kind, a.microbatch)


def _needs(a: Action, schedule: Schedule, p2p_s: float) -> list[tuple[_Key, float]]:
    """What ``a`` waits for: (action, delay after that action ends); see [Note: simulation model]."""
    s, j, last = a.stage, a.microbatch, schedule.num_stages - 1
    local_prev = s > 0 and schedule.rank_of(s - 1) == schedule.rank_of(s)
    local_next = s < last and schedule.rank_of(s + 1) == schedule.rank_of(s)
    match a.kind:
        case Kind.FORWARD if s > 0:
            return [((s - 1, Kind.FORWARD, j) if local_prev else (s, Kind.RECV_FORWARD, j), 0.0)]
        case Kind.BACKWARD:
            needs = [((s, Kind.FORWARD, j), 0.0)]
            if s < last:
                upstream = (s + 1, Kind.BACKWARD, j) if local_next else (s, Kind.RECV_BACKWARD, j)
                needs.append((upstream, 0.0))
            return needs
        case Kind.WEIGHT_GRAD | Kind.SEND_BACKWARD:
            return [((s, Kind.BACKWARD, j), 0.0)]
        case Kind.SEND_FORWARD:
            return [((s, Kind.FORWARD, j), 0.0)]
        case Kind.RECV_FORWARD:
            return [((s - 1, Kind.SEND_FORWARD, j), p2p_s)]
        case Kind.RECV_BACKWARD:
            return [((s + 1, Kind.SEND_BACKWARD, j), p2p_s)]
    return []


def _durations(schedule: Schedule, costs: StageCosts) -> dict[Kind, tuple[float, ...]]:
    n = schedule.num_stages
    out = {
        Kind.FORWARD: costs.per_stage("forward_s", n),
        Kind.BACKWARD: costs.per_stage("backward_s", n),
        Kind.WEIGHT_GRAD: costs.per_stage("weight_grad_s", n),
        Kind.UPDATE: costs.per_stage("update_s", n),
    }
    for s, (b, w) in enumerate(zip(out[Kind.BACKWARD], out[Kind.WEIGHT_GRAD], strict=True)):
        require(w <= b, "weight_grad_s", f"stage {s}: {w} exceeds backward_s {b}")
    return out


def _run(schedule: Schedule, costs: StageCosts) -> list[_Timed]:
    """Time every action; raises :class:`Deadlock` when no rank can move."""
    durations = _durations(schedule, costs)
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.WEIGHT_GRAD}
    end: dict[_Key, float] = {}
    seen: set[_Key] = set()
    for _, a in schedule.actions():
        if a.kind is not Kind.UPDATE:
            if _key(a) in seen:
                raise ValueError(f"{schedule.name}: {a} appears twice")
            seen.add(_key(a))
    pos = [0] * schedule.num_ranks
    free_s = [0.0] * schedule.num_ranks
    events: list[_Timed] = []
    while True:
        moved = False
        for rank, program in enumerate(schedule.programs):
            while pos[rank] < len(program):
                a = program[pos[rank]]
                needs = _needs(a, schedule, costs.p2p_s)
                if any(k not in end for k, _ in needs):
                    break
                start = max([free_s[rank]] + [end[k] + lag for k, lag in needs])
                duration = 0.0
                if not a.kind.is_comm:
                    duration = durations[a.kind][a.stage]
                    if a.kind is Kind.BACKWARD and (a.stage, a.microbatch) in split:
                        duration -= durations[Kind.WEIGHT_GRAD][a.stage]
                free_s[rank] = start + duration
                if a.kind is not Kind.UPDATE:
                    end[_key(a)] = free_s[rank]
                events.append(_Timed(rank, a, start, free_s[rank]))
                pos[rank] += 1
                moved = True
        if all(pos[r] == len(p) for r, p in enumerate(schedule.programs)):
            return events
        if not moved:
            raise Deadlock(schedule.name, _blocked(schedule, pos, end, costs.p2p_s))


def _blocked(schedule: Schedule, pos: list[int], end: dict[_Key, float], p2p_s: float) -> dict:
    blocked = {}
    for rank, program in enumerate(schedule.programs):
        if pos[rank] < len(program):
            a = program[pos[rank]]
            missing = [k for k, _ in _needs(a, schedule, p2p_s) if k not in end]
            waits = ", ".join(f"{s}{kind.value}{mb}" for s, kind, mb in missing)
            blocked[rank] = f"{a} waits on {waits}"
    return blocked


def _bubbles(schedule: Schedule, events: list[_Timed]) -> tuple[float, float, tuple[float, ...]]:
    """(bubble fraction, steady bubble fraction, busy seconds per rank).

    The steady window runs from the latest first backward over ranks to the earliest last
    forward: every rank is past its warm-up and before its cool-down. Without such a window (a
    schedule with no overlap of forwards and backwards, e.g. GPipe's single step) the whole
    run counts as warm-up and the steady bubble is the bubble.
    """
    num_ranks = schedule.num_ranks
    work = [e for e in events if not e.action.kind.is_comm]
    busy = [0.0] * num_ranks
    first_b: dict[int, float] = {}
    last_f: dict[int, float] = {}
    for e in work:
        busy[e.rank] += e.end_s - e.start_s
        kind = e.action.kind
        if kind is Kind.BACKWARD:
            first_b[e.rank] = min(first_b.get(e.rank, e.start_s), e.start_s)
        elif kind is Kind.FORWARD:
            last_f[e.rank] = max(last_f.get(e.rank, e.end_s), e.end_s)
    makespan = max((e.end_s for e in events), default=0.0)
    bubble = 1.0 - sum(busy) / (num_ranks * makespan) if makespan > 0 else 0.0
    if not first_b or not last_f:
        return bubble, bubble, tuple(busy)
    lo, hi = max(first_b.values()), min(last_f.values())
    if hi <= lo:
        return bubble, bubble, tuple(busy)
    inside = sum(max(0.0, min(e.end_s, hi) - max(e.start_s, lo)) for e in work)
    return bubble, 1.0 - inside / (num_ranks * (hi - lo)), tuple(busy)


def _stage_programs(schedule: Schedule) -> dict[int, list[Action]]:
    per_stage: dict[int, list[Action]] = defaultdict(list)
    for _, a in schedule.actions():
        if not a.kind.is_comm:
            per_stage[a.stage].append(a)
    return per_stage


def _peak_activations(program: list[Action]) -> int:
    in_flight = peak = 0
    for a in program:
        if a.kind is Kind.FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif a.kind is Kind.BACKWARD:
            in_flight -= 1
    return peak


def _weight_versions(program: list[Action]) -> int:
    """Most versions live at once: the newest plus any older one a pending B or W will use."""
    versions = [a.version for a in program if a.version is not None]
    if len(versions) < len(program):
        return 1
    uses: dict[int, list[int]] = defaultdict(list)  # microbatch -> versions of its B / W
    for a, version in zip(program, versions, strict=True):
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            uses[a.microbatch].append(version)
    current = min(versions, default=0)
    pending: dict[int, list[int]] = {}
    peak = 1
    for a, version in zip(program, versions, strict=True):
        if a.kind is Kind.FORWARD:
            pending[a.microbatch] = list(uses[a.microbatch])
        elif a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            pending[a.microbatch].remove(version)
        elif a.kind is Kind.UPDATE:
            current = version
        live = {current} | {v for vs in pending.values() for v in vs if v <= current}
        peak = max(peak, len(live))
    return peak


def _delays(stage: int, program: list[Action]) -> dict[tuple[int, int], int]:
    """tau per microbatch: (version its update applies to) - (version its forward used)."""
    forward_version: dict[int, int] = {}
    done: list[int] = []  # microbatches whose gradient the next update applies
    current = 0
    out: dict[tuple[int, int], int] = {}
    for a in program:
        if a.kind is Kind.FORWARD:
            forward_version[a.microbatch] = a.version if a.version is not None else current
        elif a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            if a.microbatch not in done and (stage, a.microbatch) not in out:
                done.append(a.microbatch)
        elif a.kind is Kind.UPDATE:
            current = a.version if a.version is not None else current + 1
            for mb in done:
                out[(stage, mb)] = current - 1 - forward_version[mb]
            done = []
    return out


def simulate(schedule: Schedule, costs: StageCosts = StageCosts()) -> Simulation:
    """Time ``schedule`` under ``costs``; see [Note: simulation model].

    A compute-only schedule on two or more ranks gets its send/receive actions from
    :func:`~tidal.pipeline.ir.with_communication`. Raises :class:`Deadlock` on a cycle and
    :class:`~tidal.config.ConfigError` when ``costs`` does not fit the schedule.
    """
    has_comm = any(a.kind.is_comm for _, a in schedule.actions())
    timed = schedule if has_comm or schedule.num_ranks < 2 else with_communication(schedule)
    events = _run(timed, costs)
    bubble, steady, busy = _bubbles(timed, events)
    per_stage = _stage_programs(schedule)
    stages = range(schedule.num_stages)
    peaks = tuple(_peak_activations(per_stage[s]) for s in stages)
    act_bytes = costs.per_stage("activation_bytes", schedule.num_stages)
    delays: dict[tuple[int, int], int] = {}
    for s in stages:
        delays.update(_delays(s, per_stage[s]))
    delay = [0] * schedule.num_stages
    for (s, _), tau in delays.items():
        delay[s] = max(delay[s], tau)
    return Simulation(
        schedule=schedule,
        costs=costs,
        makespan_s=max((e.end_s for e in events), default=0.0),
        bubble_fraction=bubble,
        steady_bubble_fraction=steady,
        busy_s=busy,
        peak_activations=peaks,
        peak_activation_bytes=tuple(int(p * b) for p, b in zip(peaks, act_bytes, strict=True)),
        weight_versions=tuple(_weight_versions(per_stage[s]) for s in stages),
        delay=tuple(delay),
        delays=delays,
        events=tuple(
            Event(e.rank, str(e.action), e.start_s, e.end_s)
            for e in sorted(events, key=lambda e: (e.start_s, e.rank))
        ),
    )
