"""``tidal train --mesh pp=2,dp=2``: two pipeline stages, each replicated on two ranks.

[Note: one mesh] in tidal/parallel/dims.py. Each replica trains on its own half of every batch
and averages its stage's gradients over ``mesh["dp"]`` once per step, before the tied sum and
the global clipping ([Note: the stage-parameter protocol]), so 4 gloo ranks must log the
one-process reference engine's losses and validation losses and export its weights, under
GPipe, 1F1B and interleaved 1F1B, and a run stopped at a checkpoint resumes exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.cli.main import main
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.export import export_run
from tidal.train.metrics import read_metrics
from tidal.train.safetensors import read_safetensors

STEPS = 4
TOL = 1e-5
SCHEDULES: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe", "microbatches": 2},
    "1f1b": {"schedule": "1f1b", "microbatches": 4},
    "interleaved": {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4},
}
JOB: dict[str, Any] = {
    "name": "mesh",
    "model": {"preset": "tiny"},  # tied embeddings: a matrix on the first and the last stage
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 8,
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
        "grad_clip_norm": 0.5,
    },  # fmt: skip
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "checkpoint": {"every_steps": 2},
}


def _job(run_dir: Path, *, steps: int = STEPS, **pipeline: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"]["steps"] = steps
    if pipeline:
        job["parallel"] = {"pp": 2, "dp": 2}
        job["pipeline"] = pipeline
    return job


def _losses(run_dir: Path) -> tuple[list[float], list[float]]:
    records = read_metrics(run_dir)
    train = [r["loss"] for r in records if r["kind"] == "train"]
    return train, [r["val_loss"] for r in records if r["kind"] == "val"]


def _worker(root: str, reference: tuple[list[float], list[float]]) -> None:
    root_path = Path(root)
    for name, pipeline in SCHEDULES.items():
        Trainer(_job(root_path / name, **pipeline)).fit()
        train, val = _losses(root_path / name)
        assert train == pytest.approx(reference[0], abs=TOL), (name, train, reference[0])
        assert val == pytest.approx(reference[1], abs=TOL), (name, val, reference[1])
    Trainer(_job(root_path / "resumed", steps=2, **SCHEDULES["1f1b"])).fit()
    Trainer(_job(root_path / "resumed", **SCHEDULES["1f1b"])).fit(resume=True)
    assert _losses(root_path / "resumed") == _losses(root_path / "1f1b")


def _exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(export_run(run_dir, out=out) / "model.safetensors")


@pytest.mark.slow
def test_pp2_x_dp2_equals_one_process_and_exports_its_weights(tmp_path: Path) -> None:
    Trainer(_job(tmp_path / "reference")).fit()
    reference = _losses(tmp_path / "reference")
    assert len(reference[0]) == STEPS and len(reference[1]) == 2
    run_on_ranks(_worker, world_size=4, args=(str(tmp_path), reference), timeout_s=300)
    weights = _exported(tmp_path / "reference", tmp_path / "reference-export")
    for name in SCHEDULES:
        trained = _exported(tmp_path / name, tmp_path / f"{name}-export")
        assert trained.keys() == weights.keys(), name
        for key, value in weights.items():
            torch.testing.assert_close(trained[key], value, rtol=0, atol=TOL, msg=key)


def test_a_mesh_that_does_not_multiply_to_the_ranks_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before torchrun starts, naming the mesh and the count."""
    argv = ["train", "--recipe", "tiny", "--set", "run_dir=/nonexistent"]
    assert main([*argv, "--mesh", "pp=2,dp=3", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pp2 x dp3 x tp1 needs 6 ranks, but 4 were started" in err
    assert len(err.splitlines()) == 1
    assert main([*argv, "--mesh", "pp=2,zz=2"]) == 2
    assert "'zz=2' is not NAME=N" in capsys.readouterr().err
    assert main([*argv, "--mesh", "pp=3", "--pipeline-stages", "2"]) == 2
    assert "--mesh says pp=3" in capsys.readouterr().err
    assert main([*argv, "--mesh", "dp=2", "--nproc", "4"]) == 2  # no pipeline: dp x 1 x 1 = N
    assert "dp2 x tp1 needs 2 ranks, but 4" in capsys.readouterr().err
