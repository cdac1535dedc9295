"""The training loop: a JobConfig in, a trained model, metrics, checkpoints and a summary out.

The Trainer composes the parts (model preset, token source, engine) and owns only the loop, the
run folder and resumption. Presentation is left to callbacks: the CLI adds a rich progress bar,
library users get log lines.

[Note: exact resume]
A resumed run must continue bit for bit where the saved one stopped. Everything that decides the
next step is therefore either a pure function of a saved counter or saved itself: the batches are
a function of (seed, batch index) and the index is saved; the learning rate is a function of the
optimizer step; AdamW's moments, the model and torch's RNG states (dropout) are saved. Records
past the resumed step are dropped from metrics.jsonl, because the resumed run writes them again.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import shutil
import time
from collections.abc import Sequence
from typing import Any

import torch

from tidal.config import ConfigError, to_dict
from tidal.data import BatchSampler, build_token_splits
from tidal.engine.build import build_engine
from tidal.engine.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from tidal.engine.checkpoint import save_checkpoint as write_checkpoint
from tidal.engine.device import (
    device_description,
    memory_bytes,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
)
from tidal.engine.job import JobConfig, load_job
from tidal.engine.metrics import (
    MetricsFile,
    Throughput,
    format_step_line,
    git_commit,
    read_metrics,
    write_json_atomic,
)
from tidal.models import build_gpt, num_params, training_flops_per_token

__all__ = ["Callback", "LogCallback", "Trainer"]

logger = logging.getLogger(__name__)


class Callback:
    """Hooks the loop calls; override what you need."""

    def on_start(self, trainer: Trainer, *, start_step: int) -> None: ...
    def on_step(self, record: dict[str, Any]) -> None: ...
    def on_val(self, record: dict[str, Any]) -> None: ...
    def on_checkpoint(self, step: int, path: str) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


class LogCallback(Callback):
    """The progress line through ``logging`` every ``log_every`` steps."""

    def __init__(self, *, log_every: int, total_steps: int) -> None:
        self.log_every = log_every
        self.total_steps = total_steps

    def on_step(self, record: dict[str, Any]) -> None:
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
            logger.info(format_step_line(record, total_steps=self.total_steps))

    def on_val(self, record: dict[str, Any]) -> None:
        logger.info("step %d  val_loss %.4f", record["step"], record["val_loss"])


class Trainer:
    """Train the GPT preset of ``job`` on its token source with the engine it names."""

    def __init__(
        self, job: JobConfig | str | dict[str, Any], overrides: Sequence[str] = ()
    ) -> None:
        self.job = load_job(job, overrides)
        self.run_dir = self.job.run_path
        training = self.job.training
        self.model_config = self.job.model.resolve()
        torch.manual_seed(training.seed)
        model = build_gpt(self.model_config, device="cpu", seed=training.seed)
        self.engine = build_engine(model, self.job)
        self.device = self.engine.device
        splits = build_token_splits(
            self.job.data, vocab_size=self.model_config.vocab_size, seed=training.seed
        )
        seq_len = self.model_config.seq_len
        self.train_batches = BatchSampler(
            splits.train, batch_size=training.batch_size, seq_len=seq_len, seed=training.seed
        )
        # Validation draws from its own seed so that it is the same batches at every pass.
        self._val_sampler = BatchSampler(
            splits.val, batch_size=training.batch_size, seq_len=seq_len, seed=training.seed + 1
        )
        self._val_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.tokens_per_step = training.batch_size * seq_len * training.grad_accum_steps
        self.flops_per_token = training_flops_per_token(self.model_config)
        self.num_params = num_params(self.engine.model)
        self.peak = peak_flops(self.device, training.precision, self.job.metrics.peak_tflops)
        self.metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        self.tokens_seen = 0
        self.train_time_s = 0.0
        self.last_val_loss: float | None = None

    # -- the run -------------------------------------------------------------------------------

    def fit(
        self,
        *,
        resume: bool = False,
        overwrite: bool = False,
        callbacks: Sequence[Callback] | None = None,
    ) -> dict[str, Any]:
        """Train up to ``training.steps``; return the summary (also written to summary.json).

        Without ``callbacks`` the progress line goes to ``logging`` (``tidal.engine.trainer``).
        """
        if callbacks is None:
            callbacks = [
                LogCallback(
                    log_every=self.job.training.log_every, total_steps=self.job.training.steps
                )
            ]
        start_wall = time.perf_counter()
        start_step = self._prepare_run_dir(resume=resume, overwrite=overwrite)
        for cb in callbacks:
            cb.on_start(self, start_step=start_step)
        reset_peak_memory(self.device)
        steps = self.job.training.steps
        window = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        timed = Throughput(flops_per_token=self.flops_per_token, peak_tflops=self._peak_tflops)
        last_record: dict[str, Any] | None = None
        for step in range(start_step + 1, steps + 1):
            loss, step_s = self._train_step()
            self.tokens_seen += self.tokens_per_step
            self.train_time_s += step_s
            window.add(self.tokens_per_step, step_s)
            # The first step of a process pays for warm-up (allocations, kernel selection).
            if step > start_step + 1 or steps == start_step + 1:
                timed.add(self.tokens_per_step, step_s)
            last_record = self._step_record(step, loss, step_s, window)
            if step % self.job.training.log_every == 0:
                window.reset()
            self.metrics.append(last_record)
            for cb in callbacks:
                cb.on_step(last_record)
            self._after_step(step, callbacks)
        summary = self._summary(last_record, timed, start_step, time.perf_counter() - start_wall)
        write_json_atomic(self.run_dir / "summary.json", summary)
        for cb in callbacks:
            cb.on_end(summary)
        return summary

    def _train_step(self) -> tuple[float, float]:
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.job.training.grad_accum_steps):
            inputs, targets = self.train_batches.next_batch()
            loss = self.engine(inputs.to(self.device), targets.to(self.device))
            self.engine.backward(loss)
            loss_sum += loss.detach().float()
            self.engine.step()
        loss_value = float(loss_sum) / self.job.training.grad_accum_steps  # syncs the device
        step_s = time.perf_counter() - start
        if not math.isfinite(loss_value):
            raise FloatingPointError(
                f"loss is {loss_value} at step {self.engine.global_step}; the last checkpoint is "
                f"intact. Lower optimizer.lr, raise optimizer.warmup_steps or use "
                f"training.precision='bf16' instead of fp16"
            )
        return loss_value, step_s

    def _step_record(
        self, step: int, loss: float, step_s: float, window: Throughput
    ) -> dict[str, Any]:
        return {
            "kind": "train",
            "step": step,
            "loss": loss,
            "grad_norm": self.engine.last_grad_norm,
            "lr": self.engine.lr,
            "tokens": self.tokens_seen,
            "step_s": step_s,
            **window.figures(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }

    def _after_step(self, step: int, callbacks: Sequence[Callback]) -> None:
        training, ckpt = self.job.training, self.job.checkpoint
        last = step == training.steps
        if (training.val_every and step % training.val_every == 0) or last:
            self.last_val_loss = self.evaluate()
            record = {"kind": "val", "step": step, "val_loss": self.last_val_loss}
            self.metrics.append(record)
            for cb in callbacks:
                cb.on_val(record)
        if (ckpt.every_steps and step % ckpt.every_steps == 0) or (last and ckpt.at_end):
            path = self.save_checkpoint()
            for cb in callbacks:
                cb.on_checkpoint(step, str(path))

    @property
    def _peak_tflops(self) -> float | None:
        return self.peak.tflops if self.peak else None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches."""
        if self._val_batches is None:
            self._val_batches = self._val_sampler.fixed_batches(self.job.training.val_batches)
        model = self.engine.model
        was_training = model.training
        model.eval()
        total = 0.0
        for inputs, targets in self._val_batches:
            total += float(self.engine(inputs.to(self.device), targets.to(self.device)))
        model.train(was_training)
        return total / len(self._val_batches)

    # -- run folder and checkpoints -------------------------------------------------------------

    def _prepare_run_dir(self, *, resume: bool, overwrite: bool) -> int:
        if resume and overwrite:
            raise ConfigError("", "--resume and --overwrite contradict each other; pick one")
        existing = list_checkpoints(self.run_dir)
        if overwrite:
            for name in ("checkpoints", "metrics.jsonl", "summary.json", "loss.png", "memory.png"):
                path = self.run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        elif existing and not resume:
            raise ConfigError(
                "run_dir",
                f"{self.run_dir} already holds checkpoints up to step {existing[-1][0]}; pass "
                f"--resume to continue that run, --overwrite to start over (deletes them), or "
                f"--set run_dir=PATH for a new folder",
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_dir / "config.json", to_dict(self.job))
        if not resume:
            self.metrics.truncate_after(0)
            return 0
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise ConfigError(
                "run_dir",
                f"--resume: no checkpoint under {self.run_dir / 'checkpoints'}; run without "
                f"--resume to start a new run",
            )
        step = self.load_checkpoint(path)
        self.metrics.truncate_after(step)
        return step

    def save_checkpoint(self) -> Any:
        engine_state = self.engine.state_dict()
        model_state = engine_state.pop("model")
        train_state = {
            "engine": engine_state,
            "data": self.train_batches.state_dict(),
            "rng": self._rng_state(),
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "last_val_loss": self.last_val_loss,
            "model_config": to_dict(self.model_config),
        }
        return write_checkpoint(
            self.run_dir,
            self.engine.global_step,
            model_state=model_state,
            train_state=train_state,
            keep=self.job.checkpoint.keep,
        )

    def load_checkpoint(self, path: Any) -> int:
        """Restore everything [Note: exact resume] lists; returns the checkpoint's step."""
        checkpoint = load_checkpoint(path)
        state = checkpoint["train_state"]
        saved_model = state["model_config"]
        if saved_model != to_dict(self.model_config):
            changed = sorted(
                k for k in saved_model if saved_model[k] != getattr(self.model_config, k)
            )
            raise ConfigError(
                "model",
                f"the checkpoint in {path} was trained with other model settings ({', '.join(changed)});"
                f" resume with the run's original [model] section",
            )
        self.engine.load_state_dict({"model": checkpoint["model"], **state["engine"]})
        self.train_batches.load_state_dict(state["data"])
        self._set_rng_state(state["rng"])
        self.tokens_seen = int(state["tokens_seen"])
        self.train_time_s = float(state["train_time_s"])
        self.last_val_loss = state["last_val_loss"]
        return checkpoint["step"]

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    # -- summary ---------------------------------------------------------------------------------

    def _last_logged_loss(self) -> float | None:
        # A resumed run that had already reached its last step trains nothing this time.
        losses = [r["loss"] for r in read_metrics(self.run_dir) if r.get("kind") == "train"]
        return losses[-1] if losses else None

    def _summary(
        self,
        last: dict[str, Any] | None,
        timed: Throughput,
        start_step: int,
        wall_s: float,
    ) -> dict[str, Any]:
        figures = timed.figures()
        return {
            "name": self.job.name,
            "preset": self.job.model.preset,
            "num_params": self.num_params,
            "steps": self.engine.global_step,
            "steps_this_run": self.engine.global_step - start_step,
            "resumed_from_step": start_step or None,
            "tokens": self.tokens_seen,
            "final_loss": last["loss"] if last else self._last_logged_loss(),
            "val_loss": self.last_val_loss,
            "tokens_per_s": figures["tokens_per_s"],
            "model_tflops_per_s": figures["tflops"],
            "mfu": figures["mfu"],
            "peak_tflops": self._peak_tflops,
            "peak_tflops_source": self.peak.source if self.peak else None,
            "flops_per_token": self.flops_per_token,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "model_data_bytes": self.engine.model_data_bytes(),
            **_engine_figures(self.engine.stats()),
            "wall_s": wall_s,
            "train_s": self.train_time_s,
            "device": device_description(self.device),
            "precision": self.job.training.precision,
            "torch_version": torch.__version__,
            "git_commit": git_commit(),
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }


_CHUNK_FIGURES = (
    "bytes_to_device",
    "bytes_to_host",
    "evictions",
    "device_budget",
    "peak_device_bytes",
    "peak_non_model_bytes",
    "min_device_bytes",
    "chunk_size",
    "num_chunks",
)


def _engine_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """The engine's name and, for the chunk engine, its traffic and residency figures."""
    return {"engine": stats["engine"], **{k: stats[k] for k in _CHUNK_FIGURES if k in stats}}
