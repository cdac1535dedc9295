"""Checkpoints that check themselves ([Note: checkpoint integrity] in tidal/train/integrity.py):
each kind of damage is named in one line, and a resume falls back to the newest intact one."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.train import Trainer
from tidal.train.checkpoint import list_checkpoints
from tidal.train.integrity import choose_checkpoint, damage
from tidal.train.metrics import read_metrics

COMMON = [
    "training.val_every=0",
    "training.log_every=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep=3",
    "optimizer.decay_steps=20",
    "metrics.peak_tflops=1.0",
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps, checkpoints at 2, 4 and 6: the damage is done to copies of it."""
    run_dir = tmp_path_factory.mktemp("integrity") / "full"
    Trainer("tiny", [*COMMON, f"run_dir={run_dir}", "training.steps=6"]).fit()
    return run_dir


def _copy(full_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(full_run, tmp_path / "run"))


def _truncate_a_piece(folder: Path) -> str:
    piece = sorted((folder / "state").glob("*.distcp"))[0]
    piece.write_bytes(piece.read_bytes()[: piece.stat().st_size // 2])
    return f"state/{piece.name}"


def _zero_train_state(folder: Path) -> str:
    path = folder / "train_state.pt"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # same size: only the checksum can tell
    path.write_bytes(bytes(data))
    return "train_state.pt"


def _garble_meta(folder: Path) -> str:
    (folder / "meta.json").write_text("{ this is not json")
    return "meta.json"


def _remove_dcp_metadata(folder: Path) -> str:
    (folder / "state" / ".metadata").unlink()
    return "state/.metadata"


DAMAGE: dict[str, Callable[[Path], str]] = {
    "truncated-distcp": _truncate_a_piece,
    "zeroed-train-state": _zero_train_state,
    "garbage-meta": _garble_meta,
    "missing-dcp-metadata": _remove_dcp_metadata,
}


def test_meta_records_every_file_with_its_size_and_checksum(full_run: Path) -> None:
    newest = list_checkpoints(full_run)[-1][1]
    files = json.loads((newest / "meta.json").read_text())["files"]
    assert {"train_state.pt", "state/.metadata"} <= files.keys()
    assert any(name.endswith(".distcp") for name in files)
    assert all(set(record) == {"bytes", "crc32"} for record in files.values())
    assert damage(newest) is None


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_damage_is_named_and_the_newest_intact_checkpoint_chosen(
    kind: str, full_run: Path, tmp_path: Path
) -> None:
    run_dir = _copy(full_run, tmp_path)
    newest = list_checkpoints(run_dir)[-1][1]
    broken = DAMAGE[kind](newest)
    reason = damage(newest)
    assert reason is not None and broken in reason, reason
    path, skipped = choose_checkpoint(list_checkpoints(run_dir), step=None)
    assert path.name == "step_00000004"
    assert skipped == [f"checkpoint step_00000006 is damaged: {reason}"]


def test_resume_falls_back_and_trains_the_steps_the_run_did(
    full_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = _copy(full_run, tmp_path)
    _zero_train_state(list_checkpoints(run_dir)[-1][1])
    with caplog.at_level(logging.WARNING, logger="tidal.train.trainer"):
        summary = Trainer("tiny", [*COMMON, f"run_dir={run_dir}", "training.steps=6"]).fit(
            resume=True
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "tidal: checkpoint step_00000006 is damaged: train_state.pt does not match the "
        "checksum recorded when it was written; resuming from step_00000004"
    ]
    assert summary["resumed_from_step"] == 4

    def losses(path: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in read_metrics(path) if r["kind"] == "train"]

    assert losses(run_dir) == losses(full_run)  # steps 5 and 6 again, exactly
    assert damage(list_checkpoints(run_dir)[-1][1]) is None  # step 6 written anew


def test_resume_of_a_damaged_or_missing_step_is_one_line_and_exit_2(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _copy(full_run, tmp_path)
    _truncate_a_piece(list_checkpoints(run_dir)[-1][1])
    argv = ["train", "--recipe", "tiny", "--no-plots", "--set", f"run_dir={run_dir}"]
    for step, fragment in (("6", "is damaged: state/"), ("3", "no checkpoint of step 3")):
        assert main([*argv, "--resume", step]) == 2
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
        assert err.startswith("tidal: error: --resume: ") and fragment in err, err
        assert "intact ones are of steps 2, 4" in err


def test_the_checkpoints_command_lists_each_with_its_state(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _copy(full_run, tmp_path)
    _garble_meta(list_checkpoints(run_dir)[-1][1])
    assert main(["checkpoints", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("intact") == 2 and "damaged: meta.json cannot be read" in out, out
    for _, path in list_checkpoints(run_dir)[:-1]:
        _truncate_a_piece(path)
    assert main(["checkpoints", str(run_dir)]) == 2  # none intact


def test_export_of_a_damaged_checkpoint_is_one_line_naming_the_intact_ones(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _copy(full_run, tmp_path)
    _truncate_a_piece(list_checkpoints(run_dir)[-1][1])
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "step_00000006 is damaged" in err and "(intact: 2, 4)" in err, err
    assert not (tmp_path / "out").exists()
