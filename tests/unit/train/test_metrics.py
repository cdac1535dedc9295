"""Throughput and MFU arithmetic, the progress line, metrics files, peaks and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidal.distributed import device as device_mod
from tidal.train.metrics import MetricsFile, Throughput, format_step_line, read_metrics
from tidal.train.report import summary_rows, write_plots


def test_throughput_figures() -> None:
    t = Throughput(flops_per_token=1e9, peak_tflops=10.0)
    assert t.figures() == {"tokens_per_s": None, "tflops": None, "mfu": None}
    t.add(2000, 0.5)
    t.add(2000, 0.5)
    figures = t.figures()
    assert figures["tokens_per_s"] == 4000
    assert figures["tflops"] == pytest.approx(4.0)
    assert figures["mfu"] == pytest.approx(0.4)
    assert Throughput(flops_per_token=1e9, peak_tflops=None).figures()["mfu"] is None


def test_step_line_has_the_familiar_fields() -> None:
    record = {
        "step": 10,
        "loss": 5.123456,
        "grad_norm": 1.3,
        "lr": 3e-4,
        "memory_bytes": {"device": 3 * 2**30, "host": 2**29},
        "tokens_per_s": 4321.4,
        "tflops": 0.5,
        "mfu": 0.123,
    }
    line = format_step_line(record, total_steps=300)
    assert line.startswith("step  10/300  loss 5.1235  grad_norm 1.300  lr 3.00e-04")
    assert "memory device 3.00GiB host 512.00MiB" in line
    assert "tps 4,321" in line and "tflops 0.500" in line and "mfu 12.3%" in line


def test_metrics_file_truncates_and_skips_torn_lines(tmp_path: Path) -> None:
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        metrics.append({"kind": "train", "step": step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "st')  # a run killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    metrics.truncate_after(3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_peak_override_and_cpu_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert device_mod.peak_flops(cpu, "fp32", 12.5).tflops == 12.5
    monkeypatch.setattr(device_mod, "_cpu_flags_and_ghz", lambda: ({"avx2", "fma"}, 3.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    peak = device_mod.peak_flops(cpu, "fp32")
    assert peak.tflops == pytest.approx(4 * 3.0e9 * 32 / 1e12)
    assert "avx2" in peak.source
    # bf16 doubles the rate only where the CPU has bf16 dot products.
    assert device_mod.peak_flops(cpu, "bf16").tflops == pytest.approx(peak.tflops)
    monkeypatch.setattr(device_mod, "_cpu_flags_and_ghz", lambda: ({"avx512f", "avx512_bf16"}, 2.0))
    assert device_mod.peak_flops(cpu, "bf16").tflops == pytest.approx(4 * 2.0e9 * 128 / 1e12)
    monkeypatch.setattr(device_mod, "_cpu_flags_and_ghz", lambda: (set(), None))
    assert device_mod.peak_flops(cpu, "fp32") is None


def test_report_rows_and_plots(tmp_path: Path) -> None:
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 11):
        metrics.append(
            {"kind": "train", "step": step, "loss": 6.0 - step / 5,
             "memory_bytes": {"host": 2**28 + step}, "peak_memory_bytes": {"host": 2**29}}
        )  # fmt: skip
    metrics.append({"kind": "val", "step": 10, "val_loss": 4.1})
    paths = write_plots(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "memory.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    summary = {"name": "r", "preset": "tiny", "num_params": 1000, "steps": 10, "tokens": 640,
               "final_loss": 4.0, "val_loss": 4.1, "tokens_per_s": 123.4, "mfu": 0.25,
               "peak_tflops": 2.0, "peak_memory_bytes": {"host": 2**30}, "wall_s": 3.0}  # fmt: skip
    rows = dict(summary_rows(summary))
    assert rows["validation loss"] == "4.1000"
    assert rows["MFU"].startswith("25.0%")
    assert rows["peak memory (host)"] == "1.00GiB"
    json.dumps(rows)


def test_plots_refuse_an_empty_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no training steps"):
        write_plots(tmp_path)


def test_the_engine_row_names_the_largest_chunk_where_a_parameter_outgrew_the_size() -> None:
    """A model of few layers gets a small chunk size and its large parameters chunks of their
    own: "6 chunks of 64 elements" alone hid the 262,144-element one the budget must hold."""
    chunk = {"name": "r", "steps": 1, "bytes_to_device": 0, "bytes_to_host": 0, "evictions": 0,
             "num_chunks": 6, "chunk_size": 64, "device_budget": None, "peak_device_bytes": 0,
             "min_device_bytes": 0, "peak_non_model_bytes": 0}  # fmt: skip
    rows = dict(summary_rows({**chunk, "largest_chunk_elements": 262_144}))
    assert rows["engine"] == "chunk (6 chunks of 64 elements, the largest 262,144)"
    rows = dict(summary_rows({**chunk, "largest_chunk_elements": 64}))
    assert rows["engine"] == "chunk (6 chunks of 64 elements)"
