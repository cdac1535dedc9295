"""The Trainer's pipeline in bf16 and with gradient accumulation, against the reference engine.

A bf16 1F1B pipeline (2 stages on 2 gloo ranks, fp32 masters), and one stage split over 2
tensor-parallel ranks or sharded over 2 by FSDP2, log the reference engine's bf16 losses within
the reference's own bf16 tolerance (its relative bf16-vs-fp32 gap, times 4 as in
tests/unit/pipeline/test_pipeline_precision.py). ``training.grad_accum_steps = 2`` is not refused:
the pipeline logs the reference engine's losses for the same recipe within 1e-5 (each step is its
two batches in twice the microbatches), and a run resumed from a checkpoint continues exactly.
A run without a pipeline, which trains one plain stage, does the same in one process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tidal.testing import run_on_ranks
from tidal.testing.reference import reference_losses
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

STEPS = 4
TOL = 1e-5
JOB: dict[str, Any] = {
    "name": "pipe-precision",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
    },  # fmt: skip
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "checkpoint": {"every_steps": 2},
}


def _job(run_dir: Path, *, pipeline: bool, steps: int = STEPS, **training: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"].update(steps=steps, **training)
    if pipeline:
        job["parallel"] = {"pp": 2}
        job["pipeline"] = {"microbatches": 2, "schedule": "1f1b"}
    return job


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def _relative_gap(got: list[float], want: list[float]) -> float:
    return max(abs(x - y) / y for x, y in zip(got, want, strict=True))


def _worker(root: str, references: dict[str, list[float]]) -> None:
    root_path = Path(root)
    Trainer(_job(root_path / "bf16", pipeline=True, precision="bf16")).fit()
    own = _relative_gap(references["bf16"], references["fp32"])
    got = _losses(root_path / "bf16")
    assert _relative_gap(got, references["bf16"]) <= 4 * own, (got, references, own)
    assert _relative_gap(got, references["fp32"]) > 0  # autocast ran
    # one stage split over tp, and one sharded by FSDP2 ([Note: one train step]), in bf16 too
    for name, parallel in (("bf16-tp", {"tp": 2}), ("bf16-fsdp2", {"fsdp2": True})):
        job = _job(root_path / name, pipeline=True, precision="bf16")
        job["parallel"] = parallel
        Trainer(job).fit()
        got = _losses(root_path / name)
        assert _relative_gap(got, references["bf16"]) <= 4 * own, (name, got, references, own)
        assert _relative_gap(got, references["fp32"]) > 0, name

    trainer = Trainer(_job(root_path / "accum", pipeline=True, grad_accum_steps=2))
    trainer.fit()
    # the reference engine's position after as many steps: a checkpoint resumes on either
    assert trainer.train_batches.next_index == STEPS * 2
    got = _losses(root_path / "accum")
    assert got == pytest.approx(references["accum"], abs=TOL), (got, references["accum"])
    Trainer(_job(root_path / "resumed", pipeline=True, steps=2, grad_accum_steps=2)).fit()
    Trainer(_job(root_path / "resumed", pipeline=True, grad_accum_steps=2)).fit(resume=True)
    assert _losses(root_path / "resumed") == got


@pytest.mark.slow
def test_bf16_and_accumulating_pipelines_equal_the_reference(tmp_path: Path) -> None:
    references = {}
    cases = (("fp32", {}), ("bf16", {"precision": "bf16"}), ("accum", {"grad_accum_steps": 2}))
    for name, training in cases:  # the reference engine: plain PyTorch
        references[name] = reference_losses(_job(tmp_path / name, pipeline=False, **training))
    assert references["accum"] != references["fp32"]  # two batches a step: other numbers
    # a run without a pipeline trains one plain stage ([Note: one train step]): the same
    own = _relative_gap(references["bf16"], references["fp32"])
    for name, training in cases:
        Trainer(_job(tmp_path / f"stage-{name}", pipeline=False, **training)).fit()
        got = _losses(tmp_path / f"stage-{name}")
        if name == "bf16":
            assert _relative_gap(got, references[name]) <= 4 * own, (got, references, own)
        else:
            assert got == pytest.approx(references[name], abs=TOL), (name, got, references)
    run_on_ranks(_worker, world_size=2, args=(str(tmp_path / "ranks"), references), timeout_s=240)
