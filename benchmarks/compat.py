"""``tidal bench compat``: the chunk engine on models tidal did not write, against plain PyTorch.

    tidal bench compat                                   # every zoo family, every mode
    tidal bench compat --families gpt2,t5 --ranks 2      # and a two-rank section

For each family of :data:`tidal.testing.zoo.ZOO` (or ``module:ATTR`` naming a ``ZooModel`` of
your own) and each mode ([Note: compat modes] in benchmarks/compat_cases.py: fp32 unlimited,
fp32 / bf16 / accumulation 2 at the least budget, and with ``--ranks N`` the sharded engine on N
gloo ranks), train ``steps`` steps with the chunk engine and with the reference engine on the
same seeds and batches, and write one row: budget, result (``match``, ``mismatch``, ``error:
<type>: <first line>``, ``skipped`` where an optional package is missing), the largest loss
difference, peak device bytes, evictions, wall seconds. Each family runs in a worker process of
its own ([Note: isolated cases] in benchmarks/isolated.py), so an exception or a signal in one
case is that case's row and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.compat_cases import MODES, Case, Mode, ranks_modes
from benchmarks.compat_run import run_case
from benchmarks.isolated import run_isolated
from tidal.config import ConfigError, require
from tidal.testing.zoo import ZOO, ZooModel, find_family

__all__ = ["CompatSettings", "add_arguments", "bench_compat", "run"]

_TRACEBACK_CHARS = 4000  # the end of a traceback is where the cause is
# What the fork server imports once for every worker. Every case builds a torch.optim optimizer
# (the reference engine), whose first add_param_group imports torch._dynamo: about 3 s in each
# worker (one per family, one more after each crash) unless the server already has. Importing
# it starts no thread, so forking after it is as safe as after torch.
_PRELOAD = ("benchmarks.compat_run", "torch._dynamo")


@dataclass(frozen=True, kw_only=True)
class CompatSettings:
    """What ``tidal bench compat`` runs."""

    families: tuple[str, ...] = field(default_factory=lambda: tuple(ZOO))
    modes: tuple[str, ...] = tuple(MODES)
    steps: int = 6
    chunk_elements: int = 2048  # small chunks: several per model, so budgets evict
    ranks: int = 0  # 0: no rank section; N >= 2: the sharded engine on N gloo ranks too
    ranks_families: tuple[str, ...] | None = None  # the rank section's families (default: all)
    case_timeout_s: float = 300.0  # one case in its worker, rank cases included
    ranks_timeout_s: float = 120.0  # one multi-process run of the rank section (a case has two)

    def __post_init__(self) -> None:
        require(bool(self.families), "--families", "name at least one family")
        unknown = sorted(set(self.modes) - set(MODES))
        require(not unknown, "--modes", f"unknown {unknown}; choose from {', '.join(MODES)}")
        require(self.steps >= 2, "--steps", f"must be >= 2, got {self.steps}")
        require(self.chunk_elements > 0, "--chunk-elements", "must be positive")
        require(self.ranks == 0 or self.ranks >= 2, "--ranks", f"0 or >= 2, got {self.ranks}")
        extra = set(self.ranks_families or ()) - set(self.families)
        require(not extra, "--ranks-families", f"{sorted(extra)} are not in --families")

    def modes_of(self, family: str) -> list[Mode]:
        modes = [MODES[name] for name in self.modes]
        if self.ranks and family in (self.ranks_families or self.families):
            modes += ranks_modes(self.ranks)
        return modes


def bench_compat(
    settings: CompatSettings, *, on_family: Callable[[list[dict[str, Any]]], None] | None = None
) -> list[dict[str, Any]]:
    """Every family's rows, family by family; ``on_family`` sees each family's rows as they
    come (the CLI prints progress with it)."""
    families = {spec: _find(spec) for spec in settings.families}  # bad names fail first
    rows: list[dict[str, Any]] = []
    for spec, family in families.items():
        done = _family_rows(settings, spec, family)
        if on_family is not None:
            on_family(done)
        rows += done
    return rows


def _find(spec: str) -> ZooModel:
    try:
        return find_family(spec)
    except (ValueError, ImportError, AttributeError) as err:
        raise ConfigError("--families", str(err)) from None


def _family_rows(settings: CompatSettings, spec: str, family: ZooModel) -> list[dict[str, Any]]:
    modes = settings.modes_of(spec)
    missing = [name for name in family.needs if importlib.util.find_spec(name) is None]
    if missing:
        reason = f"needs {', '.join(missing)} (not installed)"
        return [_row(family, mode, {"result": "skipped", "reason": reason}) for mode in modes]
    cases = [
        Case(family=spec, mode=mode, steps=settings.steps, chunk_elements=settings.chunk_elements,
             ranks_timeout_s=settings.ranks_timeout_s)
        for mode in modes
    ]  # fmt: skip
    results = run_isolated(run_case, cases, timeout_s=settings.case_timeout_s,
                           preload=_PRELOAD)  # fmt: skip
    shared = {"steps": settings.steps, "chunk_elements": settings.chunk_elements}
    return [_row(family, mode, shared | r) for mode, r in zip(modes, results, strict=True)]


def _row(family: ZooModel, mode: Mode, result: dict[str, Any]) -> dict[str, Any]:
    row = {
        "family": family.name,
        "kind": family.kind,
        "notes": family.notes,
        "mode": mode.name,
        "precision": mode.precision,
        "grad_accum_steps": mode.grad_accum_steps,
        "ranks": mode.ranks,
        "tight": mode.tight,
        **result,
    }
    if "error" in result:
        row["result"] = f"error: {result['error']}"
        if "traceback" in row:
            row["traceback"] = row["traceback"][-_TRACEBACK_CHARS:]
    return row


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CompatSettings()
    parser.add_argument("--families", default=None, metavar="A,B",
                        help="zoo families (default: all) or module:ATTR / file.py:ATTR naming "
                        f"a ZooModel; the zoo: {', '.join(ZOO)}")  # fmt: skip
    parser.add_argument("--modes", default=",".join(d.modes), metavar="A,B",
                        help=f"single-process modes ({','.join(d.modes)})")  # fmt: skip
    parser.add_argument("--steps", type=int, default=d.steps,
                        help=f"micro-batches per run ({d.steps})")  # fmt: skip
    parser.add_argument("--chunk-elements", type=int, default=d.chunk_elements,
                        help=f"chunk.size in elements ({d.chunk_elements})")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=d.ranks,
                        help="also run the sharded engine on N gloo ranks (default: no)")  # fmt: skip
    parser.add_argument("--ranks-families", default=None, metavar="A,B",
                        help="the families of the rank section (default: --families)")  # fmt: skip
    parser.add_argument("--case-timeout-s", type=float, default=d.case_timeout_s,
                        help=f"limit per case, in its worker process ({d.case_timeout_s:g})")  # fmt: skip
    parser.add_argument("--results-dir", default=None, metavar="DIR",
                        help="write the JSON file here instead of benchmarks/results/")  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> CompatSettings:
    d = CompatSettings()
    return CompatSettings(
        families=_names(args.families) if args.families else d.families,
        modes=_names(args.modes),
        steps=args.steps,
        chunk_elements=args.chunk_elements,
        ranks=args.ranks,
        ranks_families=_names(args.ranks_families) if args.ranks_families else None,
        case_timeout_s=args.case_timeout_s,
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """``tidal bench compat``: run, write the JSON, print its table."""
    from benchmarks.compat_report import tables
    from benchmarks.results import read_results, write_results
    from benchmarks.tables import show

    settings = settings_from_args(args)

    def progress(done: list[dict[str, Any]]) -> None:
        results = ", ".join(f"{r['mode']} {r['result'].split(':')[0]}" for r in done)
        console.print(f"{done[0]['family']}: {results}", markup=False)

    rows = bench_compat(settings, on_family=progress)
    path = write_results(
        "compat", rows, folder=Path(args.results_dir) if args.results_dir else None
    )
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0
