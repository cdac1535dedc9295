"""Benchmark results as JSON under ``benchmarks/results/``, with what is needed to reproduce them."""

from __future__ import annotations

import datetime as dt
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch

from tidal.train.metrics import git_commit

__all__ = ["environment", "read_results", "results_dir", "write_results"]


def results_dir() -> Path:
    """``benchmarks/results`` under the working directory (in a checkout's root, its own):
    never inside an installed package or a checkout the command was not run from."""
    return Path.cwd() / "benchmarks" / "results"


def environment() -> dict[str, Any]:
    """Command, commit, versions and device: the header of every result file."""
    cuda = torch.cuda.is_available()
    return {
        "command": " ".join(["tidal", *sys.argv[1:]]) if sys.argv else None,
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})",
        "cuda_version": torch.version.cuda if cuda else None,
        "num_cpu_threads": torch.get_num_threads(),
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(bench: str, rows: list[dict[str, Any]], *, folder: Path | None = None) -> Path:
    """Write ``<bench>-<device>-<timestamp>.json``; returns its path."""
    env = environment()
    folder = folder or results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    device_slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = folder / f"{bench}-{device_slug}-{stamp}.json"
    path.write_text(json.dumps({"bench": bench, **env, "rows": rows}, indent=2) + "\n")
    return path


def read_results(path: Path) -> dict[str, Any]:
    """A results file as written: its header (command, commit, device, ...) and its rows."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data
