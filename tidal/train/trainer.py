"""The training loop: a JobConfig in, a trained model, metrics, checkpoints and a summary out.

The Trainer composes the parts (model, token source, and what trains: the stages of the one
train step, behind the interface in training_part.py) and owns only the loop, the run folder,
checkpoints (checkpoint.py), resumption and the summary; callbacks present them.

[Note: exact resume]
A resumed run must continue bit for bit where the saved one stopped. Everything that decides the
next step is therefore either a pure function of a saved counter or saved itself: the batches are
a function of (seed, batch index) and the index is saved; the learning rate is a function of the
optimizer step; AdamW's moments, the model and torch's RNG states (dropout) are saved. Records
past the resumed step are dropped from metrics.jsonl, because the resumed run writes them again.

[Note: global batch]
``training.batch_size`` is the number of sequences per micro-batch over ALL ranks, not per rank.
Every rank draws the same global batch from the same-seeded sampler and trains on its contiguous
slice of rows ``[r * B / W, (r + 1) * B / W)``; validation batches are split the same way. Each
rank's loss is the mean over an equal-size slice, so the mean over ranks (what is reported) is
the loss of the global batch, and the engine's gradient average is the global batch's gradient.
The batches, and so the losses, do not depend on the world size: a run resumed on another number
of ranks continues with the batches it would have seen. Hence B must divide by W. (Dropout is
the exception: each rank draws its masks for its own rows from the shared seed, so with dropout
on, runs on different world sizes agree in distribution, not bit for bit.) A run with a plan
splits the rows over the plan's data-parallel ranks only, the ranks of a tensor-parallel group
sharing theirs, so B must divide by the plan's ``dp`` ([Note: plan runs] in plan_layout.py).
Only rank 0 writes config.json, metrics.jsonl and summary.json and calls the callbacks; every
rank runs the loop, the collectives and the checkpoint calls.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch
from torch import nn

from tidal.config import ConfigError, to_dict
from tidal.data import Batch, BatchSampler, DataBatches
from tidal.distributed import barrier, init_from_env, join_alone
from tidal.distributed import rank as current_rank
from tidal.distributed import world_size as current_world_size
from tidal.distributed.device import (
    memory_bytes,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    resolve_device,
)
from tidal.distributed.faults import maybe_inject
from tidal.models import spec_for
from tidal.train.build import build_samplers, check_plan_settings
from tidal.train.callbacks import Callback, LogCallback, ProgressLine
from tidal.train.checkpoint import (
    IDENTITY,
    list_checkpoints,
    load_checkpoint,
)
from tidal.train.checkpoint import save_checkpoint as write_checkpoint
from tidal.train.integrity import choose_checkpoint
from tidal.train.interrupts import Interrupted, StopFlag
from tidal.train.job import JobConfig
from tidal.train.losses import default_loss
from tidal.train.metrics import (
    MetricsFile,
    Throughput,
    write_json_atomic,
)
from tidal.train.plan_stage import plan_host_optimizer
from tidal.train.resume_changes import resume_changes
from tidal.train.run_dir import agree, check_one_run_dir, check_run_dir
from tidal.train.same_data import check_same_data
from tidal.train.summary import all_ranks_peak, run_summary
from tidal.train.tensorboard import TensorBoardWriter, check_tensorboard
from tidal.train.training_part import (
    LOSSES,
    TrainingPart,
    custom_run,
    user_model_and_job,
)
from tidal.train.user_optim import (
    OptimizerArg,
    describe,
    optimizer_notes,
    own_optimizer,
    runs_on,
)

if TYPE_CHECKING:
    from tidal.planner import Plan

__all__ = ["Callback", "LogCallback", "ProgressLine", "Trainer"]

logger = logging.getLogger(__name__)

# The token sampler of a job's [data], or a user's own batches (train_data=).
Sampler = BatchSampler | DataBatches


class Trainer:
    """Train the model of ``job`` (a GPT preset, or a Hugging Face config) on its token source
    on stages held as its engine, ``[parallel]`` and ``[pipeline]`` sections say.

    Under torchrun every rank builds its own Trainer; see [Note: global batch]. ``plan``: a
    plan of ``tidal plan`` (or the path of its JSON file) to train with, on its ``dp x tp``
    ranks ([Note: plan runs] in tidal/parallel/plan_layout.py), the model it lays out the one
    stage of the train step ([Note: plan stages] in tidal/runtime/plan_weights.py); for your
    own model, one of ``tidal.planner.plan_for(model, inputs, devices=...)``. Every run trains
    on stages ([Note: pipeline runs] in pipeline_part.py, [Note: one train step] in job.py). The loop, the run folder, checkpoints and the summary are the same for
    both; what trains is the ``part`` (training_part.py). ``optimizer``, ``optimizer_kwargs``,
    ``lr_scheduler``: your own torch optimizer and schedule in place of ``[optimizer]``'s
    ([Note: your optimizer] in user_optim.py).
    """

    def __init__(
        self,
        job: JobConfig | str | dict[str, Any] | nn.Module,
        overrides: Sequence[str] | JobConfig | dict[str, Any] = (),
        *,
        plan: Plan | str | Path | None = None,
        train_data: Iterable[Any] | None = None,
        val_data: Iterable[Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: OptimizerArg | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        # Trainer(model, config, train_data=, loss_fn=): your own model and data ([Note: your
        # own model] in training_part.py); else a job whose [model] and [data] say what to train.
        # optimizer=, optimizer_kwargs=, lr_scheduler=: [Note: your optimizer] in user_optim.py.
        self.user_model, self.job = user_model_and_job(job, overrides, train_data)
        self._loss_fn = loss_fn
        self._train_data = train_data or ()
        if self.user_model is None and self.job.custom.factory is not None:
            made = custom_run(self.job.custom.factory, seed=self.job.training.seed)
            self.user_model, train_data, val_data = made
            self._train_data = train_data
            loss_fn = loss_fn or LOSSES[self.job.custom.loss]
            self._loss_fn = loss_fn
        if self.job.metrics.tensorboard:
            check_tensorboard()  # before any process group or step, in one line
        self.plan = _load_plan(plan) if isinstance(plan, str | Path) else plan
        if self.plan is not None:
            check_plan_settings(self.job)
            for pp_rank in range(self.plan.pp):  # a plan's NVMe needs memory.nvme_dir
                plan_host_optimizer(self.plan, self.job, pp_rank=pp_rank)
        taken_by = runs_on(self.job, plan=self.plan is not None)
        self.job, self._torch_optimizer = own_optimizer(
            self.job, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
            lr_scheduler=lr_scheduler, runs_on=taken_by,
        )  # fmt: skip
        self._optimizer_notes = optimizer_notes(optimizer, optimizer_kwargs, lr_scheduler)
        self.run_dir = self.job.run_path
        training = self.job.training
        self.model_config = None if self.user_model is not None else self.job.model.resolve()
        self.tokens_per_row = (
            self._tokens_per_row() if self.model_config is None else self.model_config.seq_len
        )
        # Before the engine: a sharded engine reads the process group when it is built.
        self.distributed = init_from_env(device=resolve_device(training.device),
                                         timeout_s=self.job.distributed.timeout_s)  # fmt: skip
        self.rank, self.world_size = current_rank(), current_world_size()
        torch.manual_seed(training.seed)
        self.part: TrainingPart = self._pipeline_part()
        self.num_params, self.flops_per_token = self.part.num_params, self.part.flops_per_token
        self.engine = self.part.engine
        self.device = self.part.device
        self.adapter = IDENTITY  # tidal's GPT and Hugging Face models keep their names
        self._val_batches: list[Batch] | None = None
        self.train_batches: Sampler
        self._val_sampler: Sampler | None
        if self.model_config is None:  # your data
            self.train_batches = DataBatches(train_data or (), batch_size=training.batch_size)
            self._val_sampler = (
                None if val_data is None else DataBatches(val_data, batch_size=training.batch_size)
            )
        else:
            self.train_batches, self._val_sampler = build_samplers(self.job)
        self.tokens_per_step = training.batch_size * training.grad_accum_steps * self.tokens_per_row
        self.peak = all_ranks_peak(
            peak_flops(self.device, training.precision, self.job.metrics.peak_tflops),
            self.world_size,
        )
        self.metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        self.tokens_seen = 0
        self.train_time_s = 0.0
        self.last_val_loss: float | None = None
        self._checkpoint_s: float | None = None  # [Note: plotted steps] in plot_series.py

    def _tokens_per_row(self) -> int:
        """What a "token" of your data is ([Note: your own model] in training_part.py): the
        positions of a row where the targets are token ids, ``(batch, seq)``; else the row."""
        first = DataBatches(self._train_data, batch_size=self.job.training.batch_size)
        for _, targets in first.fixed_batches(1):
            if isinstance(targets, torch.Tensor) and targets.dim() >= 2:
                return 1 if targets.is_floating_point() else targets[0].numel()
        return 1

    def _pipeline_part(self) -> TrainingPart:
        from tidal.train.pipeline_part import PipelinePart

        device = resolve_device(self.job.training.device)
        join_alone(
            device=device, timeout_s=self.job.distributed.timeout_s
        )  # [Note: a group of one]
        if self.plan is not None:
            return self._planned_part(device)
        spec = None if self.model_config is None else spec_for(self.model_config)
        if spec is not None and not spec.deferred:  # a factory model: yours, built for real
            rows, seq_len = self.job.training.batch_size, spec.config.seq_len
            tokens = torch.zeros((rows, seq_len), dtype=torch.long)
            model = spec.build(device="cpu", seed=self.job.training.seed)
            part = PipelinePart(self.job, device=device, world_size=self.world_size, model=model,
                                loss_fn=default_loss, sample=(tokens, tokens),
                                torch_optimizer=self._torch_optimizer)  # fmt: skip
            part.flops_per_token = spec.flops_per_token(model)
            return part
        if self.user_model is None:
            return PipelinePart(self.job, device=device, world_size=self.world_size,
                                torch_optimizer=self._torch_optimizer)  # fmt: skip
        # [Note: sequential pipelines] in tidal/pipeline/sequential.py
        first = DataBatches(self._train_data, batch_size=self.job.training.batch_size)
        part = PipelinePart(self.job, device=device, world_size=self.world_size,
                            model=self.user_model, loss_fn=self._loss_fn or default_loss,
                            sample=first.fixed_batches(1)[0],
                            torch_optimizer=self._torch_optimizer)  # fmt: skip
        return self._priced_as_6n(part)

    def _planned_part(self, device: torch.device) -> TrainingPart:
        """The model the plan lays out, the one stage ([Note: plan stages]); yours is traced on
        this rank's rows of your first batch ([Note: models without tokens] in
        tidal/planner/wiring.py)."""
        from tidal.parallel.plan_layout import plan_rows
        from tidal.train.pipeline_part import PipelinePart

        assert self.plan is not None
        sample = None
        if self.user_model is not None:
            batch_size = self.job.training.batch_size
            inputs, targets = DataBatches(self._train_data, batch_size=batch_size).fixed_batches(1)[
                0
            ]
            rows = plan_rows(batch_size, self.plan, rank=self.rank)
            sample = (inputs[rows], targets[rows])
        part = PipelinePart(self.job, device=device, world_size=self.world_size,
                            model=self.user_model, loss_fn=self._loss_fn or default_loss,
                            sample=sample, plan=self.plan)  # fmt: skip
        return part if self.user_model is None else self._priced_as_6n(part)

    def _priced_as_6n(self, part: TrainingPart) -> TrainingPart:
        """[Note: your own model] in training_part.py: a model of tokens is priced as 6N."""
        part.flops_per_token = 6.0 * part.num_params if self.tokens_per_row > 1 else None
        return part

    # -- the run -------------------------------------------------------------------------------

    def fit(
        self,
        *,
        resume: bool | int | Literal["auto"] = False,
        overwrite: bool = False,
        callbacks: Sequence[Callback] | None = None,
        progress: bool = True,
    ) -> dict[str, Any]:
        """Train up to ``training.steps``; return the summary (also written to summary.json).

        ``resume``: True continues from the newest intact checkpoint, a step number from that
        step's checkpoint ([Note: checkpoint integrity] in integrity.py); ``"auto"`` resumes if
        the run folder holds a checkpoint and starts otherwise (what an elastic restart does).

        ``progress``: print what the run is, then the progress line every
        ``training.log_every`` steps (loss, tokens/s, TFLOP/s, memory: the CLI's line) to
        stdout, by a :class:`ProgressLine` added to ``callbacks`` unless one of them shows
        progress itself (``LogCallback`` sends the line to ``logging`` instead); False: quiet.
        Ranks other than 0 call no callbacks (see [Note: global batch]).
        """
        callbacks = list(callbacks or ())
        if progress and not any(cb.shows_progress for cb in callbacks):
            callbacks.insert(0, ProgressLine())
        if self.rank != 0:
            callbacks = []
        if self.rank == 0 and self.job.metrics.tensorboard:
            callbacks = [*callbacks, TensorBoardWriter(self.run_dir / "tensorboard")]
        start_wall = time.perf_counter()
        start_step = self._prepare_run_dir(resume=resume, overwrite=overwrite)
        for cb in callbacks:
            cb.on_start(self, start_step=start_step)
        if start_step >= self.job.training.steps and (self.run_dir / "summary.json").is_file():
            return self._already_finished(start_step, callbacks)
        reset_peak_memory(self.device)
        window = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        timed = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        last_record: dict[str, Any] | None = None
        step = start_step
        with StopFlag() as stop:  # [Note: interrupts at safe points] in interrupts.py
            while step < self.job.training.steps:
                for loss, step_s in self._train_steps(step):
                    step += 1
                    last_record = self._record_step(step, loss, step_s, window, timed, start_step)
                    for cb in callbacks:
                        cb.on_step(last_record)
                saved = self._after_step(step, callbacks)
                if stop.raised(distributed=self.distributed):
                    self._stop(step, stop.signal_name, saved, callbacks)
        summary = run_summary(self, last=last_record, timed=timed, start_step=start_step,
                              wall_s=time.perf_counter() - start_wall)  # fmt: skip
        if self.rank == 0:
            write_json_atomic(self.run_dir / "summary.json", summary)
        for cb in callbacks:
            cb.on_end(summary)
        return summary

    def _already_finished(self, step: int, callbacks: Sequence[Callback]) -> dict[str, Any]:
        """A resumed run that had reached its last step: nothing to train, and its summary (the
        figures of the runs that trained) stays as it was, not overwritten with empty ones."""
        summary: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text())
        if self.rank == 0:
            logger.warning(
                "tidal: %s already reached step %d of %d: nothing to train; summary.json kept "
                "(raise training.steps to train on)", self.job.name, step, self.job.training.steps,
            )  # fmt: skip
        for cb in callbacks:
            cb.on_end(summary)
        return summary

    def _train_steps(self, step: int) -> list[tuple[float, float]]:
        """(loss, seconds) of each step the part's next call trains: one step for an engine,
        an asynchronous pipeline's program (its time shared evenly between its steps)."""
        num_steps = self.part.next_steps(step)
        maybe_inject(step + 1)  # TIDAL_FAULT_INJECT, a testing aid (tidal/distributed/faults.py)
        start = time.perf_counter()
        losses = self.part.train(num_steps, self.train_batches)
        step_s = (time.perf_counter() - start) / num_steps
        for offset, loss in enumerate(losses, start=step + 1):
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {offset}; the last checkpoint is intact. "
                    f"{self.part.nan_advice}"
                )
        return [(loss, step_s) for loss in losses]

    def _record_step(
        self,
        step: int,
        loss: float,
        step_s: float,
        window: Throughput,
        timed: Throughput,
        start_step: int,
    ) -> dict[str, Any]:
        self.tokens_seen += self.tokens_per_step
        self.train_time_s += step_s
        window.add(self.tokens_per_step, step_s)
        # The first step of a process pays for warm-up (allocations, kernel selection).
        if step > start_step + 1 or self.job.training.steps == start_step + 1:
            timed.add(self.tokens_per_step, step_s)
        record = {
            "kind": "train",
            "step": step,
            "loss": loss,
            **self.part.step_figures(step),
            "tokens": self.tokens_seen,
            "step_s": step_s,
            **window.figures(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "world_size": self.world_size,
            **({"warm_up": True} if step == start_step + 1 else {}),
            **({"after_checkpoint_s": self._checkpoint_s} if self._checkpoint_s else {}),
        }
        self._checkpoint_s = None
        if step % self.job.training.log_every == 0:
            window.reset()
        if self.rank == 0:
            self.metrics.append(record)
        return record

    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (each rank its part, then the mean)."""
        if self._val_batches is None:
            assert self._val_sampler is not None, "_after_step validates only with data"
            self._val_batches = self._val_sampler.fixed_batches(self.job.training.val_batches)
        return self.part.evaluate(self._val_batches)

    def _stop(
        self, step: int, signal_name: str, saved: Path | None, callbacks: Sequence[Callback]
    ) -> NoReturn:
        """Checkpoint (unless this step's was just written or checkpoint.on_interrupt is off)
        and raise :class:`Interrupted`; every rank calls it after the same step."""
        if saved is None and self.job.checkpoint.on_interrupt:
            saved = self.save_checkpoint()
            for cb in callbacks:
                cb.on_checkpoint(step, str(saved))
        raise Interrupted(step=step, signal_name=signal_name,
                          checkpoint=None if saved is None else str(saved))  # fmt: skip

    def _after_step(self, step: int, callbacks: Sequence[Callback]) -> Path | None:
        """Validation and checkpoints due after ``step``; the checkpoint written, if any."""
        training, ckpt = self.job.training, self.job.checkpoint
        last = step == training.steps
        due = (training.val_every and step % training.val_every == 0) or last
        if due and self._val_sampler is not None:
            self.last_val_loss = self.evaluate()
            record = {"kind": "val", "step": step, "val_loss": self.last_val_loss}
            if self.rank == 0:
                self.metrics.append(record)
            for cb in callbacks:
                cb.on_val(record)
        if (ckpt.every_steps and step % ckpt.every_steps == 0) or (last and ckpt.at_end):
            path = self.save_checkpoint()
            for cb in callbacks:
                cb.on_checkpoint(step, str(path))
            return path
        return None

    @property
    def _peak_tflops(self) -> float | None:
        return self.peak.tflops if self.peak else None

    # -- run folder and checkpoints -------------------------------------------------------------

    def _prepare_run_dir(self, *, resume: bool | int | Literal["auto"], overwrite: bool) -> int:
        # Every rank checks, and all refuse if one does, rather than stranding peers
        # ([Note: one run folder] in run_dir.py).
        check_one_run_dir(self.run_dir)
        val = "" if self._val_sampler is None else self._val_sampler.fingerprint()
        check_same_data(f"{self.train_batches.fingerprint()}/{val}")
        if resume == "auto":  # the folder is one for all ranks: every rank decides alike
            resume = bool(list_checkpoints(self.run_dir))
        agree(lambda: check_run_dir(self.run_dir, resume=resume is not False, overwrite=overwrite))
        if self.rank == 0:
            self._reset_run_dir(overwrite=overwrite, resume=resume is not False)
        # The folder exists, and what --overwrite deletes is gone, before any rank reads it.
        barrier()
        if resume is False:
            return 0
        # [Note: checkpoint integrity] in integrity.py: checked first, the newest intact one.
        asked = None if resume is True else int(resume)
        path, skipped = choose_checkpoint(list_checkpoints(self.run_dir), step=asked)
        for line in skipped if self.rank == 0 else []:
            logger.warning("tidal: %s; resuming from %s", line, path.name)
        step = self.load_checkpoint(path)
        if self.rank == 0:
            self.metrics.truncate_after(step)
        return step

    def _reset_run_dir(self, *, overwrite: bool, resume: bool) -> None:
        if overwrite:
            for name in ("checkpoints", "metrics.jsonl", "summary.json", "loss.png", "memory.png",
                         "tensorboard"):  # fmt: skip
                path = self.run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_dir / "config.json", self._run_config())
        if not resume:
            self.metrics.truncate_after(0)

    def _run_config(self) -> dict[str, Any]:
        """config.json's content: the job, and what of yours it does not hold."""
        config = to_dict(self.job)
        if self.user_model is not None:  # what `tidal export` reads to refuse such a run
            kind = type(self.user_model)
            config["user_model"] = f"{kind.__module__}.{kind.__qualname__}"
        config.update(self._optimizer_notes)
        if self._torch_optimizer is not None:  # the algorithm a resume must keep
            from tidal.train.pipeline_part import PipelinePart

            assert isinstance(self.part, PipelinePart)  # plain stages, each with one of yours
            config["user_optimizer_class"] = describe(type(self.part.first_optimizer()))
        return config

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step in the one format; every rank calls it and writes its
        pieces ([Note: atomic checkpoints] in checkpoint.py). Returns the folder."""
        state = self.part.checkpointable.checkpoint_state()
        state = replace(state, meta={**state.meta, "world_size": self.world_size})
        start = time.perf_counter()
        path = write_checkpoint(self.run_dir, self.part.global_step, state=state,
                                train_state=self._train_state(), keep=self.job.checkpoint.keep,
                                adapter=self.adapter)  # fmt: skip
        self._checkpoint_s = time.perf_counter() - start
        return path

    def _train_state(self) -> dict[str, Any]:
        return {
            "data": self.train_batches.state_dict(),
            "rng": self._rng_state(),
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "last_val_loss": self.last_val_loss,
            "model_config": None if self.model_config is None else to_dict(self.model_config),
            "config": self._run_config(),  # [Note: resuming with changes]
        }

    def load_checkpoint(self, path: Any) -> int:
        """Restore everything [Note: exact resume] lists; returns the checkpoint's step.

        Every rank calls it and reads its pieces, whatever engine and world size wrote them."""
        checkpoint = load_checkpoint(path, adapter=self.adapter)
        state = checkpoint.train_state
        saved_model = state["model_config"]
        if self.model_config is not None and saved_model != to_dict(self.model_config):
            changed = sorted(
                k for k in saved_model if saved_model[k] != getattr(self.model_config, k)
            )
            raise ConfigError(
                "model",
                f"the checkpoint in {path} was trained with other model settings ({', '.join(changed)});"
                f" resume with the run's original [model] section",
            )
        said = resume_changes(state.get("config", {}), self._run_config(), step=checkpoint.step)
        if said and self.rank == 0:
            logger.warning("%s", said)
        if "plan" in state["engine"]:
            raise ConfigError(  # its optimizer state is in the plan's layout, by name
                "--plan",
                f"the checkpoint in {path} was written by the plan engine of an earlier tidal; "
                f"resume it with that version, or export it with `tidal export {self.run_dir}` "
                f"and start from the export",
            )
        self.part.checkpointable.restore_checkpoint(
            checkpoint.load_tensors, state["engine"], checkpoint.meta
        )
        self.train_batches.load_state_dict(state["data"])
        self._set_rng_state(state["rng"])
        self.tokens_seen = int(state["tokens_seen"])
        self.train_time_s = float(state["train_time_s"])
        self.last_val_loss = state["last_val_loss"]
        return checkpoint.step

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _load_plan(path: str | Path) -> Plan:
    from tidal.parallel.plan_layout import load_plan

    return load_plan(path)
