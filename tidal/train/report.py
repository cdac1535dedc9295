"""``tidal report RUN_DIR``: plots of a run and the rows of its summary table.

Plots need matplotlib (the ``plots`` extra); everything else here is plain data, so the CLI can
print the table on a machine without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tidal.config import format_bytes
from tidal.train.metrics import read_metrics

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


def _chunk_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    if "bytes_to_device" not in summary:
        return [("engine", str(summary.get("engine", "reference")))]
    steps = max(1, summary.get("steps_this_run") or summary.get("steps") or 1)
    budget = summary.get("device_budget")
    return [
        ("engine", f"chunk ({summary['num_chunks']} chunks of {summary['chunk_size']:,} elements)"),
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


MIB = 2**20


def _plot_tiers(ax: Any, tiered: list[dict]) -> None:
    steps = [r["step"] for r in tiered]

    def series(key: str) -> list[float]:
        return [float("nan") if r["tiers"].get(key) is None else r["tiers"][key] / MIB
                for r in tiered]  # fmt: skip

    activations, need = series("activations_bytes"), series("device_need_bytes")
    ax.fill_between(steps, 0, activations, alpha=0.35, label="device: activations")
    ax.fill_between(steps, activations, need, alpha=0.35, label="device: chunks needed")
    ax.plot(steps, series("device_peak_bytes"), "--", label="device peak so far")
    budget = tiered[-1]["tiers"].get("device_budget_bytes")
    if budget is not None:
        ax.axhline(budget / MIB, color="black", lw=1.2, label="device budget")
    ax.plot(steps, series("host_peak_bytes"), label="host tier peak so far")
    if any(r["tiers"].get("nvme_peak_bytes") is not None for r in tiered):
        ax.plot(steps, series("nvme_peak_bytes"), label="NVMe tier peak so far")
    traffic = ax.twinx()
    traffic.plot(steps, series("to_device_bytes"), ":", color="gray", label="to device per step")
    traffic.set_ylabel("MiB moved per step")
    traffic.set_ylim(bottom=0)


def _plot_memory(plt: Any, run_dir: Path, train: list[dict]) -> Path:
    """A chunk engine's device tier against its budget (the need of each step, activations
    stacked under it), its host memory, and the traffic; other engines' memory per tier."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = [r["step"] for r in train]
    tiered = [r for r in train if r.get("tiers")]
    if tiered:
        _plot_tiers(ax, tiered)
        ax.set_title(f"{run_dir.name}: the chunk engine's tiers (rank 0)")
    else:
        for tier in sorted({tier for r in train for tier in (r.get("memory_bytes") or {})}):
            values = [(r.get("memory_bytes") or {}).get(tier, float("nan")) / MIB for r in train]
            ax.plot(steps, values, label=f"{tier} in use")
            peaks = [(r.get("peak_memory_bytes") or {}).get(tier, float("nan")) / MIB
                     for r in train]  # fmt: skip
            ax.plot(steps, peaks, "--", label=f"{tier} peak")
        ax.set_title(f"{run_dir.name}: memory per tier")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles, labels = [], []
    for axis in fig.axes:  # the traffic axis too
        more = axis.get_legend_handles_labels()
        handles += more[0]
        labels += more[1]
    # Beside the plot, not on it: the lines sit where a legend inside would go.
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.12, 1.0), fontsize=8)
    path = run_dir / "memory.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend beside the plot included
    plt.close(fig)
    return path
