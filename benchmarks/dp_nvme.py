"""``tidal bench dp --section nvme``: a model larger than its ranks' host budgets, trained
through the NVMe tier.

On the largest ``--nproc`` ranks, for each ``--host-budget``: tidal alone (this is a capability,
not a comparison: the baselines' rows are perf and scale), the recipe at width ``NVME_D_MODEL``
and the smallest depth whose AdamW model data (16 bytes per parameter in fp32: weight, gradient,
two moments) exceeds ``nvme_model_factor`` times what all the ranks' budgets hold together.
Wide and shallow, because activations are kept whole (no recompute yet) and live in the device
tier, which gets ``NVME_DEVICE_FRACTION`` of the budget: at the recipe's narrow width the same
parameters take hundreds of blocks, whose activations alone outgrow any such share. The model is built
on the meta device and streamed into the shards ([Note: deferred construction] in
tidal/memory/materialize.py); tidal's tiers get the budget less ``NVME_UNCOUNTED_FRACTION``
as in the scale section (:func:`benchmarks.dp_systems.tidal_budget_overrides`), with
``memory.nvme_dir`` under the system's temporary folder, so that what does not fit goes to disk ([Note: nvme placement] in
tidal/sharding/swap.py). A row records the model's size, every rank's peak RSS against the
budget, the median step and tokens/s, and per rank what crossed the disk in the timed steps and
at what rate. The files are small enough here to stay in the operating system's page cache, so
the rate is that of the tier's I/O path (system calls, copies, the thread pool), an upper bound
for a disk that must really be read.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks.dp_runs import (
    MODEL_DATA_BYTES_PER_PARAM,
    DpSettings,
    num_params_at_depth,
    per_rank_memory,
    recipe_job,
    run_configuration,
    scale_overrides,
    teardown_figures,
)
from benchmarks.dp_systems import TIDAL, Case
from tidal.config import format_bytes

__all__ = ["NVME_STEPS", "nvme_rows", "nvme_table"]

NVME_STEPS = 4  # the first is left out of the median: it records the trace, reads on demand
NVME_D_MODEL, NVME_HEADS = 1024, 16
NVME_DEVICE_FRACTION = 0.2
# What the tiers do not count on a CPU: gloo's collectives copy their buffers (measured here: an
# all-gather of 64 MB allocates about 127 MB for its duration, a reduce-scatter about 96 MB; NCCL
# works in place), with gathers prefetched and reductions in flight, plus autograd's transient
# gradients and allocator slack. tidal is told a budget this much smaller than the one its
# ranks' peak RSS is judged by: with all of it, a 1 GiB run peaked at 1.13 GiB per rank with its
# tiers within their budgets, and 220 MB above what the tiers held.
NVME_UNCOUNTED_FRACTION = 0.25


def nvme_rows(settings: DpSettings) -> list[dict[str, Any]]:
    """One row per host budget, at ``settings.scale_nproc`` ranks."""
    return [_nvme_row(settings, budget) for budget in settings.host_budgets_bytes]


def _overrides(settings: DpSettings) -> tuple[str, ...]:
    return (*scale_overrides(settings), f"model.d_model={NVME_D_MODEL}",
            f"model.num_heads={NVME_HEADS}")  # fmt: skip


def _depth(settings: DpSettings, budget_bytes: int) -> int:
    base = recipe_job(settings.recipe, _overrides(settings))
    target = settings.nvme_model_factor * budget_bytes * settings.scale_nproc
    depth = 1
    while MODEL_DATA_BYTES_PER_PARAM * num_params_at_depth(base, depth) <= target:
        depth += 1
    return depth


def _nvme_row(settings: DpSettings, budget_bytes: int) -> dict[str, Any]:
    nproc, depth = settings.scale_nproc, _depth(settings, budget_bytes)
    base = recipe_job(settings.recipe, _overrides(settings))
    num_params = num_params_at_depth(base, depth)
    row: dict[str, Any] = {
        "system": TIDAL, "nproc": nproc, "recipe": settings.recipe,
        "host_budget_bytes_per_rank": budget_bytes, "d_model": base.model.resolve_gpt().d_model,
        "num_layers": depth, "num_params": num_params,
        "model_data_bytes": MODEL_DATA_BYTES_PER_PARAM * num_params,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tidal-bench-nvme-") as nvme_dir:
        case = Case(
            system=TIDAL,
            recipe=settings.recipe,
            overrides=(
                *_overrides(settings),
                f"model.num_layers={depth}",
                f"memory.nvme_dir={nvme_dir}",
            ),  # fmt: skip
            steps=NVME_STEPS,
            warmup_steps=1,
            tidal_budget_bytes=int(budget_bytes * (1 - NVME_UNCOUNTED_FRACTION)),
            tidal_device_fraction=NVME_DEVICE_FRACTION,
            deferred=True,
        )
        ranks = run_configuration(case, nproc, settings.timeout_s)
    if isinstance(ranks, str):
        return row | {"error": ranks}
    return row | nvme_figures(ranks, budget_bytes) | teardown_figures(ranks[0])


def nvme_figures(ranks: Sequence[dict[str, Any]], budget_bytes: int) -> dict[str, Any]:
    """A row's figures from every rank's (see :func:`benchmarks.dp_systems.run_case`)."""

    first = ranks[0]
    median_s = first["median_step_s"]
    disks = [r["disk"] for r in ranks]
    per_step = [(d["timed_bytes_to_nvme"] + d["timed_bytes_from_nvme"]) / d["timed_steps"]
                for d in disks]  # fmt: skip
    figures = per_rank_memory(ranks)
    return {
        **figures,
        "fits": max(figures["peak_rss_bytes"]) <= budget_bytes,
        "median_step_s": median_s,
        "tokens_per_s": first["tokens_per_step"] / median_s,
        "step_s": first["step_s"],
        "losses": first["losses"],
        "tidal_budgets": first["tidal_budgets"],
        "disk_per_rank": disks,
        "disk_bytes_per_step_per_rank": per_step,
        # Each rank's own traffic over the step time: the ranks read and write at once.
        "disk_bytes_per_s_per_rank": [b / median_s for b in per_step],
    }


def nvme_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["N", "budget/rank", "model (blocks, params, AdamW data)", "peak RSS/rank", "fits", "on disk (param shards / chunks)", "step", "tokens/s", "disk/step/rank", "disk rate/rank"]  # fmt: skip
    cells = []
    for r in rows:
        head = [str(r["nproc"]), format_bytes(r["host_budget_bytes_per_rank"]),
                f"{r['num_layers']}, {r['num_params']:,}, {format_bytes(r['model_data_bytes'])}"]  # fmt: skip
        if "error" in r:
            cells.append([*head, f"error: {r['error']}", *["-"] * 6])
            continue
        disk = r["disk_per_rank"][0]
        cells.append([
            *head, ", ".join(format_bytes(b) for b in r["peak_rss_bytes"]),
            "yes" if r["fits"] else "no",
            f"{disk['param_shards_on_nvme']} / {disk['num_chunks']}",
            f"{r['median_step_s']:.2f}s", f"{r['tokens_per_s']:,.0f}",
            format_bytes(int(max(r["disk_bytes_per_step_per_rank"]))),
            f"{max(r['disk_bytes_per_s_per_rank']) / 1e9:.2f} GB/s",
        ])  # fmt: skip
    return headers, cells
