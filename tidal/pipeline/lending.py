"""MPress's peer swap as schedule actions: a stage lends what it saves to a lightly loaded rank.

[Note: lending]
A borrower stage ``s`` with lender rank ``L`` gets, for each microbatch ``j``, four actions
placed by :func:`with_lending` in the programs that already have their sends and receives:

- the borrower's ``LO`` right after ``F(s, j)`` (and its send forward): what the stage's lent
  units saved for ``j``, one message to ``L``; its device memory goes with the message;
- the lender's ``HI``, where it receives that message and holds it in its own budget;
- the lender's ``HO``, where it sends the bytes home;
- the borrower's ``LI`` right before ``B(s, j)``: it receives them back.

Where the lender's two actions go depends on where ``L``'s stages sit:

- a **later** lender, ``t`` its first stage after ``s`` (one stage per rank: ``L`` > the
  borrower's rank; with virtual stages also an earlier rank, in the next chunk): ``HI`` right
  before it receives (or, with no receive, computes) ``F(t, j)``, ``HO`` right after ``B(t, j)``,
  before it sends that gradient back. ``F(s, j)`` already happens before ``F(t, j)`` (the
  activation flows through every stage between) and ``B(t, j)`` before ``B(s, j)``.
- an **earlier** lender (one stage per rank: ``L`` < the borrower's rank, MPress's swap to any
  lightly loaded GPU), ``t`` = ``L``'s stage: ``HI`` right before it receives the gradient of
  ``i``, the microbatch of the borrower's first backward after ``F(s, j)``, and ``HO`` right
  before it receives the gradient of ``j``. ``LO(s, j)`` is sent before ``B(s, i)``, which
  comes before that gradient reaches ``L``; and nothing ``L`` does before receiving the
  gradient of ``j`` waits on the borrower past ``B(s, j)`` (its forwards wait on earlier stages
  only, its backwards on the borrower's earlier ones, in microbatch order). With virtual
  stages an earlier rank's later chunks wait on the borrower's forwards, so there it lends only
  where it has a stage after ``s``.

Either way each new receive waits on a send its peer makes before an action the receiver was
already waiting for, and programs that could not deadlock still cannot. A pair's messages keep
the sender's program order ([Note: point-to-point protocol] in tidal/runtime/p2p.py): the
bytes come home with (later lender) or just before (earlier lender) the gradient the borrower
needs next. The same holds under asynchronous schedules (their microbatch ids never repeat);
with virtual stages the messages are keyed by the borrower's stage, so two stages of one rank
lending to one lender never take each other's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tidal.config import ConfigError
from tidal.pipeline.ir import Action, Kind, Schedule, replace_programs

__all__ = ["Lending", "LendingSwap", "lender_ranks", "with_lending"]


class LendingSwap(Protocol):
    """A stage's lent units (:class:`~tidal.activations.runtime.PeerSwap`)."""

    bytes_lent: int

    def close(self, lender: int) -> tuple[torch.Tensor, object]: ...

    def restore(self, bundle: object, flat: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class Lending:
    """Who lends to whom: ``lenders[s]``, the ranks stage ``s`` lends to (every stage's, the
    same on every rank); ``swaps``, this rank's lending stages; ``on_hold(bytes)``, told what
    this rank holds for others each time that changes; ``on_reclaim(seconds)``, told how long
    each reclaim waited for its bytes (the gradient it is for has arrived by then, so that is
    the stall of a transfer its idle window did not hide)."""

    lenders: Mapping[int, tuple[int, ...]]
    swaps: Mapping[int, LendingSwap] = field(default_factory=dict)
    on_hold: Callable[[int], None] | None = None
    on_reclaim: Callable[[float], None] | None = None


def with_lending(schedule: Schedule, lenders: Mapping[int, Sequence[int]]) -> Schedule:
    """``schedule`` (with its sends and receives) with [Note: lending]'s actions for each stage
    ``s`` and each rank in ``lenders[s]``."""
    given = {s: tuple(ranks) for s, ranks in lenders.items() if ranks}
    if not given:
        return schedule
    programs = [list(p) for p in schedule.programs]
    for s, ranks in given.items():
        borrower = schedule.rank_of(s)
        anchors = [_anchor(schedule, s, lender) for lender in ranks]
        first_backward_after = _first_backward_after(programs[borrower], s)
        programs[borrower] = _borrow(programs[borrower], s, ranks)
        for lender, t in zip(ranks, anchors, strict=True):
            if t > s:
                programs[lender] = _hold(programs[lender], s, borrower, t)
            else:
                programs[lender] = _hold_before(programs[lender], s, borrower, t,
                                                first_backward_after)  # fmt: skip
    return replace_programs(schedule, programs)


def lender_ranks(schedule: Schedule, s: int) -> tuple[int, ...]:
    """The ranks stage ``s`` may lend to ([Note: lending]): every other rank with a stage after
    it, and, with one stage per rank, the earlier ranks too."""
    borrower = schedule.rank_of(s)
    return tuple(r for r in range(schedule.num_ranks) if r != borrower and (
        schedule.num_virtual == 1 or any(t > s for t in schedule.stages_of(r))))  # fmt: skip


def _anchor(schedule: Schedule, s: int, lender: int) -> int:
    """The lender's stage whose actions its holding hangs on: its first after ``s``, else (one
    stage per rank) its one stage, before ``s``."""
    if not 0 <= lender < schedule.num_ranks or lender == schedule.rank_of(s):
        raise ConfigError("pipeline.memory", f"stage {s} cannot lend to rank {lender}: a lender "
                          f"is another rank, below {schedule.num_ranks}")  # fmt: skip
    later = [t for t in schedule.stages_of(lender) if t > s]
    if later:
        return later[0]
    if schedule.num_virtual > 1:
        raise ConfigError("pipeline.memory", f"stage {s} cannot lend to rank {lender}: with "
                          f"virtual stages a lender has a stage after the borrower, and no "
                          f"stage of rank {lender} comes after stage {s}")  # fmt: skip
    return lender


def _first_backward_after(program: Sequence[Action], s: int) -> dict[int, int]:
    """Per microbatch ``j`` of stage ``s``: the microbatch of ``s``'s first backward after
    ``F(s, j)`` in ``program``."""
    out: dict[int, int] = {}
    waiting: list[int] = []
    for a in program:
        if a.stage != s:
            continue
        if a.kind is Kind.FORWARD:
            waiting.append(a.microbatch)
        elif a.kind is Kind.BACKWARD:
            out.update((j, a.microbatch) for j in waiting)
            waiting.clear()
    assert not waiting, f"stage {s}: forwards {waiting} have no backward after them"
    return out


def _borrow(program: list[Action], s: int, lenders: tuple[int, ...]) -> list[Action]:
    out: list[Action] = []
    for i, a in enumerate(program):
        if a.stage == s and a.kind is Kind.BACKWARD:
            out += [Action(stage=s, kind=Kind.RECLAIM, microbatch=a.microbatch, peer=r)
                    for r in lenders]  # fmt: skip
        out.append(a)
        sent_after = i + 1 < len(program) and program[i + 1].kind is Kind.SEND_FORWARD
        after_forward = a.stage == s and (
            (a.kind is Kind.FORWARD and not sent_after) or a.kind is Kind.SEND_FORWARD
        )
        if after_forward:
            out += [Action(stage=s, kind=Kind.LEND, microbatch=a.microbatch, peer=r)
                    for r in lenders]  # fmt: skip
    return out


def _hold(program: list[Action], s: int, borrower: int, t: int) -> list[Action]:
    out: list[Action] = []
    received: set[int] = set()
    for a in program:
        j = a.microbatch
        starts = a.stage == t and a.kind in (Kind.RECV_FORWARD, Kind.FORWARD)
        if starts and j not in received:
            out.append(Action(stage=s, kind=Kind.HOLD, microbatch=j, peer=borrower))
            received.add(j)
        if a.stage == t and a.kind is Kind.SEND_BACKWARD:  # t > s >= 0: t sends gradients
            out.append(Action(stage=s, kind=Kind.GIVE_BACK, microbatch=j, peer=borrower))
        out.append(a)
    return out


def _hold_before(program: list[Action], s: int, borrower: int, t: int,
                 first_backward_after: Mapping[int, int]) -> list[Action]:  # fmt: skip
    """An earlier lender's actions ([Note: lending]): ``HI(j)`` before ``t`` receives the
    gradient of the borrower's first backward after ``F(s, j)``, ``HO(j)`` before it receives
    the gradient of ``j``."""
    holds: dict[int, list[int]] = {}
    for j, i in sorted(first_backward_after.items()):
        holds.setdefault(i, []).append(j)
    out: list[Action] = []
    held: set[int] = set()
    for a in program:
        if a.stage == t and a.kind is Kind.RECV_BACKWARD:
            for j in holds.pop(a.microbatch, []):
                out.append(Action(stage=s, kind=Kind.HOLD, microbatch=j, peer=borrower))
                held.add(j)
            if a.microbatch in first_backward_after:
                assert a.microbatch in held, f"stage {s}: {a.microbatch} given back before held"
                out.append(Action(stage=s, kind=Kind.GIVE_BACK, microbatch=a.microbatch,
                                  peer=borrower))  # fmt: skip
        out.append(a)
    assert not holds, f"stage {s}: no gradient of {sorted(holds)} reaches stage {t}"
    return out
