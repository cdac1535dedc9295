"""``tidal bench offload``: the chunk engine against plain PyTorch, DeepSpeed and the optimum.

Four sections, each a list of rows tagged ``"section"``; every measured case runs in a process
of its own (spawned), so its peak resident set (``ru_maxrss``) is that case's alone.

- ``overhead``: median steady-state step time (after ``warmup_steps``) of plain PyTorch, the chunk
  engine with an unlimited device budget, and DeepSpeed ZeRO-3 with CPU offload, on one recipe,
  same data and seed (see :mod:`benchmarks.baselines`).
- ``traffic``: the chunk engine at device budgets of 25/50/75% (``traffic_fractions``) of its
  parameter-chunk bytes (plus the peak non-model bytes a first step without a budget measured, since activations
  share the device budget), measured bytes per step against the offline optimum on the
  engine's own trace.
- ``scale``: the deepest GPT (the recipe's width, more blocks) the chunk engine trains for 2
  steps under a (device, host) budget pair, found by bisection, against the model-data limit
  of the two budgets. Depth, not width: a wider model's single largest matrix soon outgrows a
  small device budget on its own, which says nothing about how well the two tiers are used;
  sequences are short (``SCALE_SEQ_LEN``) because activations grow with depth and must fit on
  the device beside the chunks.
- ``host``: peak resident memory of the three systems on a bigger recipe.

[Note: like-for-like traffic]
The device budget holds more than streaming parameter chunks: after the first iteration the
engine pins a set P of chunk indices whose parameter, gradient and moment chunks stay on the
device ([Note: optimizer placement] in memory/pinning.py); they never move. Every other parameter
chunk is fetched when a moment needs it, and all of them are back on the host before the
optimizer step, which updates them there (the optimizer's step calls ``evict_unpinned``): each
optimizer step starts from an empty device as far as streaming chunks go. Their gradients are
copied to the host once per backward (``collect``, the post-accumulate-grad hook). So a steady
optimizer step of ``a`` accumulated micro-batches (``a`` iterations of the trace) moves

    host -> device: the fetches of streaming parameter chunks;
    device -> host: those chunks going back (each eviction writes the chunk back), plus ``a``
                    times the gradients of the parameters outside P.

The policy problem the engine solves each step is therefore: the recorded trace with P's chunks
removed, a chunk room of ``budget - bytes(P's gradients and moments) - bytes(P's parameter
chunks)`` (less each moment's non-model bytes, which the trace carries), ``a`` iterations from
an empty device. ``optimal_traffic`` (exact for equal chunk sizes) and ``traffic_lower_bound``
are computed on exactly that problem with ``iterations=a``, so their figures are per optimizer
step like the measured ones; more iterations would let a plan keep chunks across the optimizer
step, which updates them on the host, so that is not the engine's problem. The ratio
``measured / optimal`` compares host -> device bytes, the only direction the planner chooses;
device -> host is reported with its gradient share. ``static_offload_traffic`` (per iteration,
one direction, times ``a``) is taken on the whole trace: what moving every parameter chunk in
and out once per iteration costs, compared with the measured host -> device bytes.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.baselines import (
    DEEPSPEED,
    PYTORCH,
    SYSTEMS,
    TIDAL_CHUNK,
    build_run,
    deepspeed_missing_reason,
    train_steps,
)
from benchmarks.tables import ResultTable
from tidal.config import ConfigError, format_bytes, require
from tidal.distributed.device import peak_memory_bytes
from tidal.memory.policy import optimal_traffic, static_offload_traffic, traffic_lower_bound
from tidal.memory.store import DeviceBudgetTooSmall
from tidal.memory.tiers import TierBudgetError
from tidal.memory.trace import AccessTrace, Moment
from tidal.models import closed_form_num_params
from tidal.train.job import JobConfig, find_recipe, load_job

__all__ = [
    "SECTIONS",
    "OffloadSettings",
    "bench_offload",
    "in_own_process",
    "overhead_rows",
    "scale_search",
    "table",
    "tables",
    "time_system",
    "traffic_rows",
]

SECTIONS = ("overhead", "traffic", "scale", "host")
TRAFFIC_FRACTIONS = (0.25, 0.5, 0.75)
SCALE_STEPS = 2
HOST_STEPS = 3
SCALE_SEQ_LEN = 64
# What "does not fit" looks like: the engine refuses the budget before or while training.
BUDGET_ERRORS = (ConfigError, DeviceBudgetTooSmall, TierBudgetError)

# Cases train briefly and never checkpoint or validate; the bench's loop does not either.
_ONE_SEQUENCE = ("training.batch_size=1", "training.grad_accum_steps=1", "data.source=synthetic")
_SCALE_OVERRIDES = (*_ONE_SEQUENCE, f"model.seq_len={SCALE_SEQ_LEN}")
_HOST_OVERRIDES = (*_ONE_SEQUENCE, "training.precision=fp32")
_UNLIMITED = ("memory.device_budget=none", "memory.host_budget=none")
_SYSTEM_OVERRIDES = {
    PYTORCH: ("engine=reference", *_UNLIMITED),
    TIDAL_CHUNK: ("engine=chunk", *_UNLIMITED),
    DEEPSPEED: _UNLIMITED,
}


@dataclass(frozen=True)
class OffloadSettings:
    """What ``tidal bench offload`` runs; ``overrides`` apply to every case of every section."""

    sections: tuple[str, ...] = SECTIONS
    recipe: str = "demo"
    steps: int = 20
    warmup_steps: int = 5
    repeats: int = 3  # overhead rounds, systems in turn; see _systems
    device_budget_bytes: int = 128 << 20
    host_budget_bytes: int = 1 << 30
    host_recipe: str = "gpt2-small"
    traffic_fractions: tuple[float, ...] = TRAFFIC_FRACTIONS
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        require(not unknown, "--section", f"unknown {unknown}; choose from {SECTIONS}")
        require(
            self.steps > self.warmup_steps or "overhead" not in self.sections,
            "--steps",
            f"{self.steps} must exceed --warmup-steps ({self.warmup_steps})",
        )
        require(
            self.steps >= 2,
            "--steps",
            f"must be >= 2 (the first records the trace), got {self.steps}",
        )
        require(self.repeats >= 1, "--repeats", f"must be >= 1, got {self.repeats}")
        require(
            bool(self.traffic_fractions) and all(0 < f <= 1 for f in self.traffic_fractions),
            "--fractions",
            f"fractions in (0, 1] of the parameter-chunk bytes, got {self.traffic_fractions}",
        )


def bench_offload(settings: OffloadSettings) -> list[dict[str, Any]]:
    """Every selected section's rows, in the order of :data:`SECTIONS`."""
    _check_recipes(settings)
    sections: dict[str, Callable[[OffloadSettings], list[dict[str, Any]]]] = {
        "overhead": overhead_rows,
        "traffic": traffic_rows,
        "scale": lambda s: [scale_search(s)],
        "host": host_rows,
    }
    rows: list[dict[str, Any]] = []
    for name in SECTIONS:
        if name in settings.sections:
            rows.extend({"section": name, **row} for row in sections[name](settings))
    return rows


def _check_recipes(settings: OffloadSettings) -> None:
    """A bad recipe or override fails before any case runs."""
    _job(settings.recipe, settings.overrides)
    if "host" in settings.sections:
        _job(settings.host_recipe, (*_HOST_OVERRIDES, *settings.overrides))


def _job(recipe: str, overrides: Sequence[str]) -> JobConfig:
    return load_job(find_recipe(recipe), list(overrides))


def in_own_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process; a crash of that process becomes an error row."""
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(fn, *args).result()
    except BrokenProcessPool as err:
        return {"error": f"the case's process died: {err}"}


def _peak_rss_bytes() -> int:
    return peak_memory_bytes(torch.device("cpu"))["host"]


# -- overhead and host: the three systems side by side ---------------------------------------------


def overhead_rows(settings: OffloadSettings) -> list[dict[str, Any]]:
    overrides = (*settings.overrides, f"training.steps={settings.steps}")
    return _systems(
        settings.recipe, overrides, settings.steps, settings.warmup_steps, settings.repeats
    )


def host_rows(settings: OffloadSettings) -> list[dict[str, Any]]:
    overrides = (*_HOST_OVERRIDES, *settings.overrides, f"training.steps={HOST_STEPS}")
    return _systems(settings.host_recipe, overrides, HOST_STEPS, 1, 1)


def _systems(
    recipe: str, overrides: Sequence[str], steps: int, warmup_steps: int, repeats: int
) -> list[dict[str, Any]]:
    """One row per system. With ``repeats`` > 1 the systems run in turn, round after round, and
    a row keeps its median round (by step time), so that a slow spell of a shared machine
    falls on every system alike instead of on whichever ran during it."""
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    for _ in range(repeats):
        for system in SYSTEMS:
            reason = deepspeed_missing_reason() if system == DEEPSPEED else None
            if reason is not None:
                runs[system].append({"error": reason})
                continue
            case = (*overrides, *_SYSTEM_OVERRIDES[system])
            runs[system].append(
                in_own_process(time_system, system, recipe, case, steps, warmup_steps)
            )
    rows = []
    for system, results in runs.items():
        timed = sorted((r for r in results if "error" not in r), key=lambda r: r["median_step_s"])
        row = timed[len(timed) // 2] if timed else results[0]
        if timed:
            row = {
                **row,
                "rounds_step_s": [r["median_step_s"] for r in results if "error" not in r],
            }
        rows.append({"system": system, "recipe": recipe, **row})
    base = rows[0] if "error" not in rows[0] else None
    for row in rows:
        if base is not None and "error" not in row:
            row["step_time_ratio"] = row["median_step_s"] / base["median_step_s"]
            row["peak_rss_ratio"] = row["peak_rss_bytes"] / base["peak_rss_bytes"]
    return rows


def time_system(
    system: str, recipe: str, overrides: tuple[str, ...], steps: int, warmup_steps: int
) -> dict[str, Any]:
    """One system's steady-state figures (runs in its own process)."""
    job = _job(recipe, overrides)
    try:
        run = build_run(system, job)
        step_s, losses = train_steps(run, steps)
    except Exception as err:  # e.g. DeepSpeed cannot run here: a row, not a lost bench
        return {"error": f"{type(err).__name__}: {err}"}
    median_s = statistics.median(step_s[warmup_steps:])
    return {
        "num_params": run.num_params,
        "precision": job.training.precision,
        "batch_size": job.training.batch_size,
        "tokens_per_step": run.tokens_per_step,
        "steps": steps,
        "steady_steps": len(step_s) - warmup_steps,
        "median_step_s": median_s,
        "tokens_per_s": run.tokens_per_step / median_s,
        "final_loss": losses[-1],
        "peak_rss_bytes": _peak_rss_bytes(),
        "num_threads": torch.get_num_threads(),
        # Other processes on the machine slow a case down; this says how busy it was.
        "load_average_1m": os.getloadavg()[0],
    }


# -- traffic: measured against the optimum on the engine's own trace -------------------------------


def traffic_rows(settings: OffloadSettings) -> list[dict[str, Any]]:
    """One row per budget fraction; see [Note: like-for-like traffic]."""
    overrides = ("training.precision=fp32", *settings.overrides, "engine=chunk")
    return [
        {"recipe": settings.recipe, "budget_fraction": fraction}
        | in_own_process(_traffic_case, settings.recipe, overrides, fraction, settings.steps)
        for fraction in settings.traffic_fractions
    ]


def _traffic_case(
    recipe: str, overrides: tuple[str, ...], fraction: float, steps: int
) -> dict[str, Any]:
    job = _job(recipe, (*overrides, f"training.steps={steps}", *_UNLIMITED))
    chunk_bytes, non_model_bytes = _probe(job)
    budget_bytes = int(fraction * chunk_bytes) + non_model_bytes
    job = load_job(job, [f"memory.device_budget={budget_bytes}"])
    row: dict[str, Any] = {
        "device_budget_bytes": budget_bytes,
        "param_chunk_bytes": chunk_bytes,
        "probe_non_model_bytes": non_model_bytes,
    }
    try:
        run = build_run(TIDAL_CHUNK, job)
        train_steps(run, 1)  # records the trace; the optimizer placement is chosen at its step
        before = run.engine.stats()
        train_steps(run, steps - 1)
    except BUDGET_ERRORS as err:
        return row | {"error": f"{type(err).__name__}: {err}"}
    after = run.engine.stats()
    steady = steps - 1
    iterations = job.training.grad_accum_steps
    measured = {
        key: (after[key] - before[key]) / steady for key in ("bytes_to_device", "bytes_to_host")
    }
    return (
        row
        | _placement(run.engine, iterations)
        | {
            "steady_steps": steady,
            "iterations_per_step": iterations,
            "to_device_bytes_per_step": measured["bytes_to_device"],
            "to_host_bytes_per_step": measured["bytes_to_host"],
            "evictions_per_step": (after["evictions"] - before["evictions"]) / steady,
        }
        | _planned(run.engine, budget_bytes, measured["bytes_to_device"], iterations)
    )


def _probe(job: JobConfig) -> tuple[int, int]:
    """Parameter-chunk bytes and peak non-model bytes (activations) of one step with no
    device budget: what the budget fractions are taken of, and what they leave room for."""
    run = build_run(TIDAL_CHUNK, job)
    train_steps(run, 1)
    store = run.engine.store
    return store.model_bytes, int(store.trace.peak_non_model_bytes)


def _placement(engine: Any, iterations: int) -> dict[str, Any]:
    """What the engine pinned, and the gradient bytes the other chunks send home each step
    (once per iteration: each micro-batch's gradients are added into the host's chunks)."""
    store, pinned = engine.store, engine.store.pinned
    grad_bytes = sum(
        p.numel() * p.element_size()
        for pid, p in store.params.items()
        if p.requires_grad and store.slot_of[pid][0] not in pinned
    )
    return {
        "num_chunks": len(store.chunks),
        "chunk_sizes_bytes": sorted({c.num_bytes for c in store.chunks}),
        "pinned_chunks": len(pinned),
        "pinned_bytes": sum(
            store.chunks[i].num_bytes + engine.optimizer.state_bytes_of(i) for i in pinned
        ),
        "grad_to_host_bytes_per_step": grad_bytes * iterations,
    }


def streaming_problem(
    trace: AccessTrace, pinned: frozenset[int], pinned_state_bytes: int, budget_bytes: int
) -> tuple[AccessTrace, int]:
    """The trace without pinned chunks, and the device budget left to the streaming chunks."""
    streamed = AccessTrace(
        moments=tuple(
            Moment(m.index, m.chunks - pinned, m.non_model_bytes, m.label) for m in trace.moments
        ),
        chunk_bytes=trace.chunk_bytes,
    )
    return streamed, budget_bytes - pinned_state_bytes - trace.bytes_of(pinned)


def _planned(
    engine: Any, budget_bytes: int, measured_bytes: float, iterations: int
) -> dict[str, Any]:
    """Optimum, lower bound and static offload on the engine's trace, per optimizer step."""
    trace = engine.store.trace
    pinned = engine.store.pinned
    state_bytes = sum(engine.optimizer.state_bytes_of(i) for i in pinned)
    streamed, room_bytes = streaming_problem(trace, pinned, state_bytes, budget_bytes)
    static_bytes = static_offload_traffic(trace) * iterations
    out: dict[str, Any] = {
        "streaming_room_bytes": room_bytes,
        "non_model_peak_bytes": trace.peak_non_model_bytes,
        "static_bytes_per_step": static_bytes,
        "static_over_measured": static_bytes / measured_bytes if measured_bytes else None,
    }
    try:
        lower = traffic_lower_bound(streamed, device_budget_bytes=room_bytes, iterations=iterations)
    except ValueError as err:  # the room is below a moment's need: nothing to compare with
        return out | {"lower_bound_bytes_per_step": None, "optimal_error": str(err)}
    out["lower_bound_bytes_per_step"] = lower
    out["measured_over_lower_bound"] = measured_bytes / lower if lower else None
    try:
        optimal = optimal_traffic(streamed, device_budget_bytes=room_bytes, iterations=iterations)
    except ValueError as err:  # unequal chunk sizes: only the lower bound is exact enough
        return out | {"optimal_bytes_per_step": None, "optimal_error": str(err)}
    out["optimal_bytes_per_step"] = optimal
    out["measured_over_optimal"] = measured_bytes / optimal if optimal else None
    return out


# -- scale: the deepest model under a budget pair ---------------------------------------------


def scale_search(settings: OffloadSettings) -> dict[str, Any]:
    """Bisect the number of GPT blocks between one that trains and one that does not, each try
    training ``SCALE_STEPS`` steps in its own process."""
    device, host = settings.device_budget_bytes, settings.host_budget_bytes
    overrides = (
        *_SCALE_OVERRIDES,
        *settings.overrides,
        "engine=chunk",
        f"memory.device_budget={device}",
        f"memory.host_budget={host}",
        f"training.steps={SCALE_STEPS}",
    )
    base = _job(settings.recipe, overrides)
    per_param = _model_data_bytes_per_param(base.training.precision)
    tries: dict[int, dict[str, Any]] = {}

    def fits(depth: int) -> bool:
        tries[depth] = in_own_process(_scale_try, settings.recipe, overrides, depth)
        return bool(tries[depth].get("fits"))

    # ``high`` holds more model data than both budgets together: it cannot fit.
    low, high = 1, _first_depth_over(base, (device + host) // per_param)
    if fits(low):
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
    best = tries[low] if tries[low].get("fits") else None
    row: dict[str, Any] = {
        "recipe": settings.recipe,
        "d_model": base.model.resolve_gpt().d_model,
        "seq_len": base.model.resolve_gpt().seq_len,
        "device_budget_bytes": device,
        "host_budget_bytes": host,
        "model_data_bytes_per_param": per_param,
        "tries": [{"num_layers": d, **tries[d]} for d in sorted(tries)],
        "largest_num_layers": low if best else None,
        "largest_num_params": best["num_params"] if best else None,
    }
    if best is None:
        return row | {"error": f"not even one block trains: {tries[low].get('reason')}"}
    non_model = best["non_model_peak_bytes"]
    limit = (device + host - non_model) / per_param
    return row | {
        "non_model_peak_bytes": non_model,
        "limit_num_params": limit,
        "params_over_limit": best["num_params"] / limit,
    }


def _model_data_bytes_per_param(precision: str) -> int:
    """AdamW over chunks: parameter, fp32 gradient and two fp32 moments, plus an fp32 master
    copy when the parameters are in bf16 or fp16 (16 bytes in fp32, 18 otherwise)."""
    return 16 if precision == "fp32" else 2 + 4 + 4 + 4 + 4


def _depth_job(base: JobConfig, depth: int) -> JobConfig:
    return load_job(base, [f"model.num_layers={depth}"])


def _first_depth_over(base: JobConfig, max_params: int) -> int:
    """The fewest blocks whose parameter count exceeds ``max_params``: that cannot fit."""
    depth = 1
    while closed_form_num_params(_depth_job(base, depth).model.resolve_gpt()) <= max_params:
        depth += 1
    return depth


def _scale_try(recipe: str, overrides: tuple[str, ...], depth: int) -> dict[str, Any]:
    job = _depth_job(_job(recipe, overrides), depth)
    num_params = closed_form_num_params(job.model.resolve_gpt())
    steps_done = 0
    try:
        run = build_run(TIDAL_CHUNK, job)
        for _ in range(SCALE_STEPS):
            train_steps(run, 1)
            steps_done += 1
    except BUDGET_ERRORS as err:
        return {
            "num_params": num_params,
            "fits": False,
            "steps_done": steps_done,
            "reason": f"{type(err).__name__}: {err}",
        }
    stats = run.engine.stats()
    return {
        "num_params": num_params,
        "fits": True,
        "peak_device_bytes": stats["peak_device_bytes"],
        "peak_host_bytes": stats["peak_host_bytes"],
        "non_model_peak_bytes": run.engine.store.trace.peak_non_model_bytes,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


# -- presentation ----------------------------------------------------------------------------------


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _size(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """One table per section the result holds ([Note: one table per result])."""
    present = {row["section"] for row in result["rows"]}
    return [
        ResultTable.of(f"tidal bench offload: {section}", *table(section, result["rows"]))
        for section in SECTIONS
        if section in present
    ]


def table(section: str, rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of one section's table."""
    rows = [r for r in rows if r["section"] == section]
    return {
        "overhead": _overhead_table,
        "host": _overhead_table,
        "traffic": _traffic_table,
        "scale": _scale_table,
    }[section](rows)


def _overhead_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["system", "recipe", "step", "tokens/s", "vs pytorch", "peak RSS", "RSS vs pytorch", "final loss"]  # fmt: skip
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["system"], r["recipe"], f"error: {r['error']}", *["-"] * 5])
            continue
        cells.append([
            r["system"], r["recipe"], f"{r['median_step_s']:.3f}s", f"{r['tokens_per_s']:,.0f}",
            _ratio(r.get("step_time_ratio")), _size(r["peak_rss_bytes"]),
            _ratio(r.get("peak_rss_ratio")), f"{r['final_loss']:.4f}",
        ])  # fmt: skip
    return headers, cells


def _traffic_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["budget", "pinned", "to device/step", "to host/step (grads)", "optimal", "lower bound", "measured/optimal", "static", "static/measured"]  # fmt: skip
    cells = []
    for r in rows:
        budget = f"{r['budget_fraction']:.0%}: {_size(r['device_budget_bytes'])}"
        if "error" in r:
            cells.append([budget, f"error: {r['error']}", *["-"] * 7])
            continue
        cells.append([
            budget, f"{r['pinned_chunks']}/{r['num_chunks']}",
            _size(r["to_device_bytes_per_step"]),
            f"{_size(r['to_host_bytes_per_step'])} ({_size(r['grad_to_host_bytes_per_step'])})",
            _size(r.get("optimal_bytes_per_step")), _size(r.get("lower_bound_bytes_per_step")),
            _ratio(r.get("measured_over_optimal")), _size(r["static_bytes_per_step"]),
            _ratio(r.get("static_over_measured")),
        ])  # fmt: skip
    return headers, cells


def _scale_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["device + host", "width", "tries (blocks: fits)", "most blocks", "params", "limit", "params/limit"]  # fmt: skip
    cells = []
    for r in rows:
        budgets = f"{_size(r['device_budget_bytes'])} + {_size(r['host_budget_bytes'])}"
        tries = ", ".join(f"{t['num_layers']}:{'y' if t.get('fits') else 'n'}" for t in r["tries"])
        cells.append([
            budgets, str(r["d_model"]), tries, str(r["largest_num_layers"] or "-"),
            f"{r['largest_num_params']:,}" if r["largest_num_params"] else "-",
            f"{r['limit_num_params']:,.0f}" if "limit_num_params" in r else "-",
            _ratio(r.get("params_over_limit")),
        ])  # fmt: skip
    return headers, cells
