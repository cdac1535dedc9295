"""The stages a plan run trains: the job's model (or yours) laid out as ``tidal plan`` said.

``tidal train --plan PATH`` is a schedule of stages like every run ([Note: one train step] in
job.py). A flat plan is one stage: :func:`planned_stage` builds the model, checks the plan
against it, realises the plan on it in place over the run's mesh (``mesh["dp"]`` and
``mesh["tp"]``, [Note: plan runs] in tidal/parallel/plan_layout.py) and makes it the stage,
which :class:`~tidal.runtime.plan_weights.PlanStageWeights` holds ([Note: plan stages] there).
A pipelined plan is :func:`planned_pipeline`'s stages.

[Note: planned pipeline stages]
A pipelined plan ([Note: plan pipelines] in tidal/planner/plan.py) names its stages' blocks,
its schedule and, per kind of stage, the choices the planner's ILP made for that stage's own
graph (:func:`~tidal.planner.pipelines.stage_graph`: its blocks, the embeddings on the first,
the head and the loss on the last, a weight tied across them a copy on each). Each rank builds
the model on the meta device and splits it into stages around the model's own modules
(``split_parts(copy_stages=False)``), gives storage and the deterministic init's values to
its own stages alone, and realises each of them with :func:`~tidal.parallel.plan_apply.
apply_to_stage`: the stage's plan (:meth:`Plan.stage_plan`) on the stage's graph, renamed to
the stage's module paths, over this rank's ``mesh["dp", "tp"]``: DTensor, recomputation and
FSDP2 at each unit's ZeRO level, as a flat plan's model. So the plan is applied, not
re-interpreted. Between stages the residual stream travels as the sending stage's blocks hand
it to each other (``check.sent_layout``, its wiring's: a tensor rank sends its ``1 / t`` of a
sequence-split stream, as the planner prices the sends), and the receiving stage's first
block converts it to its own entry layout. Every stage is held by
:class:`~tidal.runtime.plan_weights.PlanStageWeights` and trained by the schedule the plan
names, under the one train step; checkpoints are the one format.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tidal.config import require
from tidal.distributed import rank
from tidal.memory.materialize import materialize
from tidal.models import spec_for
from tidal.parallel.dims import ParallelDims
from tidal.parallel.flat_state import model_layout
from tidal.pipeline.sequential import LossFn
from tidal.pipeline.split import PipelineStage, whole_model_stage
from tidal.runtime.weights import StageWeights
from tidal.train.job import JobConfig

if TYPE_CHECKING:
    from tidal.parallel.chunk_stage import ChunkStageConfig
    from tidal.planner import Plan
    from tidal.runtime.host_optimizer import HostOptimizerConfig

__all__ = [
    "PlannedPipeline",
    "PlannedStage",
    "plan_dims",
    "plan_chunks",
    "plan_host_optimizer",
    "plan_job",
    "planned_figures",
    "planned_pipeline",
    "planned_stage",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PlannedStage:
    """What :func:`planned_stage` made: the stage, the checkpoint layout of the whole model (its
    one-process shapes), the parameter count, FLOPs per token (None: not known) and the blocks
    the stage holds, as a split's ranges count them."""

    stage: PipelineStage
    layout: dict[str, Any]
    num_params: int
    flops_per_token: float | None
    block_range: tuple[int, int]


def plan_dims(plan: Plan, world_size: int) -> ParallelDims:
    """The mesh a plan runs on: ``pp`` stages of ``dp x tp`` ranks ([Note: plan runs]), which
    must be the ``world_size`` running."""
    from tidal.parallel.plan_layout import check_plan_devices

    check_plan_devices(plan, world_size)
    return ParallelDims(pp=plan.pp, dp=plan.dp, tp=plan.tp)


def plan_host_optimizer(plan: Plan, job: JobConfig, *, pp_rank: int) -> HostOptimizerConfig | None:
    """What of pipeline rank ``pp_rank``'s optimizer the plan updates on the host, and keeps on
    NVMe in ``memory.nvme_dir`` ([Note: the optimizer on the host] in
    tidal/runtime/host_optimizer.py; a rank's own offload: [Note: offload per stage] in
    tidal/planner/pipelines.py); None where the device's optimizer does it all, FSDP2's CPU
    offload of every group included (its shares are on the host and updated there). Raises
    naming ``memory.nvme_dir`` where the rank needs a disk and the job names none."""
    from tidal.runtime.host_optimizer import HostOptimizerConfig

    offload = plan.rank_offload(pp_rank)
    if plan.rank_chunks(pp_rank) is not None:  # the chunk store places the optimizer itself
        return None
    if not offload.optimizer or (offload.params == 1 and not offload.nvme):
        return None
    return HostOptimizerConfig(fraction=offload.optimizer, nvme_fraction=offload.nvme,
                               nvme_dir=job.memory.nvme_dir)  # fmt: skip


def plan_chunks(plan: Plan, job: JobConfig, *, pp_rank: int,
                device: torch.device) -> ChunkStageConfig | None:  # fmt: skip
    """How pipeline rank ``pp_rank``'s stages hold their model data in tidal's chunks, under
    the plan's budget and the job's chunk and sharding settings ([Note: chunk stages in plans]
    in tidal/planner/model_data.py); None where FSDP2 holds it. Raises naming
    ``memory.nvme_dir`` where the rank keeps state on NVMe and the job names no disk."""
    from tidal.parallel.chunk_stage import ChunkStageConfig
    from tidal.parallel.config import MemoryConfig

    budgets = plan.rank_chunks(pp_rank)
    if budgets is None:
        return None
    disk: dict[str, Any] = {}
    if budgets.nvme_fraction:  # the plan's share of the state, not a host budget's remainder
        require(job.memory.nvme_dir is not None, "memory.nvme_dir",
                f"the plan keeps part of pipeline rank {pp_rank}'s optimizer state on NVMe: "
                "set memory.nvme_dir to a folder on the node's NVMe drive")  # fmt: skip
        disk = {"nvme_dir": job.memory.nvme_dir, "nvme_read_ahead": job.memory.nvme_read_ahead,
                "nvme_state_fraction": budgets.nvme_fraction}  # fmt: skip
    memory = MemoryConfig(device_budget=budgets.device_bytes,
                          non_model_budget=budgets.activation_bytes or None, **disk)  # fmt: skip
    return ChunkStageConfig(optimizer=job.optimizer, memory=memory, chunk=job.chunk,
                            precision=job.training.precision, device=str(device),
                            sharding=job.sharding)  # fmt: skip


def plan_job(job: JobConfig, plan: Plan) -> JobConfig:
    """``job`` with the plan's pipeline: its stages, schedule, model chunks a rank and
    micro-batches a step ([Note: planned pipeline stages]); ``job`` itself for a flat plan."""
    layout = plan.pipeline
    if layout is None:
        return job
    pipeline = dataclasses.replace(job.pipeline, schedule=layout.schedule,  # type: ignore[arg-type]
                                   virtual_stages=layout.virtual_stages,
                                   microbatches=plan.num_microbatches, partition="even")  # fmt: skip
    parallel = dataclasses.replace(job.parallel, pp=plan.pp, dp=plan.dp, tp=plan.tp)
    return dataclasses.replace(job, pipeline=pipeline, parallel=parallel)


@dataclass(frozen=True, kw_only=True)
class PlannedPipeline:
    """What :func:`planned_pipeline` made: every stage (this rank's laid out, the others on
    the meta device), the checkpoint layout, the parameter count and FLOPs per token."""

    stages: list[PipelineStage]
    layout: dict[str, Any]
    num_params: int
    flops_per_token: float | None


def planned_pipeline(job: JobConfig, plan: Plan, *, mine: list[int], device: torch.device,
                     mesh: DeviceMesh, world_size: int) -> PlannedPipeline:  # fmt: skip
    """The stages of a pipelined plan, ``mine`` realised on this rank; see [Note: planned
    pipeline stages]. ``job``: :func:`plan_job`'s, with the plan's pipeline."""
    from tidal.parallel.plan_apply import apply_to_stage, stage_layouts
    from tidal.parallel.plan_layout import check_plan_fits
    from tidal.pipeline.split import split_parts
    from tidal.pipeline.stage_init import materialize_stages
    from tidal.planner.wiring import structure_graph

    layout = plan.pipeline
    assert layout is not None, "a pipelined plan"
    config = job.model.resolve_structured()  # raises: a plan needs a known structure
    spec = spec_for(config)
    model = spec.build(device="meta")
    graph = structure_graph(model, seq_len=config.seq_len)
    check_plan_fits(plan, model, world_size=world_size, seq_len=graph.seq_len, graph=graph)
    _warn_on_micro_batch(job, plan)
    num_params, flops = spec.num_params(model), spec.flops_per_token(model)  # tied: one here
    state = model_layout(model, {n: t.shape for n, t in model.state_dict().items()})
    stages = split_parts(model, spec.stage_parts(model), layout.block_ranges, copy_stages=False)
    materialize_stages(stages, mine, spec.init(model, job.training.seed), device)
    laid_out = stage_layouts(plan, graph)
    for s in mine:
        stage_plan, stage_graph, handed = laid_out[s]
        apply_to_stage(stages[s].to(device), model, stage_plan, stage_graph, mesh["dp", "tp"],
                       handed=handed)  # fmt: skip
    return PlannedPipeline(
        stages=stages,
        layout=state,
        num_params=num_params,
        flops_per_token=flops,
    )


def planned_stage(job: JobConfig, plan: Plan, *, device: torch.device, mesh: DeviceMesh,
                  world_size: int, model: nn.Module | None = None,
                  loss_fn: LossFn | None = None,
                  inputs: tuple[torch.Tensor, ...] | None = None) -> PlannedStage:  # fmt: skip
    """The stage of a plan run; ``model``: yours (with ``loss_fn``, and ``inputs``, this rank's
    rows of your first batch's inputs to trace it on), else the job's ``[model]``, built on the
    meta device and given its values here, whole, until the plan shards it."""
    from tidal.parallel.plan_apply import apply  # DTensor and FSDP2: plan runs only
    from tidal.parallel.plan_layout import check_plan_fits
    from tidal.planner.wiring import structure_graph
    from tidal.runtime.plan_weights import name_reordered_rows

    init = None
    if model is None:
        spec = spec_for(job.model.resolve())
        if spec.deferred:
            model = spec.build(device="meta")
            init = spec.init(model, job.training.seed)
        else:  # a factory model is built for real ([Note: factory models] in models/factory.py)
            job.model.resolve_structured()  # raises: a plan needs a known structure
            model = spec.build(device="cpu", seed=job.training.seed)
        loss_fn = None if spec.computes_loss else loss_fn
        num_params, flops = spec.num_params(model), spec.flops_per_token(model)
        config = job.model.resolve_structured()
        seq_len, block_range = config.seq_len, (0, config.num_layers)
    else:
        assert loss_fn is not None and inputs is not None, "your model's loss and inputs"
        num_params, flops = sum(p.numel() for p in model.parameters()), None
        seq_len, block_range = None, (0, 1)
    graph = structure_graph(model, seq_len=seq_len, inputs=inputs)
    check_plan_fits(plan, model, world_size=world_size, seq_len=graph.seq_len, graph=graph)
    layout = model_layout(model, {n: t.shape for n, t in model.state_dict().items()})
    _warn_on_micro_batch(job, plan)
    if init is not None:  # all of it here, until apply shards it
        materialize(model, init, device)
    apply(model.to(device), plan, mesh["dp", "tp"], graph=graph)
    stage = whole_model_stage(model, loss_fn=loss_fn)
    name_reordered_rows(stage, model, "layers.0.")
    return PlannedStage(stage=stage, layout=layout, num_params=num_params,
                        flops_per_token=flops, block_range=block_range)  # fmt: skip


def _warn_on_micro_batch(job: JobConfig, plan: Plan) -> None:
    """The plan's memory figures are for its micro-batch and its activations' precision: a run
    of others holds other bytes (a chunk stage's activations then go over their share)."""
    element_bytes = 4 if job.training.precision == "fp32" else 2
    if rank() == 0 and element_bytes != plan.activation_element_bytes:
        logger.warning(
            "the plan was priced for %d-byte activations; this run trains in %s, so its "
            "activations hold about %.3gx the plan's bytes: make the plan with `tidal plan "
            "--precision %s`",
            plan.activation_element_bytes, job.training.precision,
            element_bytes / plan.activation_element_bytes,
            "fp32" if element_bytes == 4 else "bf16",
        )  # fmt: skip
    rows = job.training.batch_size // plan.dp // job.num_microbatches
    if rank() == 0 and rows != plan.micro_batch:
        logger.warning(
            "the plan was priced for %d sequence(s) per data-parallel rank and micro-batch; "
            "this run has %d (training.batch_size %d / dp %d / %d microbatch(es)), so its "
            "memory differs from the plan's",
            plan.micro_batch, rows, job.training.batch_size, plan.dp, job.num_microbatches,
        )  # fmt: skip


def planned_figures(held: list[Any]) -> dict[str, Any]:
    """The model data of a rank's plan stages FSDP2 holds, this rank's stages together: on the
    device, with the host's part of the optimizer apart ([Note: the optimizer on the host]),
    and the bytes the plan's host swap sent ([Note: savers in place])."""
    from tidal.parallel.plan_apply import HOST_SWAP  # DTensor: plan runs only
    from tidal.parallel.reference import model_data_bytes
    from tidal.parallel.stage_params import local_nbytes
    from tidal.runtime.host_optimizer import HostStepped

    figures = [model_data_bytes(_plain(w).module, _plain(w).optimizer, nbytes=local_nbytes)
               for w in held]  # fmt: skip
    out: dict[str, Any] = {"model_data_bytes": {key: sum(f[key] for f in figures)
                                                for key in figures[0]}}  # fmt: skip
    hosted = [h.host_bytes() for w in held
              if isinstance(h := _plain(w).optimizer, HostStepped)]  # fmt: skip
    if hosted:
        out["model_data_bytes"]["optimizer_state"] -= sum(h["state"] for h in hosted)
        out["host_optimizer_bytes"] = {key: sum(h[key] for h in hosted) for key in hosted[0]}
    swaps = [getattr(m, HOST_SWAP) for w in held for m in _plain(w).module.modules()
             if hasattr(m, HOST_SWAP)]  # fmt: skip
    if swaps:
        out["host_swap_bytes"] = sum(h.bytes_out for h in swaps)
    return out


def _plain(weights: Any) -> StageWeights:
    assert isinstance(weights, StageWeights), type(weights)
    return weights
