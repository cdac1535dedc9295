"""Every rank of a pipeline in one process: the single-process simulator of its weight delays.

:func:`run_local` drives one :class:`~tidal.runtime.executor.RankExecutor` per rank over a
:class:`~tidal.runtime.p2p.LocalTransport`, taking turns; a distributed run of the same
schedule equals it bit for bit ([Note: one executor, bit-identical runs] in
tidal/runtime/executor.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from tidal.config import require
from tidal.pipeline.ir import Kind, Schedule, with_communication
from tidal.pipeline.lending import Lending, with_lending
from tidal.runtime.executor import (
    BatchFn,
    LrFn,
    Microbatches,
    RankExecutor,
    StageParams,
    StageRunner,
    TiedPair,
    UpdateRules,
)
from tidal.runtime.p2p import LocalTransport, PipelineDeadlock
from tidal.runtime.precision import LossScaler
from tidal.runtime.update import prepare_update

__all__ = ["LocalResult", "run_local"]


@dataclass(frozen=True, slots=True)
class LocalResult:
    """What :func:`run_local` measured.

    ``losses[k]`` is step ``k``'s row-weighted mean loss; ``delays[(stage, mb)]`` the measured
    tau; ``lrs[(stage, step)]`` the learning rate each update used; ``peak_held_bytes[r]`` the
    most rank ``r`` held for others ([Note: lending] in tidal/pipeline/lending.py).
    """

    losses: list[float]
    delays: dict[tuple[int, int], int]
    lrs: dict[tuple[int, int], float] = field(default_factory=dict)
    peak_held_bytes: tuple[int, ...] = ()

    def stage_delays(self, stage: int) -> list[int]:
        return [tau for (s, _), tau in sorted(self.delays.items()) if s == stage]


def run_local(
    schedule: Schedule,
    modules: Sequence[nn.Module],
    weights: Sequence[StageParams],
    batch_fn: BatchFn,
    lr_fn: LrFn,
    *,
    rules: UpdateRules | None = None,
    step_offset: int = 0,
    lending: Lending | None = None,
    scaler: LossScaler | None = None,
) -> LocalResult:
    """Run every rank's program of ``schedule`` in this process; see [Note: one executor ...].

    ``modules[s]`` / ``weights[s]`` are stage ``s``'s; ``batch_fn(step) -> (idx_BT,
    targets_BT)`` gives step ``step_offset + k``'s batch. The ranks take turns: each runs
    actions while its next one is ready (its message arrived, its input exists; a synchronous
    ``U`` waits until every rank reached its step's updates). Raises :class:`PipelineDeadlock`
    when no rank can move. ``lending``: [Note: lending] in tidal/pipeline/lending.py.
    ``scaler``: fp16's loss scale ([Note: pipeline mixed precision] in precision.py), for
    synchronous schedules.
    """
    rules = rules or UpdateRules()
    require(
        len(modules) == len(weights) == schedule.num_stages,
        "stages",
        f"{schedule.name} has {schedule.num_stages} stages; got {len(modules)} modules and "
        f"{len(weights)} weights",
    )
    require(
        not (schedule.asynchronous and scaler is not None and scaler.scaling),
        "training.precision",
        f"{schedule.name} is asynchronous: an fp16 overflow skips a step on every stage at "
        "once, which needs a flush; use bf16 or a synchronous schedule",
    )
    transport = LocalTransport()
    data = Microbatches(batch_fn, schedule.num_microbatches, step_offset=step_offset)
    if lending is not None:
        schedule = with_lending(with_communication(schedule), lending.lenders)
    executors = [
        RankExecutor(
            schedule=schedule,
            rank=r,
            modules={s: modules[s] for s in schedule.stages_of(r)},
            weights={s: weights[s] for s in schedule.stages_of(r)},
            transport=transport,
            data=data,
            lr_fn=lr_fn,
            rules=rules,
            step_offset=step_offset,
            lending=lending,
            scaler=scaler,
        )
        for r in range(schedule.num_ranks)
    ]
    runners = {s: r for ex in executors for s, r in ex.runners.items()}
    while not all(ex.done for ex in executors):
        moved = False
        for ex in executors:
            while not ex.done and ex.ready(ex.program[ex.pc]):
                ex.step()
                moved = True
        if not moved and not _sync_barrier(executors, runners, rules, scaler):
            waiting = ", ".join(f"rank {ex.rank} at {ex.next_action}" for ex in executors)
            raise PipelineDeadlock(f"{schedule.name}: no rank can move ({waiting})")
    for ex in executors:
        ex.finish()
    assert len(transport) == 0, "messages left unreceived"
    delays = {(s, mb): tau for s, r in runners.items() for mb, tau in r.delays.items()}
    lrs = dict(itertools.chain.from_iterable(ex.lrs.items() for ex in executors))
    last = executors[schedule.rank_of(schedule.num_stages - 1)]
    return LocalResult(losses=last.step_losses(schedule.num_steps), delays=delays, lrs=lrs,
                       peak_held_bytes=tuple(ex.peak_held_bytes for ex in executors))  # fmt: skip


def _sync_barrier(
    executors: Sequence[RankExecutor],
    runners: Mapping[int, StageRunner],
    rules: UpdateRules,
    scaler: LossScaler | None,
) -> bool:
    """If every unfinished rank waits at a synchronous ``U`` of one step, prepare that step."""
    waiting = [ex for ex in executors if not ex.done]
    steps = set()
    for ex in waiting:
        a = ex.program[ex.pc]
        if a.kind is not Kind.UPDATE or not ex.synchronous:
            return False
        steps.add(ex.update_step(a))
    if len(steps) != 1 or len(waiting) != len(executors):
        return False
    (step,) = steps
    _prepare_local(runners, rules, step, scaler)
    for ex in executors:
        ex.prepared.add(step)
    return True


def _prepare_local(
    runners: Mapping[int, StageRunner], rules: UpdateRules, step: int, scaler: LossScaler | None
) -> None:
    """[Note: the update's order] in update.py for every stage, all in this process."""

    def sum_tied(pair: TiedPair) -> None:
        (sa, na), (sb, nb) = pair
        a, b = runners[sa].weights.gradient(na), runners[sb].weights.gradient(nb)
        assert a is not None and b is not None, f"tied {na} / {nb} has no gradient"
        total = a + b
        runners[sa].weights.set_gradient(na, total)
        runners[sb].weights.set_gradient(nb, total)

    held = {s: r.weights for s, r in runners.items()}
    prepare_update(held, rules=rules, scaler=scaler or LossScaler("fp32"), step=step,
                   sum_over_pipeline=lambda squares: squares, sum_tied=sum_tied)  # fmt: skip
