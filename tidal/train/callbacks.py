"""The loop's hooks: :class:`Callback` (override what you need) and :class:`LogCallback`, the
progress line through ``logging``."""

from __future__ import annotations

import logging
from typing import Any

from tidal.train.metrics import format_step_line

__all__ = ["Callback", "LogCallback"]

# The trainer's logger: what a program configured for it keeps working.
logger = logging.getLogger("tidal.train.trainer")


class Callback:
    """Hooks the loop calls; override what you need."""

    def on_start(self, trainer: Any, *, start_step: int) -> None: ...  # the Trainer
    def on_step(self, record: dict[str, Any]) -> None: ...
    def on_val(self, record: dict[str, Any]) -> None: ...
    def on_checkpoint(self, step: int, path: str) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


class LogCallback(Callback):
    """The progress line through ``logging`` every ``log_every`` steps."""

    def __init__(self, *, log_every: int, total_steps: int) -> None:
        self.log_every = log_every
        self.total_steps = total_steps

    def on_step(self, record: dict[str, Any]) -> None:
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
            logger.info(format_step_line(record, total_steps=self.total_steps))

    def on_val(self, record: dict[str, Any]) -> None:
        logger.info("step %d  val_loss %.4f", record["step"], record["val_loss"])
