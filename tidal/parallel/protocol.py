"""What every engine offers the training loop: the Engine protocol, its phases, and the
checkpoint contract.

[Note: engine phases]
An engine is in one phase at a time, the same four for every engine:

    IDLE             no forward awaits its backward and no gradient is held
    FORWARD          a forward ran with autograd on; its backward is pending (the chunk store's
                     iteration is open: [Note: chunk engine iterations] in chunk_engine.py)
    ACCUMULATED      a backward ran: gradients are held until the step (or zero_grad) drops them
    GRADS_IN_PARAMS  as ACCUMULATED, but the gradients live in the parameters' own storage
                     ([Note: gradients in parameter chunks] in tidal/memory/optim.py): no
                     forward and no parameter write may come before step() or zero_grad()

A forward that ends without a backward (under ``torch.no_grad()``, one that raised, or one
followed by another forward) returns to the phase it left, so an evaluation between two
micro-batches keeps their gradients ACCUMULATED. A backward needs no forward of its own (a
loss computed from the parameters alone). The only change the table forbids is a forward out
of GRADS_IN_PARAMS, which would overwrite the gradients; engines refuse it first with an error
that says what to do, and :class:`Phases` asserts the table on every change.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CheckpointTensors",
    "Checkpointable",
    "Engine",
    "LoadTensors",
    "Phase",
    "Phases",
    "TrainingEngine",
]


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    ACCUMULATED = "accumulated"
    GRADS_IN_PARAMS = "grads_in_params"


_HELD = (Phase.IDLE, Phase.ACCUMULATED, Phase.GRADS_IN_PARAMS)  # after a backward or a step
_LEGAL = (
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.ACCUMULATED, Phase.FORWARD),
        (Phase.FORWARD, Phase.FORWARD),
    }
    | {(Phase.FORWARD, p) for p in _HELD}  # its backward, or the phase it left
    | {(p, Phase.ACCUMULATED) for p in (Phase.IDLE, Phase.ACCUMULATED)}  # a backward of its own
    | {(p, Phase.GRADS_IN_PARAMS) for p in _HELD}
    | {(p, Phase.IDLE) for p in _HELD}  # the step, or zero_grad
)


class Phases:
    """An engine's phase, changed only along the table of [Note: engine phases]."""

    def __init__(self) -> None:
        self.now = Phase.IDLE
        self._left = Phase.IDLE  # the phase the open forward left, to return to without backward

    def _set(self, new: Phase) -> None:
        assert (self.now, new) in _LEGAL, (
            f"illegal engine phase change {self.now.value} -> {new.value} (see [Note: engine "
            f"phases] in tidal/parallel/protocol.py)"
        )
        self.now = new

    def forward(self) -> None:
        if self.now is not Phase.FORWARD:
            self._left = self.now
        self._set(Phase.FORWARD)

    def forward_ended(self) -> None:
        """The open forward ended without a backward."""
        self._set(self._left)

    def track(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` in the FORWARD phase; one that raises, or runs under no_grad (no
        backward can follow), returns to the phase it left."""
        self.forward()
        try:
            output = forward()
        except BaseException:
            self.forward_ended()
            raise
        if not torch.is_grad_enabled():
            self.forward_ended()
        return output

    def backward(self, *, grads_in_params: bool = False) -> None:
        self._set(Phase.GRADS_IN_PARAMS if grads_in_params else Phase.ACCUMULATED)

    def gradients_dropped(self) -> None:
        """A step or zero_grad used or dropped the gradients (an open forward stays open)."""
        if self.now is Phase.FORWARD:
            self._left = Phase.IDLE
        else:
            self._set(Phase.IDLE)


@dataclass(frozen=True, slots=True)
class CheckpointTensors:
    """What an engine gives a sharded checkpoint: the DCP tensors, the small rest of its state
    (in ``train_state.pt``), what ``meta.json`` records (every key's numel, each state-dict
    name's key and shape) and, when some tensors are not in memory, the DCP save planner that
    reads them."""

    tensors: dict[str, Any]
    extras: dict[str, Any]
    meta: dict[str, Any]
    planner: Any = None


class LoadTensors(Protocol):
    """Loads a checkpoint's DCP tensors into ``targets`` in place (through ``planner``, a DCP
    load planner, when given)."""

    def __call__(self, targets: dict[str, Any], *, planner: Any = None) -> None: ...


@runtime_checkable
class TrainingEngine(Protocol):
    """What the training loop drives: DeepSpeed's calling convention (``loss = engine(x);
    engine.backward(loss); engine.step()``), figures, and DCP's ``Stateful``."""

    model: Any
    device: torch.device
    last_grad_norm: float | None

    @property
    def global_step(self) -> int: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def lr(self) -> float: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> bool: ...
    def zero_grad(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def model_data_bytes(self) -> dict[str, int]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def model_state_dict(self) -> dict[str, torch.Tensor]: ...


class Checkpointable(Protocol):
    """What writes and reads its state in the one checkpoint format ([Note: checkpoint keys]
    in tidal/train/checkpoint.py): every engine, and a pipeline's stages."""

    def checkpoint_state(self) -> CheckpointTensors: ...
    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None: ...


@runtime_checkable
class Engine(TrainingEngine, Checkpointable, Protocol):
    """A :class:`TrainingEngine` that writes and reads sharded (DCP) checkpoints."""
