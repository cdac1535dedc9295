"""Point-to-point messages between pipeline stages: in one process or over ``torch.distributed``.

A :class:`Transport` moves one tensor per :class:`MessageKey` (source stage, destination stage,
microbatch). :class:`LocalTransport` is a dict, for :func:`~tidal.runtime.local.run_local`;
:class:`P2PTransport` speaks ``torch.distributed`` for one process per rank.

[Note: point-to-point protocol]
- Every message is a fixed-size int64 header ``(dtype code, ndim, dims..., 0 padding)`` followed
  by the payload, so shapes are never inferred ahead of time: variable sequence lengths and
  uneven microbatches just work.
- Sends are ``isend`` and waited at the end of the program (or reaped once complete), so a rank
  never blocks on a send: 1F1B's steady state (send forward, then wait for a gradient) cannot
  deadlock. Receives block where the program needs the tensor.
- Tags are not used to match messages (NCCL ignores them). Instead a receiver knows, from the
  sender's program, the order in which that peer sends to it; a receive takes the peer's
  messages in that order and parks any that arrive before the one it wants. Receiving an earlier
  message never waits longer than the wanted one would, so this adds no deadlock.
- A tied matrix's messages (:class:`TiedKey`) travel on their own tag and are not in the
  programs: each direction between the two ranks carries one kind of message (gradients to
  the owner, values to the second copy), sent and received in update order.
- NCCL is untested here (one GPU per machine): an ``isend`` followed by a blocking ``recv`` on
  the same pair may serialise on NCCL's stream; gloo (CPU) is the tested backend.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from tidal.config import require
from tidal.pipeline.ir import Kind, Schedule

__all__ = [
    "AnyKey",
    "Direction",
    "LendKey",
    "TiedKey",
    "LocalTransport",
    "MessageKey",
    "P2PTransport",
    "PipelineDeadlock",
    "Transport",
    "isend",
]


class PipelineDeadlock(RuntimeError):
    """No rank can run its next action: the programs wait on each other."""


class Direction(enum.Enum):
    FORWARD = "forward"  # an activation, stage s -> s + 1
    BACKWARD = "backward"  # the gradient of an activation, stage s -> s - 1


@dataclass(frozen=True, slots=True, order=True)
class MessageKey:
    """One point-to-point message: ``src_stage`` sends it to ``dst_stage`` for ``microbatch``."""

    src_stage: int
    dst_stage: int
    microbatch: int

    def __post_init__(self) -> None:
        assert abs(self.src_stage - self.dst_stage) == 1, self

    @property
    def direction(self) -> Direction:
        return Direction.FORWARD if self.dst_stage > self.src_stage else Direction.BACKWARD


@dataclass(frozen=True, slots=True, order=True)
class LendKey:
    """What stage ``stage`` saved for ``microbatch``, on its way to rank ``lender`` or (``home``)
    back from it ([Note: lending] in tidal/pipeline/lending.py)."""

    stage: int
    microbatch: int
    lender: int
    home: bool


@dataclass(frozen=True, slots=True, order=True)
class TiedKey:
    """A matrix tied across two stages under an asynchronous schedule ([Note: tied matrices
    without a flush] in tidal/runtime/tied.py): pair ``pair``'s message of the update of
    ``step``, from ``src_stage`` to ``dst_stage`` (the second copy's gradient to the owner, or
    the owner's new value to the second copy)."""

    pair: int
    step: int
    src_stage: int
    dst_stage: int


AnyKey = MessageKey | LendKey | TiedKey


class Transport(Protocol):
    """Moves one tensor per key between stages on different ranks."""

    def send(self, key: AnyKey, tensor: torch.Tensor) -> None:
        """Start sending; never blocks on the receiver."""
        ...

    def recv(self, key: AnyKey) -> torch.Tensor:
        """The tensor sent under ``key``; may block until it arrives."""
        ...

    def ready(self, key: AnyKey) -> bool:
        """Whether :meth:`recv` would return without waiting on another rank's progress."""
        ...

    def flush(self) -> None:
        """Wait until every send has completed."""
        ...


class LocalTransport:
    """In-process messages for :func:`run_local`: a dict from key to tensor."""

    def __init__(self) -> None:
        self._messages: dict[AnyKey, torch.Tensor] = {}

    def send(self, key: AnyKey, tensor: torch.Tensor) -> None:
        assert key not in self._messages, f"{key} sent twice"
        self._messages[key] = tensor.detach()

    def recv(self, key: AnyKey) -> torch.Tensor:
        if key not in self._messages:
            raise PipelineDeadlock(f"receive of {key} before its send")
        return self._messages.pop(key)

    def ready(self, key: AnyKey) -> bool:
        return key in self._messages

    def flush(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._messages)


_MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,  # lent bytes ([Note: lending])
)


TIED_TAG = 1  # gloo matches by tag: a tied matrix's messages never mix with activations


def isend(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None, *, tag: int = 0
) -> dist.Work:
    """``dist.isend`` from a rank of ``group``, whose send always has a handle to wait on."""
    work = dist.isend(tensor, dst=dst, group=group, tag=tag)
    assert work is not None, "isend returns None only on a rank outside the group"
    return work


class P2PTransport:
    """Messages between ranks of a schedule over ``torch.distributed``.

    See [Note: point-to-point protocol]. ``schedule`` must have its communication actions.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.group = group
        self.device = torch.device(device)
        self._pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []
        self._parked: dict[AnyKey, torch.Tensor] = {}
        self._expected = {
            peer: iter(self._sends_to(peer, rank)) for peer in range(schedule.num_ranks)
        }
        self.bytes_sent = 0

    def _sends_to(self, sender: int, receiver: int) -> list[AnyKey]:
        out: list[AnyKey] = []
        for a in self.schedule.programs[sender]:
            key: AnyKey
            if a.kind is Kind.SEND_FORWARD:
                key = MessageKey(a.stage, a.stage + 1, a.microbatch)
            elif a.kind is Kind.SEND_BACKWARD:
                key = MessageKey(a.stage, a.stage - 1, a.microbatch)
            elif a.kind is Kind.LEND:
                assert a.peer is not None
                key = LendKey(a.stage, a.microbatch, a.peer, home=False)
            elif a.kind is Kind.GIVE_BACK:
                key = LendKey(a.stage, a.microbatch, sender, home=True)
            else:
                continue
            if self._destination(key) == receiver:
                out.append(key)
        return out

    def _destination(self, key: AnyKey) -> int:
        if isinstance(key, TiedKey):
            return self.schedule.rank_of(key.dst_stage)
        if isinstance(key, LendKey):
            return self.schedule.rank_of(key.stage) if key.home else key.lender
        return self.schedule.rank_of(key.dst_stage)

    def _source(self, key: AnyKey) -> int:
        if isinstance(key, TiedKey):
            return self.schedule.rank_of(key.src_stage)
        if isinstance(key, LendKey):
            return key.lender if key.home else self.schedule.rank_of(key.stage)
        return self.schedule.rank_of(key.src_stage)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, key: AnyKey, tensor: torch.Tensor) -> None:
        require(
            tensor.dtype in _DTYPES and tensor.dim() <= _MAX_DIMS,
            "pipeline",
            f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between stages; "
            f"supported: {_MAX_DIMS} dims of {', '.join(str(d) for d in _DTYPES)}",
        )
        payload = tensor.detach().contiguous()
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=payload.device)
        header[0] = _DTYPES.index(payload.dtype)
        header[1] = payload.dim()
        header[2 : 2 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
        dst = self._global(self._destination(key))
        tag = TIED_TAG if isinstance(key, TiedKey) else 0
        work_h = isend(header, dst, self.group, tag=tag)
        work_p = isend(payload, dst, self.group, tag=tag)
        self._pending += [(work_h, header, header), (work_p, payload, header)]
        self.bytes_sent += payload.numel() * payload.element_size()
        self._pending = [item for item in self._pending if not item[0].is_completed()]

    def _receive_next(self, src: int, *, tag: int = 0) -> torch.Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self._global(src), group=self.group, tag=tag)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        shape = [int(d) for d in header[2 : 2 + ndim]]
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(payload, src=self._global(src), group=self.group, tag=tag)
        return payload

    def recv(self, key: AnyKey) -> torch.Tensor:
        if isinstance(key, TiedKey):  # in update order on its own tag: nothing to park
            return self._receive_next(self._source(key), tag=TIED_TAG)
        if key in self._parked:
            return self._parked.pop(key)
        src = self._source(key)
        for expected in self._expected[src]:
            tensor = self._receive_next(src)
            if expected == key:
                return tensor
            self._parked[expected] = tensor
        raise RuntimeError(f"rank {self.rank}: {key} is not among rank {src}'s sends")

    def ready(self, key: AnyKey) -> bool:
        return key in self._parked

    def flush(self) -> None:
        for work, _, _ in self._pending:
            work.wait()
        self._pending.clear()
        assert not self._parked, f"rank {self.rank}: received but unused {sorted(self._parked)}"
