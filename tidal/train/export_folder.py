"""What every export shares: the run's ``config.json``, the checkpoint to read, and a folder
that appears whole or not at all (written into a hidden sibling and renamed into place, as
checkpoints are: [Note: atomic checkpoints] in checkpoint.py)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.train.checkpoint import checkpoint_root, fsync_dir, list_checkpoints
from tidal.train.integrity import damage

__all__ = [
    "EXPORT_FORMAT_VERSION",
    "ExportCheckError",
    "MODEL_FILE",
    "TIDAL_JSON",
    "compare_with_source",
    "default_out",
    "read_run_job",
    "select_checkpoint",
    "write_folder",
]

EXPORT_FORMAT_VERSION = 1
TIDAL_JSON = "tidal.json"
MODEL_FILE = "model.safetensors"


class ExportCheckError(RuntimeError):
    """A written export does not read back as the checkpoint it was made from."""


def read_run_job(run_dir: Path) -> dict[str, Any]:
    """The resolved job a run wrote into its ``config.json``."""
    path = run_dir / "config.json"
    if not run_dir.is_dir():
        raise ConfigError("run_dir", f"no run folder at {run_dir}")
    if not path.is_file():
        raise ConfigError(
            "run_dir",
            f"{run_dir} has no config.json, so it is not a run folder (`tidal train` writes "
            f"config.json, metrics.jsonl and checkpoints/ into one)",
        )
    try:
        job = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("run_dir", f"{path} is not valid JSON: {err}") from None
    if not isinstance(job, dict):
        raise ConfigError("run_dir", f"{path} holds no job (a JSON object)")
    return job


def select_checkpoint(run_dir: str | Path, step: int | None = None) -> tuple[int, Path]:
    """``(step, folder)`` of the run's latest checkpoint, or of checkpoint ``step``."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise ConfigError(
            "run_dir",
            f"no checkpoints in {checkpoint_root(run_dir)} to export; a run writes them with "
            f"checkpoint.at_end = true (the default) or checkpoint.every_steps = N, e.g. "
            f"`tidal train --recipe R --set checkpoint.every_steps=100`",
        )
    by_step = dict(checkpoints)
    if step is not None and step not in by_step:
        available = ", ".join(str(s) for s, _ in checkpoints)
        raise ConfigError(
            "step",
            f"no checkpoint of step {step} in {checkpoint_root(run_dir)} (available: {available})",
        )
    found, path = checkpoints[-1] if step is None else (step, by_step[step])
    reason = damage(path)  # [Note: checkpoint integrity] in integrity.py
    if reason is not None:
        intact = [str(s) for s, p in checkpoints if p != path and damage(p) is None]
        raise ConfigError(
            "step",
            f"checkpoint {path} is damaged: {reason}; export an intact one with --step N "
            f"(intact: {', '.join(intact) or 'none'})",
        )
    return found, path


def default_out(run_dir: Path, step: int) -> Path:
    return run_dir / "export" / f"step_{step:08d}"


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            "out",
            f"{out} already exists and is not empty; delete it or choose another folder (--out)",
        )


def write_folder(out: Path, write: Callable[[Path], None]) -> Path:
    """``write(folder)`` into a hidden sibling of ``out``, then renamed to ``out``."""
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        fsync_dir(tmp)
        check_out(out)  # nothing appeared there while we wrote
        tmp.rename(out)  # replaces an empty folder atomically, as rename(2) does
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def compare_with_source(file: Path, tensors: dict[str, Any], source: Path) -> list[str]:
    """``[line]`` when the exported ``tensors`` (read from ``file``) equal the checkpoint
    ``source`` bit for bit, ``[]`` when that checkpoint is gone; raises
    :class:`ExportCheckError` when they differ."""
    import torch

    from tidal.train.checkpoint import load_model_state

    if not (source / "meta.json").is_file():
        return []
    original = load_model_state(source)
    differ = [n for n in original if n not in tensors or not torch.equal(tensors[n], original[n])]
    if differ or tensors.keys() != original.keys():
        raise ExportCheckError(f"{file} differs from {source} in {differ}")
    return [f"{file.name if file.parent.name != 'hf' else 'hf/' + file.name}: {len(tensors)} "
            f"tensors equal to {source}"]  # fmt: skip
