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
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.dp_systems import (
    DP_SYSTEMS,
    TIDAL,
    Case,
    missing_reason,
    run_case,
)
from benchmarks.results import write_results
from tidal.config import format_bytes, require
from tidal.models import closed_form_num_params
from tidal.testing import RankFailure, run_on_ranks
from tidal.train.job import JobConfig, find_recipe, load_job
from tidal.train.trainer import rank_rows

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
    "write_dp_results",
]

SECTIONS = ("perf", "scale", "nvme")
SCALE_STEPS = 2
SCALE_SEQ_LEN = 64
FP32_BYTES = 4
# AdamW model data per parameter in fp32: weight, gradient and two moments.
MODEL_DATA_BYTES_PER_PARAM = 16

_FIXED = ("training.device=cpu",)
_UNLIMITED = ("memory.device_budget=none", "memory.host_budget=none")
# Probes train briefly: one sequence per rank, synthetic tokens, no checkpoints or validation.
_SCALE_OVERRIDES = (
    "data.source=synthetic", "training.grad_accum_steps=1", "training.precision=fp32",
    f"model.seq_len={SCALE_SEQ_LEN}", f"training.steps={SCALE_STEPS}",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DpSettings:
    """What ``tidal bench dp`` runs; ``overrides`` apply to every configuration.

    The scale section runs on ``max(nprocs)`` ranks, once per per-rank host budget, with
    ``bisections`` probes after the doubling. tidal is given ``tidal_device_fraction`` of a budget
    as its device tier (gathered chunks and activations) and the rest, less what the rank held
    before building the model, as its host tier. ``timeout_s`` bounds one configuration.
    """

    sections: tuple[str, ...] = SECTIONS
    recipe: str = "demo"
    systems: tuple[str, ...] = DP_SYSTEMS
    nprocs: tuple[int, ...] = (1, 2)
    steps: int = 10
    warmup_steps: int = 3
    host_budgets_bytes: tuple[int, ...] = (1 << 30,)
    bisections: int = 3
    tidal_device_fraction: float = 0.1
    nvme_model_factor: float = 2.0
    timeout_s: float = 600.0
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        require(not unknown, "--section", f"unknown {unknown}; choose from {SECTIONS}")
        unknown = sorted(set(self.systems) - set(DP_SYSTEMS))
        require(not unknown, "--systems", f"unknown {unknown}; choose from {DP_SYSTEMS}")
        require(bool(self.systems), "--systems", "choose at least one system")
        require(
            bool(self.nprocs) and min(self.nprocs) >= 1,
            "--nproc",
            f"rank counts must be >= 1, got {self.nprocs}",
        )
        require(
            self.steps > self.warmup_steps >= 0,
            "--steps",
            f"{self.steps} must exceed --warmup ({self.warmup_steps}), which must be >= 0",
        )
        require(
            all(b > 0 for b in self.host_budgets_bytes),
            "--host-budget",
            f"budgets must be > 0, got {self.host_budgets_bytes}",
        )
        require(self.bisections >= 0, "bisections", f"must be >= 0, got {self.bisections}")
        require(self.nvme_model_factor > 0, "nvme_model_factor",
                f"must be > 0, got {self.nvme_model_factor}")  # fmt: skip

    @property
    def scale_nproc(self) -> int:
        return max(self.nprocs)


def bench_dp(settings: DpSettings) -> list[dict[str, Any]]:
    """Every selected section's rows, in the order of :data:`SECTIONS`."""
    from benchmarks.dp_nvme import nvme_rows  # it builds on this module

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


def recipe_job(recipe: str, overrides: Sequence[str]) -> JobConfig:
    return load_job(find_recipe(recipe), list(overrides))


def _check(settings: DpSettings) -> None:
    """A bad recipe, override or batch split fails before any configuration runs."""
    job = recipe_job(settings.recipe, _perf_overrides(settings))
    for n in settings.nprocs:
        rank_rows(job.training.batch_size, rank=0, world_size=n)
    if "scale" in settings.sections or "nvme" in settings.sections:
        job = recipe_job(settings.recipe, scale_overrides(settings))
        rank_rows(job.training.batch_size, rank=0, world_size=settings.scale_nproc)


# [Note: teardown failures]
# With gloo, a rank of two sometimes aborts inside ``destroy_process_group`` after its run is
# complete ("terminate called without an active exception", SIGABRT; about 1 in 25 runs of 2
# ranks here, for every system), which :func:`run_on_ranks` rightly reports as a failed rank.
# A bench of dozens of configurations would lose one most times it runs, and the scale search
# would read it as "does not fit". So each rank also writes its figures to a file before it
# returns: when every rank wrote them, the run itself succeeded, and the row keeps the figures
# and says what failed after them (``teardown_error``). Any other failure is the row's error.


def run_configuration(case: Case, nproc: int, timeout_s: float) -> list[dict[str, Any]] | str:
    """Every rank's figures, or why the configuration failed."""
    with tempfile.TemporaryDirectory(prefix="tidal-bench-dp-") as folder:
        case = dataclasses.replace(case, result_dir=folder)
        try:
            return run_on_ranks(run_case, world_size=nproc, args=(case,), timeout_s=timeout_s)
        except RankFailure as err:
            paths = [Path(folder) / f"rank{r}.json" for r in range(nproc)]
            if not all(p.is_file() for p in paths):
                return _first_lines(str(err))
            note = _first_lines(str(err))
            return [{**json.loads(p.read_text()), "teardown_error": note} for p in paths]


def _first_lines(text: str) -> str:
    """What each failed rank raised or how it died, without the tracebacks."""
    head, *lines = text.splitlines()
    return f"{head} " + "; ".join(line for line in lines if line.startswith("rank "))


# -- perf ------------------------------------------------------------------------------------------


def _perf_overrides(settings: DpSettings) -> tuple[str, ...]:
    return (
        *settings.overrides, *_FIXED, "engine=chunk", *_UNLIMITED,
        f"training.steps={settings.steps}",
    )  # fmt: skip


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


def teardown_figures(first: dict[str, Any]) -> dict[str, str]:
    """See [Note: teardown failures]."""
    return {"teardown_error": first["teardown_error"]} if "teardown_error" in first else {}


def per_rank_memory(ranks: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    return {
        "peak_rss_bytes": [r["hwm_rss_bytes"] for r in ranks],
        "ru_maxrss_bytes": [r["ru_maxrss_bytes"] for r in ranks],
        "rss_after_warmup_bytes": [r["rss_after_warmup_bytes"] for r in ranks],
        "base_rss_bytes": [r["base_rss_bytes"] for r in ranks],
        # Each rank builds the whole model before a system shards it (tidal in the nvme
        # section builds it deferred): this shows that peak.
        "peak_rss_after_build_bytes": [r["hwm_rss_after_build_bytes"] for r in ranks],
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


def scale_overrides(settings: DpSettings) -> tuple[str, ...]:
    batch = f"training.batch_size={settings.scale_nproc}"
    return (*settings.overrides, *_FIXED, "engine=chunk", *_UNLIMITED, *_SCALE_OVERRIDES, batch)


def num_params_at_depth(base: JobConfig, depth: int) -> int:
    return closed_form_num_params(dataclasses.replace(base.model.resolve(), num_layers=depth))


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
    model = base.model.resolve()
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


def table(section: str, rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of one section's table (the CLI draws it)."""
    from benchmarks.dp_nvme import nvme_table

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
