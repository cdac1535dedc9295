"""What memory.png draws ([Note: plotted steps] in tidal/train/plot_series.py): a checkpoint's
swollen step neither scales nor leaves the plot, a resume on another world size never lowers
the peak, and a pipeline run gets a series per stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal.train.metrics import MetricsFile
from tidal.train.plot_series import MemoryFigure, Panel, memory_figure, off_scale, running_max
from tidal.train.report import write_plots

MIB = 2**20


def _chunk_record(step: int, *, world_size: int, peak_mib: float, **marks: Any) -> dict[str, Any]:
    tokens_per_step = 256
    return {
        "kind": "train", "step": step, "loss": 5.0, "tokens": step * tokens_per_step,
        "step_s": 5.0 if marks else 0.1,  # warm-up and the step after a checkpoint are slow
        "tokens_per_s": 2560.0, "mfu": 0.2, "world_size": world_size,
        "memory_bytes": {"host": 300 * MIB}, "peak_memory_bytes": {"host": 300 * MIB},
        "tiers": {
            "device_budget_bytes": 4 * MIB, "device_need_bytes": 3 * MIB,
            "activations_bytes": 2 * MIB, "device_peak_bytes": int(peak_mib * MIB),
            "host_peak_bytes": 8 * MIB, "nvme_peak_bytes": None,
            # a checkpoint's step moves far more than the others
            "to_device_bytes": (90 if "after_checkpoint_s" in marks else 1) * MIB, "to_host_bytes": MIB,
        },
        **marks,
    }  # fmt: skip


def _resumed_run() -> list[dict[str, Any]]:
    """Steps 1-10 on one rank, a checkpoint after step 5, then steps 11-20 on two ranks, whose
    device peak (rank 0's half of the shards) is lower."""
    records = [_chunk_record(1, world_size=1, peak_mib=3.9, warm_up=True)]
    records += [_chunk_record(s, world_size=1, peak_mib=3.9) for s in range(2, 6)]
    records.append(_chunk_record(6, world_size=1, peak_mib=3.9, after_checkpoint_s=2.0))
    records += [_chunk_record(s, world_size=1, peak_mib=3.9) for s in range(7, 11)]
    records.append(_chunk_record(11, world_size=2, peak_mib=2.5, warm_up=True))
    records += [_chunk_record(s, world_size=2, peak_mib=2.5) for s in range(12, 21)]
    return records


def _series(panel: Panel, label: str) -> tuple[float, ...]:
    return next(s.values for s in panel.series if s.label == label)


def test_checkpoint_and_resume_steps_are_marked_and_left_out_of_the_range() -> None:
    figure = memory_figure(_resumed_run(), name="run")
    assert figure.checkpoints == (5,) and figure.resumes == ((10, 2),)
    assert figure.excluded == {1, 6, 11}
    memory, traffic, throughput = figure.panels
    # the memory panel holds the budget; the traffic panel is scaled by the ordinary steps
    assert memory.ylim[1] == pytest.approx(4 * 1.08)
    assert traffic.ylabel == "MiB per step" and traffic.ylim[1] == pytest.approx(1.08)
    assert max(_series(traffic, "to device")) == 90  # drawn, but as a marker on the top edge
    assert off_scale(traffic, figure.steps) == [(6, "to device")]
    tokens_per_s = _series(throughput, "tokens/s")
    assert tokens_per_s[0] == pytest.approx(51.2) and tokens_per_s[1] == pytest.approx(2560)
    assert throughput.ylim[1] == pytest.approx(2560 * 1.08)  # the slow steps sit low in it
    assert throughput.right is not None and throughput.right.ylabel == "MFU (%)"
    assert _series(throughput.right, "MFU")[1] == pytest.approx(20.0)


def test_the_peak_never_falls_after_a_resume_on_another_world_size() -> None:
    memory = memory_figure(_resumed_run(), name="run").panels[0]
    peak = _series(memory, "device peak so far")
    assert all(later >= earlier for earlier, later in zip(peak, peak[1:], strict=False))
    assert peak[-1] == pytest.approx(3.9)
    # model data and activations stacked, under the budget
    stacks = [s for s in memory.series if s.kind == "stack"]
    assert [s.values[0] for s in stacks] == [1.0, 2.0]
    assert _series(memory, "device budget")[0] == 4.0
    assert running_max([float("nan"), 2.0, 1.0, 3.0])[1:] == (2.0, 2.0, 3.0)


def _pipeline_record(step: int) -> dict[str, Any]:
    ranks = [{"rank": r, "stages": [r], "budget_bytes": 2 * MIB, "model_data_bytes": MIB,
              "peak_bytes": MIB + (r + 1) * 2**18, "to_host_bytes": 2**19 if r == 0 else 0,
              "lent_bytes": 0} for r in range(2)]  # fmt: skip
    return {"kind": "train", "step": step, "loss": 5.0, "tokens": 256 * step, "step_s": 0.1,
            "tokens_per_s": 2560.0, "mfu": None, "world_size": 2, "pipeline_ranks": ranks,
            "memory_bytes": {"host": 300 * MIB}, "peak_memory_bytes": {"host": 300 * MIB}}  # fmt: skip


def test_a_pipeline_run_gets_each_stages_peak_and_swaps() -> None:
    figure = memory_figure([_pipeline_record(s) for s in range(1, 5)], name="pipe")
    memory, swaps, throughput = figure.panels
    assert _series(memory, "stage 0: measured peak so far")[0] == pytest.approx(1.25)
    assert _series(memory, "stage 1: measured peak so far")[0] == pytest.approx(1.5)
    assert _series(memory, "each rank's budget")[0] == 2.0
    assert _series(swaps, "stage 0: to host") == (512.0,) * 4 and swaps.ylabel == "KiB per step"
    assert _series(swaps, "stage 1: to host") == (0.0,) * 4
    assert throughput.right is None  # no MFU without the model's FLOPs
    unbudgeted = [_pipeline_record(s) for s in range(1, 3)]
    for record in unbudgeted:
        for figures in record["pipeline_ranks"]:
            del figures["peak_bytes"], figures["model_data_bytes"], figures["budget_bytes"]
    memory, swaps, _ = memory_figure(unbudgeted, name="pipe").panels
    assert memory.ylabel == "memory (MiB)" and _series(swaps, "stage 0: to host")[0] == 512


def test_memory_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for name, records in (("chunk", _resumed_run()),
                          ("pipe", [_pipeline_record(s) for s in range(1, 5)])):  # fmt: skip
        metrics = MetricsFile(tmp_path / name / "metrics.jsonl")
        for record in records:
            metrics.append(record)
        loss, memory = write_plots(tmp_path / name)
        assert memory.name == "memory.png" and memory.stat().st_size > 20_000
        assert memory.read_bytes()[:4] == b"\x89PNG"


def test_a_run_without_tiers_plots_each_tier_with_its_running_peak() -> None:
    records = [_chunk_record(s, world_size=1, peak_mib=1) for s in (1, 2)]
    for r, peak in zip(records, (500, 400), strict=True):
        del r["tiers"]
        r["peak_memory_bytes"] = {"host": peak * MIB}
    figure: MemoryFigure = memory_figure(records, name="ref")
    assert _series(figure.panels[0], "host peak so far") == (500.0, 500.0)
