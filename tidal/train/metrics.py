"""Per-step records, the progress line, ``metrics.jsonl`` and ``summary.json``.

``metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step": ...}`` after every
optimizer step and ``{"kind": "val", "step": ..., "val_loss": ...}`` after each validation pass.
A resumed run first drops records past the step it resumes from, so the file reads as one run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tidal.config import format_bytes

__all__ = [
    "MetricsFile",
    "Throughput",
    "format_step_line",
    "git_commit",
    "read_metrics",
    "write_json_atomic",
]


class MetricsFile:
    """Append-only JSON lines, flushed per record so a killed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (they belong to the part of a run being redone)."""
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path.parent) if r.get("step", 0) <= step]
        self._rewrite(kept)

    def _rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl``; a torn last line (killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Throughput:
    """Tokens, time and FLOPs over a window of steps, for the progress line."""

    def __init__(self, *, flops_per_token: float | None, peak_tflops: float | None) -> None:
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.reset()

    def reset(self) -> None:
        self.num_tokens = 0
        self.elapsed_s = 0.0

    def add(self, num_tokens: int, elapsed_s: float) -> None:
        self.num_tokens += num_tokens
        self.elapsed_s += elapsed_s

    def figures(self) -> dict[str, float | None]:
        if self.elapsed_s <= 0:
            return {"tokens_per_s": None, "tflops": None, "mfu": None}
        tokens_per_s = self.num_tokens / self.elapsed_s
        if self.flops_per_token is None:  # a model tidal did not write: its FLOPs are unknown
            return {"tokens_per_s": tokens_per_s, "tflops": None, "mfu": None}
        tflops = tokens_per_s * self.flops_per_token / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": mfu}


def format_step_line(record: dict[str, Any], *, total_steps: int) -> str:
    """``step 10/300  loss 5.1200  grad_norm 1.30  lr 3.0e-04  memory host 1.2GiB  tps 4,321 ...``."""
    width = len(str(total_steps))
    parts = [f"step {record['step']:>{width}}/{total_steps}", f"loss {record['loss']:.4f}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"lr {record['lr']:.2e}")
    memory = record.get("memory_bytes") or {}
    if memory:
        parts.append("memory " + " ".join(f"{k} {format_bytes(v)}" for k, v in memory.items()))
    if record.get("tokens_per_s") is not None:
        parts.append(f"tps {record['tokens_per_s']:,.0f}")
    if record.get("tflops") is not None:
        parts.append(f"tflops {record['tflops']:.3f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    return "  ".join(parts)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def git_commit(start: Path | None = None) -> str | None:
    """The commit of the tidal checkout this code runs from, or None outside a git checkout."""
    folder = start or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
