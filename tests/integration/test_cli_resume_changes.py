"""``tidal train --resume --set optimizer.lr=...``: the change said in one line on stderr, and a
change that cannot be honoured refused in one line ([Note: resuming with changes] in
tidal/train/resume_changes.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_resume_with_another_lr_says_so_and_another_algorithm_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--recipe", "tiny", "--no-plots", "--set", f"run_dir={tmp_path}",
            "--set", "training.steps=2", "--set", "training.val_every=0"]  # fmt: skip
    assert main(args) == 0
    resumed = subprocess.run(
        [sys.executable, "-m", "tidal", *args, "--resume", "--set", "optimizer.lr=1e-3",
         "--set", "training.steps=3"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    said = [line for line in resumed.stderr.splitlines() if "resuming" in line]
    assert said == [
        "tidal: resuming at step 2 with optimizer.lr 0.001 (was 0.003), training.steps 3 (was 2); "
        "the next step's learning rate is 6.00e-04 (the saved schedule's: 1.80e-03)"
    ]  # still warming up: step 3 of 5 at 3/5 of the peak
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "optimizer.name=sgd"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tidal: error: optimizer.name: the checkpoint at step 3 holds adamw's optimizer state, "
        "which sgd cannot take; resume with optimizer.name = 'adamw', or start a new run "
        "(another run_dir)"
    ]
