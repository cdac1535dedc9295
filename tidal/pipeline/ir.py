"""A pipeline schedule as plain data: one ordered program of actions per rank.

The generators in :mod:`tidal.pipeline.schedules` make a :class:`Schedule`; the simulator in
:mod:`tidal.pipeline.simulate` times it; the runtime in :mod:`tidal.runtime.distributed` carries it
out. None of them needs torch to read one.

[Note: schedule IR]
- A *stage* is a contiguous slice of the model. With ``v`` virtual stages per rank (interleaved
  1F1B) there are ``num_stages = v * num_ranks`` stages and stage ``s`` lives on rank
  ``s % num_ranks`` (Megatron's round-robin placement); otherwise stage ``s`` is rank ``s``.
- A *microbatch* id is global over the whole schedule: an asynchronous schedule spanning several
  optimizer steps numbers its microbatches ``step * m + i``, so ids never repeat.
- ``version`` on ``F``, ``B`` and ``W`` is the weight version the action computes with: the
  number of ``U`` actions the stage had done when those weights were current. For PipeMare ``B``
  uses the stage's current version (newer than its ``F``: that gap is the delay tau); for
  PipeDream ``B`` uses the stashed version of its ``F``. ``U``'s version is the one it produces.
- ``B`` is the whole backward of a microbatch (input and weight gradients) unless the same
  program also has a ``W`` for that microbatch, in which case ``B`` computes only the input
  gradient and ``W`` the weight gradient (zero-bubble style).
- Send and receive actions are explicit so that both sides post matching point-to-point
  operations in the same order: ``SF``/``RF`` carry activations forward, ``SB``/``RB``
  gradients backward. :func:`with_communication` adds them to a compute-only schedule.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "format_program",
    "parse_action",
    "parse_program",
    "replace_programs",
    "with_communication",
]


class Kind(enum.StrEnum):
    """What an action does. The value is its letter(s) in the compact string form."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT_GRAD = "W"
    UPDATE = "U"
    SEND_FORWARD = "SF"  # send this stage's output activation to stage + 1
    RECV_FORWARD = "RF"  # receive this stage's input activation from stage - 1
    SEND_BACKWARD = "SB"  # send the gradient of this stage's input to stage - 1
    RECV_BACKWARD = "RB"  # receive the gradient of this stage's output from stage + 1
    # MPress's peer swap ([Note: lending] in tidal/pipeline/lending.py): ``peer`` is the other rank
    LEND = "LO"  # send what this stage saved for the microbatch to a lender rank
    RECLAIM = "LI"  # receive it back from the lender, before the stage's backward
    HOLD = "HI"  # a lender: receive what a borrower's stage saved, and hold it
    GIVE_BACK = "HO"  # a lender: send it back

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)

    @property
    def is_comm(self) -> bool:
        return (
            self
            in (
                Kind.SEND_FORWARD,
                Kind.RECV_FORWARD,
                Kind.SEND_BACKWARD,
                Kind.RECV_BACKWARD,
            )
            or self.is_lending
        )

    @property
    def is_lending(self) -> bool:
        return self in (Kind.LEND, Kind.RECLAIM, Kind.HOLD, Kind.GIVE_BACK)


NO_MICROBATCH = -1  # an update concerns the stage's weights, not one microbatch


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One step of a rank's program; see [Note: schedule IR].

    The compact string is ``{stage}{kind}{microbatch}`` with ``v{version}`` appended when the
    version is known, and ``p{peer}`` for a lending action's other rank: ``"0F3"``, ``"2B5v1"``,
    ``"1U"`` / ``"1Uv2"``, ``"1SF3"``, ``"0LO3p2"``.
    """

    stage: int
    kind: Kind
    microbatch: int = NO_MICROBATCH
    version: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        assert self.stage >= 0, self
        if self.kind is Kind.UPDATE:
            assert self.microbatch == NO_MICROBATCH, f"an update has no microbatch: {self}"
        else:
            assert self.microbatch >= 0, f"{self.kind.name} needs a microbatch: {self}"
        assert self.version is None or self.version >= 0, self
        assert (self.peer is not None) == self.kind.is_lending, f"peer on lending only: {self}"

    def __str__(self) -> str:
        mb = "" if self.microbatch == NO_MICROBATCH else str(self.microbatch)
        ver = "" if self.version is None else f"v{self.version}"
        peer = "" if self.peer is None else f"p{self.peer}"
        return f"{self.stage}{self.kind.value}{mb}{ver}{peer}"

    def __repr__(self) -> str:
        return f"Action({self})"


_ACTION_RE = re.compile(r"^(\d+)(SF|RF|SB|RB|LO|LI|HI|HO|F|B|W|U)(\d*)(?:v(\d+))?(?:p(\d+))?$")


def parse_action(text: str) -> Action:
    """The inverse of ``str(action)``; raises ``ValueError`` naming the bad token."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"bad schedule action {text!r}: expected stage, kind (F B W U SF RF SB RB), "
            "microbatch and optional vN, like '0F3' or '2B5v1'"
        )
    stage, kind, mb, version, peer = match.groups()
    kind_ = Kind(kind)
    if (kind_ is Kind.UPDATE) == bool(mb):
        raise ValueError(f"bad schedule action {text!r}: only an update has no microbatch")
    if kind_.is_lending != (peer is not None):
        raise ValueError(f"bad schedule action {text!r}: a lending action, and only one, names "
                         "its peer rank (pN)")  # fmt: skip
    return Action(
        stage=int(stage),
        kind=kind_,
        microbatch=int(mb) if mb else NO_MICROBATCH,
        version=None if version is None else int(version),
        peer=None if peer is None else int(peer),
    )


def format_program(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_program(text: str) -> list[Action]:
    return [parse_action(token) for token in text.split()]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Programs per rank plus what they mean.

    ``asynchronous`` schedules update weights while older microbatches are still in flight
    (PipeDream, 2BW, PipeMare); ``stashing`` says how many weight versions a stage may keep
    for them (``None``: every version still needed, PipeDream; ``2``: 2BW; ``1``: PipeMare).
    ``num_microbatches`` is per optimizer step; ``num_steps`` the optimizer steps the programs
    span (``num_steps * num_microbatches`` microbatches in all).
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    num_steps: int = 1
    asynchronous: bool = False
    stashing: int | None = 1
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        assert len(self.programs) == self.num_ranks, (len(self.programs), self.num_ranks)
        assert self.num_stages % self.num_ranks == 0, (self.num_stages, self.num_ranks)
        for rank, program in enumerate(self.programs):
            for action in program:
                holds = action.kind in (Kind.HOLD, Kind.GIVE_BACK)  # for a borrower's stage
                owner = action.peer if holds else rank
                assert self.rank_of(action.stage) == owner, f"{action} is not on rank {owner}"

    @property
    def num_virtual(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    def actions(self) -> Iterator[tuple[int, Action]]:
        for rank, program in enumerate(self.programs):
            for action in program:
                yield rank, action

    def compute_only(self) -> Schedule:
        """The same schedule without send/receive actions."""
        return replace_programs(
            self, [[a for a in prog if not a.kind.is_comm] for prog in self.programs]
        )

    def __str__(self) -> str:
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches x {self.num_steps} steps"
        ]
        lines += [f"rank {r}: {format_program(p)}" for r, p in enumerate(self.programs)]
        return "\n".join(lines)


def replace_programs(schedule: Schedule, programs: Sequence[Sequence[Action]]) -> Schedule:
    """``schedule`` with other programs (its name, shape and meaning kept)."""
    return Schedule(
        name=schedule.name,
        num_ranks=schedule.num_ranks,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        programs=tuple(tuple(p) for p in programs),
        num_steps=schedule.num_steps,
        asynchronous=schedule.asynchronous,
        stashing=schedule.stashing,
        notes=dict(schedule.notes),
    )


def with_communication(schedule: Schedule) -> Schedule:
    """Add the point-to-point actions a compute-only schedule implies.

    A receive goes right before the compute that needs it and a send right after the compute
    that produced it, so each rank's program states the order of its own operations. Stages
    on the same rank (possible only with one rank) exchange nothing.
    """
    last = schedule.num_stages - 1
    programs: list[list[Action]] = []
    for program in schedule.programs:
        out: list[Action] = []
        for a in program:
            if a.kind.is_comm:
                raise ValueError(f"{schedule.name} already has communication actions ({a})")
            remote_prev = a.stage > 0 and schedule.rank_of(a.stage - 1) != schedule.rank_of(a.stage)
            remote_next = a.stage < last and schedule.rank_of(a.stage + 1) != schedule.rank_of(
                a.stage
            )
            if a.kind is Kind.FORWARD and remote_prev:
                out.append(Action(stage=a.stage, kind=Kind.RECV_FORWARD, microbatch=a.microbatch))
            if a.kind is Kind.BACKWARD and remote_next:
                out.append(Action(stage=a.stage, kind=Kind.RECV_BACKWARD, microbatch=a.microbatch))
            out.append(a)
            if a.kind is Kind.FORWARD and remote_next:
                out.append(Action(stage=a.stage, kind=Kind.SEND_FORWARD, microbatch=a.microbatch))
            if a.kind is Kind.BACKWARD and remote_prev:
                out.append(Action(stage=a.stage, kind=Kind.SEND_BACKWARD, microbatch=a.microbatch))
        programs.append(out)
    return replace_programs(schedule, programs)
