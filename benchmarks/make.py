"""``tidal bench make``: the README's two commands timed as a new user meets them.

The checkout's HEAD is cloned into a fresh folder (no ``.venv``, no caches, no runs) and each
target runs there in turn, so the first pays the set-up (the virtual environment and its
packages) and the README's "sets up .venv once" is what is timed. Per target: wall seconds,
exit status and the lines a reader looks for (the last progress line of ``make run`` with its
run's summary figures; the pytest totals of ``make test``). Uncommitted changes are not in the
clone: the JSON's commit is what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.tables import ResultTable

__all__ = ["add_arguments", "run", "tables", "time_targets"]

_PROGRESS = re.compile(r"^step \d+/\d+ .*loss")
_PYTEST_TOTAL = re.compile(r"\d+ passed.* in [\d.]+s")
# what the caller's shell may have set that a new user's would not
_SESSION_VARIABLES = ("OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH", "TIDAL_CACHE_DIR")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets", default="run,test", metavar="T[,T...]",
        help="make targets, in this order, in one fresh clone (run,test)",
    )  # fmt: skip
    parser.add_argument(
        "--results-dir", default=None, metavar="DIR",
        help="write the JSON file here instead of benchmarks/results/ under the current folder",
    )  # fmt: skip


def time_targets(checkout: Path, targets: list[str], folder: Path) -> list[dict[str, Any]]:
    """Clone ``checkout``'s HEAD into ``folder`` and time ``make TARGET`` there for each."""
    clone = folder / "tidal"
    subprocess.run(["git", "clone", "--quiet", str(checkout), str(clone)], check=True)
    rows = []
    for index, target in enumerate(targets):
        started = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in _SESSION_VARIABLES}
        done = subprocess.run(["make", target], cwd=clone, capture_output=True, text=True,
                              check=False, env=env)  # fmt: skip
        wall_s = time.perf_counter() - started
        (folder / f"make-{target}.log").write_text(done.stdout + done.stderr)
        rows.append({"target": target, "wall_s": round(wall_s, 1), "minutes": round(wall_s / 60, 1),
                     "rc": done.returncode, "includes_setup": index == 0,
                     "num_cpus": os.cpu_count(), **_figures(target, clone, done.stdout)})  # fmt: skip
    return rows


def _figures(target: str, clone: Path, stdout: str) -> dict[str, Any]:
    lines = stdout.splitlines()
    if target == "test":  # the totals, and which tests failed (a flaky one is named)
        return {"pytest_totals": [line.strip("= ") for line in lines if _PYTEST_TOTAL.search(line)],
                "failed": [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]}  # fmt: skip
    if target != "run":
        return {}
    progress = [line.strip() for line in lines if _PROGRESS.match(line.strip())]
    summary_path = clone / "runs" / "demo" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"last_progress_line": progress[-1] if progress else None, "summary": summary}


def run(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show

    targets = [t for t in args.targets.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="tidal-bench-make-") as folder:
        rows = time_targets(Path.cwd(), targets, Path(folder))
    path = write_results("make", rows, folder=None if args.results_dir is None
                         else Path(args.results_dir))  # fmt: skip
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0 if all(row["rc"] == 0 for row in rows) else 1


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """Each target's minutes from a fresh clone ([Note: one table per result] in
    benchmarks/tables.py)."""
    cells = []
    for row in result["rows"]:
        outcome = row.get("last_progress_line") or "; ".join(
            [*row.get("pytest_totals", []), *(f"failed: {t}" for t in row.get("failed", []))]
        )
        cells.append([row["target"], f"{row['minutes']:.1f}", str(row["rc"]),
                      "yes" if row["includes_setup"] else "no", outcome or "-"])  # fmt: skip
    columns = ("target", "minutes", "exit", "set-up included", "result")
    return [ResultTable.of("tidal bench make (a fresh clone)", columns, cells)]
