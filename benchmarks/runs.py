"""The results folder as runs: each ``benchmarks/results/*.json`` with what it measured (bench,
device, settings, sections), which runs a later one replaced, and whether the code a run
measured has changed since ([Note: latest runs]).

[Note: latest runs]
A run is identified by its bench, its device and its *settings*: the options of its command as
the current parser reads them (so ``tidal bench pipemare`` and ``tidal bench pipemare --seed
0`` are the same settings when 0 is the default), less the options that choose only how long or
how often to measure (``--repeats``, ``--warmup-steps``; ``--steps`` of the timing benches),
where to write (``--results-dir``), and which sections to run. A run is *current* for each
section no later run of the same bench, device and settings holds; a run current for no section
is *replaced*, and ``tidal bench report --prune`` removes it (git keeps it). The results page
shows every current run, each with the sections it is current for. A figure is a fact about the
commit its run records: a later change of the code never makes a run less current, and
``--stale`` only prints which runs' code has changed since, for whoever wants to measure again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import io
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.results import read_results
from tidal.config import ConfigError

__all__ = [
    "BENCH_CODE",
    "Run",
    "changed_since",
    "current_runs",
    "Results",
    "replaced_runs",
    "settings_of",
]

# The code whose change could move a bench's figures (what ``--stale`` compares).
BENCH_CODE: dict[str, tuple[str, ...]] = {
    "offload": ("tidal/memory", "tidal/parallel", "benchmarks/offload.py"),
    "dp": ("tidal/memory", "tidal/sharding", "tidal/parallel", "tidal/distributed",
           "benchmarks/dp.py", "benchmarks/dp_runs.py", "benchmarks/dp_systems.py",
           "benchmarks/dp_nvme.py"),
    "compose": ("tidal/memory", "tidal/sharding", "tidal/parallel", "tidal/distributed",
                "tidal/runtime", "tidal/train", "benchmarks/compose.py",
                "benchmarks/compose_ranks.py", "benchmarks/dp_runs.py", "benchmarks/dp_systems.py"),
    "compat": ("tidal/memory", "tidal/sharding", "tidal/parallel", "benchmarks/compat.py",
               "benchmarks/compat_cases.py", "benchmarks/compat_ranks.py",
               "benchmarks/compat_run.py"),
    "train": ("tidal/memory", "tidal/parallel", "tidal/train", "benchmarks/train.py"),
    "pipeline": ("tidal/pipeline", "benchmarks/pipeline.py"),
    "pipemare": ("tidal/pipeline", "benchmarks/pipemare.py"),
    "mpress": ("tidal/activations", "tidal/pipeline", "tidal/planner", "benchmarks/mpress.py",
               "benchmarks/mpress_measured.py", "benchmarks/mpress_zero3.py"),
    "savers": ("tidal/activations", "tidal/pipeline", "benchmarks/savers.py"),
    "plan": ("tidal/planner", "benchmarks/plan.py"),
    "plan-largest": ("tidal/planner", "benchmarks/plan.py"),
    "plan-check": ("tidal/planner", "tidal/parallel", "tidal/train", "benchmarks/plan_check.py"),
    "plan-check-ranks": ("tidal/planner", "tidal/parallel", "tidal/train", "tidal/runtime",
                         "benchmarks/plan_check_ranks.py"),
    "make": ("Makefile", "pyproject.toml", "constraints.txt", "tidal/recipes/demo.toml",
             "benchmarks/make.py"),
}  # fmt: skip

# Options that say how long, how often or where to measure, not what ([Note: latest runs]).
_NOT_SETTINGS = frozenset({"command", "results_dir", "no_plot", "repeats", "warmup_steps",
                           "timeout_s", "case_timeout_s"})  # fmt: skip
# --steps only times there
_TIMING_BENCHES = frozenset({"offload", "dp", "train", "pipeline", "compose"})
_SECTION_CHOICE = frozenset({"section", "sections"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One results file and what it measured."""

    path: Path
    data: dict[str, Any]
    args: argparse.Namespace  # its command as the current parser reads it

    @property
    def bench(self) -> str:
        return str(self.data["bench"])

    @property
    def device(self) -> str:
        return str(self.data["device"])

    @property
    def name(self) -> str:
        """The file's stem: the anchor of its section on the results page."""
        return self.path.stem

    @property
    def commit(self) -> str | None:
        return self.data.get("git_commit")

    @property
    def created(self) -> dt.datetime:
        return dt.datetime.fromisoformat(self.data["created_at"])

    @property
    def settings(self) -> tuple[tuple[str, str], ...]:
        return settings_of(self.bench, self.args)

    @property
    def sections(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(str(row.get("section", "")) for row in self.data["rows"]))

    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return self.bench, self.device, self.settings


def settings_of(bench: str, args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """What a command of ``bench`` measured: its options less those that say how long, how
    often or where ([Note: latest runs])."""
    ignored = _NOT_SETTINGS | _SECTION_CHOICE
    if bench in _TIMING_BENCHES:
        ignored |= {"steps"}
    return tuple(sorted((k, repr(v)) for k, v in vars(args).items() if k not in ignored))


def _parse(parser: argparse.ArgumentParser, command: str, path: Path) -> argparse.Namespace:
    tokens = shlex.split(command)
    if tokens[:1] != ["tidal"]:
        raise ConfigError(str(path), f"its command {command!r} is not a tidal command")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(tokens[1:])
    except SystemExit:
        why = errors.getvalue().strip().splitlines()[-1:] or ["?"]
        raise ConfigError(
            str(path),
            f"the current parser does not read its command {command!r} ({why[0]}); "
            "measure it again, or remove the file (git keeps it)",
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Results:
    """The runs of a results folder, oldest first, and the parser that read their commands
    (the CLI's, passed in: benchmarks sit below the CLI that runs them)."""

    runs: tuple[Run, ...]
    parser: argparse.ArgumentParser

    @classmethod
    def load(cls, folder: Path, parser: argparse.ArgumentParser) -> Results:
        runs = []
        for path in sorted(folder.glob("*.json")):
            data = read_results(path)
            runs.append(Run(path=path, data=data, args=_parse(parser, data["command"], path)))
        return cls(runs=tuple(sorted(runs, key=lambda r: (r.created, r.name))), parser=parser)

    def settings(self, bench: str, command: str) -> tuple[tuple[str, str], ...]:
        """What a run of ``command`` would be identified by ([Note: latest runs])."""
        return settings_of(bench, _parse(self.parser, command, Path("<command>")))


def current_runs(runs: Sequence[Run]) -> list[tuple[Run, tuple[str, ...]]]:
    """Each run with the sections it is the latest for, newest first; runs current for no
    section left out ([Note: latest runs])."""
    taken: set[tuple[Any, ...]] = set()
    current = []
    for run in sorted(runs, key=lambda r: (r.created, r.name), reverse=True):
        fresh = tuple(s for s in run.sections if (*run.key(), s) not in taken)
        taken.update((*run.key(), s) for s in run.sections)
        if fresh:
            current.append((run, fresh))
    return current


def replaced_runs(runs: Sequence[Run]) -> list[Run]:
    kept = {run.path for run, _ in current_runs(runs)}
    return [run for run in runs if run.path not in kept]


def changed_since(run: Run, root: Path) -> list[str] | None:
    """The files of the code ``run``'s bench measures that differ now from its commit (the
    working tree included); None where git cannot tell (no commit, or one not in this history)."""
    if not run.commit:
        return None
    paths = BENCH_CODE.get(run.bench, ())
    done = subprocess.run(
        ["git", "diff", "--name-only", run.commit, "--", *paths],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return None
    return done.stdout.split()
