"""``tidal bench make`` on a made-up checkout: a fresh clone, the targets in turn, the lines a
reader looks for, and uncommitted changes left out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.make import time_targets

MAKEFILE = """run:
\t@test ! -e .venv || (echo "not a fresh clone" && exit 3)
\t@mkdir -p .venv runs/demo
\t@echo "step 20/40  loss 3.1000  tps 9"
\t@echo "step 40/40  loss 2.5000  tps 10"
\t@echo '{"final_loss": 2.5}' > runs/demo/summary.json

test:
\t@test -d .venv || (echo "run did not set up" && exit 4)
\t@echo "FAILED tests/unit/test_a.py::test_flaky - AssertionError: 0 >= 1"
\t@echo "===== 1 failed, 12 passed, 1 skipped in 3.00s ====="
\t@cat uncommitted.txt 2>/dev/null && exit 5 || true
"""


def test_targets_run_in_turn_in_a_fresh_clone_of_head(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "Makefile").write_text(MAKEFILE)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "Makefile"], check=True)
    subprocess.run([*git, "commit", "-qm", "make"], check=True)
    (checkout / ".venv").mkdir()  # the checkout's own set-up, which a clone does not have
    (checkout / "uncommitted.txt").write_text("left out\n")
    folder = tmp_path / "work"
    folder.mkdir()
    run, test = time_targets(checkout, ["run", "test"], folder)
    assert (run["target"], run["rc"], run["includes_setup"]) == ("run", 0, True)
    assert run["last_progress_line"] == "step 40/40  loss 2.5000  tps 10"
    assert run["summary"] == {"final_loss": 2.5}
    assert (test["target"], test["rc"], test["includes_setup"]) == ("test", 0, False)
    assert test["pytest_totals"] == ["1 failed, 12 passed, 1 skipped in 3.00s"]
    assert test["failed"] == ["tests/unit/test_a.py::test_flaky"]  # which, by name
    assert run["wall_s"] >= 0 and json.loads((folder / "tidal/runs/demo/summary.json").read_text())
    assert "step 40/40" in (folder / "make-run.log").read_text()
