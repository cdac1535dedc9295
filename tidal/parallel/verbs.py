"""The verbs that change a model in place and return what trains it; build_engine
(tidal/train/build.py) chooses among them from the job's config alone, and the trainer's
pipeline part (tidal/train/pipeline_part.py) calls :func:`pipeline`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import LocalParts
from tidal.parallel.reference import ReferenceEngine, build_optimizer, lr_schedule
from tidal.parallel.sharded_parts import ShardedParts
from tidal.sharding.config import ShardingConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from tidal.pipeline.config import PipelineConfig
    from tidal.pipeline.lending import Lending
    from tidal.pipeline.runtime import PipelineRuntime
    from tidal.pipeline.split import PipelineStage
    from tidal.planner import Plan

__all__ = ["apply_plan", "offload", "pipeline", "shard"]


def offload(model: nn.Module, *, optimizer: OptimizerConfig, training: TrainingConfig,
            memory: MemoryConfig, chunk: ChunkConfig, init: ParameterValues | None = None,
            ) -> ChunkEngine:  # fmt: skip
    """Move ``model``'s parameters into chunks that travel between the device and the host
    under ``memory``'s budgets (each parameter becomes a slot of a chunk; the modules get the
    store's hooks); returns the chunk engine that trains it on this process."""
    return ChunkEngine(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                       init=init, parts=LocalParts())  # fmt: skip


_ONE_PROCESS_ONLY = {
    "relayout": "sharded chunks stay where they are",
    "grads_in_params": "sharded gradients are reduced in fp32 buffers",
}


def shard(model: nn.Module, *, optimizer: OptimizerConfig, training: TrainingConfig,
          memory: MemoryConfig, chunk: ChunkConfig, sharding: ShardingConfig, group: Any = None,
          init: ParameterValues | None = None) -> ChunkEngine:  # fmt: skip
    """:func:`offload`, each chunk and its optimizer state sharded over ``group``'s ranks
    (default: the default process group; none initialised: a mesh of one, which the NVMe tier
    uses on one process). ``chunk.relayout`` and ``chunk.grads_in_params`` do not apply: set
    to true, they are refused."""
    for key, why in _ONE_PROCESS_ONLY.items():
        if getattr(chunk, key) is True:
            raise ConfigError(f"chunk.{key}", f"applies on one process only ({why}); drop the "
                              f"setting (unset, it is on wherever it applies) or set it to false")  # fmt: skip
    parts = ShardedParts(Collectives(group), sharding=sharding, memory=memory, optimizer=optimizer)
    return ChunkEngine(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                       init=init, parts=parts)  # fmt: skip


def apply_plan(model: nn.Module, plan: Plan, *, optimizer: OptimizerConfig,
               training: TrainingConfig, init: ParameterValues | None = None,
               seq_len: int | None = None,
               inputs: tuple[torch.Tensor, ...] | None = None) -> ReferenceEngine:  # fmt: skip
    """Shard ``model`` as ``plan`` says (DTensor on ``tp``, FSDP2 on ``dp``: [Note: plan runs]
    in plan_layout.py); returns the reference engine that trains it in that layout. ``inputs``:
    for a model of your own, a sample of its inputs (as ``tidal.planner.plan_for`` took)."""
    from tidal.parallel.plan_layout import PlanLayout  # DTensor and FSDP2: for plan runs only

    layout = PlanLayout(plan, seq_len=seq_len, batch_size=training.batch_size, inputs=inputs)
    return ReferenceEngine(model, optimizer=optimizer, training=training, init=init,
                           layout=layout)  # fmt: skip


def pipeline(stages: Sequence[PipelineStage], *, config: PipelineConfig, optimizer: OptimizerConfig,
             training: TrainingConfig, block_ranges: Sequence[tuple[int, int]],
             num_microbatches: int, device: torch.device, mesh: DeviceMesh,
             lending: Lending | None = None) -> PipelineRuntime:  # fmt: skip
    """Train ``stages`` (all of the model's, in order; ``block_ranges``: the blocks of each) as
    a pipeline over ``mesh["pp"]`` under ``config``'s schedule: the rank at pipeline position
    ``r`` of ``p`` keeps stages ``r, r + p, ...`` (each with its own optimizer and, for
    asynchronous schedules, its weight versions), and each stage's gradients are averaged over
    ``mesh["dp"]`` once per step ([Note: one mesh] in dims.py); returns the runtime that trains
    them ([Note: pipeline runs] in tidal/train/pipeline_part.py). ``lending``: who lends what
    stages save to whom ([Note: lending] in tidal/pipeline/lending.py). ``num_microbatches``: a
    step's, before accumulation: ``training.grad_accum_steps = k`` runs ``k`` times as many
    (the caller's step draws ``k`` batches); ``training.precision``: [Note: pipeline mixed
    precision] in tidal/pipeline/precision.py."""
    from tidal.pipeline.pipemare import AsyncConfig, StageWeights, WeightMode  # pipelines only
    from tidal.pipeline.runtime import PipelineRuntime, RuntimeConfig
    from tidal.pipeline.split import tied_parameters

    versions = {"pipedream": WeightMode.STASH, "2bw": WeightMode.TWO_VERSIONS}
    tied = tied_parameters(stages)
    rank, world_size = mesh.get_local_rank("pp"), mesh["pp"].size()
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    mine = [stages[s] for s in range(rank, len(stages), world_size)]
    microbatches = num_microbatches * training.grad_accum_steps
    first_lr = lr_schedule(optimizer, training).lr_at(1)
    weights = AsyncConfig(
        weights=versions.get(config.schedule, WeightMode.CURRENT),
        lr_rescheduling=config.reschedules_lr,
        lr_warmup_steps=config.lr_warmup_steps,
        correction=config.correction,
        correction_decay=config.correction_decay,
        prediction=config.prediction,
        microbatches_per_update=microbatches if config.prediction else 0,
    )
    runtime = RuntimeConfig(
        schedule=config.schedule,
        microbatches=microbatches,
        virtual_stages=config.virtual_stages,
        sync_steps=config.sync_steps,
        max_grad_norm=training.grad_clip_norm or None,
        partition=tuple(block_ranges),
        precision=training.precision,
    )
    return PipelineRuntime(
        runtime,
        stages=mine,
        weights=[
            StageWeights(
                s,
                build_optimizer(s, optimizer, first_lr),
                weights,
                precision=training.precision,
                dp_group=dp_group,
            )
            for s in mine
        ],  # fmt: skip
        tied=tied,
        group=pp_group,
        dp_group=dp_group,
        device=device,
        lending=lending,
    )
