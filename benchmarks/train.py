"""``tidal bench train``: throughput, FLOP/s, MFU and peak memory of recipes, side by side.

Each recipe trains for a short fixed number of steps into a throw-away run folder, in a process of
its own, so that the host's peak resident memory is that recipe's alone. Figures come from the
steady state: the median step time over the steps after ``warmup_steps``, so allocator
warm-up and kernel selection do not count.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.tables import ResultTable
from tidal.config import format_bytes
from tidal.train import Trainer, load_job
from tidal.train.job import find_recipe
from tidal.train.metrics import read_metrics

__all__ = ["bench_train", "tables"]

_BENCH_OVERRIDES = (
    "checkpoint.every_steps=0",
    "checkpoint.at_end=false",
    "training.val_every=0",
    "training.val_batches=1",
)


def parse_variant(text: str) -> tuple[str, ...]:
    """``"training.precision=bf16,training.batch_size=4"`` -> its overrides; ``""`` -> none."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def bench_train(
    recipes: Sequence[str],
    overrides: Sequence[str] = (),
    *,
    variants: Sequence[str] = ("",),
    steps: int = 30,
    warmup_steps: int = 5,
) -> list[dict[str, Any]]:
    """One row per (recipe, variant), each measured in a fresh process, one after the other.

    A variant is a comma-separated list of overrides applied on top of ``overrides``.
    """
    if steps <= warmup_steps:
        raise ValueError(f"--steps ({steps}) must exceed --warmup-steps ({warmup_steps})")
    cases = [(r, (*overrides, *parse_variant(v)), v) for r in recipes for v in variants]
    for recipe, case_overrides, _ in cases:  # a bad recipe or override fails before any run
        load_job(find_recipe(recipe), [*case_overrides, f"training.steps={steps}"])
    rows = []
    context = multiprocessing.get_context("spawn")
    for recipe, case_overrides, variant in cases:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            job = pool.submit(_bench_one, recipe, case_overrides, steps, warmup_steps)
            rows.append({"variant": variant, **job.result()})
    return rows


def _bench_one(
    recipe: str, overrides: tuple[str, ...], steps: int, warmup_steps: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as run_dir:
        job = load_job(
            find_recipe(recipe),
            [*_BENCH_OVERRIDES, *overrides, f"training.steps={steps}", f"run_dir={run_dir}"],
        )
        trainer = Trainer(job)
        summary = trainer.fit()
        return _row(recipe, trainer, summary, Path(run_dir), warmup_steps)


def _row(
    recipe: str, trainer: Trainer, summary: dict[str, Any], run_dir: Path, warmup_steps: int
) -> dict[str, Any]:
    steady = [
        r["step_s"]
        for r in read_metrics(run_dir)
        if r["kind"] == "train" and r["step"] > warmup_steps
    ]
    step_s = statistics.median(steady)
    tokens_per_s = trainer.tokens_per_step / step_s
    tflops = tokens_per_s * trainer.flops_per_token / 1e12
    peak = trainer.peak.tflops if trainer.peak else None
    job = trainer.job
    return {
        "recipe": recipe,
        "preset": job.model.preset,
        "num_params": trainer.num_params,
        "precision": job.training.precision,
        "batch_size": job.training.batch_size,
        "seq_len": job.model.resolve().seq_len,
        "tokens_per_step": trainer.tokens_per_step,
        "steps": summary["steps"],
        "steady_steps": len(steady),
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "model_tflops_per_s": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
        "peak_tflops_source": trainer.peak.source if trainer.peak else None,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "final_loss": summary["final_loss"],
    }


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """The recipes side by side, tokens/s against the first ([Note: one table per result])."""
    rows = result["rows"]
    base = rows[0]["tokens_per_s"]
    cells = []
    for row in rows:
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        memory = ", ".join(f"{k} {format_bytes(v)}" for k, v in row["peak_memory_bytes"].items())
        cells.append([
            row["recipe"], row["variant"] or "-", f"{row['num_params']:,}",
            f"{row['tokens_per_s']:,.0f} ({row['tokens_per_s'] / base:.2f}x)",
            f"{row['model_tflops_per_s']:.3f}", mfu, memory,
        ])  # fmt: skip
    columns = ("recipe", "variant", "params", "tokens/s", "TFLOP/s", "MFU", "peak memory")
    return [ResultTable.of("tidal bench train", columns, cells)]
