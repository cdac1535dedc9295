"""Training a recipe as a pipeline: one process per stage (``tidal train --pipeline-stages P``).

:class:`PipelinePart` builds the recipe's model (tidal's GPT or a Hugging Face decoder: LLaMA,
GPT-2), cuts it into stages (balanced by profiled time
or evenly), keeps this rank's stages and trains them with
:class:`~tidal.runtime.distributed.PipelineRuntime` under the recipe's ``[pipeline]`` schedule.
The one :class:`~tidal.train.trainer.Trainer` runs it as it runs an engine, so a pipeline run
writes the same run folder: ``metrics.jsonl``, validation losses, ``summary.json`` and
checkpoints that resume.

[Note: pipeline runs]
- Each rank draws the same global batches (the sampler is deterministic); only the first and last
  stages read them. ``training.batch_size`` rows are split into ``pipeline.microbatches``;
  with ``training.grad_accum_steps = k`` a step is ``k`` batches, the reference engine's ``k``
  micro-batches, as one of ``k`` times the rows in ``k`` times the microbatches.
- Synchronous schedules run one flushed step at a time: the result equals one-process training
  (global-norm clipping included). Asynchronous ones run one program from a checkpoint to the
  next (``checkpoint.every_steps``; the whole run without checkpoints): a checkpoint is a flush
  point, so the progress line of such a run arrives in bursts, one per program.
- Checkpoints are the one format, the whole model under its own names ([Note: pipeline
  checkpoints] in engine_state.py): each rank writes its stages' tensors.
- Validation runs the stages forward only, microbatch by microbatch, over the same
  point-to-point protocol as training.
- No rank builds the whole model: it is built and split on the meta device, and each rank
  gives storage and the deterministic init's values to its own stages only, equal bit for bit
  to those of the model built whole ([Note: stages from the meta device] in
  tidal/pipeline/stage_init.py); the parameter count, FLOPs and the checkpoint layout come
  from the meta model. Your own ``nn.Sequential`` is split as given: on the meta device, each
  rank materialises its stages' children alone ([Note: sequential pipelines]).
- ``engine = 'chunk'``: each stage's parameters in chunks under ``memory.device_budget``, one
  store iteration per step, sharded over the stage's replicas with ``parallel.dp > 1`` ([Note:
  chunk stages] in tidal/parallel/chunk_stage.py); the store holds the budget, so the savers'
  plan does not run (``pipeline.memory = 'none'``).
- ``parallel.tp > 1``: each stage's blocks split over ``mesh["tp"]`` ([Note: tensor-parallel
  stages] in tidal/parallel/tensor_stage.py); the tp ranks of a replica take its rows (the rows
  follow the dp coordinate alone) and compute one stage together.
- bf16 and fp16 (fp32 masters, autocast compute, fp16's dynamic loss scale) under synchronous
  schedules; asynchronous ones are fp32 only, and fp16 needs CUDA as in the reference engine,
  except on chunk stages, whose parameters are fp16 chunks under the pipeline's own loss scale,
  as the chunk engine's are on any device ([Note: pipeline mixed precision] in
  tidal/runtime/precision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.config import ConfigError, require
from tidal.data import Batches, BatchSampler
from tidal.distributed import gather_ints
from tidal.distributed.device import resolve_device
from tidal.models import GPTConfig, build_stages, spec_for
from tidal.parallel.accumulation import split_rows
from tidal.parallel.chunk_stage import ChunkStageParams, require_one_version
from tidal.parallel.flat_state import model_layout
from tidal.parallel.lr import lr_schedule
from tidal.parallel.reference import TorchOptimizer, model_data_bytes
from tidal.parallel.stage_params import reshard_stage
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.sequential import (
    LossFn,
    check_sequential,
    is_meta,
    profile_sequential,
    sequential_parts,
    sequential_values,
)
from tidal.pipeline.split import PipelineStage, even_ranges, split_parts
from tidal.pipeline.stage_init import materialize_stages
from tidal.runtime.build import pipeline
from tidal.runtime.eval import evaluate_stages
from tidal.runtime.weights import StageWeights
from tidal.train.build import chunk_stage_config
from tidal.train.engine_state import PipelineStages
from tidal.train.job import JobConfig, check_nvme_dir
from tidal.train.pipeline_memory import (
    MemoryProbe,
    model_data_per_weight_byte,
    plan_pipeline_memory,
)
from tidal.train.plan_stage import (
    plan_chunks,
    plan_dims,
    plan_host_optimizer,
    plan_job,
    planned_figures,
    planned_pipeline,
    planned_stage,
)
from tidal.train.tiers import CHUNK_FIGURES, StepTiers

if TYPE_CHECKING:
    from tidal.planner import Plan

# the running counters of PipelineMemory.counters a step's record gives as that step's bytes
_MOVED = ("to_host_bytes", "lent_bytes")

__all__ = ["PipelinePart", "block_ranges", "check_pipeline_job"]


def check_pipeline_job(job: JobConfig, *, world_size: int, model: nn.Module | None = None) -> None:
    """What a pipeline run can refuse before any process starts (one line each). ``model``:
    your own, else the job's ``[model]``."""
    pipe, training = job.pipeline, job.training
    check_nvme_dir(job, plan=False)
    dims = job.parallel.resolve(world_size)
    split_rows(training.batch_size, index=0, parts=dims.dp,
               over=f"{dims.dp} data-parallel replicas (it is the global batch; each replica "
               f"trains batch_size / dp of its rows)",
               fix=", or a data-parallel size that divides it")  # fmt: skip
    m, rows = job.num_microbatches, training.batch_size // dims.dp
    require(
        m <= rows,
        "pipeline.microbatches",
        f"{m} microbatches need at least {m} rows per replica, each of the {dims.dp} gets "
        f"{rows} of training.batch_size; lower pipeline.microbatches or raise the batch",
    )
    _check_asynchronous_precision(job)
    chunked = job.engine == "chunk"  # [Note: chunk stages] in tidal/parallel/chunk_stage.py
    require(  # the chunk engine's loss scale is tidal's own, on any device, as the stages' is
        training.precision != "fp16" or resolve_device(training.device).type == "cuda" or chunked,
        "training.precision",
        "fp16 needs CUDA (loss scaling is a CUDA feature); use 'bf16' or 'fp32' on a CPU",
    )
    if chunked and pipe.asynchronous:  # [Note: PipeMare on chunk stages]
        require_one_version(pipe.schedule, stashes=pipe.stashes, correction=pipe.correction,
                            prediction=pipe.prediction,
                            reduce_per_step=job.sharding.reduce_per_step)  # fmt: skip
    require(
        not (job.parallel.fsdp2 and pipe.asynchronous),
        "parallel.fsdp2",
        f"{pipe.schedule} redirects saved weights to their versions, which FSDP2's gathered "
        "copies hide; use gpipe, 1f1b or interleaved, or parallel.fsdp2 = false",
    )
    num_stages = job.parallel.pp * pipe.virtual_stages
    if dims.tp > 1:
        _check_tensor_stages(job, dims.tp, own_model=model is not None)
    if model is not None:  # [Note: sequential pipelines] in tidal/pipeline/sequential.py
        check_sequential(model, num_stages=num_stages)
        return
    config = job.model.resolve_structured()  # tidal's GPT or a Hugging Face decoder
    num_layers = config.num_layers
    require(
        num_stages <= num_layers + 2,
        "parallel.pp",
        f"{num_stages} stages for {num_layers} blocks (plus the embedding and the head); use "
        f"at most {num_layers + 2}",
    )


def _check_asynchronous_precision(job: JobConfig) -> None:
    """An asynchronous schedule trains in fp32 only, a plan's as any other's."""
    pipe = job.pipeline
    require(
        job.training.precision == "fp32" or not pipe.asynchronous,
        "training.precision",
        f"{pipe.schedule} is asynchronous, which trains in fp32 only (autocast's copies of the "
        "weights escape the saved-tensor redirection); set training.precision = 'fp32' or use "
        "gpipe, 1f1b or interleaved",
    )


def _check_tensor_stages(job: JobConfig, tp: int, *, own_model: bool) -> None:
    """What tensor-parallel stages cannot run yet, one line each naming the fix ([Note:
    tensor-parallel stages] in tidal/parallel/tensor_stage.py)."""
    pipe, fix = job.pipeline, "or parallel.tp = 1"
    require(job.engine == "reference", "parallel.tp",
            f"tensor-parallel stages hold DTensors, which chunk stages do not take yet; set "
            f"engine = 'reference' {fix}")  # fmt: skip
    require(not pipe.asynchronous, "pipeline.schedule",
            f"{pipe.schedule} redirects saved weights by storage, which tensor-parallel stages' "
            f"DTensors hide; use gpipe, 1f1b or interleaved {fix}")  # fmt: skip
    require(not own_model, "parallel.tp",
            "your own nn.Sequential has no blocks tensor parallelism knows how to split; set "
            "parallel.tp = 1")  # fmt: skip
    config = job.model.resolve_structured()
    if isinstance(config, GPTConfig):
        counts = {"model.num_heads": config.num_heads, "model.d_ff": config.ffn_dim}
    else:
        require(config.model_type == "llama", "parallel.tp",
                f"tensor-parallel stages split tidal's GPT and LLaMA blocks, not "
                f"{config.model_type!r} ones; set parallel.tp = 1")  # fmt: skip
        counts = {"num_attention_heads": config.num_heads,
                  "num_key_value_heads": config.num_kv_heads,
                  "intermediate_size": int(config.pretrained().intermediate_size)}  # fmt: skip
    for what, count in counts.items():
        require(count % tp == 0, "parallel.tp",
                f"{tp} tensor-parallel ranks do not divide {what} ({count}); use a parallel.tp "
                f"that divides it")  # fmt: skip


def block_ranges(job: JobConfig) -> tuple[tuple[int, int], ...]:
    """The stages' blocks: balanced by the DP partitioner over profiled time, or even."""
    pipe, config = job.pipeline, job.model.resolve_structured()
    num_stages = job.parallel.pp * pipe.virtual_stages
    if pipe.partition == "even" or num_stages == 1:
        if num_stages > config.num_layers:
            raise ConfigError(
                "pipeline.partition",
                f"an even split gives every one of {num_stages} stages a block, but the model "
                f"has {config.num_layers}; use partition = 'balanced'",
            )
        return tuple(even_ranges(config.num_layers, num_stages))
    spec = spec_for(config)
    rows = _microbatch_rows(job)
    profiles = spec.profile(spec.build(device="meta"), micro_batch=rows, seq_len=config.seq_len)
    return balanced_ranges(job, profiles)


def sequential_ranges(
    job: JobConfig, model: nn.Sequential, sample: torch.Tensor
) -> tuple[tuple[int, int], ...]:
    """Your own model's stages: its children split evenly, or balanced by what each costs on
    one microbatch of ``sample`` ([Note: sequential pipelines] in tidal/pipeline/sequential.py)."""
    pipe = job.pipeline
    num_stages = job.parallel.pp * pipe.virtual_stages
    if pipe.partition == "even" or num_stages == 1:
        return tuple(even_ranges(len(model), num_stages))
    return balanced_ranges(job, profile_sequential(model, sample[: _microbatch_rows(job)]))


def _microbatch_rows(job: JobConfig) -> int:
    return max(1, job.training.batch_size // job.num_microbatches)


def _spec_probe(job: JobConfig, device: torch.device) -> MemoryProbe:
    """One microbatch of zeros for the job's model, each block's forward priced analytically."""
    config = job.model.resolve_structured()
    rows = _microbatch_rows(job)
    tokens = torch.zeros((rows, config.seq_len), dtype=torch.long, device=device)
    spec = spec_for(config)
    forward_s = [p.forward_s for p in spec.profile(spec.build(device="meta"), micro_batch=rows,
                                                   seq_len=config.seq_len)]  # fmt: skip
    # profiles: the embedding, the blocks, the head
    return MemoryProbe(tokens, tokens, lambda s, b: forward_s[b + 1] if b >= 0 else 0.0)


def _sequential_probe(job: JobConfig, model: nn.Sequential, inputs: torch.Tensor,
                      targets: torch.Tensor) -> MemoryProbe:  # fmt: skip
    """One microbatch of your data, each child's forward priced by its counted FLOPs."""
    rows = _microbatch_rows(job)
    forward_s = [p.forward_s for p in profile_sequential(model, inputs[:rows])]
    return MemoryProbe(inputs[:rows], targets[:rows], lambda s, b: forward_s[b] if b >= 0 else 0.0)


def balanced_ranges(job: JobConfig, profiles: list[LayerProfile]) -> tuple[tuple[int, int], ...]:
    """The DP partition of ``profiles``, each stage's memory priced under the run's schedule:
    the simulator's peak in-flight microbatches and live weight versions per stage (1F1B's first
    stage holds ``p`` microbatches, its last one), plus the delta buffer of PipeMare's
    correction or of weight prediction."""
    from tidal.pipeline.partition import PartitionInfeasible, partition
    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.simulate import simulate

    pipe = job.pipeline
    steps = 3 if pipe.asynchronous else 1  # enough for an asynchronous schedule's steady state
    schedule = make_schedule(
        pipe.schedule, stages=job.parallel.pp, microbatches=job.num_microbatches,
        virtual=pipe.virtual_stages, steps=steps, sync_steps=min(pipe.sync_steps, steps),
    )  # fmt: skip
    sim = simulate(schedule)
    delta_buffer = int(pipe.correction or pipe.prediction)
    extra_versions = [v - 1 + delta_buffer for v in sim.weight_versions]
    try:
        split = partition(
            profiles,
            job.parallel.pp * pipe.virtual_stages,
            memory_limit_bytes=pipe.stage_memory,
            in_flight=sim.peak_activations,
            state_bytes_per_param_byte=model_data_per_weight_byte(job),
            weight_versions=extra_versions,
        )
    except PartitionInfeasible as err:
        raise ConfigError("pipeline.stage_memory", str(err)) from None
    return tuple(split.block_ranges)


class PipelinePart:
    """The pipeline behind the Trainer's loop: this rank's stages of ``job``'s model under its
    ``[pipeline]`` schedule; see [Note: pipeline runs]. ``engine`` is the
    :class:`~tidal.runtime.distributed.PipelineRuntime`."""

    nan_advice = (
        "Lower optimizer.lr or, for asynchronous schedules, use pipemare with "
        "pipeline.correction = true or a longer pipeline.lr_warmup_steps"
    )

    def __init__(
        self,
        job: JobConfig,
        *,
        device: torch.device,
        world_size: int,
        model: nn.Module | None = None,
        loss_fn: LossFn | None = None,
        sample: tuple[torch.Tensor, torch.Tensor] | None = None,
        torch_optimizer: TorchOptimizer | None = None,
        plan: Plan | None = None,
    ) -> None:
        """``model``: your own (an ``nn.Sequential``, with ``loss_fn`` and a ``sample`` batch,
        inputs and targets, to profile it on), else the job's ``[model]``. ``torch_optimizer``:
        yours, on plain stages ([Note: your optimizer] in tidal/train/user_optim.py). ``plan``:
        the model laid out as ``tidal plan`` said, the one stage of its ``dp x tp`` mesh
        ([Note: plan stages] in tidal/runtime/plan_weights.py); with your model, ``sample``'s
        inputs are this rank's rows it is traced on."""
        if plan is not None:  # the plan's pipeline ([Note: planned pipeline stages])
            job = plan_job(job, plan)
            _check_asynchronous_precision(job)
        self.job = job
        training, pipe = job.training, job.pipeline
        self.device = device
        if plan is None:
            check_pipeline_job(job, world_size=world_size, model=model)
            self.dims = job.parallel.resolve(world_size)
        else:
            self.dims = plan_dims(plan, world_size)
        self.mesh = self.dims.build_mesh(device.type)  # [Note: one mesh] in tidal/parallel/dims.py
        pp_rank, pp_size = self.mesh.get_local_rank("pp"), self.dims.pp
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.flops_per_token: float | None
        self.ranges: tuple[tuple[int, int], ...]
        if plan is not None and plan.pipeline is not None:
            assert model is None, "check_plan_settings: a pipelined plan is for the job's model"
            self.ranges = plan.pipeline.block_ranges
            self.stage_ids = list(range(pp_rank, len(self.ranges), pp_size))
            piped = planned_pipeline(job, plan, mine=self.stage_ids, device=device,
                                     mesh=self.mesh, world_size=world_size)  # fmt: skip
            stages, layout, probe = piped.stages, piped.layout, None
            self.num_params, self.flops_per_token = piped.num_params, piped.flops_per_token
        elif plan is not None:
            made = planned_stage(job, plan, device=device, mesh=self.mesh, world_size=world_size,
                                 model=model, loss_fn=loss_fn,
                                 inputs=None if sample is None else (sample[0].to(device),))  # fmt: skip
            stages, layout, probe = [made.stage], made.layout, None
            self.num_params = made.num_params
            self.flops_per_token = made.flops_per_token
            self.ranges = (made.block_range,)
            self.stage_ids = [0]
        else:
            stages, layout, probe = self._stages(model, loss_fn, sample, pp_rank=pp_rank)
        self.memory = plan_pipeline_memory(job, stages, mine=self.stage_ids, rank=pp_rank,
                                           world_size=pp_size, device=device,
                                           probe=probe, planned=plan)  # fmt: skip
        self.lr = lr_schedule(job.optimizer, training)
        self.engine = pipeline(stages, config=pipe, optimizer=job.optimizer, training=training,
                               block_ranges=self.ranges, num_microbatches=job.num_microbatches,
                               device=device, mesh=self.mesh, lending=self.memory.lending,
                               chunks=chunk_stage_config(job, device) if plan is None
                               else plan_chunks(plan, job, pp_rank=pp_rank, device=device),
                               fsdp2=job.parallel.fsdp2, fsdp2_offload=job.parallel.fsdp2_offload,
                               torch_optimizer=torch_optimizer,
                               planned=plan is not None,
                               host_optimizer=None if plan is None
                               else plan_host_optimizer(plan, job, pp_rank=pp_rank))  # fmt: skip
        self.plan = plan
        # your scheduler, one per stage, stepped after each of its updates
        make_scheduler = None if torch_optimizer is None else torch_optimizer.schedule
        self.schedulers = [] if make_scheduler is None else [
            make_scheduler(_plain(w).optimizer) for w in self.engine.weights.values()]  # fmt: skip
        self.own_rates = torch_optimizer is not None
        self.memory.bind(self.engine.weights)
        self._moved_before: dict[int, dict[str, int]] = {}  # each rank's counters a step ago
        self._tiers = StepTiers()  # this rank's chunk stages'
        del stages
        split = {"schedule": pipe.schedule, "block_ranges": [list(r) for r in self.ranges]}
        self.checkpointable = PipelineStages(self.engine, layout, split,
                                             schedulers=self.schedulers)  # fmt: skip

    def _stages(self, model: nn.Module | None, loss_fn: LossFn | None,
                sample: tuple[torch.Tensor, torch.Tensor] | None, *,
                pp_rank: int) -> tuple[list[PipelineStage], dict[str, Any], MemoryProbe | None]:  # fmt: skip
        """All the model's stages, this rank's with storage; the checkpoint layout of the whole
        model; what the savers' plan measures the stages on (with a device budget)."""
        job, device, training = self.job, self.device, self.job.training
        budgeted = job.memory.device_budget is not None and job.engine == "reference"
        probe = None
        # [Note: stages from the meta device]: the model stays on the meta device; only this
        # rank's stages get storage
        if model is None:
            spec = spec_for(job.model.resolve_structured())
            model = spec.build(device="meta")
            self.num_params = spec.num_params(model)
            self.flops_per_token = spec.flops_per_token(model)
            self.ranges = block_ranges(job)
            self.stage_ids = list(range(pp_rank, len(self.ranges), self.dims.pp))
            stages = build_stages(spec, model, self.ranges, mine=self.stage_ids, device=device,
                                  seed=training.seed)  # fmt: skip
            probe = _spec_probe(job, device) if budgeted else None
        else:
            assert loss_fn is not None and sample is not None
            model = model if is_meta(model) else model.to(device)
            self.num_params = sum(p.numel() for p in model.parameters())
            self.flops_per_token = None  # a model tidal did not write: FLOPs unknown
            inputs, targets = (t.to(device) for t in sample)
            # [Note: sequential pipelines]: another module is one block on one stage
            self.ranges = (sequential_ranges(job, model, inputs)
                           if isinstance(model, nn.Sequential) else ((0, 1),))  # fmt: skip
            self.stage_ids = list(range(pp_rank, len(self.ranges), self.dims.pp))
            stages = split_parts(model, sequential_parts(model, loss_fn), self.ranges)
            if is_meta(model):  # [Note: sequential pipelines]
                values = sequential_values(model, training.seed)
                materialize_stages(stages, self.stage_ids, values, device)
            one = model if isinstance(model, nn.Sequential) else nn.Sequential(model)
            probe = _sequential_probe(job, one, inputs, targets) if budgeted else None
        layout = model_layout(model, {n: t.shape for n, t in model.state_dict().items()})
        return stages, layout, probe

    @property
    def global_step(self) -> int:
        return self.engine.step

    def next_steps(self, step: int) -> int:
        """Steps the next :meth:`train` runs: 1 when synchronous; an asynchronous program runs
        to the next checkpoint or validation (a flush point)."""
        training, ckpt = self.job.training, self.job.checkpoint
        stop = training.steps
        if not self.job.pipeline.asynchronous:
            return 1
        for every in (ckpt.every_steps, training.val_every):
            if every:
                stop = min(stop, (step // every + 1) * every)
        return stop - step

    def train(self, num_steps: int, sampler: Batches) -> list[float]:
        """``num_steps`` steps; every rank gets each step's loss. Step ``s`` (from 0) trains on
        batch ``s`` with the reference engine's rate for it."""

        # grad_accum_steps = k: step s is batches k*s .. k*s + k - 1 as one batch of k times
        # the rows (k times the microbatches), the batches the reference engine sums for it
        k = self.job.training.grad_accum_steps
        draw: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
        if isinstance(sampler, BatchSampler):
            draw = sampler.batch
        else:  # your data: every rank draws each batch, so all keep the same position
            first = self.engine.step * k
            drawn = {first + i: sampler.next_batch() for i in range(num_steps * k)}
            draw = drawn.__getitem__

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            # the step's k global batches as one; this replica's rows of it
            drawn = [draw(step * k + i) for i in range(k)]
            inputs, targets = (torch.cat(parts) for parts in zip(*drawn, strict=True))
            dp, at = self.dims.dp, self.dp_rank
            inputs, targets = inputs.tensor_split(dp)[at], targets.tensor_split(dp)[at]
            return inputs.to(self.device), targets.to(self.device)

        if self.schedulers:  # stepped after every update: one synchronous step at a time
            losses = []
            for _ in range(num_steps):
                losses += self.engine.train(1, batch, self.lr.lr_at)
                for scheduler in self.schedulers:
                    scheduler.step()
        else:
            losses = self.engine.train(num_steps, batch, self.lr.lr_at)
        if isinstance(sampler, BatchSampler):  # its saved position: an engine resumes from it
            sampler.next_index = self.engine.step * k
        return losses

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches``, through the stages forward only."""
        modules = dict(zip(self.stage_ids, self.engine.modules.values(), strict=True))
        loss = evaluate_stages(
            modules,
            num_ranks=self.engine.num_ranks,
            batches=[(x.to(self.device), y.to(self.device)) for x, y in batches],
            device=self.device,
            group=self.mesh.get_group("pp"),  # every replica evaluates the same batches
        )
        for module in modules.values():  # [Note: FSDP2 stages]: no backward resharded them
            reshard_stage(module)
        return loss

    def step_figures(self, step: int) -> dict[str, Any]:
        delays = [tau for (s, _), tau in self.engine.delays.items() if s in self.stage_ids]
        # The next step's rate, as the reference engine logs it.
        figures: dict[str, Any] = {
            "grad_norm": self.engine.last_grad_norm,
            "lr": self._lr_now(step),
            "max_delay": max(delays, default=0),
            "pipeline_ranks": self._rank_figures(),
        }
        chunked = [
            w.stats() for w in self.engine.weights.values() if isinstance(w, ChunkStageParams)
        ]
        tiers = self._tiers(chunked)  # [Note: tier figures] in tiers.py
        if tiers:
            figures["tiers"] = tiers
        return figures

    def first_optimizer(self) -> torch.optim.Optimizer:
        """This rank's first stage's optimizer: yours, where you gave one."""
        return _plain(next(iter(self.engine.weights.values()))).optimizer

    def _lr_now(self, step: int) -> float:
        """The rate of step ``step``: ``[optimizer]``'s schedule, else your optimizer's own
        (its first group's, on this rank's first stage)."""
        if not self.own_rates:
            return self.lr.lr_at(step)
        return float(self.first_optimizer().param_groups[0]["lr"])

    def _rank_figures(self) -> list[dict[str, Any]]:
        """Every rank's stages and memory figures (a collective): the peak so far, and the bytes
        its savers swapped to the host and lent to peers this step ([Note: pipeline memory])."""
        counters = self.memory.counters()
        gathered = {key: gather_ints(value) for key, value in counters.items()}
        num_ranks, num_stages = len(gathered["to_host_bytes"]), len(self.ranges)
        out = []
        for r in range(num_ranks):
            pp_rank = self.dims.coords(r)[0]
            figures: dict[str, Any] = {key: gathered[key][r] for key in counters}
            before = self._moved_before.get(r, {})
            self._moved_before[r] = {key: figures[key] for key in _MOVED}
            figures.update({key: figures[key] - before.get(key, 0) for key in _MOVED})
            stages = list(range(pp_rank, num_stages, self.dims.pp))
            out.append({"rank": r, "stages": stages, **figures})
        return out

    def summary_figures(self) -> dict[str, Any]:
        pipe, parallel = self.job.pipeline, self.job.parallel
        offload = parallel.fsdp2_offload
        max_delays: dict[int, int] = {}
        for (s, _), tau in self.engine.delays.items():
            max_delays[s] = max(max_delays.get(s, 0), tau)
        summary: dict[str, Any] = {
            "pipeline": {
                "schedule": pipe.schedule,
                "stages": self.job.parallel.pp,
                "microbatches": self.job.num_microbatches,
                "block_ranges": [list(r) for r in self.ranges],
                "max_delay_per_stage": {str(s): tau for s, tau in max_delays.items()},
                "memory": self.memory.figures(self.mesh.get_local_rank("pp")),
                "mesh": str(self.dims),
                "chunk_stages": self._chunk_figures(),
            },
            "engine": f"pipeline {pipe.schedule} x{self.job.parallel.pp}"
            + (" chunk stages" if self.job.engine == "chunk" else "")
            + (" fsdp2 stages" if parallel.fsdp2 and (self.dims.dp > 1 or offload) else "")
            + (" offloaded" if offload else "")
            + (f" tensor-parallel stages (tp{self.dims.tp})" if self.dims.tp > 1 else ""),
        }
        held = list(self.engine.weights.values())
        chunked = [w for w in held if isinstance(w, ChunkStageParams)]
        if self.plan is not None:  # the plan's name, as the plan engine gave it
            summary["engine"], summary["mesh"] = "plan", self.plan.mesh_name
        if chunked:
            if len(chunked) == 1:  # a rank of one chunk stage gives its figures as the engine did
                stats = chunked[0].stats()
                summary |= {key: stats[key] for key in CHUNK_FIGURES if key in stats}
                if self.dims.pp == 1 and self.plan is None:  # the model in chunks, nothing else:
                    summary["engine"] = stats["engine"]  # say it as the config does
            figures = [w.engine.model_data_bytes() for w in chunked]  # this rank's together
            summary["model_data_bytes"] = {key: sum(f[key] for f in figures) for key in figures[0]}
        elif self.plan is not None:
            summary |= planned_figures(held)
        elif self.dims.pp == 1 and all(type(w) is StageWeights for w in held):
            # the whole model in plain replicas: the reference engine's figures and name
            (plain,) = held
            assert isinstance(plain, StageWeights)
            summary["engine"] = "reference"
            summary["model_data_bytes"] = model_data_bytes(plain.module, plain.optimizer)
        return summary

    def _chunk_figures(self) -> dict[str, dict[str, Any]]:
        """This rank's chunk stages' store figures (none with plain stages), by stage (keys
        that are strings, as summary.json has them)."""
        keep = ("evictions", "prefetches", "peak_device_bytes", "device_budget",
                "min_device_bytes", "bytes_to_device", "bytes_to_host", "num_chunks",
                "peak_host_bytes", "host_budget", "bytes_to_nvme", "bytes_from_nvme",
                "peak_nvme_bytes", "bytes_all_gathered", "bytes_reduce_scattered",
                "non_model_over_budget_bytes")  # fmt: skip
        return {str(s): {k: v for k, v in w.stats().items() if k in keep}
                for s, w in self.engine.weights.items() if isinstance(w, ChunkStageParams)}  # fmt: skip


def _plain(weights: Any) -> StageWeights:
    """A stage's weights that your optimizer steps: plain ones ([Note: your optimizer])."""
    assert isinstance(weights, StageWeights), type(weights)
    return weights
