"""``tidal bench plan-check``: each budget's plan trained, its prediction beside the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.cli.main import main


@pytest.mark.slow
def test_each_budget_gets_its_fastest_plan_and_a_run_of_it(tmp_path: Path) -> None:
    # demo at 2 rows: 67 MiB without recompute, 56 MiB with it, nothing fits 52 MiB
    argv = ["bench", "plan-check", "--models", "demo", "--device-memory", "80GiB,60MiB,52MiB",
            "--micro-batch", "2", "--recipe", "demo", "--steps", "3", "--warmup-steps", "1",
            "--set", "training.device=cpu", "--set", "data.source=synthetic",
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("plan-check-*.json")
    data = json.loads(path.read_text())
    assert data["bench"] == "plan-check" and data["git_commit"]
    loose, tight, none = data["rows"]
    assert loose["recompute"] == {"none": 1} and tight["recompute"] == {"full": 1}
    assert tight["predicted_peak_bytes"] <= 60 * 2**20 < loose["predicted_peak_bytes"]
    assert none["plan"] is None and "52.00MiB" in none["infeasible"]
    for row in (loose, tight):
        assert row["plan"] == "dp 1 x tp 1" and row["steady_steps"] == 2
        assert row["step_measured_over_predicted"] == pytest.approx(
            row["measured_step_s"] / row["predicted_step_s"]
        )
        assert row["measured_peak_bytes"] is None  # no device allocator on a CPU
        assert row["final_loss"] > 0
