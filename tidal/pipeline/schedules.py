"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, PipeDream, 2BW, PipeMare, PipeMareW.

Every generator returns a compute-only :class:`~tidal.pipeline.ir.Schedule` (``F``, ``B``,
``U``; no ``W`` and no send/receive): :func:`tidal.pipeline.ir.with_communication` adds the
point-to-point actions, the simulator does so itself.

[Note: weight versions in generated schedules]
A stage's version counter starts at 0 and each ``U`` on that stage increments it; ``U`` carries
the version it produces. ``F``/``B`` carry the version they compute with:
- synchronous (gpipe, 1f1b, interleaved): every ``F``/``B`` of step ``k`` uses version ``k``;
  the flush ``U`` at the end of step ``k`` produces ``k + 1``.
- ``pipemare`` (no stashing): ``F`` and ``B`` both use the stage's *current* version, so a
  ``B`` can be newer than its ``F``; the gap is the weight delay tau.
- ``pipedream`` (stash everything): ``B`` uses its ``F``'s version, so every version still
  referenced by an in-flight microbatch stays live (``p - s`` on stage ``s``).
- ``2bw`` (double buffering): the version ``F`` uses is refreshed only at the first microbatch
  of each step's batch of ``m``, and ``B`` uses its ``F``'s version; with ``m >= p`` at most
  two versions are live (the one in-flight microbatches use and the newest).
- ``pipemarew``: synchronous 1F1B for the first ``sync_steps`` steps, then ``pipemare``.
The stage's update always goes to its newest version, so the delay of a microbatch is
(version the following ``U`` produces - 1) - (its ``F``'s version); the simulator measures it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from tidal.config import ConfigError, require
from tidal.pipeline.ir import Action, Kind, Schedule

__all__ = [
    "SCHEDULE_NAMES",
    "Stashing",
    "asynchronous_1f1b",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "pipemare_warmup",
]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "pipedream", "2bw", "pipemare", "pipemarew")


class Stashing(enum.Enum):
    """Which weights an asynchronous backward uses (see [Note: weight versions ...])."""

    NONE = "pipemare"  # the stage's current weights
    ALL = "pipedream"  # the weights of its own forward
    DOUBLE_BUFFER = "2bw"  # the weights of its own forward, refreshed once per batch

    @property
    def ir_stashing(self) -> int | None:
        return {Stashing.NONE: 1, Stashing.ALL: None, Stashing.DOUBLE_BUFFER: 2}[self]


_Order = list[tuple[Kind, int]]  # (FORWARD or BACKWARD, microbatch) in program order


def _one_f_one_b_order(num_warmup: int, microbatches: Sequence[int]) -> _Order:
    """``num_warmup`` forwards, then one forward one backward, then the remaining backwards."""
    n = len(microbatches)
    warmup = min(num_warmup, n)
    order: _Order = [(Kind.FORWARD, mb) for mb in microbatches[:warmup]]
    for i in range(n - warmup):
        order += [(Kind.FORWARD, microbatches[warmup + i]), (Kind.BACKWARD, microbatches[i])]
    order += [(Kind.BACKWARD, mb) for mb in microbatches[n - warmup :]]
    return order


def _sync_step(stage: int, step: int, order: _Order) -> list[Action]:
    """One flushed step on one stage: its F/B at version ``step``, then the update."""
    out = [Action(stage=stage, kind=kind, microbatch=mb, version=step) for kind, mb in order]
    return out + [Action(stage=stage, kind=Kind.UPDATE, version=step + 1)]


def _step_microbatches(step: int, num_microbatches: int) -> list[int]:
    return list(range(step * num_microbatches, (step + 1) * num_microbatches))


def _sync(
    name: str,
    *,
    stages: int,
    microbatches: int,
    steps: int,
    order: Callable[[int, list[int]], _Order],
) -> Schedule:
    programs = []
    for s in range(stages):
        program: list[Action] = []
        for step in range(steps):
            program += _sync_step(s, step, order(s, _step_microbatches(step, microbatches)))
        programs.append(tuple(program))
    return Schedule(
        name=name,
        num_ranks=stages,
        num_stages=stages,
        num_microbatches=microbatches,
        programs=tuple(programs),
        num_steps=steps,
    )


def gpipe(*, stages: int, microbatches: int, steps: int = 1) -> Schedule:
    """All forwards, then all backwards, then the update; per step.

    Backwards run in forward order (first in, first out): the last stage can start ``B0`` as
    soon as ``F0`` is done, the oldest activations are freed first, and the order matches
    1F1B's, so the two schedules differ only in when backwards start. The makespan is the
    same either way because the last stage finishes every forward before any backward.
    """

    def order(_stage: int, mbs: list[int]) -> _Order:
        return [(Kind.FORWARD, mb) for mb in mbs] + [(Kind.BACKWARD, mb) for mb in mbs]

    return _sync("gpipe", stages=stages, microbatches=microbatches, steps=steps, order=order)


def one_f_one_b(*, stages: int, microbatches: int, steps: int = 1) -> Schedule:
    """1F1B with a flush per step (PipeDream-Flush / DAPPLE / Megatron).

    Stage ``s`` warms up with ``min(p - 1 - s, m)`` forwards, so ``m < p`` is allowed (it then
    degenerates to GPipe's order) and at most ``min(p - s, m)`` microbatches are in flight.
    """

    def order(stage: int, mbs: list[int]) -> _Order:
        return _one_f_one_b_order(stages - 1 - stage, mbs)

    return _sync("1f1b", stages=stages, microbatches=microbatches, steps=steps, order=order)


def _interleaved_unit(k: int, *, ranks: int, virtual: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch offset) of a rank's ``k``-th forward or backward unit in a step.

    Units go in groups of ``p`` microbatches per chunk: chunk 0 for microbatches 0..p-1, chunk 1
    for the same, ..., then the next ``p`` microbatches. Backwards walk the chunks in reverse.
    """
    group, rem = divmod(k, ranks * virtual)
    chunk = rem // ranks
    if backward:
        chunk = virtual - 1 - chunk
    return chunk, group * ranks + rem % ranks


def _interleaved_order(rank: int, ranks: int, virtual: int, mbs: list[int]) -> list[Action]:
    total = virtual * len(mbs)
    # With chunks, a microbatch comes back to rank r for its next chunk only after a round trip
    # through the ranks after it (2 (p - r - 1) units), and chunk 0 runs p microbatches first.
    interleave = 2 * (ranks - 1 - rank) + (virtual - 1) * ranks
    warmup = interleave if virtual > 1 else ranks - 1 - rank
    warmup = min(warmup, total)

    def unit(kind: Kind, k: int) -> tuple[Kind, int, int]:
        chunk, offset = _interleaved_unit(
            k, ranks=ranks, virtual=virtual, backward=kind is Kind.BACKWARD
        )
        return kind, chunk * ranks + rank, mbs[offset]

    units = [unit(Kind.FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        units += [unit(Kind.FORWARD, warmup + i), unit(Kind.BACKWARD, i)]
    units += [unit(Kind.BACKWARD, k) for k in range(total - warmup, total)]
    return [Action(stage=s, kind=kind, microbatch=mb) for kind, s, mb in units]


def interleaved_1f1b(*, stages: int, microbatches: int, virtual: int, steps: int = 1) -> Schedule:
    """Megatron's interleaved 1F1B: ``virtual`` chunks per rank, stage ``s`` on rank ``s % p``.

    ``stages`` is the number of ranks ``p``; the schedule has ``virtual * p`` stages. Each step
    ends with one update per stage (in the rank's chunk order).
    """
    require(
        microbatches % stages == 0,
        "microbatches",
        f"interleaved needs microbatches ({microbatches}) to be a multiple of stages "
        f"({stages}); use {max(stages, microbatches - microbatches % stages)} microbatches",
    )
    programs = []
    for rank in range(stages):
        program: list[Action] = []
        for step in range(steps):
            mbs = _step_microbatches(step, microbatches)
            for a in _interleaved_order(rank, stages, virtual, mbs):
                program.append(
                    Action(stage=a.stage, kind=a.kind, microbatch=a.microbatch, version=step)
                )
            program += [
                Action(stage=chunk * stages + rank, kind=Kind.UPDATE, version=step + 1)
                for chunk in range(virtual)
            ]
        programs.append(tuple(program))
    return Schedule(
        name="interleaved",
        num_ranks=stages,
        num_stages=virtual * stages,
        num_microbatches=microbatches,
        programs=tuple(programs),
        num_steps=steps,
    )


def _async_stage(
    stage: int,
    order: _Order,
    *,
    microbatches: int,
    stashing: Stashing,
    first_version: int,
) -> list[Action]:
    """Versions and updates (one after every ``m``-th backward) for one asynchronous stage."""
    version = first_version
    forward_version: dict[int, int] = {}
    batch_version = first_version  # 2BW: the version forwards of the current batch use
    num_backward = 0
    out: list[Action] = []
    for kind, mb in order:
        if kind is Kind.FORWARD:
            if mb % microbatches == 0:
                batch_version = version
            v = batch_version if stashing is Stashing.DOUBLE_BUFFER else version
            forward_version[mb] = v
        else:
            v = version if stashing is Stashing.NONE else forward_version.pop(mb)
        out.append(Action(stage=stage, kind=kind, microbatch=mb, version=v))
        if kind is Kind.BACKWARD:
            num_backward += 1
            if num_backward % microbatches == 0:
                version += 1
                out.append(Action(stage=stage, kind=Kind.UPDATE, version=version))
    return out


def asynchronous_1f1b(
    name: str, *, stages: int, microbatches: int, steps: int, stashing: Stashing
) -> Schedule:
    """1F1B run without a flush over ``steps * m`` microbatches; an update every ``m`` backwards.

    Stage ``s`` keeps up to ``p - s`` microbatches in flight (PipeDream's NOAM with one replica).
    """
    if stashing is Stashing.DOUBLE_BUFFER:
        require(
            microbatches >= stages,
            "microbatches",
            f"2bw keeps two weight versions only when microbatches ({microbatches}) >= stages "
            f"({stages}); use at least {stages} microbatches, or pipedream",
        )
    all_mbs = list(range(steps * microbatches))
    programs = tuple(
        tuple(
            _async_stage(
                s,
                _one_f_one_b_order(stages - 1 - s, all_mbs),
                microbatches=microbatches,
                stashing=stashing,
                first_version=0,
            )
        )
        for s in range(stages)
    )
    return Schedule(
        name=name,
        num_ranks=stages,
        num_stages=stages,
        num_microbatches=microbatches,
        programs=programs,
        num_steps=steps,
        asynchronous=True,
        stashing=stashing.ir_stashing,
    )


def pipemare_warmup(*, stages: int, microbatches: int, steps: int, sync_steps: int) -> Schedule:
    """PipeMareW: ``sync_steps`` flushed 1F1B steps, then PipeMare for the remaining steps."""
    require(
        0 <= sync_steps <= steps,
        "sync_steps",
        f"pipemarew needs 0 <= sync_steps <= steps, got sync_steps={sync_steps}, steps={steps}",
    )
    first_async_mb = sync_steps * microbatches
    async_mbs = list(range(first_async_mb, steps * microbatches))
    programs = []
    for s in range(stages):
        program: list[Action] = []
        for step in range(sync_steps):
            mbs = _step_microbatches(step, microbatches)
            program += _sync_step(s, step, _one_f_one_b_order(stages - 1 - s, mbs))
        program += _async_stage(
            s,
            _one_f_one_b_order(stages - 1 - s, async_mbs),
            microbatches=microbatches,
            stashing=Stashing.NONE,
            first_version=sync_steps,
        )
        programs.append(tuple(program))
    return Schedule(
        name="pipemarew",
        num_ranks=stages,
        num_stages=stages,
        num_microbatches=microbatches,
        programs=tuple(programs),
        num_steps=steps,
        asynchronous=True,
        stashing=1,
        notes={
            "sync_steps": str(sync_steps),
            "phases": f"steps 0..{sync_steps - 1} synchronous 1F1B with flush, then pipemare",
        },
    )


def make_schedule(
    name: str,
    *,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    steps: int = 1,
    sync_steps: int = 1,
) -> Schedule:
    """The named schedule for ``stages`` ranks; see [Note: weight versions ...].

    ``virtual`` (chunks per rank) is for ``interleaved`` only; ``sync_steps`` for ``pipemarew``
    only (other schedules ignore it). Raises :class:`~tidal.config.ConfigError` on bad input.
    """
    if name not in SCHEDULE_NAMES:
        raise ConfigError(
            "schedule", f"unknown {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}"
        )
    require(stages >= 1, "stages", f"need at least 1 stage, got {stages}")
    require(microbatches >= 1, "microbatches", f"need at least 1 microbatch, got {microbatches}")
    require(steps >= 1, "steps", f"need at least 1 step, got {steps}")
    require(virtual >= 1, "virtual", f"need at least 1 chunk per rank, got {virtual}")
    require(
        virtual == 1 or name == "interleaved",
        "virtual",
        f"{name} has one chunk per rank; use virtual=1 or the interleaved schedule",
    )
    size = {"stages": stages, "microbatches": microbatches, "steps": steps}
    if name == "gpipe":
        return gpipe(**size)
    if name == "1f1b":
        return one_f_one_b(**size)
    if name == "interleaved":
        return interleaved_1f1b(virtual=virtual, **size)
    if name == "pipemarew":
        return pipemare_warmup(sync_steps=sync_steps, **size)
    return asynchronous_1f1b(name, stashing=Stashing(name), **size)
