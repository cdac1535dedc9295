"""The summary of a run (summary.json): what trained, how far, how fast, with what memory."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import torch

from tidal.distributed import gather_ints
from tidal.distributed.device import PeakFlops, device_description, peak_memory_bytes
from tidal.train.metrics import Throughput, git_commit, read_metrics

__all__ = ["all_ranks_peak", "gather_per_rank", "run_summary"]


def run_summary(
    trainer: Any, *, last: dict[str, Any] | None, timed: Throughput, start_step: int, wall_s: float
) -> dict[str, Any]:
    """``trainer``'s (a Trainer's) figures after its run: ``last``, the last step's record
    (None when it trained nothing); ``timed``, the throughput of the steps past warm-up.
    A collective: every rank calls it."""
    figures = timed.figures()
    peak_memory = peak_memory_bytes(trainer.device)
    return {
        "name": trainer.job.name,
        "preset": trainer.job.model.preset
        if trainer.job.model.hf_config is None and trainer.job.model.factory is None
        else None,
        "factory": trainer.job.model.factory,
        "hf_config": trainer.job.model.hf_config,
        "num_params": trainer.num_params,
        "steps": trainer.part.global_step,
        "steps_this_run": trainer.part.global_step - start_step,
        "resumed_from_step": start_step or None,
        "tokens": trainer.tokens_seen,
        "final_loss": last["loss"] if last else _last_logged_loss(trainer.run_dir),
        "val_loss": trainer.last_val_loss,
        "tokens_per_s": figures["tokens_per_s"],
        "model_tflops_per_s": figures["tflops"],
        "mfu": figures["mfu"],
        "peak_tflops": trainer.peak.tflops if trainer.peak else None,
        "peak_tflops_source": trainer.peak.source if trainer.peak else None,
        "flops_per_token": trainer.flops_per_token,
        "peak_memory_bytes": peak_memory,
        "peak_memory_bytes_per_rank": gather_per_rank(peak_memory, trainer.world_size),
        **trainer.part.summary_figures(),
        "wall_s": wall_s,
        "train_s": trainer.train_time_s,
        "device": device_description(trainer.device),
        "world_size": trainer.world_size,
        "precision": trainer.job.training.precision,
        "torch_version": torch.__version__,
        "git_commit": git_commit(),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _last_logged_loss(run_dir: Path) -> float | None:
    # A resumed run that had already reached its last step trains nothing this time.
    losses = [r["loss"] for r in read_metrics(run_dir) if r.get("kind") == "train"]
    return losses[-1] if losses else None


def all_ranks_peak(peak: PeakFlops | None, world_size: int) -> PeakFlops | None:
    """The peak of ``world_size`` devices like this one, which MFU over all ranks divides by."""
    if peak is None or world_size == 1:
        return peak
    return PeakFlops(tflops=peak.tflops * world_size, source=f"{world_size} x {peak.source}")


def gather_per_rank(figures: dict[str, int], world_size: int) -> list[dict[str, int]]:
    """Every rank's ``figures`` (same keys on each), indexed by rank; a collective."""
    columns = {key: gather_ints(value) for key, value in figures.items()}
    return [{key: columns[key][r] for key in figures} for r in range(world_size)]
