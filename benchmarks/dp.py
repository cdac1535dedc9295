"""``tidal bench dp``: tidal's sharded chunks against DeepSpeed ZeRO-3 offload and FSDP2 offload.

Every configuration (system, N ranks) runs in N fresh processes (:func:`tidal.testing.run_on_ranks`,
gloo on the CPU, ``cores // N`` threads per rank), so a rank's peak resident set is that
configuration's alone; the systems and what they share are in :mod:`benchmarks.dp_systems`.
Three sections, each a list of rows tagged ``"section"``:

- ``perf``: per system and N, the median step time after ``warmup_steps``, global tokens/s, the
  losses (systems at the same N train the same model on the same batches, so they agree to
  rounding), and per rank the peak RSS and the RSS after warm-up; ratios against tidal at the
  same N. Model data lives in host memory for every system (there is no device to offload
  from on a CPU), so the budgets of tidal's tiers are left unlimited here.
- ``scale``: per system, the deepest GPT (the recipe's width, more blocks, short sequences,
  ``SCALE_STEPS`` steps) whose every rank stays within a per-rank host budget, measured by the
  rank's peak RSS (see [Note: peak RSS of a spawned rank] in dp_systems.py); a failure of any
  rank (an out-of-memory kill, or tidal refusing its tier budgets) counts as not fitting. The
  search is coarse on purpose (:func:`search_largest`): double the depth from a guess until a
  probe does not fit, then bisect a few times.
- ``nvme``: tidal alone, a model whose AdamW data is larger than its ranks' host budgets, built
  deferred and trained through the NVMe tier (:mod:`benchmarks.dp_nvme`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.dp_nvme import nvme_rows, nvme_table
from benchmarks.dp_runs import (
    MODEL_DATA_BYTES_PER_PARAM,
    SCALE_STEPS,
    SECTIONS,
    DpSettings,
    fixed_overrides,
    num_params_at_depth,
    per_rank_memory,
    recipe_job,
    run_configuration,
    scale_overrides,
    teardown_figures,
)
from benchmarks.dp_systems import TIDAL, Case, missing_reason
from benchmarks.results import write_results
from benchmarks.tables import ResultTable
from tidal.config import format_bytes
from tidal.parallel.accumulation import rank_rows
from tidal.train.job import JobConfig

__all__ = [
    "SECTIONS",
    "TEARDOWN_FOOTNOTE",
    "DpSettings",
    "bench_dp",
    "has_teardown_errors",
    "perf_rows",
    "scale_rows",
    "search_largest",
    "table",
    "tables",
    "write_dp_results",
]

FP32_BYTES = 4


def bench_dp(settings: DpSettings) -> list[dict[str, Any]]:
    """Every selected section's rows, in the order of :data:`SECTIONS`."""
    _check(settings)
    sections: dict[str, Callable[[DpSettings], list[dict[str, Any]]]] = {
        "perf": perf_rows,
        "scale": scale_rows,
        "nvme": nvme_rows,
    }
    rows: list[dict[str, Any]] = []
    for name in SECTIONS:
        if name in settings.sections:
            rows.extend({"section": name, **row} for row in sections[name](settings))
    return rows


def write_dp_results(
    settings: DpSettings, rows: list[dict[str, Any]], *, folder: Path | None = None
) -> Path:
    """:func:`write_results`, plus the settings and the baselines' versions at the top level."""
    path = write_results("dp", rows, folder=folder)
    data = json.loads(path.read_text())
    try:
        deepspeed_version: str | None = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed_version = None
    extra = {"deepspeed_version": deepspeed_version, "settings": dataclasses.asdict(settings)}
    rows_last = {key: value for key, value in data.items() if key != "rows"}
    path.write_text(json.dumps({**rows_last, **extra, "rows": data["rows"]}, indent=2) + "\n")
    return path


def _check(settings: DpSettings) -> None:
    """A bad recipe, override or batch split fails before any configuration runs."""
    job = recipe_job(settings.recipe, _perf_overrides(settings))
    for n in settings.nprocs:
        rank_rows(job.training.batch_size, rank=0, world_size=n)
    if "scale" in settings.sections or "nvme" in settings.sections:
        job = recipe_job(settings.recipe, scale_overrides(settings))
        rank_rows(job.training.batch_size, rank=0, world_size=settings.scale_nproc)


# -- perf ------------------------------------------------------------------------------------------


def _perf_overrides(settings: DpSettings) -> tuple[str, ...]:
    return (*fixed_overrides(settings), f"training.steps={settings.steps}")


def perf_rows(settings: DpSettings) -> list[dict[str, Any]]:
    """One row per (system, N), N in the outer loop; ratios against tidal at the same N."""
    rows = []
    for nproc in settings.nprocs:
        group = [_perf_row(settings, system, nproc) for system in settings.systems]
        _add_ratios(group)
        rows.extend(group)
    return rows


def _perf_row(settings: DpSettings, system: str, nproc: int) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "nproc": nproc, "recipe": settings.recipe}
    reason = missing_reason(system)
    if reason is not None:
        return row | {"error": reason}
    case = Case(
        system=system,
        recipe=settings.recipe,
        overrides=_perf_overrides(settings),
        steps=settings.steps,
        warmup_steps=settings.warmup_steps,
    )
    load_before = os.getloadavg()[0]
    ranks = run_configuration(case, nproc, settings.timeout_s)
    if isinstance(ranks, str):
        return row | {"error": ranks}
    first = ranks[0]
    median_s = first["median_step_s"]
    return row | {
        "num_params": first["num_params"],
        "tokens_per_step": first["tokens_per_step"],
        "steps": settings.steps,
        "warmup_steps": settings.warmup_steps,
        "median_step_s": median_s,
        "tokens_per_s": first["tokens_per_step"] / median_s,
        "step_s": first["step_s"],
        "losses": first["losses"],
        "final_loss": first["losses"][-1],
        **per_rank_memory(ranks),
        "num_threads_per_rank": first["num_threads"],
        **teardown_figures(first),
        # Other processes on the machine slow a configuration down; this says how busy it was.
        "load_average_1m": [load_before, os.getloadavg()[0]],
    }


def _add_ratios(group: list[dict[str, Any]]) -> None:
    base = next((r for r in group if r["system"] == TIDAL and "error" not in r), None)
    if base is None:
        return
    for row in group:
        if "error" in row:
            continue
        row["step_time_vs_tidal"] = row["median_step_s"] / base["median_step_s"]
        row["peak_rss_vs_tidal"] = max(row["peak_rss_bytes"]) / max(base["peak_rss_bytes"])
        row["final_loss_minus_tidal"] = row["final_loss"] - base["final_loss"]


# -- scale -----------------------------------------------------------------------------------------


def search_largest(
    fits: Callable[[int], bool], *, start: int, limit: int, bisections: int
) -> int | None:
    """The largest ``n`` in ``[1, limit)`` found to fit, ``limit`` being known not to.

    Doubles from ``start`` while probes fit (halves while they do not), which brackets the edge
    between a fitting ``low`` and a failing ``high``; then bisects that bracket ``bisections``
    times. Coarse by design: each probe is a training run. ``fits`` is called at most once per
    value and is assumed monotone (what fits at ``n`` fits below it).
    """
    if limit <= 1:
        return None
    tried: dict[int, bool] = {}

    def probe(n: int) -> bool:
        if n not in tried:
            tried[n] = fits(n)
        return tried[n]

    n = min(max(1, start), limit - 1)
    if probe(n):
        low, high = n, limit
        while 2 * low < limit:
            if not probe(2 * low):
                high = 2 * low
                break
            low *= 2
    else:
        high = n
        while high > 1 and not probe(high // 2):
            high //= 2
        if high == 1:
            return None
        low = high // 2
    for _ in range(bisections):
        if high - low <= 1:
            break
        mid = (low + high) // 2
        low, high = (mid, high) if probe(mid) else (low, mid)
    return low


def _depth_bounds(base: JobConfig, budget_bytes: int, nproc: int) -> tuple[int, int]:
    """A first depth to probe and one that cannot fit.

    Each rank builds the whole fp32 model before any system shards it, so a depth whose weights
    exceed one rank's budget cannot fit. The first probe guesses that an eighth of the N ranks'
    budgets holds model data, fully sharded: the rest goes to the process itself (torch alone is
    a few hundred MiB), the whole model each rank builds, gathered blocks and allocator slack.
    """
    guess_params = budget_bytes * nproc // (8 * MODEL_DATA_BYTES_PER_PARAM)
    start = limit = 1
    while num_params_at_depth(base, limit) * FP32_BYTES <= budget_bytes:
        if num_params_at_depth(base, limit) <= guess_params:
            start = limit
        limit += 1
    return start, limit


def scale_rows(settings: DpSettings) -> list[dict[str, Any]]:
    """One row per (host budget, system), at ``settings.scale_nproc`` ranks."""
    rows = []
    for budget in settings.host_budgets_bytes:
        group = [_scale_row(settings, system, budget) for system in settings.systems]
        base = next((r for r in group if r["system"] == TIDAL), None)
        base_params = base.get("largest_num_params") if base else None
        for row in group:
            if base_params and row.get("largest_num_params"):
                row["largest_params_vs_tidal"] = row["largest_num_params"] / base_params
        rows.extend(group)
    return rows


def _scale_row(settings: DpSettings, system: str, budget_bytes: int) -> dict[str, Any]:
    nproc = settings.scale_nproc
    overrides = scale_overrides(settings)
    base = recipe_job(settings.recipe, overrides)
    model = base.model.resolve_gpt()
    row: dict[str, Any] = {
        "system": system, "nproc": nproc, "recipe": settings.recipe,
        "host_budget_bytes_per_rank": budget_bytes, "d_model": model.d_model,
        "seq_len": model.seq_len, "steps": SCALE_STEPS,
    }  # fmt: skip
    reason = missing_reason(system)
    if reason is not None:
        return row | {"error": reason}
    tries: list[dict[str, Any]] = []

    def fits(depth: int) -> bool:
        case = Case(
            system=system,
            recipe=settings.recipe,
            overrides=(*overrides, f"model.num_layers={depth}"),
            steps=SCALE_STEPS,
            warmup_steps=1,
            tidal_budget_bytes=budget_bytes if system == TIDAL else None,
            tidal_device_fraction=settings.tidal_device_fraction,
        )
        tries.append(_probe(case, nproc, budget_bytes, settings.timeout_s))
        tries[-1] = {
            "num_layers": depth,
            "num_params": num_params_at_depth(base, depth),
            **tries[-1],
        }
        return bool(tries[-1]["fits"])

    start, limit = _depth_bounds(base, budget_bytes, nproc)
    largest = search_largest(fits, start=start, limit=limit, bisections=settings.bisections)
    best = next((t for t in tries if t["num_layers"] == largest), None)
    return row | {
        "first_depth_over_weights": limit,
        "tries": sorted(tries, key=lambda t: t["num_layers"]),
        "largest_num_layers": largest,
        "largest_num_params": best["num_params"] if best else None,
        "largest_peak_rss_bytes": best["peak_rss_bytes"] if best else None,
    }


def _probe(case: Case, nproc: int, budget_bytes: int, timeout_s: float) -> dict[str, Any]:
    ranks = run_configuration(case, nproc, timeout_s)
    if isinstance(ranks, str):
        return {"fits": False, "error": ranks}
    figures = per_rank_memory(ranks)
    over = max(figures["peak_rss_bytes"]) > budget_bytes
    return {
        "fits": not over,
        **figures,
        **teardown_figures(ranks[0]),
        "final_loss": ranks[0]["losses"][-1],
        "tidal_budgets": ranks[0]["tidal_budgets"],
    }


# -- presentation ----------------------------------------------------------------------------------


# Flags figures of a run whose ranks finished but then failed; see [Note: teardown failures].
_TEARDOWN_MARK = "*"
TEARDOWN_FOOTNOTE = (
    "* every rank finished and wrote its figures, then one failed in teardown "
    "(teardown_error in the JSON)"
)


def has_teardown_errors(rows: Sequence[dict[str, Any]]) -> bool:
    runs = [*rows, *(t for r in rows for t in r.get("tries", ()))]
    return any("teardown_error" in run for run in runs)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _sizes(values: Sequence[int] | None) -> str:
    return "-" if not values else ", ".join(format_bytes(v) for v in values)


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """One table per section the result holds ([Note: one table per result]); a run whose ranks
    failed in teardown says so under its table."""
    present = {row["section"] for row in result["rows"]}
    note = TEARDOWN_FOOTNOTE if has_teardown_errors(result["rows"]) else None
    return [
        ResultTable.of(f"tidal bench dp: {section}", *table(section, result["rows"]), note=note)
        for section in SECTIONS
        if section in present
    ]


def table(section: str, rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of one section's table."""
    rows = [r for r in rows if r["section"] == section]
    return {"perf": _perf_table, "scale": _scale_table, "nvme": nvme_table}[section](rows)


def _perf_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["system", "N", "step", "tokens/s", "time vs tidal", "peak RSS/rank", "RSS vs tidal", "RSS after warm-up/rank", "final loss", "loss - tidal"]  # fmt: skip
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["system"], str(r["nproc"]), f"error: {r['error']}", *["-"] * 7])
            continue
        delta = r.get("final_loss_minus_tidal")
        cells.append([
            r["system"], f"{r['nproc']}{_TEARDOWN_MARK if 'teardown_error' in r else ''}", f"{r['median_step_s']:.3f}s",
            f"{r['tokens_per_s']:,.0f}", _ratio(r.get("step_time_vs_tidal")),
            _sizes(r["peak_rss_bytes"]), _ratio(r.get("peak_rss_vs_tidal")),
            _sizes(r["rss_after_warmup_bytes"]), f"{r['final_loss']:.5f}",
            "-" if delta is None else f"{delta:+.1e}",
        ])  # fmt: skip
    return headers, cells


def _scale_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["system", "N", "budget/rank", "width", "tries (blocks: peak RSS/rank or error)", "most blocks", "params", "vs tidal"]  # fmt: skip
    cells = []
    for r in rows:
        head = [r["system"], str(r["nproc"]), format_bytes(r["host_budget_bytes_per_rank"]), str(r["d_model"])]  # fmt: skip
        if "error" in r:
            cells.append([*head, f"error: {r['error']}", *["-"] * 3])
            continue
        tries = ", ".join(_try_cell(t) for t in r["tries"])
        params = r["largest_num_params"]
        cells.append([
            *head, tries, str(r["largest_num_layers"] or "-"),
            f"{params:,}" if params else "-", _ratio(r.get("largest_params_vs_tidal")),
        ])  # fmt: skip
    return headers, cells


def _try_cell(t: dict[str, Any]) -> str:
    mark = ("y" if t["fits"] else "n") + (_TEARDOWN_MARK if "teardown_error" in t else "")
    if "error" in t:
        return f"{t['num_layers']}:{mark} (failed)"
    return f"{t['num_layers']}:{mark} ({format_bytes(max(t['peak_rss_bytes']))})"
