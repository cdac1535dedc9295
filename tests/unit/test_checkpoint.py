"""Checkpoint folders: atomic layout, pruning, re-saving a step, stale temporaries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tidal.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _save(run_dir: Path, step: int, keep: int = 2) -> Path:
    return save_checkpoint(
        run_dir,
        step,
        model_state={"w": torch.full((3,), float(step))},
        train_state={"step": step},
        keep=keep,
    )


def test_keep_prunes_oldest_and_latest_is_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _save(tmp_path, step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 15]
    latest = load_checkpoint(latest_checkpoint(tmp_path))
    assert latest["step"] == 15
    assert torch.equal(latest["model"]["w"], torch.full((3,), 15.0))
    assert latest["train_state"] == {"step": 15}


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 7)
    save_checkpoint(tmp_path, 7, model_state={"w": torch.zeros(1)}, train_state={}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7]
    assert torch.equal(load_checkpoint(latest_checkpoint(tmp_path))["model"]["w"], torch.zeros(1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000007"]


def test_stale_temporaries_are_ignored_then_removed(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    dead = root / ".tmp-step_00000002-999999999"  # no such pid
    dead.mkdir()
    (dead / "model.pt").write_bytes(b"torn")
    incomplete = root / "step_00000003"  # a folder without meta.json is not a checkpoint
    incomplete.mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    live = root / f".tmp-step_00000004-{os.getppid()}"  # a writer that is still alive
    live.mkdir()
    _save(tmp_path, 2)
    assert not dead.exists() and live.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]


def test_loading_a_non_checkpoint_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a complete tidal checkpoint"):
        load_checkpoint(tmp_path)
