"""The job the mesh tests share (test_pipeline_mesh.py, test_pipeline_tp.py) and how they read
a run: its losses, gradient norms and exported weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from tidal.train.export import export_run
from tidal.train.metrics import read_metrics
from tidal.train.safetensors import read_safetensors

STEPS = 4
TOL = 1e-5
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


def job_at(run_dir: Path, *, steps: int = STEPS) -> dict[str, Any]:
    """A copy of :data:`JOB` writing to ``run_dir``, ``steps`` long."""
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"]["steps"] = steps
    return job


def losses(run_dir: Path) -> tuple[list[float], list[float]]:
    """A run's training and validation losses."""
    records = read_metrics(run_dir)
    train = [r["loss"] for r in records if r["kind"] == "train"]
    return train, [r["val_loss"] for r in records if r["kind"] == "val"]


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """``tidal export``'s weights of a run."""
    return read_safetensors(export_run(run_dir, out=out) / "model.safetensors")
