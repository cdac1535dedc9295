"""MPress's peer swap as schedule actions: a stage lends what it saves to a lightly loaded rank.

[Note: lending]
A borrower stage ``s`` with lender rank ``L`` (a later stage's rank, one stage per rank) gets,
for each microbatch ``j``, four actions placed by :func:`with_lending` in the programs that
already have their sends and receives:

- the borrower's ``LO`` right after ``F(s, j)`` (and its send forward): what the stage's lent
  units saved for ``j``, one message to ``L``; its device memory goes with the message;
- the lender's ``HI`` right before it receives (or, with no receive, computes) ``F(L, j)``:
  it receives that message and holds it in its own budget;
- the lender's ``HO`` right after ``B(L, j)``, before it sends that gradient back: it sends the
  bytes home;
- the borrower's ``LI`` right before ``B(s, j)``: it receives them back.

No new wait is added: ``F(s, j)`` already happens before ``F(L, j)`` (the activation flows
through every stage between), and ``B(L, j)`` before ``B(s, j)``. So each new receive waits
on a send its peer makes before an action the receiver was already waiting for, and programs
that could not deadlock still cannot. A pair's messages keep the sender's program order
([Note: point-to-point protocol] in tidal/pipeline/p2p.py): the bytes come home with the
gradient the borrower needs next, not earlier, so they are not parked on the borrower.
The same holds under asynchronous schedules (their microbatch ids never repeat); not with
virtual stages (a rank's stages would need an order of their own).
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
    _check(schedule, given)
    programs = [list(p) for p in schedule.programs]
    for s, ranks in given.items():
        borrower = schedule.rank_of(s)
        programs[borrower] = _borrow(programs[borrower], s, ranks)
        for lender in ranks:
            programs[lender] = _hold(programs[lender], s, borrower, lender)
    return replace_programs(schedule, programs)


def _check(schedule: Schedule, lenders: Mapping[int, tuple[int, ...]]) -> None:
    if schedule.num_stages != schedule.num_ranks:
        raise ConfigError("pipeline.memory", f"peer swap runs under schedules of one stage per "
                          f"rank, not {schedule.name!r} with virtual stages")  # fmt: skip
    for s, ranks in lenders.items():
        for lender in ranks:
            if not schedule.rank_of(s) < lender < schedule.num_ranks:
                raise ConfigError("pipeline.memory", f"stage {s} cannot lend to rank {lender}: "
                                  f"a lender is a later stage's rank, below "
                                  f"{schedule.num_ranks}")  # fmt: skip


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


def _hold(program: list[Action], s: int, borrower: int, lender: int) -> list[Action]:
    out: list[Action] = []
    received: set[int] = set()
    for a in program:
        j = a.microbatch
        starts = a.stage == lender and a.kind in (Kind.RECV_FORWARD, Kind.FORWARD)
        if starts and j not in received:
            out.append(Action(stage=s, kind=Kind.HOLD, microbatch=j, peer=borrower))
            received.add(j)
        if a.stage == lender and a.kind is Kind.SEND_BACKWARD:  # a lender is never stage 0
            out.append(Action(stage=s, kind=Kind.GIVE_BACK, microbatch=j, peer=borrower))
        out.append(a)
    return out
