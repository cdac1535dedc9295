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
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {run_dir} is not a finished tidal run (train with "
            f"`tidal train --recipe NAME --set run_dir={run_dir}` first)"
        )
    return json.loads(path.read_text())


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs, in reading order, for the summary table."""
    rows = [
        ("run", str(summary.get("name"))),
        ("model", f"{summary.get('preset')} ({summary.get('num_params', 0):,} params)"),
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_memory(plt: Any, run_dir: Path, train: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    tiers = sorted({tier for r in train for tier in (r.get("memory_bytes") or {})})
    steps = [r["step"] for r in train]
    for tier in tiers:
        values = [(r.get("memory_bytes") or {}).get(tier, float("nan")) / 2**20 for r in train]
        ax.plot(steps, values, label=f"{tier} in use")
        peaks = [(r.get("peak_memory_bytes") or {}).get(tier, float("nan")) / 2**20 for r in train]
        ax.plot(steps, peaks, "--", label=f"{tier} peak")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{run_dir.name}: memory per tier")
    ax.grid(alpha=0.3)
    ax.legend()
    path = run_dir / "memory.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
