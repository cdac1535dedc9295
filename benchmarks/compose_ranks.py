"""One rank of a ``tidal bench compose`` configuration, and what the parent makes of its end.

tidal's compositions train through the trainer's own part (:class:`~tidal.train.trainer.Trainer`
builds the engine or the pipeline from the job, on the meta device, as ``tidal train`` does);
the peers through :func:`benchmarks.dp_systems.run_case`, as ``tidal bench dp`` runs them. Both
report the same per-rank figures: step times, losses, peak RSS (``VmHWM``, [Note: peak RSS of a
spawned rank] in dp_systems.py); tidal's also its collective and point-to-point byte counters
over the timed steps and its own figure for the rank's memory ([Note: tidal's memory figure]).

[Note: tidal's memory figure]
What tidal says a rank of a composition will hold, from the function its runtime uses:

- a pipeline of plain stages under ``memory.device_budget``: the pipeline memory plan's peak for
  the rank (:func:`~tidal.train.pipeline_memory.plan_pipeline_memory`: model data plus the
  activations of the microbatches the schedule keeps in flight), made before the first step;
- chunks (the ZeRO-3 engine, chunk stages): the store's bound, made before the first step from
  what the store knows then: the model data the rank's tiers hold (its shards of parameters,
  gradients and optimizer state, fixed by the chunk layout) plus each store's device budget,
  which the store never passes and which counts everything on the device, gathered chunks and
  activations included ([Note: the least budget] in tidal/memory/shortfall.py). On the CPU both
  tiers are the process's memory, so the two add up;
- anything else: none, and the row says so.

Either figure counts model data and activations only; the process itself (the interpreter,
torch, allocator slack) is the rank's RSS before the model existed, which the bench adds to
compare it with the measured peak.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.dp_systems import Case, rss_figures, run_case, tidal_budget_overrides
from tidal.config import ConfigError
from tidal.train.job import JobConfig, find_recipe, load_job

__all__ = [
    "BUDGET_MARKERS",
    "ComposeCase",
    "check_runnable",
    "is_budget_failure",
    "refusal_line",
    "run_compose_case",
]

# What a rank's failure says when it ran out of its budget or memory: "does not fit". Any other
# failure is no verdict on the size ([Note: fits, refused, failed] in compose.py).
BUDGET_MARKERS = (
    "memory.device_budget", "memory.host_budget", "DeviceBudgetTooSmall", "TierBudgetError",
    "out of memory", "Cannot allocate memory", "MemoryError", "killed by signal SIGKILL",
)  # fmt: skip


def is_budget_failure(error: str) -> bool:
    return any(marker in error for marker in BUDGET_MARKERS)


def refusal_line(error: str) -> str | None:
    """The ``ConfigError`` line of a failed run that is no budget failure (tidal refused the
    configuration on a rank), else None."""
    if is_budget_failure(error):
        return None
    for part in error.split("; "):
        _, sep, rest = part.partition("ConfigError: ")
        if sep:
            return rest.strip()
    return None


def check_runnable(job: JobConfig, world_size: int) -> str | None:
    """tidal's refusal of ``job`` on ``world_size`` ranks at job check, in one line; None if it
    passes (then only its run can tell whether it fits)."""
    from tidal.train.pipeline_part import check_pipeline_job

    try:
        if job.pipelined:
            check_pipeline_job(job, world_size=world_size)
        else:
            job.parallel.resolve(world_size)
    except ConfigError as err:
        return str(err)
    return None


@dataclass(frozen=True, kw_only=True)
class ComposeCase:
    """One configuration at one size as every rank runs it: ``system`` ``tidal`` trains the job
    of ``recipe`` + ``overrides`` through the trainer, a peer through ``run_case``.
    ``budget_bytes``: the per-rank host budget tidal is told ([Note: one budget] in compose.py);
    ``result_dir``: where each rank writes its figures too ([Note: teardown failures] in
    dp_runs.py); ``deferred``: a peer builds the model as its docs do for one too large for a
    rank (``Case.deferred`` in dp_systems.py), else whole on every rank first (tidal's trainer
    always builds on the meta device)."""

    system: str
    recipe: str
    overrides: tuple[str, ...]
    steps: int
    warmup_steps: int
    budget_bytes: int | None = None
    device_fraction: float = 0.1
    result_dir: str | None = None
    deferred: bool = True

    def peer_case(self) -> Case:
        return Case(system=self.system, recipe=self.recipe, overrides=self.overrides,
                    steps=self.steps, warmup_steps=self.warmup_steps,
                    result_dir=self.result_dir, deferred=self.deferred)  # fmt: skip


def run_compose_case(case: ComposeCase) -> dict[str, Any]:
    """This rank's figures (under :func:`tidal.testing.run_on_ranks`)."""
    if case.system != "tidal":
        return run_case(case.peer_case())
    figures = _run_tidal(case)
    if case.result_dir is not None:
        path = Path(case.result_dir) / f"rank{figures['rank']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(figures))
        path.with_suffix(".tmp").replace(path)  # whole or absent, never half written
    return figures


def _budgets(job: JobConfig, case: ComposeCase, base_rss: int) -> list[str]:
    """[Note: one budget] in compose.py: chunks get tiers, plain stages a device budget."""
    if case.budget_bytes is None:
        return []
    if job.engine == "chunk":
        return tidal_budget_overrides(case.budget_bytes, base_rss, case.device_fraction)
    room = case.budget_bytes - base_rss
    if room <= 0:
        raise ConfigError("memory.device_budget", f"the process holds {base_rss:,} bytes "
                          f"before the model exists, over the budget of {case.budget_bytes:,}")  # fmt: skip
    return [f"memory.device_budget={room}", "pipeline.memory=none"]


def _run_tidal(case: ComposeCase) -> dict[str, Any]:
    from tidal.train.trainer import Trainer

    base = rss_figures()
    job = load_job(find_recipe(case.recipe), list(case.overrides))
    budgets = _budgets(job, case, base["rss_bytes"])
    run_dir = Path(case.result_dir or ".") / "run"
    job = load_job(job, [*budgets, f"run_dir={run_dir}"])
    trainer = Trainer(job)
    part = trainer.part
    built = rss_figures()
    predicted = _memory_figure(part)  # before the first step ([Note: tidal's memory figure])
    step_s: list[float] = []
    losses: list[float] = []
    before: dict[str, int] = {}
    after_warmup: dict[str, int] = {}
    for step in range(case.steps):
        if step == case.warmup_steps:
            before, after_warmup = _counters(part), rss_figures()
        start = time.perf_counter()
        losses += part.train(1, trainer.train_batches)
        step_s.append(time.perf_counter() - start)
    end = rss_figures()
    after = _counters(part)
    timed = max(1, case.steps - case.warmup_steps)
    return {
        "rank": dist.get_rank(),
        "num_params": trainer.num_params,
        "tokens_per_step": trainer.tokens_per_step,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[case.warmup_steps :] or step_s),
        "losses": losses,
        "bytes_per_step": {k: (after[k] - before.get(k, 0)) / timed for k in after},
        "tidal_memory": predicted,
        "base_rss_bytes": base["rss_bytes"],
        "hwm_rss_after_build_bytes": built["hwm_rss_bytes"],
        "rss_after_warmup_bytes": (after_warmup or end)["rss_bytes"],
        "hwm_rss_bytes": end["hwm_rss_bytes"],
        "ru_maxrss_bytes": end["ru_maxrss_bytes"],
        "tidal_budgets": budgets,
        "load_average_1m": os.getloadavg()[0],
    }


def _stage_stats(part: Any) -> list[dict[str, Any]]:
    """The figures of this rank's engine, or of each of its stages that keeps some (chunk
    stages, tensor-parallel ones)."""
    weights = getattr(part.engine, "weights", None)
    if weights is None:  # an engine
        return [part.engine.stats()]
    return [w.stats() for w in weights.values() if hasattr(w, "stats")]


def _chunk_stats(part: Any) -> list[dict[str, Any]]:
    """The chunk engines' figures on this rank: the engine's, or each chunk stage's."""
    return [s for s in _stage_stats(part) if "min_device_bytes" in s]


def _counters(part: Any) -> dict[str, int]:
    """This rank's running byte counters: what it all-gathered, reduce-scattered and
    all-reduced, ZeRO-3's over dp and tensor parallelism's over tp ([Note: collective byte
    counts] in tidal/distributed/collectives.py), and sent to other pipeline ranks
    (:attr:`PipelineRuntime.bytes_sent`)."""
    keys = ("bytes_all_gathered", "bytes_reduce_scattered", "bytes_all_reduced")
    stats = _stage_stats(part)
    out = {key: sum(int(s.get(key, 0)) for s in stats) for key in keys}
    out["bytes_sent"] = int(getattr(part.engine, "bytes_sent", 0))
    return out


def _memory_figure(part: Any) -> dict[str, Any]:
    """[Note: tidal's memory figure] for this rank."""
    memory = getattr(part, "memory", None)
    if memory is not None and memory.plan is not None:
        rank = part.mesh.get_local_rank("pp")
        return {"bytes": int(memory.plan.peak_bytes[rank]), "kind": "prediction",
                "source": "pipeline memory plan (model data + in-flight activations), "
                "before the first step"}  # fmt: skip
    stats = _chunk_stats(part)
    if stats and all(s["device_budget"] is not None for s in stats):
        bound = sum(sum(s["model_data_bytes"].values()) + s["device_budget"] for s in stats)
        return {"bytes": int(bound), "kind": "prediction",
                "source": "chunk store before the first step: model data its tiers hold + its "
                "device budget (gathered chunks and activations included), a bound"}  # fmt: skip
    return {"bytes": None, "kind": "none", "source": "tidal makes no figure for this composition"}
