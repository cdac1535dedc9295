"""Building a pipeline's runtime over one mesh from the job's configs (the trainer's pipeline
part, tidal/train/pipeline_part.py, calls :func:`pipeline`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tidal.config import ConfigError, require
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_stage import (
    ChunkStageConfig,
    ChunkStageParams,
    require_synchronous,
    zero3_parts,
)
from tidal.parallel.config import OptimizerConfig, TrainingConfig
from tidal.parallel.reference import TorchOptimizer, build_optimizer, lr_schedule
from tidal.parallel.stage_params import StageParams
from tidal.pipeline.config import PipelineConfig
from tidal.pipeline.ir import Schedule
from tidal.pipeline.lending import Lending
from tidal.pipeline.split import PipelineStage, tied_parameters
from tidal.runtime.distributed import PipelineRuntime, RuntimeConfig
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

if TYPE_CHECKING:
    from tidal.runtime.host_optimizer import HostOptimizerConfig  # DTensor: plan runs only

__all__ = ["pipeline", "stage_params"]


def pipeline(stages: Sequence[PipelineStage], *, config: PipelineConfig, optimizer: OptimizerConfig,
             training: TrainingConfig, block_ranges: Sequence[tuple[int, int]],
             num_microbatches: int, device: torch.device, mesh: DeviceMesh,
             lending: Lending | None = None,
             chunks: ChunkStageConfig | None = None, fsdp2: bool = False,
             fsdp2_offload: bool = False,
             torch_optimizer: TorchOptimizer | None = None,
             planned: bool = False,
             host_optimizer: HostOptimizerConfig | None = None) -> PipelineRuntime:  # fmt: skip
    """Train ``stages`` (all of the model's, in order; ``block_ranges``: the blocks of each) as
    a pipeline over ``mesh["pp"]`` under ``config``'s schedule: the rank at pipeline position
    ``r`` of ``p`` keeps stages ``r, r + p, ...`` (each with its own optimizer and, for
    asynchronous schedules, its weight versions), and each stage's gradients are averaged over
    ``mesh["dp"]`` once per step ([Note: one mesh] in tidal/parallel/dims.py); returns the runtime that trains
    them ([Note: pipeline runs] in tidal/train/pipeline_part.py). ``lending``: who lends what
    stages save to whom ([Note: lending] in tidal/pipeline/lending.py). ``num_microbatches``: a
    step's, before accumulation: ``training.grad_accum_steps = k`` runs ``k`` times as many
    (the caller's step draws ``k`` batches); ``training.precision``: [Note: pipeline mixed
    precision] in tidal/runtime/precision.py. ``chunks``: each stage's parameters in tidal's
    chunks under its budgets instead ([Note: chunk stages] in tidal/parallel/chunk_stage.py),
    sharded over ``mesh["dp"]`` (ZeRO-3) when it has several ranks; ``fsdp2``: each stage
    sharded over ``mesh["dp"]`` by FSDP2 instead of replicated ([Note: FSDP2 stages] in
    tidal/runtime/fsdp_stage.py), ``fsdp2_offload`` with its shards on the host (with one dp
    rank too). With ``mesh["tp"]`` of several ranks each stage's blocks are split over them
    first ([Note: tensor-parallel stages] in tidal/parallel/tensor_stage.py).
    ``torch_optimizer``: yours, one per plain stage, at its own rates ([Note: your optimizer]
    in tidal/train/user_optim.py). ``planned``: the one stage is a model a plan laid out on
    ``mesh["dp"]`` and ``mesh["tp"]`` ([Note: plan stages] in tidal/runtime/plan_weights.py),
    ``host_optimizer`` what of its optimizer the host updates ([Note: the optimizer on the host]
    in tidal/runtime/host_optimizer.py)."""
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
    held = stage_params(mine, mesh, runtime.make(world_size, steps=1),
                         optimizer=optimizer, weights=weights, precision=training.precision,
                         lr=first_lr, microbatches=microbatches, chunks=chunks, fsdp2=fsdp2,
                         fsdp2_offload=fsdp2_offload,
                         torch_optimizer=torch_optimizer, planned=planned,
                         host_optimizer=host_optimizer)  # fmt: skip
    return PipelineRuntime(
        runtime,
        stages=mine,
        weights=held,
        tied=tied,
        group=pp_group,
        dp_group=dp_group,
        device=device,
        lending=lending,
    )


def stage_params(mine: Sequence[nn.Module], mesh: DeviceMesh | None, schedule: Schedule, *,
                  optimizer: OptimizerConfig, weights: AsyncConfig,
                  precision: str, lr: float, microbatches: int,
                  chunks: ChunkStageConfig | None, fsdp2: bool,
                  fsdp2_offload: bool,
                  torch_optimizer: TorchOptimizer | None = None,
                  planned: bool = False,
                  host_optimizer: HostOptimizerConfig | None = None,
                  init: ParameterValues | None = None) -> list[StageParams]:  # fmt: skip
    """What holds each of this rank's stages' parameters ([Note: the stage-parameter
    protocol]): tensor-parallel weights, chunks, FSDP2 shards, or plain replicas; the one
    choice, for a pipeline's stages and for a model of one stage (tidal.initialize's
    StageEngine). ``schedule``: one step of the run's, which decides what the stages must
    support. ``torch_optimizer``: yours, which only plain replicas take (the Trainer maps a
    torch class onto ``optimizer`` for the others: [Note: your optimizer]). ``planned``: a
    model a plan laid out, the one stage ([Note: plan stages]), ``host_optimizer`` what of its
    optimizer the host updates; with ``chunks``, the plan's stages in chunks under its budgets
    ([Note: chunk stages in plans] in tidal/planner/model_data.py). ``mesh``: None for one process
    without a process group ([Note: one model on stages]). ``init``: the values of a stage on
    the meta device, which chunks stream in (the other holders take a stage with storage)."""
    dp_group = None if mesh is None else mesh.get_group("dp")
    dp_size, tp_size = (1, 1) if mesh is None else (mesh["dp"].size(), mesh["tp"].size())
    assert mesh is not None or not planned, "a plan's layout needs its mesh"
    assert init is None or chunks is not None, "only chunks stream a meta stage's values in"
    assert host_optimizer is None or planned, "a plan's offload"
    if planned and chunks is None:
        return _planned_stage(mine, schedule, optimizer, weights, precision, lr, microbatches,
                              host_optimizer)  # fmt: skip
    if torch_optimizer is not None:
        assert tp_size == 1 and chunks is None and not fsdp2, "user_optim's refusal"
        return [_your_optimizer_stage(s, torch_optimizer, optimizer, weights, precision,
                                      dp_group=dp_group) for s in mine]  # fmt: skip
    if tp_size > 1:
        assert mesh is not None
        require(
            not schedule.asynchronous,
            "pipeline.schedule",
            f"{schedule.name} redirects saved weights to their versions by storage, which "
            "tensor-parallel stages' DTensors hide; use gpipe, 1f1b or interleaved",
        )
        return _tensor_stages(mine, mesh, optimizer, weights, precision, lr,
                              chunks=chunks is not None, fsdp2=fsdp2, fsdp2_offload=fsdp2_offload,
                              microbatches=microbatches)  # fmt: skip
    if chunks is not None:
        require_synchronous(schedule)
        # the NVMe tier is the sharded optimizer's: a stage with a disk is a dp group of one
        sharded = dp_size > 1 or chunks.memory.nvme_dir is not None
        pipemare = weights if schedule.asynchronous else None  # [Note: PipeMare on chunk stages]
        return [ChunkStageParams(s, chunks, init=init,
                                 parts=zero3_parts(chunks, dp_group) if sharded else None,
                                 microbatches_per_step=microbatches, weights=pipemare,
                                 whole_model=schedule.num_stages == 1)
                for s in mine]  # fmt: skip
    if fsdp2 and (dp_size > 1 or fsdp2_offload):
        assert mesh is not None
        from tidal.runtime.fsdp_stage import Fsdp2StageWeights, fsdp2_stage  # FSDP2 runs only

        # the optimizer goes over the shards, so each stage is sharded before it is built
        return [Fsdp2StageWeights(s, build_optimizer(s, optimizer, lr), weights,
                                  precision=precision, microbatches_per_step=microbatches)
                for s in (fsdp2_stage(s, mesh["dp"], offload=fsdp2_offload) for s in mine)]  # fmt: skip
    return [StageWeights(s, build_optimizer(s, optimizer, lr), weights, precision=precision,
                         dp_group=dp_group)
            for s in mine]  # fmt: skip


def _tensor_stages(mine: Sequence[nn.Module], mesh: DeviceMesh, optimizer: OptimizerConfig,
                   weights: AsyncConfig, precision: str, lr: float, *, chunks: bool,
                   fsdp2: bool, fsdp2_offload: bool, microbatches: int) -> list[StageParams]:  # fmt: skip
    """Each stage split over ``mesh["tp"]``, then, with ``fsdp2``, its shares sharded over
    ``mesh["dp"]`` (torchtitan's 2D), then its optimizer over what this rank holds."""
    from tidal.parallel.tensor_stage import tensor_parallel_stage  # DTensor: tp runs only
    from tidal.runtime.fsdp_stage import fsdp2_stage
    from tidal.runtime.tensor_weights import Fsdp2TensorStageWeights, TensorStageWeights

    if chunks:
        raise ConfigError(
            "parallel.tp",
            "tensor-parallel stages hold their parameters as DTensors, which chunk stages do "
            "not take yet; set parallel.tp = 1, or engine = 'reference'",
        )
    sharded = fsdp2 and (mesh["dp"].size() > 1 or fsdp2_offload)
    held: list[StageParams] = []
    for stage in mine:
        tensor_parallel_stage(stage, mesh["tp"])
        if not sharded:
            held.append(TensorStageWeights(stage, build_optimizer(stage, optimizer, lr), weights,
                                           precision=precision, dp_group=mesh.get_group("dp")))  # fmt: skip
            continue
        fsdp2_stage(stage, mesh["dp"], offload=fsdp2_offload)  # the optimizer goes over shards
        held.append(Fsdp2TensorStageWeights(stage, build_optimizer(stage, optimizer, lr), weights,
                                            precision=precision,
                                            microbatches_per_step=microbatches))  # fmt: skip
    return held


def _your_optimizer_stage(stage: nn.Module, yours: TorchOptimizer, optimizer: OptimizerConfig,
                          weights: AsyncConfig, precision: str, *,
                          dp_group: torch.distributed.ProcessGroup | None) -> StageWeights:  # fmt: skip
    """A plain replica stepped by your optimizer at its own rates, or by ``optimizer``'s built
    at its peak rate for your scheduler to set ([Note: your optimizer])."""
    made = (build_optimizer(stage, optimizer, optimizer.lr) if yours.make is None
            else yours.make(stage.parameters()))  # fmt: skip
    return StageWeights(
        stage, made, weights, precision=precision, dp_group=dp_group, own_rates=True
    )


def _planned_stage(mine: Sequence[nn.Module], schedule: Schedule, optimizer: OptimizerConfig,
                   weights: AsyncConfig, precision: str, lr: float, microbatches: int,
                   host_optimizer: HostOptimizerConfig | None) -> list[StageParams]:  # fmt: skip
    """Stages a plan laid out, whose optimizers go over their shards mesh by mesh, with what
    the plan offloads of each updated on the host."""
    from tidal.parallel.plan_layout import build_plan_optimizer  # DTensor: plan runs only
    from tidal.runtime.host_optimizer import HostStepped
    from tidal.runtime.plan_weights import PlanStageWeights

    # a PipeMare plan keeps all of its model data on the device ([Note: PipeMare plans] in
    # tidal/planner/pipelines.py)
    assert not schedule.asynchronous or host_optimizer is None, "check_plan: nothing off it"
    held: list[StageParams] = []
    for stage in mine:
        made = build_plan_optimizer(stage, optimizer, lr)
        if host_optimizer is not None:
            made = HostStepped(made, host_optimizer)
        held.append(PlanStageWeights(stage, made, weights, precision=precision,
                                     microbatches_per_step=microbatches))  # fmt: skip
    return held
