"""``metrics.tensorboard = true``: the figures of metrics.jsonl as TensorBoard scalars, read
back with TensorBoard's own reader, one curve across an interrupted and resumed run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tidal.config import ConfigError
from tidal.train import Trainer
from tidal.train.metrics import read_metrics
from tidal.train.tensorboard import scalars

pytest.importorskip("tensorboard")


def _events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}  # fmt: skip


def _fit(run_dir: Path, steps: int, *, resume: bool = False) -> None:
    overrides = [f"run_dir={run_dir}", f"training.steps={steps}", "training.val_every=2",
                 "checkpoint.every_steps=2", "metrics.tensorboard=true", "engine=chunk",
                 "chunk.size=20000", "optimizer.decay_steps=6"]  # fmt: skip
    Trainer("tiny", overrides).fit(resume=resume)


def test_the_scalars_are_the_records_and_a_resume_rewrites_its_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fit(run, 6)
    # Resume from step 4's checkpoint after reaching 6: steps 5, 6 are trained again and their
    # first events must be purged, as metrics.jsonl drops their records.
    _fit(run, 8, resume=4)  # type: ignore[arg-type]
    events = _events(run / "tensorboard")
    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    assert [s for s, _ in events["train/loss"]] == list(range(1, 9))
    assert [v for _, v in events["train/loss"]] == pytest.approx([r["loss"] for r in train])
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "val"]
    assert [(s, pytest.approx(v)) for s, v in events["val/val_loss"]] == val
    # The chunk engine's tiers, in MiB, and the throughput.
    peaks = [r["tiers"]["device_peak_bytes"] / 2**20 for r in train]
    assert [v for _, v in events["tiers/device_peak_MiB"]] == pytest.approx(peaks, rel=1e-6)
    assert len(events["perf/tokens_per_s"]) == 8 and "memory/host_MiB" in events


def test_scalars_flatten_nested_figures_and_leave_out_none() -> None:
    record = {"kind": "train", "step": 3, "loss": 2.5, "mfu": None, "step_s": 0.5,
              "memory_bytes": {"host": 3 * 2**20}, "tiers": {"nvme_peak_bytes": None,
              "to_device_bytes": 2**21}}  # fmt: skip
    assert dict(scalars(record)) == {
        "train/loss": 2.5, "perf/step_s": 0.5, "memory/host_MiB": 3.0, "tiers/to_device_MiB": 2.0,
    }  # fmt: skip


def test_without_the_package_the_run_stops_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))  # fmt: skip
    with pytest.raises(ConfigError, match=r"metrics.tensorboard: needs the tensorboard package"):
        Trainer("tiny", [f"run_dir={tmp_path / 'run'}", "metrics.tensorboard=true"])
    assert not (tmp_path / "run").exists()
