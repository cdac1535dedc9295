"""Checkpoint folders: atomic layout, pruning, re-saving a step, stale temporaries, old formats,
and the state-dict adapter at the boundary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tidal.parallel.protocol import CheckpointTensors
from tidal.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    read_tensors,
    save_checkpoint,
)


def _state(value: float, shape: tuple[int, ...] = (3,)) -> CheckpointTensors:
    numel = int(torch.Size(shape).numel())
    return CheckpointTensors(
        tensors={"model/w": torch.full((numel,), value), "optim/w/exp_avg": torch.zeros(numel)},
        extras={"optimizer_steps": {"w": value}},
        meta={"model_keys": {"w": "model/w"}, "model_shapes": {"w": list(shape)}},
    )


def _save(run_dir: Path, step: int, keep: int = 2) -> Path:
    return save_checkpoint(
        run_dir, step, state=_state(float(step)), train_state={"step": step}, keep=keep
    )


def test_keep_prunes_oldest_and_latest_is_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _save(tmp_path, step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 15]
    latest = load_checkpoint(latest_checkpoint(tmp_path))
    assert latest.step == 15
    assert torch.equal(load_model_state(latest.path)["w"], torch.full((3,), 15.0))
    assert latest.train_state == {"step": 15, "engine": {"optimizer_steps": {"w": 15.0}}}
    assert latest.meta["numels"] == {"model/w": 3, "optim/w/exp_avg": 3}
    targets = {"model/w": torch.empty(3)}
    latest.load_tensors(targets)
    assert torch.equal(targets["model/w"], torch.full((3,), 15.0))


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 7)
    save_checkpoint(tmp_path, 7, state=_state(0.0, (1,)), train_state={}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7]
    assert torch.equal(load_model_state(latest_checkpoint(tmp_path))["w"], torch.zeros(1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000007"]


def test_stale_temporaries_are_ignored_then_removed(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    dead = root / ".tmp-step_00000002-999999999"  # no such pid
    dead.mkdir()
    (dead / "train_state.pt").write_bytes(b"torn")
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


def test_an_old_format_is_refused_naming_it_and_what_to_do(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints" / "step_00000001"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"format_version": 1, "step": 1}))
    for read in (load_checkpoint, load_model_state, read_tensors):
        with pytest.raises(ValueError, match=r"format 1 .*reads formats 2, 3.*tidal that wrote it"):
            read(folder)


class _Prefixed:
    """An adapter that stores every name under ``hf.``: a stand-in for a per-model one."""

    def to_checkpoint(self, name: str) -> str:
        return f"hf.{name}"

    def from_checkpoint(self, name: str) -> str:
        assert name.startswith("hf."), name
        return name.removeprefix("hf.")


def test_the_adapter_renames_at_the_boundary_and_back(tmp_path: Path) -> None:
    adapter = _Prefixed()
    path = save_checkpoint(tmp_path, 3, state=_state(3.0, (1, 3)), train_state={}, keep=1,
                           adapter=adapter)  # fmt: skip
    # On disk: the checkpoint's names; meta.json and train_state.pt agree with DCP.
    assert set(read_tensors(path)) == {"model/hf.w", "optim/hf.w/exp_avg"}
    meta = json.loads((path / "meta.json").read_text())
    assert meta["model_keys"] == {"hf.w": "model/hf.w"} and meta["format_version"] == 3
    assert load_model_state(path).keys() == {"hf.w"}
    # Through the adapter: the model's names, everywhere.
    checkpoint = load_checkpoint(path, adapter=adapter)
    assert checkpoint.meta["model_keys"] == {"w": "model/w"}
    assert checkpoint.train_state["engine"] == {"optimizer_steps": {"w": 3.0}}
    targets = {"model/w": torch.empty(3), "optim/w/exp_avg": torch.ones(3)}
    checkpoint.load_tensors(targets)
    assert torch.equal(targets["model/w"], torch.full((3,), 3.0))
    assert torch.equal(targets["optim/w/exp_avg"], torch.zeros(3))
    assert torch.equal(load_model_state(path, adapter=adapter)["w"], torch.full((1, 3), 3.0))
    assert set(read_tensors(path, adapter=adapter)) == {"model/w", "optim/w/exp_avg"}
