"""Training a recipe as a pipeline: one process per stage (``tidal train --pipeline-stages P``).

:class:`PipelineTrainer` builds the recipe's GPT, cuts it into stages (balanced by profiled time
or evenly), keeps this rank's stages and trains them with
:class:`~tidal.pipeline.runtime.PipelineRuntime` under the recipe's ``[pipeline]`` schedule. It
writes the same run folder as :class:`~tidal.train.trainer.Trainer`: ``metrics.jsonl`` (loss,
tokens/s, TFLOP/s, memory), validation losses, ``summary.json`` and checkpoints that resume.

[Note: pipeline runs]
- Each rank draws the same global batches (the sampler is deterministic); only the first and last
  stages read them. ``training.batch_size`` rows are split into ``pipeline.microbatches``.
- Synchronous schedules run one flushed step at a time: the result equals one-process training
  (global-norm clipping included). Asynchronous ones run one program from a checkpoint to the
  next (``checkpoint.every_steps``; the whole run without checkpoints): a checkpoint is a flush
  point, so the progress line of such a run arrives in bursts, one per program.
- Checkpoints are ``checkpoints/step_N/stage-S.pt`` (each rank its stages) plus rank 0's
  ``train_state.pt``, made visible all at once by rank 0's ``meta.json`` after a barrier.
- Validation runs the stages forward only, microbatch by microbatch, over the same
  point-to-point protocol as training.
- Every rank builds the whole model (with the deterministic init) and keeps its stages: simple
  and equal to the reference bit for bit, but a model that does not fit one host's memory
  would need a meta-device build per stage (not done yet).
- fp32 only: under autocast a stage saves dtype copies of its weights that the saved-tensor
  redirection of asynchronous schedules cannot reach ([Note: saved-tensor redirection]).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.config import ConfigError, require, to_dict
from tidal.distributed import barrier, init_from_env
from tidal.distributed import rank as current_rank
from tidal.distributed import world_size as current_world_size
from tidal.distributed.device import (
    device_description,
    memory_bytes,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    resolve_device,
)
from tidal.models import spec_for
from tidal.parallel.reference import build_optimizer, lr_schedule
from tidal.pipeline.eval import evaluate_stages
from tidal.pipeline.pipemare import AsyncConfig, StageWeights, WeightMode
from tidal.pipeline.runtime import PipelineRuntime, RuntimeConfig
from tidal.pipeline.split import even_ranges, tied_parameters
from tidal.train.checkpoint import (
    _prune,
    checkpoint_root,
    swap_into_place,
    write_json_durable,
)
from tidal.train.job import JobConfig, load_job
from tidal.train.metrics import MetricsFile, Throughput, git_commit, write_json_atomic
from tidal.train.trainer import Callback, LogCallback, TrainerBase, build_samplers

__all__ = ["PipelineTrainer", "check_pipeline_job"]

_WEIGHTS = {"pipedream": WeightMode.STASH, "2bw": WeightMode.TWO_VERSIONS}


def check_pipeline_job(job: JobConfig, *, world_size: int) -> None:
    """What a pipeline run can refuse before any process starts (one line each)."""
    pipe, training = job.pipeline, job.training
    require(
        world_size == pipe.stages,
        "pipeline.stages",
        f"a pipeline of {pipe.stages} stages runs one process per stage, got {world_size} "
        f"processes; use --nproc {pipe.stages} (tidal train --pipeline-stages sets both)",
    )
    m = pipe.num_microbatches
    require(
        m <= training.batch_size,
        "pipeline.microbatches",
        f"{m} microbatches need at least {m} rows, training.batch_size is "
        f"{training.batch_size}; lower pipeline.microbatches or raise the batch",
    )
    require(
        training.precision == "fp32",
        "training.precision",
        "pipeline runs are fp32 for now (autocast copies defeat the saved-tensor redirection "
        "of asynchronous schedules); set training.precision = 'fp32'",
    )
    require(
        training.grad_accum_steps == 1,
        "training.grad_accum_steps",
        "a pipeline accumulates its microbatches; raise pipeline.microbatches (and "
        "training.batch_size) instead",
    )
    num_stages = pipe.stages * pipe.virtual_stages
    num_layers = job.model.resolve().num_layers
    require(
        num_stages <= num_layers + 2,
        "pipeline.stages",
        f"{num_stages} stages for {num_layers} blocks (plus the embedding and the head); use "
        f"at most {num_layers + 2}",
    )
    require(
        not (pipe.asynchronous and job.model.resolve().tie_embeddings and pipe.stages > 1),
        "model.tie_embeddings",
        f"{pipe.schedule} is asynchronous: the first and last stages' copies of the tied "
        "embedding would update at different times; set model.tie_embeddings=false",
    )


def block_ranges(job: JobConfig) -> tuple[tuple[int, int], ...]:
    """The stages' blocks: balanced by the DP partitioner over profiled time, or even.

    The balanced split prices each stage's memory under the run's schedule: the simulator's
    peak in-flight microbatches and live weight versions per stage (1F1B's first stage holds
    ``p`` microbatches, its last one), plus the delta buffer of PipeMare's correction or of
    weight prediction.
    """
    pipe, config = job.pipeline, job.model.resolve()
    num_stages = pipe.stages * pipe.virtual_stages
    if pipe.partition == "even" or num_stages == 1:
        if num_stages > config.num_layers:
            raise ConfigError(
                "pipeline.partition",
                f"an even split gives every one of {num_stages} stages a block, but the model "
                f"has {config.num_layers}; use partition = 'balanced'",
            )
        return tuple(even_ranges(config.num_layers, num_stages))
    from tidal.pipeline.partition import PartitionInfeasible, partition
    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.simulate import simulate

    m = pipe.num_microbatches
    steps = 3 if pipe.asynchronous else 1  # enough for an asynchronous schedule's steady state
    schedule = make_schedule(
        pipe.schedule, stages=pipe.stages, microbatches=m, virtual=pipe.virtual_stages,
        steps=steps, sync_steps=min(pipe.sync_steps, steps),
    )  # fmt: skip
    sim = simulate(schedule)
    delta_buffer = int(pipe.correction or pipe.prediction)
    extra_versions = [v - 1 + delta_buffer for v in sim.weight_versions]
    state_per_weight_byte = 4.0 if job.optimizer.name in ("adamw", "adam") else 3.0
    spec = spec_for(config)
    rows = max(1, job.training.batch_size // m)
    profiles = spec.profile(spec.build(device="meta"), micro_batch=rows, seq_len=config.seq_len)
    try:
        split = partition(
            profiles,
            num_stages,
            memory_limit_bytes=pipe.stage_memory,
            in_flight=sim.peak_activations,
            state_bytes_per_param_byte=state_per_weight_byte,
            weight_versions=extra_versions,
        )
    except PartitionInfeasible as err:
        raise ConfigError("pipeline.stage_memory", str(err)) from None
    return tuple(split.block_ranges)


class PipelineTrainer(TrainerBase):
    """Train ``job`` as a pipeline of ``job.pipeline.stages`` processes; see [Note: pipeline runs]."""

    plan = None  # the progress line asks

    def __init__(self, job: JobConfig | str | dict[str, Any], overrides: Sequence[str] = ()):
        self.job = load_job(job, overrides)
        training, pipe = self.job.training, self.job.pipeline
        self.run_dir = self.job.run_path
        self.model_config = self.job.model.resolve()
        self.device = resolve_device(training.device)
        self.distributed = init_from_env(device=self.device)
        self.rank, self.world_size = current_rank(), current_world_size()
        check_pipeline_job(self.job, world_size=self.world_size)
        torch.manual_seed(training.seed)
        self.spec = spec_for(self.model_config)
        model = self.spec.build(device=self.device, seed=training.seed)
        self.num_params = self.spec.num_params(model)
        self.flops_per_token = self.spec.flops_per_token(model)
        self.ranges = block_ranges(self.job)
        config = RuntimeConfig(
            schedule=pipe.schedule,
            microbatches=pipe.num_microbatches,
            virtual_stages=pipe.virtual_stages,
            sync_steps=pipe.sync_steps,
            max_grad_norm=training.grad_clip_norm or None,
            partition=self.ranges,
        )
        stages = self.spec.split(model, self.ranges)
        tied = tied_parameters(stages)
        del model
        self.stage_ids = list(range(self.rank, len(stages), self.world_size))
        mine = [stages[s] for s in self.stage_ids]
        del stages
        self.lr = lr_schedule(self.job.optimizer, training)
        self.weights = [self._stage_weights(stage) for stage in mine]
        self.runtime = PipelineRuntime(
            config, stages=mine, weights=self.weights, tied=tied, device=self.device
        )
        self.train_batches, self._val_sampler = build_samplers(self.job)
        self.tokens_per_step = training.batch_size * self.model_config.seq_len
        peak = peak_flops(self.device, training.precision, self.job.metrics.peak_tflops)
        self.peak = peak
        self.metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        self.tokens_seen = 0
        self.train_time_s = 0.0
        self.last_val_loss: float | None = None

    def _stage_weights(self, stage: torch.nn.Module) -> StageWeights:
        pipe = self.job.pipeline
        optimizer = build_optimizer(stage, self.job.optimizer, self.lr.lr_at(1))
        config = AsyncConfig(
            weights=_WEIGHTS.get(pipe.schedule, WeightMode.CURRENT),
            lr_rescheduling=pipe.reschedules_lr,
            lr_warmup_steps=pipe.lr_warmup_steps,
            correction=pipe.correction,
            correction_decay=pipe.correction_decay,
            prediction=pipe.prediction,
            microbatches_per_update=pipe.num_microbatches if pipe.prediction else 0,
        )
        return StageWeights(stage, optimizer, config)

    # -- the run -------------------------------------------------------------------------------

    def fit(
        self,
        *,
        resume: bool = False,
        overwrite: bool = False,
        callbacks: Sequence[Callback] | None = None,
    ) -> dict[str, Any]:
        """Train up to ``training.steps``; every rank returns the summary (rank 0 writes it)."""
        training = self.job.training
        if self.rank != 0:
            callbacks = []
        elif callbacks is None:
            callbacks = [LogCallback(log_every=training.log_every, total_steps=training.steps)]
        start_wall = time.perf_counter()
        start_step = self._prepare_run_dir(resume=resume, overwrite=overwrite)
        for cb in callbacks:
            cb.on_start(self, start_step=start_step)  # type: ignore[arg-type]
        reset_peak_memory(self.device)
        timed = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        last: dict[str, Any] | None = None
        step = start_step
        while step < training.steps:
            count = self._program_steps(step)
            started = time.perf_counter()
            losses = self.runtime.train(count, self._batch, self._lr)
            elapsed_s = time.perf_counter() - started
            for loss in losses:
                step += 1
                last = self._record_step(step, loss, elapsed_s / count, timed, callbacks)
            self._after_step(step, callbacks)
        summary = self._summary(last, timed, start_step, time.perf_counter() - start_wall)
        if self.rank == 0:
            write_json_atomic(self.run_dir / "summary.json", summary)
        for cb in callbacks:
            cb.on_end(summary)
        return summary

    def _program_steps(self, step: int) -> int:
        """Steps the next :meth:`PipelineRuntime.train` call runs: 1 when synchronous."""
        training, ckpt = self.job.training, self.job.checkpoint
        stop = training.steps
        if not self.job.pipeline.asynchronous:
            return 1
        for every in (ckpt.every_steps, training.val_every):
            if every:
                stop = min(stop, (step // every + 1) * every)
        return stop - step

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.train_batches.batch(step)
        return inputs.to(self.device), targets.to(self.device)

    def _lr(self, step: int) -> float:
        """Step ``step`` (from 0) uses the reference engine's rate for it."""
        return self.lr.lr_at(step)

    def _record_step(
        self,
        step: int,
        loss: float,
        step_s: float,
        timed: Throughput,
        callbacks: Sequence[Callback],
    ) -> dict[str, Any]:
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {step}; the last checkpoint is intact. Lower "
                f"optimizer.lr or, for asynchronous schedules, use pipemare with "
                f"pipeline.correction = true or a longer pipeline.lr_warmup_steps"
            )
        self.tokens_seen += self.tokens_per_step
        self.train_time_s += step_s
        window = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        window.add(self.tokens_per_step, step_s)
        timed.add(self.tokens_per_step, step_s)
        delays = [tau for (s, _), tau in self.runtime.delays.items() if s in self.stage_ids]
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "grad_norm": None,
            "lr": self.lr.lr_at(step),  # the next step's, as the reference engine logs it
            "tokens": self.tokens_seen,
            "step_s": step_s,
            **window.figures(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "max_delay": max(delays, default=0),
        }
        if self.rank == 0:
            self.metrics.append(record)
        for cb in callbacks:
            cb.on_step(record)
        return record

    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches, through the stages forward only."""
        batches = self._val_sampler.fixed_batches(self.job.training.val_batches)
        modules = dict(zip(self.stage_ids, self.runtime.modules.values(), strict=True))
        return evaluate_stages(
            modules,
            num_ranks=self.world_size,
            batches=[(x.to(self.device), y.to(self.device)) for x, y in batches],
            device=self.device,
        )

    @property
    def _peak_tflops(self) -> float | None:
        return self.peak.tflops * self.world_size if self.peak else None

    # -- checkpoints ---------------------------------------------------------------------------

    def load_checkpoint(self, path: Any) -> int:
        """Restore this rank's stages and the run's counters; returns the checkpoint's step."""
        step = self.runtime.load(path)
        state = torch.load(Path(path) / "train_state.pt", weights_only=False)
        if state["model_config"] != to_dict(self.model_config):
            raise ConfigError(
                "model",
                f"the checkpoint in {path} was trained with other model settings; resume with "
                "the run's original [model] section",
            )
        self.tokens_seen = int(state["tokens_seen"])
        self.train_time_s = float(state["train_time_s"])
        self.last_val_loss = state["last_val_loss"]
        return step

    def save_checkpoint(self) -> Path:
        """Every rank writes its stages into one temporary folder; rank 0 completes it."""
        step = self.runtime.step
        root = checkpoint_root(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        tag = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        tmp = root / f".tmp-step_{step:08d}-{tag}"
        final = root / f"step_{step:08d}"
        if self.rank == 0:
            tmp.mkdir(exist_ok=True)
        barrier()
        self.runtime.save(tmp, step)
        if self.rank == 0:
            train_state = {
                "tokens_seen": self.tokens_seen,
                "train_time_s": self.train_time_s,
                "last_val_loss": self.last_val_loss,
                "model_config": to_dict(self.model_config),
            }
            torch.save(train_state, tmp / "train_state.pt")
        barrier()
        if self.rank == 0:
            write_json_durable(tmp / "meta.json", {"format_version": 1, "step": step})
            swap_into_place(tmp, final, root)
            _prune(self.run_dir, self.job.checkpoint.keep)
        barrier()
        return final

    def _summary(
        self, last: dict[str, Any] | None, timed: Throughput, start_step: int, wall_s: float
    ) -> dict[str, Any]:
        figures = timed.figures()
        pipe = self.job.pipeline
        return {
            "name": self.job.name,
            "preset": self.job.model.preset,
            "num_params": self.num_params,
            "steps": self.runtime.step,
            "steps_this_run": self.runtime.step - start_step,
            "resumed_from_step": start_step or None,
            "tokens": self.tokens_seen,
            "final_loss": last["loss"] if last else None,
            "val_loss": self.last_val_loss,
            "tokens_per_s": figures["tokens_per_s"],
            "model_tflops_per_s": figures["tflops"],
            "mfu": figures["mfu"],
            "peak_tflops": self._peak_tflops,
            "peak_tflops_source": self.peak.source if self.peak else None,
            "flops_per_token": self.flops_per_token,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "pipeline": {
                "schedule": pipe.schedule,
                "stages": pipe.stages,
                "microbatches": pipe.num_microbatches,
                "block_ranges": [list(r) for r in self.ranges],
                "max_delay_per_stage": self._max_delays(),
            },
            "engine": f"pipeline {pipe.schedule} x{pipe.stages}",
            "wall_s": wall_s,
            "train_s": self.train_time_s,
            "device": device_description(self.device),
            "world_size": self.world_size,
            "precision": self.job.training.precision,
            "torch_version": torch.__version__,
            "git_commit": git_commit(),
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }

    def _max_delays(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (s, _), tau in self.runtime.delays.items():
            out[s] = max(out.get(s, 0), tau)
        return out
