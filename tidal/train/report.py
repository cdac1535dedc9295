"""``tidal report RUN_DIR``: plots of a run and the rows of its summary table.

Plots need matplotlib (the ``plots`` extra); everything else here is plain data, so the CLI can
print the table on a machine without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tidal.config import format_bytes
from tidal.train.metrics import read_metrics
from tidal.train.plot_series import MemoryFigure, Panel, memory_figure, off_scale

__all__ = ["load_summary", "summary_rows", "write_plots"]


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """summary.json of a finished run; of a run still going or stopped early, what its
    metrics.jsonl says so far (``status`` names which)."""
    path = Path(run_dir) / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    records = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise FileNotFoundError(
            f"{path} does not exist and {Path(run_dir) / 'metrics.jsonl'} holds no step: "
            f"{run_dir} is not a tidal run yet (train with `tidal train --recipe NAME --set "
            f"run_dir={run_dir}` first)"
        )
    config_path = Path(run_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    val = [r for r in records if r.get("kind") == "val"]
    last = train[-1]
    return {
        "status": f"unfinished: no summary.json yet (running, or stopped after step {last['step']})",
        "name": config.get("name", Path(run_dir).name),
        "preset": config.get("model", {}).get("preset"),
        "steps": last["step"],
        "tokens": last.get("tokens"),
        "final_loss": last["loss"],
        "val_loss": val[-1]["val_loss"] if val else None,
        "tokens_per_s": last.get("tokens_per_s"),
        "model_tflops_per_s": last.get("tflops"),
        "peak_memory_bytes": last.get("peak_memory_bytes"),
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs, in reading order, for the summary table."""
    params = summary.get("num_params")
    rows = [
        *([("status", summary["status"])] if "status" in summary else []),
        ("run", str(summary.get("name"))),
        ("model", f"{summary.get('preset')}" + (f" ({params:,} params)" if params else "")),
        ("device", f"{summary.get('device')} / {summary.get('precision')}"),
        *(
            [("world size", f"{summary['world_size']} ranks")]
            if (summary.get("world_size") or 1) > 1
            else []
        ),
        ("steps", f"{summary.get('steps')} ({summary.get('tokens', 0):,} tokens)"),
        ("final loss", _fmt(summary.get("final_loss"), ".4f")),
        ("validation loss", _fmt(summary.get("val_loss"), ".4f")),
        ("tokens/s", _fmt(summary.get("tokens_per_s"), ",.0f")),
        ("model TFLOP/s", _fmt(summary.get("model_tflops_per_s"), ".3f")),
    ]
    if summary.get("mfu") is not None:
        rows.append(("MFU", f"{100 * summary['mfu']:.1f}% of {summary['peak_tflops']:.2f} TFLOP/s"))
        rows.append(("peak source", str(summary.get("peak_tflops_source"))))
    for tier, num_bytes in (summary.get("peak_memory_bytes") or {}).items():
        rows.append((f"peak memory ({tier})", format_bytes(num_bytes)))
    rows += _chunk_rows(summary)
    rows.append(("wall time", _fmt(summary.get("wall_s"), ".1f") + " s"))
    return rows


def _chunk_sizes(summary: dict[str, Any]) -> str:
    """How many chunks of what size; a parameter larger than the chunk size has a chunk of its
    own, so the largest chunk is said where it is larger."""
    text = f"{summary['num_chunks']} chunks of {summary['chunk_size']:,} elements"
    largest = summary.get("largest_chunk_elements") or 0
    return text + (f", the largest {largest:,}" if largest > summary["chunk_size"] else "")


def _chunk_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    if "bytes_to_device" not in summary:
        return [("engine", str(summary.get("engine", "reference")))]
    steps = max(1, summary.get("steps_this_run") or summary.get("steps") or 1)
    budget = summary.get("device_budget")
    sharded = "bytes_all_gathered" in summary
    over = f", ZeRO-3 over {summary.get('world_size')} ranks" if sharded else ""
    rows = [
        ("engine", f"chunk{over} ({_chunk_sizes(summary)})"),
        ("device budget", "unlimited" if budget is None else format_bytes(budget)),
        (
            "peak device",
            f"{format_bytes(summary['peak_device_bytes'])} (of which activations at most "
            f"{format_bytes(summary.get('peak_non_model_bytes') or 0)})",
        ),
        ("min device budget", format_bytes(summary["min_device_bytes"])),
        (
            "traffic per step",
            f"to device {format_bytes(summary['bytes_to_device'] / steps)}, "
            f"to host {format_bytes(summary['bytes_to_host'] / steps)}",
        ),
        ("evictions", f"{summary['evictions']:,}"),
    ]
    if sharded:  # this rank's collectives, as the traffic above
        rows.insert(-1, ("gathered per step", f"all-gathered "
                         f"{format_bytes(summary['bytes_all_gathered'] / steps)}, reduce-scattered "
                         f"{format_bytes(summary['bytes_reduce_scattered'] / steps)} (rank 0)"))  # fmt: skip
    return rows


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``loss.png`` (train and validation loss against step) and ``memory.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            "plots need matplotlib: pip install 'tidal[plots]' (or matplotlib)"
        ) from err
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    if not train:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no training steps to plot")
    written = [_plot_loss(plt, run_dir, train, val), _plot_memory(plt, run_dir, train)]
    return written


def _plot_loss(plt: Any, run_dir: Path, train: list[dict], val: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val_loss"] for r in val],
            "o-",
            label="validation loss",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{run_dir.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend beside the plot included
    plt.close(fig)
    return path


def _plot_memory(plt: Any, run_dir: Path, train: list[dict]) -> Path:
    """The panels of :func:`~tidal.train.plot_series.memory_figure`, one above the other on a
    shared step axis, checkpoints and resumes marked on each ([Note: plotted steps] in
    plot_series.py)."""
    from matplotlib.ticker import MaxNLocator

    figure = memory_figure(train, name=run_dir.name)
    heights = [1.6, *([1.0] * (len(figure.panels) - 1))]  # the memory panel leads
    fig, axes = plt.subplots(len(figure.panels), 1, sharex=True, squeeze=False,
                             figsize=(10, 2.2 + 2.0 * len(figure.panels)),
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for i, (ax, panel) in enumerate(zip(axes[:, 0], figure.panels, strict=True)):
        handles = _draw_panel(ax, panel, figure)
        if panel.right is not None:
            handles += _draw_panel(ax.twinx(), panel.right, figure)
        _mark_steps(ax, figure, handles if i == 0 else [])  # in the first legend only
        by_label = dict((h.get_label(), h) for h in handles)
        # Beside the plot, not on it: the lines sit where a legend inside would go.
        ax.legend(by_label.values(), by_label.keys(), loc="upper left",
                  bbox_to_anchor=(1.09 if panel.right else 1.01, 1.0), fontsize=8)  # fmt: skip
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(figure.title)
    path = run_dir / "memory.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends beside the plots included
    plt.close(fig)
    return path


def _draw_panel(ax: Any, panel: Panel, figure: MemoryFigure) -> list[Any]:
    """``panel``'s series on ``ax``; a point above the range is a marker on its top edge and a
    timing's left-out step a hollow marker, neither joined to the line ([Note: plotted
    steps] in plot_series.py)."""
    steps, top = figure.steps, panel.ylim[1]
    handles, base = [], [0.0] * len(steps)
    for series in panel.series:
        colour = _COLOURS[series.group % len(_COLOURS)]
        if series.kind == "stack":
            reach = [
                b + (0.0 if math.isnan(v) else v) for b, v in zip(base, series.values, strict=True)
            ]
            handles.append(ax.fill_between(steps, base, reach, step="mid", alpha=0.45,
                                           color=colour, label=series.label, lw=0))  # fmt: skip
            base = reach
            continue
        if series.kind == "limit":
            handles += ax.plot(steps, series.values, color="black", lw=1.4, label=series.label)
            continue
        gap = figure.excluded if series.gaps else frozenset()
        odd = [(s, v) for s, v in zip(steps, series.values, strict=True) if s in gap and v <= top]
        joined = [math.nan if s in gap or v > top else v
                  for s, v in zip(steps, series.values, strict=True)]  # fmt: skip
        style = {"dashed": "--", "line": "-", "dots": "."}[series.kind]
        handles += ax.plot(steps, joined, style, color=colour, lw=1.2, label=series.label)
        if odd:
            handles += ax.plot(*zip(*odd, strict=True), "o", mfc="none", color="gray", ms=5,
                               label="warm-up or after a checkpoint (left out of the range)")  # fmt: skip
    ax.set_ylim(*panel.ylim)
    ax.set_ylabel(panel.ylabel)
    if panel.title:
        ax.set_title(panel.title, fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    clipped = off_scale(panel, steps)
    if clipped:
        handles += ax.plot([s for s, _ in clipped], [top] * len(clipped), "^", color="crimson",
                           clip_on=False, ms=6, label="above the range (warm-up or after a "
                           "checkpoint)")  # fmt: skip
    return handles


def _mark_steps(ax: Any, figure: MemoryFigure, handles: list[Any]) -> None:
    for step in figure.checkpoints:
        handles.append(ax.axvline(step, color="gray", ls=":", lw=1, label="checkpoint saved"))
    for step, world_size in figure.resumes:
        label = f"resumed on {world_size} rank{'s' if world_size > 1 else ''}"
        handles.append(ax.axvline(step, color="purple", ls="-.", lw=1, label=label))


_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
            "tab:pink", "tab:olive", "tab:cyan")  # fmt: skip
