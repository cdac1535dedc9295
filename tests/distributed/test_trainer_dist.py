"""The Trainer on two gloo ranks against one process: same losses, same parameters, one writer.

See [Note: global batch] in tidal/train/trainer.py: the global batch does not depend on the
world size, so two ranks must reproduce the one-process run up to the order of summation.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import tidal.train.trainer as trainer_module
from tidal.config import ConfigError
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import list_checkpoints
from tidal.train.interrupts import Interrupted
from tidal.train.metrics import read_metrics

WORLD = 2
STEPS = 4

# Accumulation over two micro-batches, so gradients are averaged on the boundary only; a
# validation pass mid-run and at the end; a checkpoint at the end (rank 0 writes the replicas).
JOB: dict[str, Any] = {
    "name": "dist",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,
        "grad_accum_steps": 2,
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
    },
    # eps 1e-6: AdamW divides by sqrt(v) + eps, and with the default 1e-8 a gradient that is
    # near zero and differs by rounding between two ranks and one process moves by up to lr.
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "eps": 1e-6},
    "metrics": {"peak_tflops": 1.0},
}

# Two ranks sum the same terms in another order (each rank's mean over 2 rows, then the mean of
# the two), a few ulps of fp32 apart. Losses agree to 1e-5 relative, parameters to 1e-5.
RTOL = 1e-5
ATOL = 1e-5


def _job(run_dir: Path, **training: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"].update(training)
    return job


def _train_and_record_writes(job: dict[str, Any]) -> dict[str, Any]:
    """Fit ``job`` on this rank; return its summary, parameters, and the files it wrote."""
    writes: list[str] = []
    real_json, real_ckpt = trainer_module.write_json_atomic, trainer_module.write_checkpoint
    real_append = trainer_module.MetricsFile.append

    def write_json(path: Path, data: Any) -> None:
        writes.append(Path(path).name)
        real_json(path, data)

    def write_checkpoint(run_dir: Any, step: int, **kwargs: Any) -> Any:
        writes.append(f"checkpoint {step}")
        return real_ckpt(run_dir, step, **kwargs)

    def append(self: Any, record: dict[str, Any]) -> None:
        writes.append(f"metrics {record['kind']}")
        real_append(self, record)

    trainer_module.write_json_atomic = write_json  # type: ignore[assignment]
    trainer_module.write_checkpoint = write_checkpoint  # type: ignore[assignment]
    trainer_module.MetricsFile.append = append  # type: ignore[method-assign]
    trainer = Trainer(job)
    summary = trainer.fit()
    params = trainer.engine.model_state_dict()
    return {"summary": summary, "params": params, "writes": writes,
            "rank": (trainer.rank, trainer.world_size)}  # fmt: skip


def _losses(run_dir: Path, kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r["kind"] == kind]


def _assert_close_losses(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [step for step, _ in got] == [step for step, _ in want]
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=RTOL), step


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    ranks = run_on_ranks(
        _train_and_record_writes, world_size=WORLD, args=(_job(tmp_path / "dist"),), timeout_s=90
    )
    single = Trainer(_job(tmp_path / "single"))
    single_summary = single.fit()

    _assert_close_losses(
        _losses(tmp_path / "dist", "train", "loss"), _losses(tmp_path / "single", "train", "loss")
    )
    _assert_close_losses(
        _losses(tmp_path / "dist", "val", "val_loss"),
        _losses(tmp_path / "single", "val", "val_loss"),
    )
    for result in ranks:
        assert result["summary"]["final_loss"] == pytest.approx(
            single_summary["final_loss"], rel=RTOL
        )
        for name, param in single.engine.model_state_dict().items():
            torch.testing.assert_close(result["params"][name], param, rtol=RTOL, atol=ATOL)
    # The replicas are identical, not merely close: every rank took the same averaged step.
    for name, param in ranks[0]["params"].items():
        assert torch.equal(param, ranks[1]["params"][name]), name

    # Rank 0 alone wrote the run folder's files.
    metrics = ["metrics train"] * 2 + ["metrics val"]
    assert ranks[0]["writes"] == [
        "config.json",
        *metrics,
        *metrics,
        f"checkpoint {STEPS}",
        "summary.json",
    ]
    # A checkpoint is a collective every rank joins (the one format); rank 1's replicas add no
    # tensors to it, and it writes nothing else.
    assert ranks[1]["writes"] == [f"checkpoint {STEPS}"]
    assert [step for step, _ in list_checkpoints(tmp_path / "dist")] == [STEPS]

    summary = ranks[0]["summary"]
    assert summary["world_size"] == WORLD and single_summary["world_size"] == 1
    assert summary["tokens"] == single_summary["tokens"] == STEPS * 2 * 4 * 64
    per_rank = summary["peak_memory_bytes_per_rank"]
    assert len(per_rank) == WORLD and all(peak["host"] > 0 for peak in per_rank)
    assert per_rank[0] == summary["peak_memory_bytes"]
    assert per_rank[1] == ranks[1]["summary"]["peak_memory_bytes"]
    assert single_summary["peak_memory_bytes_per_rank"] == [single_summary["peak_memory_bytes"]]
    assert [r["rank"] for r in ranks] == [(0, 2), (1, 2)]
    assert summary["engine"] == single_summary["engine"] == "reference"  # plain replicas
    held, num_params = single_summary["model_data_bytes"], single_summary["num_params"]
    assert held["params"] == 4 * num_params and held["grads"] == 0  # dropped after the step
    assert held["optimizer_state"] >= 8 * num_params  # AdamW's two fp32 moments
    # MFU divides by the peak of both devices.
    assert summary["peak_tflops"] == 2.0


def _resume_on_one_process(job: dict[str, Any]) -> None:
    Trainer(job).fit()


@pytest.mark.slow
def test_a_run_saved_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    half = _job(tmp_path / "split", steps=STEPS // 2)
    half["optimizer"]["decay_steps"] = STEPS
    run_on_ranks(_resume_on_one_process, world_size=WORLD, args=(half,), timeout_s=90)
    whole = _job(tmp_path / "whole")
    whole["optimizer"]["decay_steps"] = STEPS
    Trainer(whole).fit()
    resumed = _job(tmp_path / "split")
    resumed["optimizer"]["decay_steps"] = STEPS
    Trainer(resumed).fit(resume=True)

    _assert_close_losses(
        _losses(tmp_path / "split", "train", "loss"), _losses(tmp_path / "whole", "train", "loss")
    )


def _batch_size_3() -> str:
    try:
        Trainer(_job(Path("unused"), batch_size=3))
    except ConfigError as err:
        return str(err)
    raise AssertionError("batch_size 3 on 2 ranks was accepted")


def test_a_batch_that_does_not_split_over_the_ranks_names_the_key() -> None:
    messages = run_on_ranks(_batch_size_3, world_size=WORLD, timeout_s=60)
    assert messages[0] == messages[1]
    assert messages[0].startswith("training.batch_size: 3 sequences do not split evenly over 2")
    assert "multiple of 2, e.g. 2 or 4" in messages[0]


def _fit_until_interrupted(job: dict[str, Any]) -> dict[str, Any]:
    try:
        Trainer(job).fit()
    except Interrupted as err:
        return {"step": err.step, "signal": err.signal_name, "checkpoint": err.checkpoint}
    raise AssertionError("the run was not interrupted")


@pytest.mark.slow
def test_a_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: interrupts at safe points]: rank 1 alone gets SIGINT as step 2 begins; both ranks
    finish step 2, write their pieces of its checkpoint, and stop."""
    monkeypatch.setenv("TIDAL_FAULT_INJECT", "interrupt:rank=1:step=2")
    job = _job(tmp_path / "run", val_every=0)
    ranks = run_on_ranks(_fit_until_interrupted, world_size=WORLD, args=(job,), timeout_s=90)
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert ranks == [
        {"step": 2, "signal": "a signal on another rank", "checkpoint": checkpoint},
        {"step": 2, "signal": "SIGINT", "checkpoint": checkpoint},
    ]
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2]
    monkeypatch.delenv("TIDAL_FAULT_INJECT")
    Trainer(_job(tmp_path / "run", val_every=0)).fit(resume=True)  # on one process
    Trainer(_job(tmp_path / "whole", val_every=0)).fit()
    _assert_close_losses(
        _losses(tmp_path / "run", "train", "loss"), _losses(tmp_path / "whole", "train", "loss")
    )
