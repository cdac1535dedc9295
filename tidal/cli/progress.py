"""Rich presentation of a training run: a progress bar with the familiar step line above it."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from tidal.train import Callback, Trainer
from tidal.train.callbacks import describe_start, format_val_line
from tidal.train.metrics import format_step_line
from tidal.train.report import summary_rows

__all__ = ["RichProgress", "summary_table"]


def summary_table(summary: dict[str, Any], *, title: str = "summary") -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    return table


class RichProgress(Callback):
    """A bar for the run (only on a terminal) and :class:`~tidal.train.ProgressLine`'s lines."""

    shows_progress = True

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=False, highlight=False)
        self.progress: Progress | None = None
        self.task: Any = None
        self.total_steps = 0
        self.log_every = 1

    def on_start(self, trainer: Trainer, *, start_step: int) -> None:
        self.total_steps = trainer.job.training.steps
        self.log_every = trainer.job.training.log_every
        self.console.print(
            f"[bold]{trainer.job.name}[/]: {describe_start(trainer, start_step=start_step)}",
            soft_wrap=True,
        )
        self.progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.total_steps, completed=start_step)

    def on_step(self, record: dict[str, Any]) -> None:
        assert self.progress is not None
        self.progress.update(self.task, completed=record["step"])
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
            self.console.print(
                format_step_line(record, total_steps=self.total_steps), soft_wrap=True
            )

    def on_val(self, record: dict[str, Any]) -> None:
        self.console.print(format_val_line(record))

    def on_checkpoint(self, step: int, path: str) -> None:
        self.console.print(f"step {step}  checkpoint {path}")

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.console.print(summary_table(summary))
