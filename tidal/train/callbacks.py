"""The loop's hooks: :class:`Callback` (override what you need), :class:`ProgressLine`, the
progress line ``Trainer.fit()`` prints by default, and :class:`LogCallback`, the same line
through ``logging``. The CLI's rich display (tidal/cli/progress.py) prints the same lines."""

from __future__ import annotations

import logging
import sys
from typing import Any, ClassVar, TextIO

from tidal.train.metrics import format_step_line

__all__ = ["Callback", "LogCallback", "ProgressLine", "describe_start", "format_val_line"]

# The trainer's logger: what a program configured for it keeps working.
logger = logging.getLogger("tidal.train.trainer")


class Callback:
    """Hooks the loop calls; override what you need.

    ``shows_progress``: the callback shows the run's progress itself, so ``fit()`` adds no
    :class:`ProgressLine` of its own beside it.
    """

    shows_progress: ClassVar[bool] = False

    def on_start(self, trainer: Any, *, start_step: int) -> None: ...  # the Trainer
    def on_step(self, record: dict[str, Any]) -> None: ...
    def on_val(self, record: dict[str, Any]) -> None: ...
    def on_checkpoint(self, step: int, path: str) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


def describe_start(trainer: Any, *, start_step: int) -> str:
    """What the run is, after its name: ``starting; tiny with 1,234 params on cpu (fp32,
    reference engine); 2,048 tokens/step; peak ...; run dir runs/tiny``."""
    job = trainer.job
    peak = trainer.peak
    peak_text = f"{peak.tflops:.2f} TFLOP/s ({peak.source})" if peak else "unknown"
    verb = f"resuming at step {start_step}" if start_step else "starting"
    plan = trainer.plan
    engine = f"plan {plan.mesh_name}" if plan is not None else f"{job.engine} engine"
    if job.pipelined:
        engine = f"pipeline of {job.parallel.pp} stages, {job.pipeline.schedule}"
    elif job.needs_stages:  # [Note: one train step] in job.py
        held = "chunk stage" if job.engine == "chunk" else "stage"
        engine = f"one {held} on {job.parallel.resolve(trainer.world_size)}"
    model = job.model.hf_config or job.model.factory or job.model.preset
    if trainer.user_model is not None:  # [Note: your own model] in training_part.py
        model = f"your {type(trainer.user_model).__name__}"
    unit = "rows" if trainer.tokens_per_row == 1 else "tokens"
    return (
        f"{verb}; {model} with {trainer.num_params:,} params on {trainer.device} "
        f"({job.training.precision}, {engine}); {trainer.tokens_per_step:,} {unit}/step; "
        f"peak {peak_text}; run dir {trainer.run_dir}"
    )


def format_val_line(record: dict[str, Any]) -> str:
    return f"step {record['step']}  val_loss {record['val_loss']:.4f}"


def _due(step: int, *, log_every: int, total_steps: int) -> bool:
    return step % log_every == 0 or step == total_steps


class ProgressLine(Callback):
    """What the run is, then the progress line every ``training.log_every`` steps
    (:func:`~tidal.train.metrics.format_step_line`: loss, grad norm, lr, memory, tokens/s,
    TFLOP/s, MFU), validation losses and checkpoints, printed to ``file`` (default: stdout)."""

    shows_progress = True

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self.total_steps = 0
        self.log_every = 1

    def _print(self, line: str) -> None:
        print(line, file=self.file or sys.stdout, flush=True)

    def on_start(self, trainer: Any, *, start_step: int) -> None:
        self.total_steps = trainer.job.training.steps
        self.log_every = trainer.job.training.log_every
        self._print(f"{trainer.job.name}: {describe_start(trainer, start_step=start_step)}")

    def on_step(self, record: dict[str, Any]) -> None:
        if _due(record["step"], log_every=self.log_every, total_steps=self.total_steps):
            self._print(format_step_line(record, total_steps=self.total_steps))

    def on_val(self, record: dict[str, Any]) -> None:
        self._print(format_val_line(record))

    def on_checkpoint(self, step: int, path: str) -> None:
        self._print(f"step {step}  checkpoint {path}")


class LogCallback(Callback):
    """The progress line through ``logging`` (at INFO, logger ``tidal.train.trainer``) every
    ``log_every`` steps, for programs that route tidal's lines through their logging."""

    shows_progress = True

    def __init__(self, *, log_every: int, total_steps: int) -> None:
        self.log_every = log_every
        self.total_steps = total_steps

    def on_step(self, record: dict[str, Any]) -> None:
        if _due(record["step"], log_every=self.log_every, total_steps=self.total_steps):
            logger.info(format_step_line(record, total_steps=self.total_steps))

    def on_val(self, record: dict[str, Any]) -> None:
        logger.info(format_val_line(record))
