"""What every engine offers the training loop: the Engine protocol and the checkpoint contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["CheckpointTensors", "LoadTensors"]


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
