"""``tidal bench compose``: tidal's compositions of parallelisms on 4 gloo ranks against DeepSpeed
ZeRO-3 offload and FSDP2 CPU offload, under one per-rank host budget.

    tidal bench compose                      # every section, every configuration
    tidal bench compose --quick              # a smoke run: the tiny recipe, at most 6 blocks

Every configuration is data (:data:`COMPOSITIONS`: a mesh and an engine as overrides, or a
peer), run in 4 fresh processes each time (:func:`benchmarks.dp_runs.run_configuration`), on
the recipe's width with short synthetic sequences, untied embeddings (ZeRO-3 chunk stages
refuse tied ones) and fp32. Sections, each a list of rows tagged ``"section"``:

- ``scale``: per configuration, the deepest GPT whose every rank stays within the host budget
  (peak RSS, [Note: peak RSS of a spawned rank] in dp_systems.py), by
  :func:`benchmarks.dp.search_largest` ([Note: fits, refused, failed]);
- ``fixed``: every configuration at one depth all of them fit (the least of the scale
  section's largest, or ``--layers``): median step, the bytes each rank all-gathers,
  reduce-scatters and sends per step (tidal's counters; the peers' from the ZeRO-3 formula,
  :func:`zero3_bytes`, and said so), and each rank's peak beside tidal's own figure for it
  ([Note: tidal's memory figure] in compose_ranks.py);
- ``targets``: the issue's targets read off those rows, those that miss beside those that hold.

[Note: one budget]
Every configuration is held to the same per-rank budget, judged by each rank's peak RSS. tidal
is also told it, as its runtime takes it: chunks (the ZeRO-3 engine, chunk stages) get
``--device-fraction`` of it as the device tier and the rest, less what the rank held before
the model existed, as the host tier (:func:`benchmarks.dp_systems.tidal_budget_overrides`);
plain pipeline stages get the budget less that as ``memory.device_budget``, which their
memory plan checks before the first step. The peers have no such setting. No configuration
holds the whole model on a rank at any time: tidal builds on the meta device, as ``tidal train``
does; DeepSpeed constructs the model inside ``deepspeed.zero.Init`` (each module's parameters
partitioned as it is made, then set one gathered parameter at a time), FSDP2 ``fully_shard``-s
a meta model and then allocates and draws each rank's shards (``ComposeCase.deferred``;
``tidal bench dp`` builds the peers whole on every rank first).

[Note: fits, refused, failed]
A probe fits when every rank finished within the budget. It does not fit when a rank went over
the budget, or failed for memory: tidal refusing its tiers' budgets, a tier over budget, an
allocation that failed, a rank killed by SIGKILL (:data:`~benchmarks.compose_ranks.
BUDGET_MARKERS`). A configuration tidal refuses at job check (a ``ConfigError``: the NVMe tier
on chunk stages and tensor-parallel stages, until they land) is no size at all: its row says
"not runnable" with the refusal's line, and it runs without a change here once tidal accepts
it. Any other failure ends the configuration's search with the error in its row.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.compose_ranks import (
    ComposeCase,
    check_runnable,
    is_budget_failure,
    refusal_line,
    run_compose_case,
)
from benchmarks.dp import search_largest
from benchmarks.dp_runs import MODEL_DATA_BYTES_PER_PARAM, num_params_at_depth, per_rank_memory
from benchmarks.dp_systems import DEEPSPEED, FSDP2, TIDAL, missing_reason
from benchmarks.tables import ResultTable
from tidal.config import ConfigError, format_bytes, parse_bytes, require
from tidal.train.job import JobConfig, find_recipe, load_job

__all__ = [
    "BASELINE",
    "COMPOSITIONS",
    "NPROC",
    "SECTIONS",
    "ComposeSettings",
    "Composition",
    "add_arguments",
    "bench_compose",
    "depth_bounds",
    "fixed_depth",
    "moved_per_rank",
    "not_runnable_row",
    "run",
    "holds",
    "settings_from_args",
    "tables",
    "target_rows",
    "zero3_bytes",
]

NPROC = 4
SECTIONS = ("scale", "fixed", "targets")
SEQ_LEN = 32
FP32_BYTES = 4
# Probes train briefly on one sequence per rank; no model is tied ([Note: one budget]).
_BASE_OVERRIDES = (
    "training.device=cpu", "memory.device_budget=none", "memory.host_budget=none",
    "data.source=synthetic", "training.grad_accum_steps=1", "training.precision=fp32",
    f"model.seq_len={SEQ_LEN}", f"training.batch_size={NPROC}", "model.tie_embeddings=false",
)  # fmt: skip
_SCALE_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class Composition:
    """One configuration of the bench: ``system`` ``tidal`` with ``overrides`` (its mesh and
    engine; ``nvme``: a fresh ``memory.nvme_dir`` per run), or a peer on 4 ranks."""

    key: str
    label: str
    system: str = TIDAL
    overrides: tuple[str, ...] = ()
    nvme: bool = False


_PP2_DP2_CHUNK = ("engine=chunk", "parallel.pp=2", "parallel.dp=2")
COMPOSITIONS: tuple[Composition, ...] = (
    Composition(key="dp4-zero3", label="dp4 chunk ZeRO-3", overrides=("engine=chunk",)),
    Composition(key="pp4", label="pp4", overrides=("engine=reference", "parallel.pp=4")),
    Composition(key="pp2-dp2-chunk", label="pp2 x dp2 chunk", overrides=_PP2_DP2_CHUNK),
    Composition(key="pp2-dp2-chunk-nvme", label="pp2 x dp2 chunk + NVMe",
                overrides=_PP2_DP2_CHUNK, nvme=True),
    Composition(key="pp2-tp2", label="pp2 x tp2",
                overrides=("engine=reference", "parallel.pp=2", "parallel.tp=2")),
    Composition(key="pp2-dp2-chunk-per-step", label="pp2 x dp2 chunk, reduce per step",
                overrides=(*_PP2_DP2_CHUNK, "sharding.reduce_per_step=true")),
    Composition(key="deepspeed", label="DeepSpeed ZeRO-3 offload (dp4)", system=DEEPSPEED),
    Composition(key="fsdp2", label="FSDP2 CPU offload (dp4)", system=FSDP2),
)  # fmt: skip
_BY_KEY = {c.key: c for c in COMPOSITIONS}
BASELINE = "dp4-zero3"  # what the fixed section's ratios are against
# The peers build the model as their docs do for one no rank holds ([Note: one budget]); their
# rows say so ("build"), as a run from before this has no such key.
PEERS_DEFERRED = True
_QUICK = {"recipe": "tiny", "max_layers": 6, "bisections": 1, "steps": 3, "warmup_steps": 1}


@dataclass(frozen=True, kw_only=True)
class ComposeSettings:
    """What ``tidal bench compose`` runs. The scale search probes depths up to ``max_layers``
    (a largest equal to it is a lower bound, marked so), ``bisections`` probes after the
    doubling; the fixed section runs ``steps`` steps at ``layers`` blocks (default: the least
    largest of the scale section), timing those after ``warmup_steps``."""

    sections: tuple[str, ...] = SECTIONS
    recipe: str = "demo"
    compositions: tuple[str, ...] = tuple(c.key for c in COMPOSITIONS)
    host_budget_bytes: int = 1 << 30
    device_fraction: float = 0.2
    max_layers: int = 128
    bisections: int = 2
    nvme_factor: float = 4.0  # the NVMe configuration's search limit over the budgets' model data
    layers: int | None = None
    steps: int = 6
    warmup_steps: int = 2
    timeout_s: float = 900.0
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        require(not unknown, "--section", f"unknown {unknown}; choose from {SECTIONS}")
        unknown = sorted(set(self.compositions) - set(_BY_KEY))
        require(not unknown, "--compositions", f"unknown {unknown}; choose from {tuple(_BY_KEY)}")
        require(self.host_budget_bytes > 0, "--host-budget", "must be > 0")
        require(0 < self.device_fraction < 1, "--device-fraction", "must be in (0, 1)")
        require(self.max_layers >= 1, "--max-layers", f"must be >= 1, got {self.max_layers}")
        require(self.layers is None or self.layers >= 1, "--layers", "must be >= 1")
        require(self.steps > self.warmup_steps >= 0, "--steps",
                f"{self.steps} must exceed --warmup-steps ({self.warmup_steps}) >= 0")  # fmt: skip

    def overrides_at(self, composition: Composition, depth: int, steps: int) -> tuple[str, ...]:
        """A configuration's overrides at ``depth`` blocks: the bench's, the user's, its own."""
        return (*_BASE_OVERRIDES, *self.overrides, *composition.overrides,
                f"model.num_layers={depth}", f"training.steps={steps}")  # fmt: skip


# -- the configurations -------------------------------------------------------------------------


def _refusal(settings: ComposeSettings, composition: Composition, depth: int) -> str | None:
    """Why this machine or tidal cannot run ``composition`` at ``depth`` blocks, in one line;
    None if it can try."""
    if composition.system != TIDAL:
        return missing_reason(composition.system)
    overrides = settings.overrides_at(composition, depth, _SCALE_STEPS)
    nvme = ("memory.nvme_dir=" + tempfile.gettempdir(),) if composition.nvme else ()
    try:
        job = load_job(find_recipe(settings.recipe), [*overrides, *nvme])
    except ConfigError as err:
        return str(err)
    return check_runnable(job, NPROC)


def not_runnable_row(composition: Composition, reason: str) -> dict[str, Any]:
    """The row of a configuration that did not run: tidal's refusal or a missing peer."""
    return {"composition": composition.key, "label": composition.label,
            "system": composition.system, "not_runnable": reason}  # fmt: skip


class _Refused(Exception):
    """tidal refused the configuration on a rank ([Note: fits, refused, failed])."""


class _Failed(Exception):
    """A run failed for another reason than memory ([Note: fits, refused, failed])."""


def _run(settings: ComposeSettings, composition: Composition, depth: int, *, steps: int,
         warmup_steps: int) -> list[dict[str, Any]] | str:  # fmt: skip
    """Every rank's figures, or why the run failed."""
    with tempfile.TemporaryDirectory(prefix="tidal-bench-compose-nvme-") as nvme_dir:
        nvme = (f"memory.nvme_dir={nvme_dir}",) if composition.nvme else ()
        case = ComposeCase(
            system=composition.system, recipe=settings.recipe,
            overrides=(*settings.overrides_at(composition, depth, steps), *nvme),
            steps=steps, warmup_steps=warmup_steps,
            budget_bytes=settings.host_budget_bytes if composition.system == TIDAL else None,
            device_fraction=settings.device_fraction, deferred=PEERS_DEFERRED,
        )  # fmt: skip
        from benchmarks.dp_runs import run_configuration

        return run_configuration(case, NPROC, settings.timeout_s, fn=run_compose_case)


def _verdict(error: str) -> None:
    """A failed run's error, unless it is a budget failure: raised as refused or failed."""
    if is_budget_failure(error):
        return
    refused = refusal_line(error)
    if refused is not None:
        raise _Refused(refused)
    raise _Failed(error)


# -- scale ----------------------------------------------------------------------------------------


def depth_bounds(base: JobConfig, composition: Composition, settings: ComposeSettings) -> tuple[int, int]:  # fmt: skip
    """A first depth to probe and one known (or, capped, taken) not to fit.

    No configuration builds the whole model on a rank ([Note: one budget]), so its model data
    (fp32 parameters, gradients and AdamW's two moments: 16 bytes a parameter, the peers' and
    tidal's alike) cannot pass the 4 ranks' budgets together, ``nvme_factor`` times that with
    tidal's NVMe tier. The first probe guesses an eighth of the budgets for model data, as
    ``tidal bench dp`` does. ``max_layers + 1`` caps the limit."""
    budget = settings.host_budget_bytes
    factor = settings.nvme_factor if composition.nvme else 1.0
    room, per_param = factor * NPROC * budget, MODEL_DATA_BYTES_PER_PARAM
    guess = budget * NPROC / (8 * MODEL_DATA_BYTES_PER_PARAM)
    start = limit = 1
    while limit <= settings.max_layers and num_params_at_depth(base, limit) * per_param <= room:
        if num_params_at_depth(base, limit) <= guess:
            start = limit
        limit += 1
    return start, limit


def scale_rows(settings: ComposeSettings) -> list[dict[str, Any]]:
    return [_scale_row(settings, _BY_KEY[key]) for key in settings.compositions]


def _scale_row(settings: ComposeSettings, composition: Composition) -> dict[str, Any]:
    # at NPROC blocks every composition of 4 ranks has a block a stage (pp4 refuses 1 block)
    reason = _refusal(settings, composition, NPROC)
    if reason is not None:
        return not_runnable_row(composition, reason)
    base = load_job(find_recipe(settings.recipe), settings.overrides_at(composition, 1, 1))
    row: dict[str, Any] = {"composition": composition.key, "label": composition.label,
                           "system": composition.system, "nproc": NPROC,
                           "host_budget_bytes_per_rank": settings.host_budget_bytes,
                           "d_model": base.model.resolve_gpt().d_model, "seq_len": SEQ_LEN}  # fmt: skip
    if composition.system != TIDAL:
        row["build"] = "deferred" if PEERS_DEFERRED else "whole"
    tries: list[dict[str, Any]] = []

    def fits(depth: int) -> bool:
        ranks = _run(settings, composition, depth, steps=_SCALE_STEPS, warmup_steps=1)
        probe: dict[str, Any] = {
            "num_layers": depth,
            "num_params": num_params_at_depth(base, depth),
        }
        tries.append(probe)
        if isinstance(ranks, str):
            probe.update(fits=False, error=ranks)
            _verdict(ranks)
            return False
        peaks = per_rank_memory(ranks)
        probe.update(fits=max(peaks["peak_rss_bytes"]) <= settings.host_budget_bytes, **peaks)
        return bool(probe["fits"])

    start, limit = depth_bounds(base, composition, settings)
    try:
        largest = search_largest(fits, start=start, limit=limit, bisections=settings.bisections)
    except _Refused as refused:
        return not_runnable_row(composition, str(refused)) | {"tries": tries}
    except _Failed as failed:
        return row | {"error": str(failed), "tries": tries}
    best = next((t for t in tries if t["num_layers"] == largest), None)
    return row | {
        "search_limit": limit,
        "capped": largest is not None and largest == settings.max_layers,
        "tries": sorted(tries, key=lambda t: t["num_layers"]),
        "largest_num_layers": largest,
        "largest_num_params": best["num_params"] if best else None,
        "largest_peak_rss_bytes": best["peak_rss_bytes"] if best else None,
    }


# -- fixed ----------------------------------------------------------------------------------------


def zero3_bytes(num_params: int, *, nproc: int = NPROC, bytes_per_param: int = FP32_BYTES) -> dict[str, float]:  # fmt: skip
    """A rank's bytes per step under ZeRO-3 by the formula ([Note: collective byte counts] in
    tidal/distributed/collectives.py): the parameters all-gathered for the forward and again
    for the backward, the gradients reduce-scattered, each bringing or sending the ``(N-1)/N``
    a rank does not hold; no point-to-point sends. What the peers move, said to be a formula:
    DeepSpeed's parameter reuse and FSDP2's root kept gathered can only lower it."""
    share = num_params * bytes_per_param * (nproc - 1) / nproc
    return {"bytes_all_gathered": 2 * share, "bytes_reduce_scattered": share, "bytes_sent": 0.0,
            "bytes_all_reduced": 0.0}  # fmt: skip


_MOVED = ("bytes_all_gathered", "bytes_reduce_scattered", "bytes_all_reduced", "bytes_sent")


def moved_per_rank(bytes_per_step: dict[str, float]) -> float:
    """What a rank moves per step: all-gathered, reduce-scattered, all-reduced (tensor
    parallelism's activations; a sharded stage's norms) and sent."""
    return float(sum(bytes_per_step.get(key, 0.0) for key in _MOVED))


def fixed_depth(settings: ComposeSettings, scale: Sequence[dict[str, Any]]) -> int:
    """``--layers``, else the least largest of the configurations the scale section measured
    (one model all of them fit), else 4."""
    if settings.layers is not None:
        return settings.layers
    largest = [r["largest_num_layers"] for r in scale if r.get("largest_num_layers")]
    return min(largest, default=4)


def fixed_rows(settings: ComposeSettings, depth: int) -> list[dict[str, Any]]:
    rows = [_fixed_row(settings, _BY_KEY[key], depth) for key in settings.compositions]
    add_fixed_ratios(rows)
    return rows


def _fixed_row(settings: ComposeSettings, composition: Composition, depth: int) -> dict[str, Any]:
    reason = _refusal(settings, composition, depth)
    if reason is not None:
        return not_runnable_row(composition, reason)
    base = load_job(find_recipe(settings.recipe), settings.overrides_at(composition, depth, 1))
    num_params = num_params_at_depth(base, depth)
    row: dict[str, Any] = {"composition": composition.key, "label": composition.label,
                           "system": composition.system, "nproc": NPROC, "num_layers": depth,
                           "num_params": num_params, "steps": settings.steps,
                           "warmup_steps": settings.warmup_steps,
                           "host_budget_bytes_per_rank": settings.host_budget_bytes}  # fmt: skip
    load_before = os.getloadavg()[0]
    ranks = _run(settings, composition, depth, steps=settings.steps,
                 warmup_steps=settings.warmup_steps)  # fmt: skip
    if isinstance(ranks, str):
        refused = None if is_budget_failure(ranks) else refusal_line(ranks)
        return not_runnable_row(composition, refused) if refused else row | {"error": ranks}
    first = ranks[0]
    memory = per_rank_memory(ranks)
    row |= {
        "median_step_s": max(r["median_step_s"] for r in ranks),
        "final_loss": first["losses"][-1],
        **memory,
        "fits": max(memory["peak_rss_bytes"]) <= settings.host_budget_bytes,
        "load_average_1m": [load_before, os.getloadavg()[0]],
    }
    if composition.system == TIDAL:
        row["bytes_per_step"] = [r["bytes_per_step"] for r in ranks]
        row["bytes_source"] = "tidal's counters"
        row["tidal_memory"] = [r["tidal_memory"] for r in ranks]
    else:
        row["bytes_per_step"] = [zero3_bytes(num_params)] * NPROC
        row["bytes_source"] = "formula (ZeRO-3), not measured"
    row["zero3_formula_bytes_per_step"] = zero3_bytes(num_params)
    return row


def add_fixed_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Each measured row's step and mean bytes moved per rank over :data:`BASELINE`'s, and its
    peak beside tidal's figure plus the rank's RSS before the model ([Note: tidal's memory
    figure] in compose_ranks.py)."""
    for row in rows:
        if "bytes_per_step" not in row:
            continue
        moved = [moved_per_rank(b) for b in row["bytes_per_step"]]
        row["moved_bytes_per_rank"] = moved
        row["mean_moved_bytes_per_rank"] = sum(moved) / len(moved)
        figures = row.get("tidal_memory") or [None] * len(moved)
        row["figure_rss_bytes"] = [
            None if f is None or f["bytes"] is None else f["bytes"] + base
            for f, base in zip(figures, row["base_rss_bytes"], strict=True)
        ]
        row["peak_over_figure"] = [
            None if f is None else peak / f
            for peak, f in zip(row["peak_rss_bytes"], row["figure_rss_bytes"], strict=True)
        ]
    base = next((r for r in rows if r["composition"] == BASELINE and "bytes_per_step" in r), None)
    if base is None:
        return
    for row in rows:
        if "bytes_per_step" in row:
            row["step_vs_dp4"] = row["median_step_s"] / base["median_step_s"]
            row["moved_vs_dp4"] = row["mean_moved_bytes_per_rank"] / base["mean_moved_bytes_per_rank"]  # fmt: skip


# -- targets --------------------------------------------------------------------------------------


def _largest(rows: Sequence[dict[str, Any]], key: str) -> int | None:
    row = next((r for r in rows if r["composition"] == key), None)
    return None if row is None else row.get("largest_num_params")


def target_rows(scale: Sequence[dict[str, Any]], fixed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """The issue's targets read off the rows: tidal's best largest model over DeepSpeed's and
    FSDP2's (each >= 1.25x), and pp2 x dp2's bytes moved per rank over dp4 ZeRO-3's (<= 0.6x).
    ``value`` None: not measured (a configuration that did not run); ``lower_bound``: tidal's
    best was capped by ``--max-layers``, so the ratio is at least ``value``."""
    tidal = [r for r in scale if r["system"] == TIDAL and r.get("largest_num_params")]
    best = max(tidal, key=lambda r: r["largest_num_params"], default=None)
    rows: list[dict[str, Any]] = []
    for peer, label in (("deepspeed", "DeepSpeed ZeRO-3 offload"), ("fsdp2", "FSDP2 CPU offload")):
        theirs = _largest(scale, peer)
        value = best["largest_num_params"] / theirs if best and theirs else None
        rows.append({"target": f"largest-vs-{peer}", "value": value, "bound": 1.25,
                     "at_most": False, "lower_bound": bool(best and best.get("capped")),
                     "figure": f"tidal's best largest model ({best['label'] if best else '-'}) "
                     f"over {label}'s"})  # fmt: skip
    for key, target in (("pp2-dp2-chunk", "bytes-pp2-dp2-vs-dp4"),
                        ("pp2-dp2-chunk-per-step", "bytes-pp2-dp2-per-step-vs-dp4")):  # fmt: skip
        pp = next((r for r in fixed if r["composition"] == key), {})
        rows.append({"target": target, "value": pp.get("moved_vs_dp4"),
                     "bound": 0.6, "at_most": True, "lower_bound": False,
                     "figure": f"{_BY_KEY[key].label}: bytes each rank moves per step over "
                     "dp4 ZeRO-3's"})  # fmt: skip
    for row in rows:
        row["holds"] = holds(row["value"], bound=row["bound"], at_most=row["at_most"])
    return rows


def holds(value: float | None, *, bound: float, at_most: bool) -> bool | None:
    """Whether ``value`` keeps its bound; None: not measured."""
    if value is None:
        return None
    return value <= bound if at_most else value >= bound


# -- the bench ------------------------------------------------------------------------------------


def bench_compose(settings: ComposeSettings, *, say: Callable[[str], None] = print) -> list[dict[str, Any]]:  # fmt: skip
    """Every selected section's rows; ``say`` tells progress."""
    scale: list[dict[str, Any]] = []
    fixed: list[dict[str, Any]] = []
    if "scale" in settings.sections:
        for key in settings.compositions:
            say(f"scale: {_BY_KEY[key].label} ...")
            scale.append(_scale_row(settings, _BY_KEY[key]))
    if "fixed" in settings.sections:
        depth = fixed_depth(settings, scale)
        say(f"fixed: every configuration at {depth} blocks ...")
        fixed = fixed_rows(settings, depth)
    rows = [{"section": "scale", **r} for r in scale] + [{"section": "fixed", **r} for r in fixed]
    if "targets" in settings.sections:
        rows += [{"section": "targets", **r} for r in target_rows(scale, fixed)]
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--section", dest="sections", action="append", default=None,
                        choices=SECTIONS, help="run only this section (repeatable; default all)")  # fmt: skip
    parser.add_argument("--recipe", default=None, metavar="NAME_OR_PATH",
                        help="the model's width and data (default demo; tiny with --quick)")  # fmt: skip
    parser.add_argument("--compositions", default=None, metavar="KEY[,KEY...]",
                        help=f"a subset of {','.join(_BY_KEY)} (default: all)")  # fmt: skip
    parser.add_argument("--host-budget", default="1GiB", metavar="SIZE",
                        help="the per-rank host budget, judged by each rank's peak RSS (1GiB)")  # fmt: skip
    parser.add_argument("--max-layers", type=int, default=None,
                        help="the deepest model the scale search probes (128; 6 with --quick)")  # fmt: skip
    parser.add_argument("--device-fraction", type=float, default=0.2,
                        help="of the budget, tidal's device tier for chunks (gathered chunks and "
                        "activations; the rest its host tier) (0.2)")  # fmt: skip
    parser.add_argument("--bisections", type=int, default=None,
                        help="scale probes after the doubling (2; 1 with --quick)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None,
                        help="the fixed section's depth (default: the least largest of scale)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="fixed steps (6; 3 with --quick)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="leading fixed steps left out of the figures (2; 1 with --quick)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: the tiny recipe, at most 6 blocks, 3 steps")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                        help="an override for every configuration (e.g. model.d_model=128)")  # fmt: skip
    parser.add_argument("--results-dir", default=None, metavar="DIR",
                        help="write the JSON file here instead of benchmarks/results/")  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> ComposeSettings:
    """The settings of the parsed command line; ``--quick`` changes the defaults of the options
    not given."""
    quick = _QUICK if args.quick else {}
    given: dict[str, Any] = {}
    for name in ("recipe", "max_layers", "bisections", "steps", "warmup_steps"):
        value = getattr(args, name)
        if value is not None or name in quick:
            given[name] = value if value is not None else quick[name]
    if args.compositions:
        given["compositions"] = tuple(k.strip() for k in args.compositions.split(","))
    return ComposeSettings(
        sections=tuple(args.sections or SECTIONS),
        host_budget_bytes=parse_bytes(args.host_budget, key="--host-budget"),
        layers=args.layers,
        device_fraction=args.device_fraction,
        overrides=tuple(args.overrides),
        **given,
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """``tidal bench compose``: measure, write the JSON, print the tables from it."""
    from benchmarks.results import read_results, write_results
    from benchmarks.tables import show

    settings = settings_from_args(args)
    rows = bench_compose(settings, say=lambda line: console.print(line, markup=False))
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("compose", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


# -- presentation ---------------------------------------------------------------------------------


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """One table per section the result holds ([Note: one table per result] in tables.py)."""
    rows = result["rows"]
    present = [s for s in SECTIONS if any(r["section"] == s for r in rows)]
    makers = {"scale": _scale_table, "fixed": _fixed_tables, "targets": _targets_table}
    return [t for section in present for t in makers[section]([r for r in rows if r["section"] == section])]  # fmt: skip


def _mib(value: float | None) -> str:
    return "-" if value is None else format_bytes(int(value))


def _per_rank(values: Sequence[float | None], cell: Callable[[float | None], str] = _mib) -> str:
    """Rank 0's to rank 3's figures; one figure if every rank has it."""
    texts = [cell(v) for v in values]
    return f"{texts[0]} each" if len(set(texts)) == 1 else " / ".join(texts)


def _ratio(value: float | None, *, bound: bool = False) -> str:
    return (
        "-"
        if value is None or not math.isfinite(value)
        else f"{'>= ' if bound else ''}{value:.2f}x"
    )


def _scale_table(rows: Sequence[dict[str, Any]]) -> list[ResultTable]:
    headers = ["configuration", "budget/rank", "width", "tries (blocks: peak RSS/rank or failure)", "most blocks", "params", "peak RSS/rank"]  # fmt: skip
    cells = []
    for r in rows:
        if "not_runnable" in r:
            cells.append(
                [r["label"], "-", "-", f"not runnable: {r['not_runnable']}", "-", "-", "-"]
            )
            continue
        head = [r["label"], format_bytes(r["host_budget_bytes_per_rank"]), str(r["d_model"])]
        tries = ", ".join(_try_cell(t) for t in r.get("tries", ()))
        if "error" in r:
            cells.append([*head, f"{tries}; failed: {r['error']}", "-", "-", "-"])
            continue
        most = r["largest_num_layers"]
        mark = ">= " if r.get("capped") else ""
        params = r["largest_num_params"]
        peak = r["largest_peak_rss_bytes"]
        cells.append([*head, tries, f"{mark}{most}" if most else "-",
                      f"{params:,}" if params else "-", _mib(max(peak) if peak else None)])  # fmt: skip
    deferred = any(r.get("build") == "deferred" for r in rows)
    note = "'>=': the search stopped at --max-layers. " + (
        _DEFERRED_NOTE if deferred else _WHOLE_NOTE
    )
    return [ResultTable.of("tidal bench compose: largest model per configuration (4 gloo ranks)", headers, cells, note=note)]  # fmt: skip


_DEFERRED_NOTE = (
    "No rank holds the whole model at any time: tidal builds on the meta device, DeepSpeed "
    "inside deepspeed.zero.Init, FSDP2 shards a meta model before allocating its shards "
    "([Note: one budget] in benchmarks/compose.py)."
)
_WHOLE_NOTE = (  # the runs before the peers built deferred
    "The peers build the whole model on every rank first; tidal builds on the meta device "
    "([Note: one budget] in benchmarks/compose.py)."
)


def _try_cell(t: dict[str, Any]) -> str:
    if "error" in t:
        return f"{t['num_layers']}:n (failed for memory)"
    return (
        f"{t['num_layers']}:{'y' if t['fits'] else 'n'} ({format_bytes(max(t['peak_rss_bytes']))})"
    )


def _fixed_tables(rows: Sequence[dict[str, Any]]) -> list[ResultTable]:
    depth = next((r["num_layers"] for r in rows if "num_layers" in r), None)
    traffic: list[list[str]] = []
    memory: list[list[str]] = []
    for r in rows:
        if "not_runnable" in r or "error" in r:
            why = (
                f"not runnable: {r['not_runnable']}"
                if "not_runnable" in r
                else f"failed: {r['error']}"
            )
            traffic.append([r["label"], why, *["-"] * 7])
            memory.append([r["label"], why, *["-"] * 4])
            continue
        per_rank = r["bytes_per_step"]
        traffic.append([
            r["label"], f"{r['median_step_s']:.3f}s", _ratio(r.get("step_vs_dp4")),
            _per_rank([b["bytes_all_gathered"] for b in per_rank]),
            _per_rank([b["bytes_reduce_scattered"] for b in per_rank]),
            _per_rank([b.get("bytes_all_reduced", 0.0) for b in per_rank]),
            _per_rank([b["bytes_sent"] for b in per_rank]),
            _ratio(r.get("moved_vs_dp4")), r["bytes_source"],
        ])  # fmt: skip
        memory.append(_memory_cells(r))
    title = f"tidal bench compose: one model all fit ({depth} blocks), per step"
    traffic_headers = ["configuration", "step", "step vs dp4", "all-gathered/rank", "reduce-scattered/rank", "all-reduced/rank", "sent/rank", "moved vs dp4", "bytes from"]  # fmt: skip
    memory_headers = ["configuration", "peak RSS/rank", "RSS before the model/rank", "tidal's figure + that/rank", "peak / that", "tidal's figure"]  # fmt: skip
    note = ("Steps are the slowest rank's median, on a 2-core machine shared with other work: "
            "compare within the run only. moved = all-gathered + reduce-scattered + all-reduced + "
            "sent, the mean over ranks (runs before 2026-12-07 left all-reduced out of moved and "
            "did not count tensor parallelism's all-reduces).")  # fmt: skip
    return [ResultTable.of(title, traffic_headers, traffic, note=note),
            ResultTable.of(f"tidal bench compose: per-rank peak beside tidal's figure ({depth} blocks)",
                           memory_headers, memory, note=_FIGURE_NOTE)]  # fmt: skip


_FIGURE_NOTE = (
    "Ranks 0 to 3. Each figure is made before the first step. Plain stages: the pipeline "
    "memory plan's peak for the rank (model data and in-flight activations). Chunks: the "
    "store's bound (the model data its tiers hold + its device budget, which counts gathered "
    "chunks and activations). Runs before 2026-12-07 showed, for chunks, an accounting after "
    "the first step instead. Either plus the rank's RSS before the model (interpreter, torch) "
    "is compared with its peak RSS. [Note: tidal's memory figure] in benchmarks/compose_ranks.py"
)


def _memory_cells(r: dict[str, Any]) -> list[str]:
    peaks, base = _per_rank(r["peak_rss_bytes"]), _per_rank(r["base_rss_bytes"])
    figures = r.get("tidal_memory")
    if not figures or figures[0]["bytes"] is None:
        kind = "none (tidal makes none)" if figures else "none (a peer)"
        return [r["label"], peaks, base, "-", "-", kind]
    with_base = _per_rank(r["figure_rss_bytes"])
    ratios = _per_rank(r["peak_over_figure"], _ratio)
    return [r["label"], peaks, base, with_base, ratios, figures[0]["kind"]]


def _targets_table(rows: Sequence[dict[str, Any]]) -> list[ResultTable]:
    cells = []
    for r in rows:
        verdict = "not measured" if r["holds"] is None else ("holds" if r["holds"] else "misses")
        bound = f"{'<=' if r['at_most'] else '>='} {r['bound']:.2f}x"
        cells.append([r["figure"], _ratio(r["value"], bound=r["lower_bound"]), bound, verdict])
    return [ResultTable.of("tidal bench compose: targets", ["figure", "measured", "target", "verdict"], cells)]  # fmt: skip
