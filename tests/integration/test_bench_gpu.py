"""``tidal bench gpu`` at its CPU size (the suite's run of the GPU benchmark, so it cannot rot):
the JSON and table, tidal's host-device bytes beside its own prediction, the peers' rows, the
depth search, and the one-line refusal of a machine too small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu import SIZES, SYSTEMS, largest_depth
from tidal.cli.main import main


def test_bench_gpu_at_its_cpu_size_writes_every_systems_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "gpu", "--device", "cpu", "--size", "tiny", "--steps", "4",
                 "--warmup-steps", "1", "--results-dir", str(tmp_path)]) == 0  # fmt: skip
    assert "tidal bench gpu:" in capsys.readouterr().out
    (path,) = tmp_path.glob("gpu-*.json")
    data = json.loads(path.read_text())
    assert "git_commit" in data and "torch_version" in data
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == set(SYSTEMS) and {r["section"] for r in data["rows"]} == {"train"}
    ours, fsdp2 = rows["tidal"], rows["fsdp2-cpu-offload"]
    # the model data needs offload: three times the device budget
    assert ours["model_data_bytes"] >= 3 * ours["device_budget_bytes"]
    for row in (ours, fsdp2):
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and 0 < row["mfu"] < 1, row
        assert row["hwm_rss_bytes"] > 0 and row["final_loss"] > 0, row
    assert 0 < ours["peak_device_bytes"] <= ours["device_budget_bytes"]
    # evictions and fetches happened, and the store moved what its policy predicts
    assert ours["traffic_source"] == "counted" and ours["h2d_bytes_per_step"] > 0
    predicted = ours["predicted_h2d_bytes_per_step"]
    assert ours["h2d_bytes_per_step"] == pytest.approx(predicted, rel=0.1), ours
    assert fsdp2["traffic_source"] == "formula"
    deepspeed = rows["deepspeed-zero3-offload"]
    assert deepspeed.get("missing") or deepspeed["tokens_per_s"] > 0, deepspeed


def test_the_depth_search_finds_the_deepest_that_trains() -> None:
    for deepest, limit in ((37, 100), (1, 100), (100, 100), (0, 100), (20, 20)):
        asked: list[int] = []

        def trains(layers: int, deepest: int = deepest, asked: list[int] = asked) -> bool:
            asked.append(layers)
            return layers <= deepest

        found, tried = largest_depth(trains, start=4, limit=limit)
        assert found == min(deepest, limit), (deepest, limit, found)
        assert tried == len(asked) <= 16 and max(asked) <= limit, asked


def test_a_machine_too_small_is_told_what_it_would_need(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert SIZES["7b"].num_layers == 32
    assert main(["bench", "gpu", "--device", "cuda", "--size", "7b"]) == 2
    out = capsys.readouterr().out
    assert "too small" in out, out
    # 7b's model data is 107 GB: more than this machine's memory, or than its lack of CUDA
    assert ("host memory" in out) or ("a CUDA device" in out), out
