"""Cut a model's layers into contiguous pipeline stages: the slowest stage as fast as possible,
every stage within its memory.

A model is a list of :class:`LayerProfile` units, ``embed, blocks.0, ..., blocks.{L-1}, head``
(what :func:`tidal.planner.stage_profile.profile_model` gives, and a model spec's ``profile``:
profiling traces the model with the planner's meta-device measurement, a layer above this one);
:func:`partition` cuts it into ``num_stages`` contiguous non-empty runs and returns the
:class:`Partition`, whose ``block_ranges`` :func:`tidal.pipeline.split.split_parts` (a model
spec's ``split``) takes.

[Note: stage memory]
Stage ``s`` holding units with weight bytes ``W`` and per-microbatch activation bytes ``A`` needs
``state_bytes_per_param_byte * W + weight_versions[s] * W + in_flight[s] * A`` bytes:
weights, gradients and optimizer state (fp32 AdamW: weights + grads + two moments = 4x the
weights), the extra weight copies an asynchronous schedule stashes (PipeDream ``p - s``, 2BW 1,
PipeMare's discrepancy correction 1), and the activations of every microbatch between its
forward and its backward. ``in_flight`` comes from the schedule: GPipe keeps all ``m``, 1F1B
(flush) ``min(p - s, m)``, PipeDream and PipeMare ``p - s``. The default ``p - s`` makes the
first stage the binding one, so an optimal split moves work to later stages when memory is tight.
A weight tied across the first and last stage (embedding and LM head) is held by both stages
(tidal/pipeline/split.py, [Note: tied embeddings across stages]), so the profiles count it in
both; with a single stage that overcounts one matrix.

[Note: partition objective]
Minimise the bottleneck ``max_s (F_s + B_s)`` over feasible contiguous splits: in steady state
every stage handles one forward and one backward per microbatch, so the slowest stage sets the
pipeline's rate. Many splits often share the optimal bottleneck; among those the partitioner
takes the least total memory (activations moved to stages with fewer microbatches in flight),
then the most even stage times (least sum of squared stage times). Both tie-breaks are sums over
stages, so a second dynamic programme restricted to stages no slower than the optimum finds the
exact lexicographic minimum; one programme carrying (bottleneck, memory) pairs would not, since
a suffix that loses on its own bottleneck can win once a slower stage in front hides it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.config import format_bytes, require

__all__ = [
    "LayerProfile",
    "Partition",
    "PartitionInfeasible",
    "partition",
    "stage_memory_bytes",
]

_TIME_RTOL = 1e-9  # stage times within this of the bottleneck count as ties


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerProfile:
    """One partitionable unit (``embed``, ``blocks.i`` or ``head``): its costs per microbatch."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int  # weights
    activation_bytes: int  # kept per in-flight microbatch, forward to backward

    def __post_init__(self) -> None:
        require(bool(self.name), "name", "a layer profile needs a name")
        for key in ("forward_s", "backward_s", "param_bytes", "activation_bytes"):
            value = getattr(self, key)
            require(
                math.isfinite(value) and value >= 0, key, f"{self.name}: must be >= 0, got {value}"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class Partition:
    """A contiguous split of the profile list into stages, and what each stage costs."""

    block_ranges: tuple[tuple[int, int], ...]  # what split_parts takes
    unit_ranges: tuple[tuple[int, int], ...]  # over the profile list
    stage_time_s: tuple[float, ...]  # forward + backward of one microbatch
    stage_memory_bytes: tuple[int, ...]  # see [Note: stage memory]
    bottleneck_s: float


class PartitionInfeasible(ValueError):
    """No contiguous split fits the memory limits. ``least_bytes`` is the least memory per stage
    any split needs (the best split's largest stage), ``binding_stage`` that stage."""

    def __init__(self, message: str, *, least_bytes: int, binding_stage: int) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes
        self.binding_stage = binding_stage


# ---------------------------------------------------------------------------------------------
# the cost of a stage


@dataclass(frozen=True, slots=True)
class _Costs:
    """Prefix sums over the units, and the per-stage memory coefficients."""

    time_s: list[float]  # time_s[i] = sum of F + B over units [0, i)
    param_bytes: list[int]
    activation_bytes: list[int]
    in_flight: list[int]
    weight_versions: list[int]
    state_factor: float
    limits: list[float]

    def time(self, a: int, b: int) -> float:
        return self.time_s[b] - self.time_s[a]

    def memory(self, s: int, a: int, b: int) -> float:
        weights = self.param_bytes[b] - self.param_bytes[a]
        acts = self.activation_bytes[b] - self.activation_bytes[a]
        return (self.state_factor + self.weight_versions[s]) * weights + self.in_flight[s] * acts


def _prefix(values: Sequence[float]) -> list:
    return list(itertools.accumulate(values, initial=0))


def stage_memory_bytes(
    profiles: Sequence[LayerProfile],
    *,
    in_flight: int,
    state_bytes_per_param_byte: float = 4.0,
    weight_versions: int = 0,
) -> int:
    """The bytes one stage holding ``profiles`` needs; see [Note: stage memory]."""
    weights = sum(p.param_bytes for p in profiles)
    acts = sum(p.activation_bytes for p in profiles)
    return math.ceil((state_bytes_per_param_byte + weight_versions) * weights + in_flight * acts)


def _per_stage(value: int | Sequence[int] | None, default: list, num_stages: int, key: str) -> list:
    if value is None:
        return default
    if isinstance(value, int | float):
        return [value] * num_stages
    values = list(value)
    require(
        len(values) == num_stages,
        key,
        f"has {len(values)} entries for {num_stages} stages; give one per stage",
    )
    return values


def _costs(
    profiles: Sequence[LayerProfile],
    num_stages: int,
    memory_limit_bytes: int | Sequence[int] | None,
    in_flight: Sequence[int] | None,
    state_bytes_per_param_byte: float,
    weight_versions: Sequence[int] | None,
) -> _Costs:
    require(len(profiles) >= 1, "profiles", "nothing to partition: the profile list is empty")
    require(
        1 <= num_stages <= len(profiles),
        "num_stages",
        f"must be in [1, {len(profiles)}] (every stage holds at least one of the "
        f"{len(profiles)} units), got {num_stages}",
    )
    p = num_stages
    limits = _per_stage(memory_limit_bytes, [math.inf] * p, p, "memory_limit_bytes")
    flights = _per_stage(in_flight, [p - s for s in range(p)], p, "in_flight")
    versions = _per_stage(weight_versions, [0] * p, p, "weight_versions")
    require(all(x > 0 for x in limits), "memory_limit_bytes", f"must be > 0, got {limits}")
    require(all(x >= 0 for x in flights), "in_flight", f"must be >= 0, got {flights}")
    require(all(x >= 0 for x in versions), "weight_versions", f"must be >= 0, got {versions}")
    require(
        state_bytes_per_param_byte >= 0,
        "state_bytes_per_param_byte",
        f"must be >= 0, got {state_bytes_per_param_byte}",
    )
    return _Costs(
        time_s=_prefix([pr.forward_s + pr.backward_s for pr in profiles]),
        param_bytes=_prefix([pr.param_bytes for pr in profiles]),
        activation_bytes=_prefix([pr.activation_bytes for pr in profiles]),
        in_flight=flights,
        weight_versions=versions,
        state_factor=state_bytes_per_param_byte,
        limits=[float(x) for x in limits],
    )


# ---------------------------------------------------------------------------------------------
# the dynamic programmes; see [Note: partition objective]

_INF = math.inf


def _last_start(s: int, num_units: int, num_stages: int) -> int:
    """One past the last unit stage ``s`` may start at: later stages need a unit each."""
    return num_units - (num_stages - 1 - s)


def _min_bottleneck(c: _Costs, num_units: int, num_stages: int) -> float:
    """The least bottleneck over memory-feasible splits (``inf`` if none fits)."""
    best = [[_INF] * (num_units + 1) for _ in range(num_stages + 1)]
    best[num_stages][num_units] = 0.0
    for s in reversed(range(num_stages)):
        end = _last_start(s, num_units, num_stages)
        for a in range(s, end):
            value = _INF
            for b in range(a + 1, end + 1):
                rest = best[s + 1][b]
                if rest < value and c.memory(s, a, b) <= c.limits[s]:
                    value = min(value, max(c.time(a, b), rest))
            best[s][a] = value
    return best[0][0]


def _least_memory_split(
    c: _Costs, num_units: int, num_stages: int, bottleneck_s: float
) -> list[tuple[int, int]]:
    """Among feasible splits with no stage slower than ``bottleneck_s``: least total memory,
    then least sum of squared stage times."""
    cap_s = bottleneck_s + _TIME_RTOL * abs(bottleneck_s)
    best: list[list[tuple[float, float] | None]] = [
        [None] * (num_units + 1) for _ in range(num_stages + 1)
    ]
    choice = [[0] * (num_units + 1) for _ in range(num_stages)]
    best[num_stages][num_units] = (0.0, 0.0)
    for s in reversed(range(num_stages)):
        end = _last_start(s, num_units, num_stages)
        for a in range(s, end):
            for b in range(a + 1, end + 1):
                rest, t_s, mem = best[s + 1][b], c.time(a, b), c.memory(s, a, b)
                if rest is None or t_s > cap_s or mem > c.limits[s]:
                    continue
                key, here = (mem + rest[0], t_s * t_s + rest[1]), best[s][a]
                if here is None or key < here:
                    best[s][a], choice[s][a] = key, b
    assert best[0][0] is not None, "the bottleneck came from a feasible split"
    ranges, a = [], 0
    for s in range(num_stages):
        ranges.append((a, choice[s][a]))
        a = choice[s][a]
    return ranges


def _minimax_memory_split(c: _Costs, num_units: int, num_stages: int) -> list[tuple[int, int]]:
    """The split whose largest stage memory is least, limits ignored."""
    best = [[_INF] * (num_units + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (num_units + 1) for _ in range(num_stages)]
    best[num_stages][num_units] = 0.0
    for s in reversed(range(num_stages)):
        end = _last_start(s, num_units, num_stages)
        for a in range(s, end):
            for b in range(a + 1, end + 1):
                value = max(c.memory(s, a, b), best[s + 1][b])
                if value < best[s][a]:
                    best[s][a], choice[s][a] = value, b
    ranges, a = [], 0
    for s in range(num_stages):
        ranges.append((a, choice[s][a]))
        a = choice[s][a]
    return ranges


def _infeasible(
    c: _Costs, profiles: Sequence[LayerProfile], num_stages: int, limits: object
) -> PartitionInfeasible:
    ranges = _minimax_memory_split(c, len(profiles), num_stages)
    memories = [c.memory(s, a, b) for s, (a, b) in enumerate(ranges)]
    binding = max(range(num_stages), key=lambda s: memories[s])
    a, b = ranges[binding]
    least = math.ceil(memories[binding])
    weights = (c.state_factor + c.weight_versions[binding]) * (c.param_bytes[b] - c.param_bytes[a])
    acts = c.activation_bytes[b] - c.activation_bytes[a]
    units = profiles[a].name if b == a + 1 else f"{profiles[a].name}..{profiles[b - 1].name}"
    message = (
        f"no split of {len(profiles)} units into {num_stages} stages fits memory_limit_bytes="
        f"{limits}: the least memory per stage any split needs is {format_bytes(least)} "
        f"({least} bytes; stage {binding} binds, holding {units}: {format_bytes(weights)} of "
        f"weights and optimizer state + {c.in_flight[binding]} in flight x "
        f"{format_bytes(acts)} of activations); raise the limit to at least that, use more "
        "stages, or keep fewer microbatches in flight"
    )
    return PartitionInfeasible(message, least_bytes=least, binding_stage=binding)


def _block_ranges(
    profiles: Sequence[LayerProfile], unit_ranges: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """Unit ranges to block ranges: ``embed`` (if first) and ``head`` (if last) are no blocks."""
    lead = 1 if profiles[0].name == "embed" else 0
    trail = 1 if len(profiles) > lead and profiles[-1].name == "head" else 0
    num_blocks_ = len(profiles) - lead - trail
    return tuple(
        (min(max(a - lead, 0), num_blocks_), min(max(b - lead, 0), num_blocks_))
        for a, b in unit_ranges
    )


def partition(
    profiles: Sequence[LayerProfile],
    num_stages: int,
    *,
    memory_limit_bytes: int | Sequence[int] | None = None,
    in_flight: Sequence[int] | None = None,
    state_bytes_per_param_byte: float = 4.0,
    weight_versions: Sequence[int] | None = None,
) -> Partition:
    """The contiguous split of ``profiles`` into ``num_stages`` non-empty stages with the least
    bottleneck stage time whose stages fit their memory ([Note: stage memory]); ties go to the
    least total memory, then the most even stage times ([Note: partition objective]).

    ``memory_limit_bytes`` is one limit for every stage or one per stage (``None``: unlimited);
    ``in_flight`` and ``weight_versions`` are per stage (defaults ``p - s`` and ``0``). Raises
    :class:`PartitionInfeasible` when no split fits, :class:`ConfigError` on bad arguments.
    """
    c = _costs(
        profiles,
        num_stages,
        memory_limit_bytes,
        in_flight,
        state_bytes_per_param_byte,
        weight_versions,
    )
    bottleneck_s = _min_bottleneck(c, len(profiles), num_stages)
    if bottleneck_s == _INF:
        raise _infeasible(c, profiles, num_stages, memory_limit_bytes)
    unit_ranges = _least_memory_split(c, len(profiles), num_stages, bottleneck_s)
    return Partition(
        block_ranges=_block_ranges(profiles, unit_ranges),
        unit_ranges=tuple(unit_ranges),
        stage_time_s=tuple(c.time(a, b) for a, b in unit_ranges),
        stage_memory_bytes=tuple(
            math.ceil(c.memory(s, a, b)) for s, (a, b) in enumerate(unit_ranges)
        ),
        bottleneck_s=bottleneck_s,
    )
