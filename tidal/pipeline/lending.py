"""MPress's peer swap as schedule actions: a stage lends what it saves to a lightly loaded rank.

[Note: lending]
A borrower stage ``s`` with lender rank ``L`` gets, for each microbatch ``j``, four actions
placed by :func:`with_lending` in the programs that already have their sends and receives. ``t``
is the lender's first stage after ``s`` (one stage per rank: ``L`` itself, a later stage; with
virtual stages, the lender's stage in ``s``'s chunk when ``L`` is a later rank, else in the next
chunk; a stage with no stage of ``L`` after it cannot lend to ``L``):

- the borrower's ``LO`` right after ``F(s, j)`` (and its send forward): what the stage's lent
  units saved for ``j``, one message to ``L``; its device memory goes with the message;
- the lender's ``HI`` right before it receives (or, with no receive, computes) ``F(t, j)``:
  it receives that message and holds it in its own budget;
- the lender's ``HO`` right after ``B(t, j)``, before it sends that gradient back: it sends the
  bytes home;
- the borrower's ``LI`` right before ``B(s, j)``: it receives them back.

No new wait is added: ``F(s, j)`` already happens before ``F(t, j)`` (the activation flows
through every stage between), and ``B(t, j)`` before ``B(s, j)``. So each new receive waits
on a send its peer makes before an action the receiver was already waiting for, and programs
that could not deadlock still cannot. A pair's messages keep the sender's program order
([Note: point-to-point protocol] in tidal/pipeline/p2p.py): the bytes come home with the
gradient the borrower needs next, not earlier, so they are not parked on the borrower.
The same holds under asynchronous schedules (their microbatch ids never repeat) and with
virtual stages: the messages are keyed by the borrower's stage, so two stages of one rank
lending to one lender never take each other's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tidal.config import ConfigError
from tidal.pipeline.ir import Action, Kind, Schedule, replace_programs

__all__ = ["Lending", "LendingSwap", "with_lending"]


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
        programs[borrower] = _borrow(programs[borrower], s, ranks)
        for lender, t in zip(ranks, anchors, strict=True):
            programs[lender] = _hold(programs[lender], s, borrower, t)
    return replace_programs(schedule, programs)


def _anchor(schedule: Schedule, s: int, lender: int) -> int:
    """The lender's first stage after ``s``: it holds ``s``'s bytes for each microbatch from
    that stage's forward to its backward."""
    if not 0 <= lender < schedule.num_ranks or lender == schedule.rank_of(s):
        raise ConfigError("pipeline.memory", f"stage {s} cannot lend to rank {lender}: a lender "
                          f"is another rank, below {schedule.num_ranks}")  # fmt: skip
    later = [t for t in schedule.stages_of(lender) if t > s]
    if not later:
        raise ConfigError("pipeline.memory", f"stage {s} cannot lend to rank {lender}: a lender "
                          f"is a later stage's rank, and no stage of rank {lender} comes after "
                          f"stage {s}")  # fmt: skip
    return later[0]


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
