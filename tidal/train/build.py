"""Choose and build the engine a job asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.reference import ReferenceEngine
from tidal.parallel.sharded_engine import ShardedEngine
from tidal.train.job import JobConfig

if TYPE_CHECKING:
    from tidal.parallel.plan_engine import PlanEngine
    from tidal.planner import Plan

__all__ = ["Engine", "build_engine"]

Engine = ReferenceEngine | ChunkEngine


def build_engine(
    model: nn.Module,
    job: JobConfig,
    *,
    init: ParameterValues | None = None,
    plan: Plan | None = None,
) -> Engine | PlanEngine:
    """``engine = "reference"``: plain PyTorch; ``"chunk"``: parameters in chunks under budgets,
    sharded over the ranks (ZeRO-3) when a process group of several ranks is initialised, and
    on one process when ``memory.nvme_dir`` asks for the disk tier. With a ``plan`` (``tidal
    plan``), the plan engine on the plan's ranks. ``init``: the values of a model built on the
    meta device ([Note: deferred construction] in tidal/memory/materialize.py)."""
    if plan is not None:
        # Imported here: the planner's runtime (DTensor, FSDP2) is only needed for plan runs.
        from tidal.parallel.plan_engine import PlanEngine, refuse_chunk_engine

        refuse_chunk_engine(job)
        return PlanEngine(
            model,
            plan=plan,
            optimizer=job.optimizer,
            training=job.training,
            init=init,
            seq_len=job.model.resolve().seq_len,
        )
    if job.engine == "chunk":
        parts = dict(
            optimizer=job.optimizer,
            training=job.training,
            memory=job.memory,
            chunk=job.chunk,
            init=init,
        )
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if several or job.memory.nvme_dir is not None:  # the NVMe tier is the sharded engine's
            return ShardedEngine(model, sharding=job.sharding, **parts)
        return ChunkEngine(model, **parts)
    return ReferenceEngine(
        model, optimizer=job.optimizer, training=job.training, memory=job.memory, init=init
    )
