"""``metrics.tensorboard = true``: every figure of ``metrics.jsonl`` as a TensorBoard scalar.

The records are the ones ``metrics.jsonl`` gets (rank 0's, after each step and validation);
the writer is torch's ``SummaryWriter`` from the ``tensorboard`` package, an extra. Nested
figures are tagged by their path (``tiers/device_peak``), and byte counts are written in MiB
(``memory/host_MiB``) so the axes read. A resumed run purges the events past the step it
resumes from, as ``metrics.jsonl`` drops those records, so the curves read as one run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.train.callbacks import Callback

__all__ = ["TensorBoardWriter", "check_tensorboard", "scalars"]

_MIB = 1 << 20
# Record fields that are not figures: the step is the x axis.
_NOT_FIGURES = frozenset(("kind", "step"))
# Where the top-level fields of a train record go; nested ones take their parent's name.
_GROUPS = {"loss": "train", "grad_norm": "train", "lr": "train", "tokens": "train",
           "val_loss": "val", "memory_bytes": "memory", "peak_memory_bytes": "memory_peak"}  # fmt: skip


def check_tensorboard() -> None:
    """A one-line error, before any step, when the ``tensorboard`` package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "metrics.tensorboard",
            "needs the tensorboard package: pip install 'tidal[tensorboard]' (or tensorboard), "
            "or set metrics.tensorboard = false",
        )


def scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` of each number in a metrics record; ``None`` figures are left out."""
    for key, value in record.items():
        if key in _NOT_FIGURES:
            continue
        if isinstance(value, Mapping):
            group = _GROUPS.get(key, key)
            for name, inner in value.items():
                yield from _scalar(f"{group}/{name}", inner)
        else:
            yield from _scalar(f"{_GROUPS.get(key, 'perf')}/{key}", value)


def _scalar(tag: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if tag.endswith("_bytes"):
        yield tag.removesuffix("_bytes") + "_MiB", value / _MIB
    elif tag.startswith(("memory/", "memory_peak/")):  # memory_bytes' tiers hold bytes too
        yield f"{tag}_MiB", value / _MIB
    else:
        yield tag, float(value)


class TensorBoardWriter(Callback):
    """The records of a run into ``log_dir``, flushed after each (a run killed or interrupted
    keeps what its ``metrics.jsonl`` kept)."""

    def __init__(self, log_dir: Path) -> None:
        check_tensorboard()
        self.log_dir = log_dir
        self._writer: Any = None

    def on_start(self, trainer: Any, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or past it, from the run being resumed, are dropped.
        self._writer = SummaryWriter(str(self.log_dir),
                                     purge_step=start_step + 1 if start_step else None)  # fmt: skip

    def on_step(self, record: dict[str, Any]) -> None:
        self._write(record)

    def on_val(self, record: dict[str, Any]) -> None:
        self._write(record)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, record: Mapping[str, Any]) -> None:
        assert self._writer is not None, "on_start opens the writer"
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, global_step=record["step"])
        self._writer.flush()
