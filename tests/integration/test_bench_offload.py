"""``tidal bench offload``: traffic against the optimum, the results file, the scale search and
the DeepSpeed baseline. Figures are checked for consistency, never for speed."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import baselines, offload
from benchmarks.baselines import DEEPSPEED, PYTORCH, deepspeed_missing_reason
from benchmarks.offload import (
    TRAFFIC_FRACTIONS,
    OffloadSettings,
    in_own_process,
    scale_search,
    time_system,
)
from tidal.cli.args import build_parser
from tidal.cli.main import main


@pytest.mark.slow
def test_traffic_section_through_the_cli(tmp_path: Path, bench_cli: Callable[..., Any]) -> None:
    # 16384-element chunks: the tiny model in 13 equal chunks, so optimal_traffic is exact.
    # The least and the most room of the bench's three budgets, one process each.
    argv = ["bench", "offload", "--section", "traffic", "--recipe", "tiny", "--steps", "3",
            "--fractions", "0.25,0.75", "--set", "chunk.size=16384",
            "--results-dir", str(tmp_path)]  # fmt: skip
    stdout, data = bench_cli(argv, tmp_path, "offload-*.json")
    assert "measured/optimal" in stdout
    assert "created_at" in data
    assert data["bench"] == "offload"
    rows = data["rows"]
    assert [(r["section"], r["budget_fraction"]) for r in rows] == [
        ("traffic", 0.25),
        ("traffic", 0.75),
    ]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["steady_steps"] == 2
        measured = row["to_device_bytes_per_step"]
        lower, optimal = row["lower_bound_bytes_per_step"], row["optimal_bytes_per_step"]
        assert 0 < lower <= optimal
        assert measured >= lower
        assert row["measured_over_optimal"] == pytest.approx(measured / optimal)
        # Every chunk fetched in a step goes back before the update, with the gradients.
        assert row["to_host_bytes_per_step"] >= row["grad_to_host_bytes_per_step"] > 0
        # Static offload moves every parameter chunk once per iteration.
        assert row["static_bytes_per_step"] == row["param_chunk_bytes"] * row["iterations_per_step"]
        assert (
            row["device_budget_bytes"]
            == int(row["budget_fraction"] * row["param_chunk_bytes"]) + row["probe_non_model_bytes"]
        )
    moved = [r["to_device_bytes_per_step"] for r in rows]
    assert moved == sorted(moved, reverse=True)  # more room never moves more


@pytest.mark.slow
def test_scale_search_finds_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tries in this process: what decides a try is the engine's own budget accounting, the
    # same in any process, and the traffic test above runs its cases through in_own_process as
    # the bench does. Spawning a process per try would import torch once more each time.
    monkeypatch.setattr(offload, "in_own_process", lambda fn, *args: fn(*args))
    settings = OffloadSettings(
        sections=("scale",),
        recipe="tiny",
        device_budget_bytes=2 << 20,
        host_budget_bytes=3 << 20,
    )
    row = scale_search(settings)
    largest = row["largest_num_layers"]
    assert largest is not None, row
    tries = {t["num_layers"]: t for t in row["tries"]}
    assert tries[largest]["fits"]
    assert not tries[largest + 1]["fits"]
    refused = {error.__name__ for error in offload.BUDGET_ERRORS}  # not crashed
    assert tries[largest + 1]["reason"].split(":")[0] in refused
    assert row["largest_num_params"] == tries[largest]["num_params"]
    assert 0 < row["params_over_limit"] <= 1


def test_traffic_budgets_default_to_the_bench_fractions() -> None:
    args = build_parser().parse_args(["bench", "offload"])
    assert args.fractions == ",".join(str(f) for f in TRAFFIC_FRACTIONS)
    assert main(["bench", "offload", "--fractions", "0,1"]) == 2  # refused before any case


def test_deepspeed_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(baselines.importlib.util, "find_spec", lambda name: None)
    reason = deepspeed_missing_reason()
    assert reason is not None and "pip install -e .[baselines]" in reason


@pytest.mark.skipif(deepspeed_missing_reason() is not None, reason=str(deepspeed_missing_reason()))
def test_deepspeed_trains_the_same_model_as_pytorch() -> None:
    overrides = (
        "data.source=synthetic",
        "training.steps=3",
        "memory.device_budget=none",
    )
    ours = time_system(PYTORCH, "tiny", overrides, 3, 1)
    theirs = in_own_process(time_system, DEEPSPEED, "tiny", overrides, 3, 1)
    assert "error" not in theirs, theirs["error"]
    assert theirs["num_params"] == ours["num_params"]
    assert theirs["peak_rss_bytes"] > 0 and math.isfinite(theirs["median_step_s"])
    # Same weights, batches and AdamW: DeepSpeedCPUAdam's arithmetic differs only in rounding.
    assert theirs["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-3)
