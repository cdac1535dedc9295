"""``tidal train --mesh pp=2,tp=2``: two pipeline stages, each split over two tensor-parallel ranks.

[Note: tensor-parallel stages] in tidal/parallel/tensor_stage.py. The tp ranks of a stage take
the same rows of every batch and each computes its share of every block, so 4 gloo ranks must
log the one-process reference engine's losses and validation losses and export its weights,
under 1F1B and interleaved 1F1B (the tiny GPT ties its embedding across the first and last
stage, and clips by the global norm, which counts each replicated parameter once). A pp2 x tp2
checkpoint resumes on one process and a pp2 x dp2 one (tp1) on pp2 x tp2, both going on as the
unbroken run. What does not run yet is refused in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from mesh_job import JOB, STEPS, TOL, exported, grad_norms, job_at, losses

from tidal.cli.main import main
from tidal.models.gpt import PRESETS
from tidal.testing import run_on_ranks
from tidal.train import Trainer

SCHEDULES: dict[str, dict[str, Any]] = {
    "1f1b": {"schedule": "1f1b", "microbatches": 4},
    "interleaved": {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4},
}


def _job(run_dir: Path, *, steps: int = STEPS, schedule: str | None = None,
         parallel: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    job = job_at(run_dir, steps=steps)
    if schedule is not None:
        job["parallel"] = parallel or {"pp": 2, "tp": 2}
        job["pipeline"] = SCHEDULES[schedule]
    return job


def _reference(run_dir: Path) -> tuple[list[float], list[float], list[float]]:
    """The one-process run's losses, validation losses and gradient norms."""
    return (*losses(run_dir), grad_norms(run_dir))


def _worker(root: str, reference: tuple[list[float], list[float], list[float]]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    root_path = Path(root)
    engines = {}
    for name in ("1f1b", "interleaved"):
        trainer = Trainer(_job(root_path / f"tp-{name}", schedule=name))
        engines[name] = trainer.fit()["engine"]
        split = [p for m in trainer.part.engine.modules.values()  # type: ignore[attr-defined]
                 for p in m.parameters() if isinstance(p, DTensor)]  # fmt: skip
        assert split, name  # the blocks are DTensors on mesh["tp"]
        train, val = losses(root_path / f"tp-{name}")
        assert train == pytest.approx(reference[0], abs=TOL), (name, train, reference[0])
        assert val == pytest.approx(reference[1], abs=TOL), (name, val, reference[1])
    Trainer(_job(root_path / "tp-half", steps=2, schedule="1f1b")).fit()  # stopped at step 2
    # [Note: resuming on another split]: pp2 x dp2's step-2 checkpoint goes on as pp2 x tp2
    Trainer(_job(root_path / "from-tp1", steps=2, schedule="1f1b",
                 parallel={"pp": 2, "dp": 2})).fit()  # fmt: skip
    Trainer(_job(root_path / "from-tp1", schedule="1f1b")).fit(resume=True)
    train, val = losses(root_path / "from-tp1")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])
    # [Note: one train step] in tidal/train/job.py: a model of one stage, split over tp and
    # replicated over dp, or split over tp and its shares sharded over dp by FSDP2 (2D),
    # trains through the same step as the pipeline, clipped by the same global norm
    for name, fsdp2 in (("dp2-tp2", False), ("dp2-tp2-fsdp2", True)):
        parallel = {"dp": 2, "tp": 2, "fsdp2": fsdp2}
        one_stage = Trainer(_job(root_path / name, schedule="1f1b", parallel=parallel))
        engines[name] = one_stage.fit()["engine"]
        (stage,) = one_stage.part.engine.modules.values()  # type: ignore[attr-defined]
        meshes = {p.device_mesh.ndim for p in stage.parameters() if isinstance(p, DTensor)}
        assert meshes == ({1, 2} if fsdp2 else {1}), (name, meshes)  # tp's, and dp x tp's
        train, val = losses(root_path / name)
        assert train == pytest.approx(reference[0], abs=TOL), (name, train, reference[0])
        assert val == pytest.approx(reference[1], abs=TOL), (name, val, reference[1])
        norms = grad_norms(root_path / name)
        assert norms == pytest.approx(reference[2], rel=1e-5), (name, norms, reference[2])
    dist.barrier()
    return engines | {"tp_bytes_per_step": _tensor_parallel_bytes(root_path / "tp-bytes")}


def _tensor_parallel_bytes(run_dir: Path) -> dict[str, int]:
    """This rank's tensor-parallel collective bytes over one 1F1B step, counted by its stage."""
    trainer = Trainer(_job(run_dir, schedule="1f1b"))
    (weights,) = trainer.part.engine.weights.values()  # type: ignore[attr-defined]
    before = weights.stats()
    trainer.part.train(1, trainer.train_batches)
    return {key: value - before[key] for key, value in weights.stats().items()}


@pytest.mark.slow
def test_pp2_x_tp2_equals_one_process_and_resumes_across_tp(tmp_path: Path) -> None:
    Trainer(_job(tmp_path / "reference")).fit()
    reference = _reference(tmp_path / "reference")
    engines = run_on_ranks(_worker, world_size=4, args=(str(tmp_path), reference), timeout_s=400)
    assert engines[0]["1f1b"] == "pipeline 1f1b x2 tensor-parallel stages (tp2)", engines[0]
    assert engines[0]["dp2-tp2"] == "pipeline 1f1b x1 tensor-parallel stages (tp2)", engines[0]
    assert "fsdp2 stages tensor-parallel" in engines[0]["dp2-tp2-fsdp2"], engines[0]
    # Megatron's four all-reduces of a microbatch's activations per block, two in the forward
    # (after the attention's and the MLP's row-wise layers) and two in the backward (before the
    # column-wise ones), counted by the ring formula: 2 x bytes x (tp - 1) / tp each
    config, microbatches = PRESETS["tiny"], SCHEDULES["1f1b"]["microbatches"]
    activation_bytes = (
        JOB["training"]["batch_size"] // microbatches * config.seq_len * config.d_model * 4
    )
    blocks_per_stage = config.num_layers // 2
    want = microbatches * blocks_per_stage * 4 * (2 * activation_bytes * (2 - 1) // 2)
    for rank, out in enumerate(engines):
        assert out["tp_bytes_per_step"] == {"bytes_all_reduced": want, "bytes_all_gathered": 0,
                                            "bytes_reduce_scattered": 0}, (rank, out)  # fmt: skip
    shutil.copytree(tmp_path / "tp-half", tmp_path / "one-process")
    Trainer(_job(tmp_path / "one-process")).fit(resume=True)  # pp2 x tp2's step 2, one process
    train, val = losses(tmp_path / "one-process")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])
    weights = exported(tmp_path / "reference", tmp_path / "reference-export")
    for name in ("tp-1f1b", "tp-interleaved", "dp2-tp2-fsdp2"):  # the last: one 2D stage
        trained = exported(tmp_path / name, tmp_path / f"{name}-export")
        assert trained.keys() == weights.keys(), name
        for key, value in weights.items():
            torch.testing.assert_close(trained[key], value, rtol=0, atol=TOL,
                                       msg=lambda m, key=key: f"{key}: {m}")  # fmt: skip


def test_what_tensor_parallel_stages_cannot_run_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused before torchrun starts, each in one line naming the key and the fix."""
    argv = ["train", "--recipe", "tiny", "--set", "run_dir=/nonexistent"]
    refusals = {
        ("--mesh", "tp=3"): "parallel.tp: 3 tensor-parallel ranks do not divide",  # one stage
        ("--mesh", "pp=2,tp=3"): "parallel.tp: 3 tensor-parallel ranks do not divide "
                                 "model.num_heads (4)",
        ("--mesh", "pp=2,tp=2", "--set", "engine=chunk", "--set", "pipeline.memory=none"):
            "parallel.tp: tensor-parallel stages hold DTensors, which chunk stages",
        ("--mesh", "pp=2,tp=2", "--schedule", "pipemare", "--set", "model.tie_embeddings=false"):
            "pipeline.schedule: pipemare redirects saved weights by storage",
    }  # fmt: skip
    for extra, says in refusals.items():
        assert main([*argv, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    assert JOB["model"] == {"preset": "tiny"}  # 4 heads: tp 3 divides none of them
