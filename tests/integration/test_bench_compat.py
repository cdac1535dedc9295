"""``tidal bench compat``: rows for a family that matches, one that raises, one that kills its
process with a signal and one whose package is missing, in one run through the CLI's entry
point; the table made from that run's JSON, as the CLI printed it and docs/results.md shows it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.compat import CompatSettings
from benchmarks.compat_report import load_results, tables
from tidal.cli.main import main
from tidal.config import ConfigError
from tidal.testing.zoo import ZooModel
from tidal.testing.zoo.base import lm_batch

MODES = ("fp32-unlimited", "fp32-tight")


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model cannot train\nsecond line")


class _KillsItself(_Raises):
    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a kernel on freed storage does
        raise AssertionError("unreachable")


RAISES = ZooModel(name="raises", kind="special", build=lambda seed: _Raises(), batch=lm_batch)
KILLS_ITSELF = ZooModel(
    name="kills-itself", kind="special", build=lambda seed: _KillsItself(), batch=lm_batch
)
NEEDS_MISSING = ZooModel(
    name="needs-missing", kind="special", build=lambda seed: _Raises(), batch=lm_batch,
    needs=("a_package_that_is_not_installed",),
)  # fmt: skip
FAMILIES = (
    f"{__file__}:KILLS_ITSELF",
    "alternating-branch",
    f"{__file__}:RAISES",
    f"{__file__}:NEEDS_MISSING",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The CLI in this process (its workers are processes of their own anyway)."""
    folder = tmp_path_factory.mktemp("compat")
    argv = ["bench", "compat", "--families", ",".join(FAMILIES), "--modes", ",".join(MODES),
            "--steps", "4", "--results-dir", str(folder)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0
    (path,) = folder.glob("compat-*.json")
    return path, out.getvalue()


def _rows(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["family"], r["mode"]): r for r in json.loads(path.read_text())["rows"]}


@pytest.mark.slow
def test_rows_of_a_match_an_exception_a_signal_and_a_missing_package(run: tuple[Path, str]):
    path, stdout = run
    data = json.loads(path.read_text())
    assert data["bench"] == "compat"
    for key in ("command", "git_commit", "torch_version", "device", "created_at"):
        assert key in data
    rows = _rows(path)
    names = ("kills-itself", "alternating-branch", "raises", "needs-missing")
    assert list(rows) == [(name, mode) for name in names for mode in MODES]
    # The run went on past the family that killed its worker, and each of its cases ran in a
    # fresh worker that died in turn.
    for mode in MODES:
        assert rows["kills-itself", mode]["result"] == "error: killed by signal 11 (SIGSEGV)"
        raised = rows["raises", mode]
        assert raised["result"] == "error: RuntimeError: this model cannot train"
        assert "second line" in raised["traceback"]
        assert rows["needs-missing", mode]["result"] == "skipped"
        assert "a_package_that_is_not_installed" in rows["needs-missing", mode]["reason"]
    unlimited = rows["alternating-branch", "fp32-unlimited"]
    tight = rows["alternating-branch", "fp32-tight"]
    for row in (unlimited, tight):
        assert row["result"] == "match"
        assert row["max_rel_loss_diff"] <= row["tolerance"] == 1e-5
        assert len(row["losses"]) == len(row["reference_losses"]) == 4
        assert row["params_without_grad"] == 4  # the branch's LayerNorm and Linear
    assert unlimited["budget_bytes"] is None and unlimited["evictions"] == 0
    assert tight["budget_bytes"] == unlimited["min_device_bytes"]
    assert 0 < tight["peak_device_bytes"] <= tight["budget_bytes"]
    assert tight["evictions"] > 0 and tight["same_as_unlimited"] is True
    assert "alternating-branch" in stdout and "results:" in stdout


@pytest.mark.slow
def test_the_table_has_one_line_per_family(run: tuple[Path, str]) -> None:
    path, stdout = run
    (table,) = tables(load_results(path))
    assert [row[0] for row in table.rows] == [
        "kills-itself", "alternating-branch", "raises", "needs-missing",
    ]  # fmt: skip
    rows = _rows(path)
    branch = table.rows[1]
    diff = rows["alternating-branch", "fp32-unlimited"]["max_rel_loss_diff"]
    assert branch[3] == f"match {'0' if diff == 0 else f'{diff:.1e}'}"
    budget_kib = rows["alternating-branch", "fp32-tight"]["budget_bytes"] / 1024
    assert branch[4].endswith(f"@ {budget_kib:.0f}KiB")
    assert branch[5] == "-"  # bf16 did not run
    assert table.note is not None
    assert "[1] killed by signal 11 (SIGSEGV)" in table.note
    assert "[2] RuntimeError: this model cannot train" in table.note
    assert table.rows[0].count("error [1]") == 2 and table.rows[3].count("skipped [3]") == 2
    assert "alternating-branch" in stdout and "error [1]" in stdout  # the CLI printed this table


def test_bad_settings_are_refused_before_running() -> None:
    with pytest.raises(ConfigError, match="--modes"):
        CompatSettings(modes=("fp64-unlimited",))
    with pytest.raises(ConfigError, match="--ranks"):
        CompatSettings(ranks=1)
    assert main(["bench", "compat", "--families", "no-such-family"]) == 2
