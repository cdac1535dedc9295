"""Runs you can watch (issue 17): per-step tier figures in metrics.jsonl, memory.png of the
device tier against its budget, and `tidal report` on a run that has not finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

BUDGET_BYTES = 2700 * 1024  # the activations need 2.4 MiB: chunks move every step


@pytest.fixture(scope="module")
def chunk_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    overrides = ["engine=chunk", "chunk.size=128", f"memory.device_budget={BUDGET_BYTES}",
                 "training.steps=4", "training.val_every=0", "training.log_every=1",
                 f"run_dir={run_dir}", "metrics.peak_tflops=1.0"]  # fmt: skip
    Trainer("tiny", overrides).fit()
    return run_dir


def test_each_step_records_the_tiers(chunk_run: Path) -> None:
    steps = [r for r in read_metrics(chunk_run) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        tiers = record["tiers"]
        assert tiers["device_budget_bytes"] == BUDGET_BYTES
        assert 0 < tiers["activations_bytes"] <= tiers["device_need_bytes"] <= BUDGET_BYTES
        assert tiers["device_peak_bytes"] <= BUDGET_BYTES and tiers["host_peak_bytes"] > 0
        assert tiers["nvme_peak_bytes"] is None
    # Chunks move every step under this budget; the first step also places the optimizer.
    assert all(r["tiers"]["to_device_bytes"] > 0 for r in steps)
    assert steps[1]["tiers"]["to_device_bytes"] == steps[2]["tiers"]["to_device_bytes"]


def test_report_draws_a_finished_and_an_unfinished_run(
    chunk_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    assert main(["report", str(chunk_run)]) == 0
    assert (chunk_run / "memory.png").stat().st_size > 10_000
    assert "unfinished" not in capsys.readouterr().out
    (chunk_run / "summary.json").unlink()  # as while it runs, or after a kill
    assert main(["report", str(chunk_run)]) == 0
    out = capsys.readouterr().out
    assert "unfinished: no summary.json yet" in out and "stopped after step 4" in out
