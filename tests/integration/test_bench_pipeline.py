"""``tidal bench pipeline``: a tiny run on 2 gloo ranks writes its JSON and PNG; the prediction
follows the closed forms on synthetic costs. Measured timings are never asserted, only that
they exist and are positive."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from rich.console import Console

from benchmarks.pipeline import (
    DEFAULT_SCHEDULES,
    PipelineBenchConfig,
    add_arguments,
    config_from_args,
    predict,
    run,
    steady_step_s,
)
from tidal.config import ConfigError
from tidal.pipeline.simulate import StageCosts

TINY_FLAGS = [
    "--stages", "2", "--steps", "2", "--warmup-steps", "1", "--repeats", "1", "--rounds", "2",
    "--reps", "1", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--vocab-size", "32",
    "--rows-per-microbatch", "1", "--timeout-s", "60",
]  # fmt: skip

ROW_KEYS = {
    "schedule", "stages", "microbatches", "tokens_per_step", "measured_step_s", "tokens_per_s",
    "predicted_step_s", "measured_over_predicted", "core_bound_step_s",
    "measured_over_core_bound", "bubble_fraction", "program_bubble_fraction", "work_s",
    "step_time_definition", "costs", "cpu", "settings", "cpu_s_per_step",
    "run_queue_wait_s_per_step", "cores_used", "measured_step_s_by_round", "rounds",
}  # fmt: skip


def parse(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(flags)


@pytest.mark.slow
def test_tiny_run_writes_json_and_png(tmp_path) -> None:
    out = io.StringIO()
    code = run(parse([*TINY_FLAGS, "--results-dir", str(tmp_path)]), Console(file=out, width=200))
    assert code == 0
    (path,) = tmp_path.glob("pipeline-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["bench"] == "pipeline"
    assert [r["schedule"] for r in data["rows"]] == list(DEFAULT_SCHEDULES)
    for row in data["rows"]:
        assert row.keys() >= ROW_KEYS, ROW_KEYS - row.keys()
        assert (row["stages"], row["microbatches"]) == (2, 2)  # m = p by default
        assert row["tokens_per_step"] == 1 * 2 * 8
        assert row["measured_step_s"] > 0
        assert row["predicted_step_s"] > 0
        assert row["core_bound_step_s"] >= row["predicted_step_s"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["measured_step_s"])
        costs = row["costs"]
        assert len(costs["forward_s"]) == len(costs["backward_s"]) == len(costs["update_s"]) == 2
        assert all(x > 0 for k in ("forward_s", "backward_s", "update_s") for x in costs[k])
        assert costs["p2p_s"] > 0
        assert len(row["rounds"]) == 2
        assert row["measured_step_s"] == min(row["measured_step_s_by_round"])
        assert row["cpu"]["processes"] == 2 and row["cpu"]["threads_per_process"] == 1
    by_name = {r["schedule"]: r for r in data["rows"]}
    assert len(by_name["gpipe"]["step_times_s"]) == 2  # one per timed step
    assert len(by_name["pipemare"]["one_step_programs_s"]) == 1
    for r in by_name["pipemare"]["rounds"]:
        if not r["steady_state_resolved"]:
            assert r["measured_step_s"] == pytest.approx(r["program_s"] / 2)
    assert "pipemare" in out.getvalue() and str(path) in out.getvalue()


def test_steady_step_never_reports_a_negative_time() -> None:
    assert steady_step_s(5.0, 2.0, steps=4) == (1.0, True)  # (5 - 2) / 3
    # Noise in the one-step program larger than the steps' difference: the upper bound instead.
    assert steady_step_s(0.010, 0.013, steps=2) == (0.005, False)
    assert steady_step_s(0.010, 0.010, steps=2) == (0.005, False)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(4, 4), (2, 6)])
def test_synchronous_prediction_is_the_flushed_step(schedule: str, p: int, m: int) -> None:
    f_s, b_s = 0.3, 0.7
    pred = predict(
        schedule, stages=p, microbatches=m, steps=5, costs=StageCosts(forward_s=f_s, backward_s=b_s)
    )
    assert pred["step_s"] == pytest.approx((m + p - 1) * (f_s + b_s))
    assert pred["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert pred["work_s"] == pytest.approx(p * m * (f_s + b_s))


@pytest.mark.parametrize("steps", [2, 6])
def test_pipemare_prediction_is_the_steady_state(steps: int) -> None:
    p, m, f_s, b_s = 4, 4, 0.3, 0.7
    costs = StageCosts(forward_s=f_s, backward_s=b_s)
    pred = predict("pipemare", stages=p, microbatches=m, steps=steps, costs=costs)
    # No flush: in steady state every rank is busy, so a step costs its own work only, and
    # the fill and drain that the whole program pays once are left out.
    assert pred["step_s"] == pytest.approx(m * (f_s + b_s))
    assert pred["bubble_fraction"] == pytest.approx(0.0, abs=1e-9)
    assert pred["program_makespan_s"] > steps * pred["step_s"]
    assert pred["program_bubble_fraction"] > 0


def test_flags_map_onto_the_config() -> None:
    assert config_from_args(parse([])) == PipelineBenchConfig()
    config = config_from_args(parse(["--layers", "6", "--heads", "2", "--schedules", "1f1b"]))
    assert (config.num_layers, config.num_heads, config.schedules) == (6, 2, ("1f1b",))


def test_bad_settings_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="schedules"):
        config_from_args(parse(["--schedules", "gpipe,interleaved"]))
    with pytest.raises(ConfigError, match="steps"):
        PipelineBenchConfig(steps=1)
    with pytest.raises(ConfigError, match="num_layers"):
        PipelineBenchConfig(stages=4, num_layers=2)
    assert PipelineBenchConfig(stages=3).num_microbatches == 3
    assert PipelineBenchConfig(stages=3, microbatches=5).num_microbatches == 5
