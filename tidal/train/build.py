"""What a job's config builds, chosen from it alone: the engine that owns its step (the parity
baseline; the verbs of tidal/parallel/verbs.py), the chunk stages' config, the checks of a
plan run against the job, and the token samplers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.config import ConfigError, require
from tidal.data import BatchSampler, build_token_splits
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_stage import ChunkStageConfig
from tidal.parallel.protocol import Engine, TrainingEngine
from tidal.parallel.reference import ReferenceEngine
from tidal.parallel.verbs import offload, shard
from tidal.train.job import JobConfig

if TYPE_CHECKING:
    from tidal.planner import Plan


__all__ = [
    "Engine",
    "TrainingEngine",
    "build_engine",
    "build_samplers",
    "check_plan_job",
    "check_plan_settings",
    "chunk_stage_config",
]


def build_engine(model: nn.Module, job: JobConfig, *,
                 init: ParameterValues | None = None) -> Engine:  # fmt: skip
    """The engine the job names, owning its step: ``engine = "reference"``, plain PyTorch (the
    parity baseline every stage is checked against: tidal/testing/reference.py); ``"chunk"``:
    the chunk engine, sharded over the ranks (ZeRO-3) when a process group of several ranks is
    initialised, and on one process when ``memory.nvme_dir`` asks for the disk tier. ``init``:
    the values of a model built on the meta device ([Note: deferred construction] in
    tidal/memory/materialize.py). Training runs (``tidal train``, ``tidal.initialize``) take
    stages instead ([Note: one train step] in job.py)."""
    if job.engine == "reference":
        return ReferenceEngine(model, optimizer=job.optimizer, training=job.training,
                               memory=job.memory, init=init)  # fmt: skip
    parts: dict[str, Any] = dict(optimizer=job.optimizer, training=job.training, memory=job.memory,
                 chunk=job.chunk, init=init)  # fmt: skip
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    # The NVMe tier is the sharded optimizer's: one process with a disk is a mesh of one.
    if several or job.memory.nvme_dir is not None:
        return shard(model, sharding=job.sharding, **parts)
    return offload(model, **parts)


def check_plan_job(plan: Plan, job: JobConfig, *, model: nn.Module, world_size: int) -> None:
    """All that ``tidal train --plan`` checks of the job and the world before training, for a
    launcher to report once rather than once per rank; ``model``: the job's, on the meta
    device (its spec builds it: this layer builds no model)."""
    from tidal.parallel.plan_layout import check_plan_fits, plan_rows  # DTensor: plan runs only

    check_plan_settings(job)
    check_plan_fits(plan, model, world_size=world_size, seq_len=job.model.resolve().seq_len)
    plan_rows(job.training.batch_size, plan, rank=0)


def check_plan_settings(job: JobConfig) -> None:
    """What of the job a plan run refuses, one line each naming the fix: a plan sets the mesh
    and lays the model out on it, which the job's own pipeline, tensor parallelism, FSDP2 or
    chunks would do too ([Note: plan stages] in tidal/runtime/plan_weights.py)."""
    if job.engine != "reference":
        raise ConfigError(
            "--plan",
            f"a plan says how to shard the model, which the {job.engine} engine would do too; "
            f"drop --plan, or set engine = 'reference' (--set engine=reference)",
        )
    if job.needs_stages:
        raise ConfigError("--plan", "a plan sets the mesh and places the parameters, which the "
                          "job's pipeline, parallel.tp or parallel.fsdp2 would do too; drop "
                          "--plan or those settings")  # fmt: skip
    if job.training.precision == "fp16":
        raise ConfigError(
            "training.precision",
            "a plan run trains in 'fp32' or 'bf16' (fp16's loss scaling is not wired to "
            "sharded gradients); use 'bf16'",
        )
    require(job.pipeline.memory == "none", "pipeline.memory",
            "a plan chooses what each block recomputes itself; drop pipeline.memory or "
            "--plan")  # fmt: skip
    require(not job.pipeline.asynchronous, "pipeline.schedule",
            f"a plan runs one synchronous stage, not {job.pipeline.schedule}; drop "
            f"pipeline.schedule or --plan")  # fmt: skip


def chunk_stage_config(job: JobConfig, device: torch.device | str) -> ChunkStageConfig | None:
    """With ``engine = 'chunk'``, how each stage's chunks live ([Note: chunk stages] in
    tidal/parallel/chunk_stage.py); None for the other engines."""
    if job.engine != "chunk":
        return None
    return ChunkStageConfig(optimizer=job.optimizer, memory=job.memory, chunk=job.chunk,
                            precision=job.training.precision, device=str(device),
                            sharding=job.sharding)  # fmt: skip


def build_samplers(job: JobConfig) -> tuple[BatchSampler, BatchSampler]:
    """The run's training and validation batch samplers (global batches, every rank the same)."""
    training, config = job.training, job.model.resolve()
    splits = build_token_splits(job.data, vocab_size=config.vocab_size, seed=training.seed)
    train = BatchSampler(
        splits.train, batch_size=training.batch_size, seq_len=config.seq_len, seed=training.seed
    )
    # Validation draws from its own seed so that it is the same batches at every pass.
    val = BatchSampler(
        splits.val, batch_size=training.batch_size, seq_len=config.seq_len, seed=training.seed + 1
    )
    return train, val
