"""``tidal train --mesh pp=2,dp=2``: two pipeline stages, each replicated on two ranks.

[Note: one mesh] in tidal/parallel/dims.py. Each replica trains on its own half of every batch
and averages its stage's gradients over ``mesh["dp"]`` once per step, before the tied sum and
the global clipping ([Note: the stage-parameter protocol]), so 4 gloo ranks must log the
one-process reference engine's losses and validation losses and export its weights, under
GPipe, 1F1B and interleaved 1F1B, and a run stopped at a checkpoint resumes exactly. With
``engine = 'chunk'`` each stage's parameters live in chunks under the device budget ([Note:
chunk stages]), sharded over the stage's replicas (ZeRO-3) with dp 2: the same losses, every rank
within its budget and evicting, the same resumed run and exported weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from mesh_job import STEPS, TOL, exported, grad_norms, job_at, losses
from torch.distributed.tensor import DTensor

from tidal.cli.main import main
from tidal.distributed import shutdown
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

# Sharded replicas (ZeRO-3 chunks, FSDP2) reduce-scatter each gradient, summing in another order
# than one process does, and AdamW's division by sqrt(v) magnifies that rounding where v is
# tiny: 1.4e-5 at most in both, in one element of 137k (the losses stay within TOL).
SHARDED_ATOL = 3e-5
SCHEDULES: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe", "microbatches": 2},
    "1f1b": {"schedule": "1f1b", "microbatches": 4},
    "interleaved": {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4},
}


def _job(run_dir: Path, *, steps: int = STEPS, **pipeline: Any) -> dict[str, Any]:
    job = job_at(run_dir, steps=steps)
    if pipeline:
        job["parallel"] = {"pp": 2, "dp": 2}
        job["pipeline"] = pipeline
    return job


def _worker(root: str, reference: tuple[list[float], list[float]]) -> None:
    import torch.distributed as dist

    root_path = Path(root)
    for name, pipeline in SCHEDULES.items():
        Trainer(_job(root_path / name, **pipeline)).fit()
        train, val = losses(root_path / name)
        assert train == pytest.approx(reference[0], abs=TOL), (name, train, reference[0])
        assert val == pytest.approx(reference[1], abs=TOL), (name, val, reference[1])
    Trainer(_job(root_path / "resumed", steps=2, **SCHEDULES["1f1b"])).fit()
    if dist.get_rank() == 0:  # [Note: resuming on another split]: the same step-2 checkpoint
        for name in ("pp4", "one-process"):
            shutil.copytree(root_path / "resumed", root_path / name)
    dist.barrier()
    Trainer(_job(root_path / "resumed", **SCHEDULES["1f1b"])).fit(resume=True)
    assert losses(root_path / "resumed") == losses(root_path / "1f1b")
    # the one-process reference engine's step-2 checkpoint goes on as pp2 x dp2
    Trainer(_job(root_path / "from-engine", **SCHEDULES["1f1b"])).fit(resume=True)
    train, val = losses(root_path / "from-engine")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])
    on_four = _job(root_path / "pp4", **SCHEDULES["1f1b"])
    on_four["parallel"] = {"pp": 4, "dp": 1}  # every block its own stage, no replicas
    Trainer(on_four).fit(resume=True)
    train, val = losses(root_path / "pp4")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])


@pytest.mark.slow
def test_pp2_x_dp2_equals_one_process_and_exports_its_weights(tmp_path: Path) -> None:
    Trainer(_job(tmp_path / "reference")).fit()
    reference = losses(tmp_path / "reference")
    assert len(reference[0]) == STEPS and len(reference[1]) == 2
    Trainer(_job(tmp_path / "from-engine", steps=2)).fit()  # no pipeline: the reference engine
    run_on_ranks(_worker, world_size=4, args=(str(tmp_path), reference), timeout_s=300)
    Trainer(_job(tmp_path / "one-process")).fit(resume=True)  # pp2 x dp2's step 2, one process
    train, val = losses(tmp_path / "one-process")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])
    weights = exported(tmp_path / "reference", tmp_path / "reference-export")
    for name in SCHEDULES:
        trained = exported(tmp_path / name, tmp_path / f"{name}-export")
        assert trained.keys() == weights.keys(), name
        for key, value in weights.items():
            torch.testing.assert_close(trained[key], value, rtol=0, atol=TOL, msg=key)
        # the logged norm is the global one over the mesh, before clipping, as the engine's
        norms, want = grad_norms(tmp_path / name), grad_norms(tmp_path / "reference")
        assert norms == pytest.approx(want, rel=1e-5) and min(want) > 0.5, (name, norms, want)


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
    chunked = [*argv, "--set", "engine=chunk"]
    refusals = {  # what chunk stages cannot do yet, each one line naming the key
        ("--mesh", "pp=2", "--schedule", "pipedream", "--set", "model.tie_embeddings=false"):
            "pipeline.schedule: pipedream keeps older weight versions",
        ("--mesh", "pp=2", "--schedule", "pipemare", "--set", "model.tie_embeddings=false",
         "--set", "pipeline.correction=true"): "pipeline.correction: correction needs a weight-sized",
        ("--mesh", "pp=2", "--set", "pipeline.memory=recompute"): "pipeline.memory: chunk stages",
        ("--mesh", "pp=2,dp=2", "--set", "parallel.fsdp2=true"): "parallel.fsdp2: chunk stages",
    }  # fmt: skip
    fsdp2 = [*argv, "--mesh", "pp=2,dp=2", "--set", "parallel.fsdp2=true", "--schedule",
             "pipemare", "--set", "model.tie_embeddings=false"]  # fmt: skip
    assert main(fsdp2) == 2
    assert "parallel.fsdp2: pipemare redirects saved weights" in capsys.readouterr().err
    for extra, says in refusals.items():
        assert main([*chunked, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def _chunk_job(run_dir: Path, *, steps: int = STEPS, dp: int = 1, memory: dict[str, Any]
               ) -> dict[str, Any]:  # fmt: skip
    job = _job(run_dir, steps=steps, **SCHEDULES["1f1b"])
    job["parallel"] = {"pp": 2, "dp": dp}
    job["engine"] = "chunk"
    job["memory"] = memory
    job["chunk"] = {"size": 4096}
    return job


def _chunk_worker(root: str, reference: tuple[list[float], list[float]], dp: int,
                  memory: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    root_path = Path(root)
    summary = Trainer(_chunk_job(root_path / "chunk", dp=dp, memory=memory)).fit()
    train, val = losses(root_path / "chunk")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, summary["pipeline"]["chunk_stages"])
    Trainer(_chunk_job(root_path / "resumed", steps=2, dp=dp, memory=memory)).fit()
    Trainer(_chunk_job(root_path / "resumed", dp=dp, memory=memory)).fit(resume=True)
    assert losses(root_path / "resumed") == (train, val)
    if dp > 1:  # [Note: reducing once per step]: a quarter of the reduce-scatters at m = 4
        job = _chunk_job(root_path / "per-step", dp=dp, memory=memory)
        job["sharding"] = {"reduce_per_step": True}
        once = Trainer(job).fit()["pipeline"]["chunk_stages"]
        once_train, once_val = losses(root_path / "per-step")
        assert once_train == pytest.approx(train, abs=TOL), (once_train, train)
        assert once_val == pytest.approx(val, abs=TOL), (once_val, val)
        every = summary["pipeline"]["chunk_stages"]
        for s, figure in once.items():
            m = SCHEDULES["1f1b"]["microbatches"]
            assert figure["bytes_reduce_scattered"] * m == every[s]["bytes_reduce_scattered"]
            assert figure["bytes_all_gathered"] < every[s]["bytes_all_gathered"], (figure, every)
            assert figure["peak_device_bytes"] <= figure["device_budget"], figure
        _pipemare_on_chunk_stages(root_path, memory)
    return {"figures": figures, "engine": summary["engine"]}


def _pipemare_on_chunk_stages(root: Path, memory: dict[str, Any]) -> None:
    """[Note: PipeMare on chunk stages]: ZeRO-3 chunk stages under the budget log the plain
    stages' PipeMare losses, and a run stopped at step 2 resumes as the unbroken one."""

    def pipemare(name: str, *, engine: str, steps: int = STEPS) -> dict[str, Any]:
        job = _chunk_job(root / name, steps=steps, dp=2, memory=memory)
        job["engine"] = engine
        job["memory"] = memory if engine == "chunk" else {}  # plain stages hold it all
        job["pipeline"] = {"schedule": "pipemare", "microbatches": 2}
        job["model"]["tie_embeddings"] = False
        return job

    plain = Trainer(pipemare("pipemare-plain", engine="reference")).fit()
    chunked = Trainer(pipemare("pipemare-chunk", engine="chunk")).fit()
    assert chunked["engine"] == "pipeline pipemare x2 chunk stages", chunked["engine"]
    assert chunked["pipeline"]["max_delay_per_stage"] == plain["pipeline"]["max_delay_per_stage"]
    train, val = losses(root / "pipemare-chunk")
    want_train, want_val = losses(root / "pipemare-plain")
    assert train == pytest.approx(want_train, abs=TOL) and val == pytest.approx(want_val, abs=TOL)
    assert train != losses(root / "chunk")[0]  # not the synchronous run's
    for stage in chunked["pipeline"]["chunk_stages"].values():
        assert stage["evictions"] > 0 and stage["peak_device_bytes"] <= stage["device_budget"]
    Trainer(pipemare("pipemare-resumed", engine="chunk", steps=2)).fit()
    Trainer(pipemare("pipemare-resumed", engine="chunk")).fit(resume=True)
    assert losses(root / "pipemare-resumed") == (train, val)


# A host budget below the stage's model data (its AdamW state goes to disk), above the staging
# the NVMe tier needs to stream it (1.06 MiB: tidal/sharding/swap.py's plan_nvme).
NVME_HOST_BUDGET = 1_500_000


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "nvme"), [(1, False), (2, False), (1, True)],
                         ids=["pp2", "pp2xdp2-zero3", "pp2-nvme"])  # fmt: skip
def test_chunk_stages_train_evict_and_resume_as_one_process(
    tmp_path: Path, dp: int, nvme: bool
) -> None:
    """``engine = 'chunk'`` in a pipeline: each stage's parameters in chunks under a device
    budget that forces evictions (ZeRO-3 over each stage's replicas with dp 2; with an NVMe tier
    under a host budget that sends optimizer state to disk), the tied embedding summed across
    the stages, the one-process reference's losses, within every rank's budgets, a resumed run
    equal to the unbroken one."""
    memory: dict[str, Any] = {"device_budget": "1200KiB"}
    if nvme:
        memory |= {"host_budget": NVME_HOST_BUDGET, "nvme_dir": str(tmp_path / "nvme")}
    Trainer(_job(tmp_path / "reference")).fit()
    reference = losses(tmp_path / "reference")
    out = run_on_ranks(_chunk_worker, world_size=2 * dp, args=(str(tmp_path), reference, dp, memory),
                       timeout_s=300)  # fmt: skip
    figures = out[0]["figures"]
    assert out[0]["engine"].endswith("chunk stages")
    stages = [f for rank in figures for f in rank.values()]
    assert len(stages) == 2 * dp, figures  # a stage on each rank
    assert all(f["evictions"] > 0 for f in stages), figures
    assert all(f["peak_device_bytes"] <= f["device_budget"] == 1200 << 10 for f in stages), figures
    if nvme:
        assert all(f["bytes_to_nvme"] > 0 and f["bytes_from_nvme"] > 0 for f in stages), figures
        assert all(f["peak_host_bytes"] <= f["host_budget"] == NVME_HOST_BUDGET
                   for f in stages), figures  # fmt: skip
    # Each step's record has rank 0's stage's tiers ([Note: tier figures] in tidal/train/tiers.py)
    records = [r for r in read_metrics(tmp_path / "chunk") if r["kind"] == "train"]
    assert len(records) == STEPS, records
    for tiers in (r["tiers"] for r in records):
        assert tiers["device_budget_bytes"] == 1200 << 10, tiers
        assert 0 < tiers["device_peak_bytes"] <= 1200 << 10 and tiers["to_device_bytes"] > 0, tiers
        assert (tiers.get("gathered_bytes", 0) > 0) == (dp > 1), tiers
        assert (tiers["nvme_peak_bytes"] is not None) == nvme, tiers
    weights = exported(tmp_path / "reference", tmp_path / "reference-export")
    trained = exported(tmp_path / "chunk", tmp_path / "chunk-export")
    assert trained.keys() == weights.keys()
    atol = TOL if dp == 1 else SHARDED_ATOL
    for key, value in weights.items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")  # fmt: skip


def _fsdp2_worker(root: str, reference: tuple[list[float], list[float]]) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    root_path = Path(root)
    for name in ("gpipe", "1f1b"):
        job = _job(root_path / f"fsdp2-{name}", **SCHEDULES[name])
        job["parallel"]["fsdp2"] = True
        trainer = Trainer(job)
        # FSDP2's reduce-scatter (dist.reduce_scatter_single, torch 2.13), counted
        with mock.patch.object(
            dist, "reduce_scatter_single", wraps=dist.reduce_scatter_single
        ) as rs:
            assert trainer.fit()["engine"].endswith("fsdp2 stages")
        (stage,) = trainer.part.engine.modules.values()  # type: ignore[attr-defined]
        assert all(isinstance(p, DTensor) for p in stage.parameters())  # sharded, not replicated
        # once per step and FSDP2 group (each block and the stage), not once per microbatch
        groups = sum(isinstance(m, FSDPModule) for m in stage.modules())
        assert rs.call_count == STEPS * groups, (name, rs.call_count, groups)
        train, val = losses(root_path / f"fsdp2-{name}")
        assert train == pytest.approx(reference[0], abs=TOL), (name, train, reference[0])
        assert val == pytest.approx(reference[1], abs=TOL), (name, val, reference[1])
    job = _job(root_path / "fsdp2-offload", **SCHEDULES["1f1b"])
    job["parallel"] |= {
        "fsdp2": True,
        "fsdp2_offload": True,
    }  # CPUOffloadPolicy: shards on the host
    trainer = Trainer(job)
    assert trainer.fit()["engine"].endswith("fsdp2 stages offloaded")
    (stage,) = trainer.part.engine.modules.values()  # type: ignore[attr-defined]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in stage.modules()
              if isinstance(m, FSDPModule)]  # fmt: skip
    assert groups and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
    train, val = losses(root_path / "fsdp2-offload")
    assert train == pytest.approx(reference[0], abs=TOL), ("offload", train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), ("offload", val, reference[1])
    for steps in (2, STEPS):  # stopped at step 2's checkpoint, then resumed from it
        job = _job(root_path / "fsdp2-resumed", steps=steps, **SCHEDULES["1f1b"])
        job["parallel"]["fsdp2"] = True
        Trainer(job).fit(resume=steps == STEPS)
    assert losses(root_path / "fsdp2-resumed") == losses(root_path / "fsdp2-1f1b")
    # [Note: one train step] in tidal/train/job.py: no pipeline, the model one stage sharded
    # over all four ranks by FSDP2 (it trained the reference engine unsharded before)
    job = _job(root_path / "fsdp2-dp4", **SCHEDULES["gpipe"])
    job["parallel"] = {"dp": 4, "fsdp2": True}
    trainer = Trainer(job)
    assert trainer.fit()["engine"] == "pipeline gpipe x1 fsdp2 stages"
    (stage,) = trainer.part.engine.modules.values()  # type: ignore[attr-defined]
    assert all(isinstance(p, DTensor) and p.device_mesh.size() == 4 for p in stage.parameters())
    train, val = losses(root_path / "fsdp2-dp4")
    assert train == pytest.approx(reference[0], abs=TOL), ("dp4", train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), ("dp4", val, reference[1])


@pytest.mark.slow
def test_pp2_x_dp2_on_fsdp2_stages_equals_one_process(tmp_path: Path) -> None:
    """[Note: FSDP2 stages]: each stage fully_shard-ed over its replicas instead of replicated:
    the one-process reference's losses, its exported weights, a resumed run equal to the
    unbroken one."""
    Trainer(_job(tmp_path / "reference")).fit()
    reference = losses(tmp_path / "reference")
    run_on_ranks(_fsdp2_worker, world_size=4, args=(str(tmp_path), reference), timeout_s=300)
    weights = exported(tmp_path / "reference", tmp_path / "reference-export")
    trained = exported(tmp_path / "fsdp2-1f1b", tmp_path / "fsdp2-export")
    assert trained.keys() == weights.keys()
    for key, value in weights.items():  # SHARDED_ATOL: the reduce-scatter's order under AdamW
        torch.testing.assert_close(trained[key], value, rtol=0, atol=SHARDED_ATOL,
                                   msg=lambda m, key=key: f"{key}: {m}")  # fmt: skip


def test_fsdp2_with_cpu_offload_in_one_process_equals_the_reference(tmp_path: Path) -> None:
    """[Note: a group of one] in tidal/distributed/env.py: without torchrun a run on stages
    makes a process group of its one process, so FSDP2's CPU offload trains a model on one
    device, through the same step, with the reference engine's losses and gradient norms."""
    import torch.distributed as dist

    Trainer(job_at(tmp_path / "reference")).fit()
    job = job_at(tmp_path / "offloaded")
    job["parallel"] = {"fsdp2": True, "fsdp2_offload": True}
    trainer = Trainer(job)
    try:
        assert trainer.fit()["engine"].endswith("fsdp2 stages offloaded")
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:  # the group stays until shutdown (the CLI's); this process runs other tests
        shutdown()
    (stage,) = trainer.part.engine.modules.values()  # type: ignore[attr-defined]
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in stage.parameters())
    train, val = losses(tmp_path / "offloaded")
    reference = losses(tmp_path / "reference")
    assert train == pytest.approx(reference[0], abs=TOL) and val == pytest.approx(
        reference[1], abs=TOL
    )
    assert grad_norms(tmp_path / "offloaded") == pytest.approx(
        grad_norms(tmp_path / "reference"), abs=TOL
    )
