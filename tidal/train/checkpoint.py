"""Checkpoints that survive being killed mid-write.

Layout under ``<run_dir>/checkpoints/``::

    step_00000010/          a complete checkpoint
        model.pt            the model's state dict (load it alone to export or evaluate)
        train_state.pt      optimizer, schedule step, data position, RNG states, counters
        meta.json           step, files and their sizes; written last
    .tmp-step_00000020-4242/  a checkpoint being written by process 4242

[Note: atomic checkpoints]
A checkpoint is written into a hidden temporary folder, every file is fsync'd, and only then is the
folder renamed to ``step_NNNNNNNN`` (a rename within one file system is atomic), followed by an fsync
of the parent folder so the rename itself is durable. A reader only ever considers ``step_*``
folders, so a process killed at any instant leaves either the old set of checkpoints or the old
set plus the new one, never a half-written checkpoint that looks complete. Leftover temporary
folders from dead writers are removed by the next save. Old checkpoints are pruned only after the
new one is in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "checkpoint_root",
    "fsync_dir",
    "list_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "save_checkpoint",
    "swap_into_place",
    "write_json_durable",
]

_STEP_DIR_RE = re.compile(r"^step_(\d{8})$")
_FORMAT_VERSION = 1


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, folder), oldest first (see [Note: atomic checkpoints])."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR_RE.match(path.name)
        if match and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1][1] if checkpoints else None


def _write_tensor_file(obj: Any, path: Path) -> int:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, data: dict[str, Any], *, indent: int = 1) -> int:
    """Write ``data`` as JSON and fsync it; returns the file's size."""
    with path.open("w") as f:
        f.write(json.dumps(data, indent=indent) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model_state: dict[str, Any],
    train_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically, then keep only the newest ``keep`` checkpoints."""
    assert keep >= 1, keep
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    tmp.mkdir()
    sizes = {
        "model.pt": _write_tensor_file(model_state, tmp / "model.pt"),
        "train_state.pt": _write_tensor_file(train_state, tmp / "train_state.pt"),
    }
    meta = {"format_version": _FORMAT_VERSION, "step": step, "file_bytes": sizes}
    write_json_durable(tmp / "meta.json", meta)
    fsync_dir(tmp)
    swap_into_place(tmp, final, root)
    _prune(run_dir, keep)
    return final


def swap_into_place(tmp: Path, final: Path, root: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final`` (in ``root``), durably."""
    if final.exists():
        # The same step saved again (e.g. a finished run resumed): swap the folders so there is
        # never a moment without a complete checkpoint for this step.
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)


def _remove_stale_temporaries(root: Path) -> None:
    for path in root.iterdir():
        if path.name.startswith((".tmp-", ".old-")) and not _written_by_live_process(path):
            shutil.rmtree(path, ignore_errors=True)


def _written_by_live_process(path: Path) -> bool:
    pid = int(path.name.rsplit("-", 1)[-1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune(run_dir: str | Path, keep: int) -> None:
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(
    path: str | Path, *, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """``{"step", "model", "train_state"}`` from a checkpoint folder (tensors on ``map_location``);
    a sharded one (format 2) gives ``"meta"`` and ``"load_tensors"`` instead of ``"model"``."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(
            f"{path} is not a complete tidal checkpoint (no meta.json); pick a step_* folder "
            f"listed by list_checkpoints()"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") == 2:  # sharded: the engine reads its tensors itself
        from tidal.train.dist_checkpoint import load_sharded_checkpoint

        train_state, load = load_sharded_checkpoint(path, meta)
        return {"step": int(meta["step"]), "train_state": train_state, "meta": meta,
                "load_tensors": load}  # fmt: skip
    if meta.get("format_version") != _FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format_version')} is not supported by this "
            f"tidal (format {_FORMAT_VERSION})"
        )
    return {
        "step": int(meta["step"]),
        "model": torch.load(path / "model.pt", map_location=map_location, weights_only=True),
        "train_state": torch.load(
            path / "train_state.pt", map_location=map_location, weights_only=True
        ),
    }


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full state dict (``model.state_dict()`` names and shapes, fp32 weights, tied
    weights under each of their names) from a checkpoint folder of any engine and world size."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if meta.get("format_version") == 2:
        from tidal.train.dist_checkpoint import read_model_state

        return read_model_state(path, meta)
    return load_checkpoint(path)["model"]
