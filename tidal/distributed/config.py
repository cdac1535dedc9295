"""The ``[distributed]`` section: how the ranks of a job talk (see [Note: dead ranks] in
watchdog.py for what stops a job whose rank died; its settings are the environment's,
``TIDAL_HEARTBEAT_S`` and ``TIDAL_DEAD_AFTER_S``, read before any config exists)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import require

__all__ = ["DistributedConfig"]


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """The process group of a run on several ranks; with one process these settings do nothing.

    Attributes:
        timeout_s: seconds a collective may wait for its peers before it fails (the process
            group's timeout). The watchdog names a dead rank far sooner; this bounds what it
            cannot see, a rank that lives but never reaches the collective (mismatched
            collectives, a deadlock). Raise it for steps or checkpoints slower than 10 minutes.
    """

    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
