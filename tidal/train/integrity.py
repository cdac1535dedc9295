"""Checkpoints that check themselves.

[Note: checkpoint integrity]
A checkpoint folder is renamed into place only once every file in it is written and fsync'd
([Note: atomic checkpoints] in checkpoint.py), but a disk can still lose or damage it later: a
copy cut short, a file system that zeroed a block, a hand that edited it. So ``meta.json``
records every file's size and CRC-32 before the rename: each rank's record of the DCP pieces it
wrote, confirmed present at that size in rank 0's folder ([Note: confirmed shards] in
checkpoint.py), and rank 0's of the rest; and
a resume checks the checkpoint it would load against that record first. A damaged one is named
with what is wrong, in one line, and the newest intact checkpoint is used instead (said as
well); ``--resume STEP`` asks for one checkpoint and fails with exit 2 if it is damaged. Rank 0
decides and tells the others, so every rank loads the same checkpoint. A checkpoint written
before checksums is checked for what it recorded (the size of ``train_state.pt``) and for DCP's
metadata file.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.distributed import decided_on_main

__all__ = [
    "CheckpointState",
    "choose_checkpoint",
    "damage",
    "describe_checkpoints",
    "file_record",
    "own_record",
]

_BLOCK_BYTES = 8 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def file_record(
    folder: Path, *, known: dict[str, dict[str, int]] | None = None
) -> dict[str, dict[str, int]]:
    """Every file under ``folder`` by relative path: its size and CRC-32. ``known``: records
    another rank made of the files it wrote, taken as they are (their sizes confirmed by the
    caller), so those files are not read back."""
    known = known or {}
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    record = {}
    for path in files:
        name = path.relative_to(folder).as_posix()
        record[name] = known.get(name) or {"bytes": path.stat().st_size, "crc32": _crc32(path)}
    return record


def own_record(folder: Path, pattern: str) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files under ``folder`` matching ``pattern``, by relative path."""
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
            for p in sorted(folder.glob(pattern)) if p.is_file()}  # fmt: skip


def _recorded(meta: dict[str, Any]) -> dict[str, dict[str, int]]:
    if "files" in meta:
        return dict(meta["files"])
    older = {name: {"bytes": int(n)} for name, n in meta.get("file_bytes", {}).items()}
    if meta.get("format_version", 0) < 2:
        return older  # torch.save files: the reader names the format it cannot read
    return {**older, "state/.metadata": {}}  # only that it exists


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint ``folder``, in a few words; None if it is intact."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"meta.json cannot be read ({type(err).__name__})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return "meta.json is not a tidal checkpoint's"
    for name, want in _recorded(meta).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if "bytes" in want and size != want["bytes"]:
            return f"{name} holds {size:,} bytes of the {want['bytes']:,} written"
        if "crc32" in want and _crc32(path) != want["crc32"]:
            return f"{name} does not match the checksum recorded when it was written"
    return None


@dataclass(frozen=True, slots=True)
class CheckpointState:
    step: int
    path: Path
    num_bytes: int
    damage: str | None  # None: intact


def describe_checkpoints(checkpoints: list[tuple[int, Path]]) -> list[CheckpointState]:
    """Each checkpoint (as ``list_checkpoints`` gives them) with its size and its damage."""
    return [
        CheckpointState(step, path, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                        damage(path))
        for step, path in checkpoints
    ]  # fmt: skip


def _choose(checkpoints: list[tuple[int, Path]], step: int | None) -> tuple[Path, list[str]]:
    """The checkpoint to resume from and a line for each damaged one passed over."""
    states = describe_checkpoints(checkpoints)
    intact = [s.step for s in states if s.damage is None]
    if step is not None:
        asked = [s for s in states if s.step == step]
        if not asked:
            raise ConfigError(
                "--resume",
                f"there is no checkpoint of step {step}; the intact ones are of steps "
                f"{', '.join(map(str, intact)) or 'none'}",
            )
        if asked[0].damage is not None:
            raise ConfigError(
                "--resume",
                f"checkpoint {asked[0].path} is damaged: {asked[0].damage}; the intact ones are "
                f"of steps {', '.join(map(str, intact)) or 'none'} (--resume STEP picks one)",
            )
        return asked[0].path, []
    skipped: list[str] = []
    for state in reversed(states):
        if state.damage is None:
            return state.path, skipped
        skipped.append(f"checkpoint {state.path.name} is damaged: {state.damage}")
    raise ConfigError(
        "--resume",
        f"every checkpoint is damaged ({'; '.join(skipped)}); start again with --overwrite",
    )


def choose_checkpoint(
    checkpoints: list[tuple[int, Path]], *, step: int | None
) -> tuple[Path, list[str]]:
    """Rank 0's :func:`_choose`, on every rank (a collective under torch.distributed); its
    ConfigError is raised on every rank."""
    path, skipped = decided_on_main(lambda: _choose(checkpoints, step))
    return Path(path), skipped
