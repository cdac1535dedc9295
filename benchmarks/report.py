"""``tidal bench report``: docs/results.md, and the results table of README.md, written from
``benchmarks/results/*.json`` and nothing else.

    tidal bench report            # write docs/results.md and README.md's results table
    tidal bench report --check    # write nothing; exit 1 if either is not what it would write
    tidal bench report --prune    # first remove the runs later runs replaced (git keeps them)
    tidal bench report --stale    # also print which runs' code has changed since their commit

The page holds every current run ([Note: latest runs] in benchmarks/runs.py), grouped by bench
and device, each with its command, commit, date, torch version and device and the tables its
bench prints ([Note: one table per result] in benchmarks/tables.py), and every target of
benchmarks/targets.py beside its figure. ``make test`` checks that both files are what this
command writes, so a figure cannot be edited by hand and a new result cannot land unreported.
Whether code changed after a run is never written into a checked file: a figure is a fact about
the commit it was measured at.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from benchmarks.runs import Results, Run, changed_since, current_runs, replaced_runs
from benchmarks.tables import ResultTable, markdown
from benchmarks.targets import TARGETS, Reading, read
from tidal.config import ConfigError

__all__ = [
    "README_BEGIN",
    "README_END",
    "add_arguments",
    "add_parser",
    "readme_with",
    "render",
    "run",
]

README_BEGIN = (
    "<!-- results: written by `tidal bench report` from benchmarks/results/ and "
    "benchmarks/targets.py; do not edit by hand -->"
)
README_END = "<!-- end of results -->"

# bench -> (what it measures, its tables function)
BENCHES: dict[str, tuple[str, str]] = {
    "make": ("`make run` and `make test` timed in a fresh clone, as a new user meets them.",
             "benchmarks.make:tables"),
    "offload": ("The chunk engine on one process against plain PyTorch, DeepSpeed ZeRO-3 "
                "offload and the offline optimum: step time, traffic, the largest model, host "
                "memory.", "benchmarks.offload:tables"),
    "dp": ("ZeRO-3 over gloo ranks against DeepSpeed ZeRO-3 offload and FSDP2 offload: step "
           "time, host memory, the largest model per host budget, the NVMe tier.",
           "benchmarks.dp:tables"),
    "compose": ("Compositions of parallelisms on 4 gloo ranks (dp, pp, pp x dp chunks, NVMe, "
                "pp x tp) against DeepSpeed ZeRO-3 offload and FSDP2 offload: the largest model, "
                "bytes moved per step, per-rank peaks beside tidal's figures.",
                "benchmarks.compose:tables"),
    "compat": ("The chunk engine on models tidal did not write, against the reference engine "
               "on the same seeds.", "benchmarks.compat_report:tables"),
    "train": ("Recipes trained a few steps each: tokens/s, TFLOP/s, MFU, peak memory.",
              "benchmarks.train:tables"),
    "plan": ("The planner's plans in its cost model against Megatron-LM's layouts, ZeRO-3 and "
             "Megatron-LM at its best.", "benchmarks.plan:tables"),
    "plan-largest": ("The largest model whose least-memory configuration fits, tidal's planner "
                     "against Megatron-LM (cost model).", "benchmarks.plan:largest_tables"),
    "plan-check": ("Plans trained on this device beside their prediction.",
                   "benchmarks.plan_check:tables"),
    "plan-check-ranks": ("Plans the search makes for 4 devices (pipelined, tensor-parallel, "
                         "swapping), trained on 4 gloo ranks, each rank beside its prediction.",
                         "benchmarks.plan_check_ranks:tables"),
    "pipeline": ("Pipeline schedules on gloo ranks against the simulator.",
                 "benchmarks.pipeline:tables"),
    "pipemare": ("Asynchronous pipelines (PipeMare and kin) against synchronous training: "
                 "validation loss, delays.", "benchmarks.pipemare:tables"),
    "mpress": ("MPress savers (recompute, host swap, peer swap): the largest model each trains, "
               "predicted and trained on gloo ranks.", "benchmarks.mpress:tables"),
    "gpu": ("Offload at GPU speed: tidal, FSDP2 CPU offload and DeepSpeed ZeRO-3 offload on a "
            "model that needs offload under an emulated smaller GPU.", "benchmarks.gpu:tables"),
    "savers": ("MPress savers measured on the device against the memory model.",
               "benchmarks.savers:tables"),
}  # fmt: skip


def add_parser(benches: argparse._SubParsersAction) -> None:
    """``tidal bench report`` among the benches of the command line."""
    report = benches.add_parser(
        "report",
        help="write docs/results.md and the README's results table from benchmarks/results/",
        description="Read every benchmarks/results/*.json; for each bench, device and setting, "
        "the latest run's tables (each bench's own, as it printed them), its command, commit, "
        "date, torch version and device, and each target beside its figure, written to "
        "docs/results.md; the headline targets also to README.md, between its results "
        "markers. Runs nothing.",
    )
    add_arguments(report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", default=None, metavar="DIR",
                        help="the results to read (default: benchmarks/results/)")  # fmt: skip
    parser.add_argument("--page", default="docs/results.md", metavar="FILE",
                        help="the page to write (docs/results.md)")  # fmt: skip
    parser.add_argument("--readme", default="README.md", metavar="FILE",
                        help="the README whose results table to write (README.md)")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the page or the README's table is not "
                        "what this command writes")  # fmt: skip
    parser.add_argument("--prune", action="store_true",
                        help="remove the runs later runs replaced, and their plots, first")  # fmt: skip
    parser.add_argument("--stale", action="store_true",
                        help="print which current runs' code has changed since their commit")  # fmt: skip


# -- the page ------------------------------------------------------------------------------------


def _tables(run: Run, sections: Sequence[str]) -> list[ResultTable]:
    """The bench's own tables, of the rows of ``sections`` only."""
    module, name = BENCHES[run.bench][1].split(":")
    tables = getattr(importlib.import_module(module), name)
    rows = [row for row in run.data["rows"] if str(row.get("section", "")) in sections]
    return list(tables({**run.data, "rows": rows}, run.args))


def _date(run: Run) -> str:
    return run.created.strftime("%Y-%m-%d")


def _commit(run: Run) -> str:
    return f"`{run.commit[:7]}`" if run.commit else "unknown"


def _run_section(run: Run, sections: Sequence[str], folder: str) -> str:
    threads = run.data.get("num_cpu_threads")
    facts = [
        f"commit {_commit(run)}",
        f"torch {run.data.get('torch_version', '?')}",
        f"Python {run.data.get('python_version', '?')}",
        run.device + (f", {threads} threads" if threads else ""),
        f"[JSON]({folder}/{run.path.name})",
    ]
    if run.path.with_suffix(".png").is_file():
        facts.append(f"[plot]({folder}/{run.name}.png)")
    lines = [
        f'<a id="{run.name}"></a>',
        f"#### {run.created.strftime('%Y-%m-%d %H:%M UTC')} · `{run.data['command']}`",
        "",
        " · ".join(facts),
        "",
    ]
    if tuple(sections) != run.sections:
        lines += [f"Sections shown (later runs replaced the others): {', '.join(sections)}.", ""]
    for table in _tables(run, sections):
        lines += [markdown(table)]
    return "\n".join(lines)


def _readings_table(
    readings: Sequence[Reading], *, link: str, folder: str, anchors: bool = False
) -> list[str]:
    lines = [
        "| figure | measured | target | verdict | compared with | device, date, commit | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in readings:
        t, run = r.target, r.run
        where = "-" if run is None else f"{run.device}, {_date(run)}, {_commit(run)}"
        links = "-" if run is None else f"[run]({link}#{run.name}), [JSON]({folder}/{run.path.name})"  # fmt: skip
        figure = f'<a id="{t.key}"></a>{t.figure}' if anchors else t.figure
        cells = [figure, r.shown, f"{t.bound_text} ({t.set_by})", r.verdict, t.compared_with,
                 where, links]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def render(results: Results) -> str:
    """docs/results.md for ``results``."""
    readings = [read(t, results) for t in TARGETS]
    current = current_runs(results.runs)
    lines = [
        "# Results",
        "",
        "Written by `tidal bench report` from `benchmarks/results/*.json`; do not edit it by "
        "hand (`make test` checks that it is what the command writes). Each run below is the "
        "latest of its bench, device and settings, with the commit it measured: a figure is a "
        "fact about that commit, and `tidal bench report --stale` says which runs' code has "
        "changed since. Targets come from `benchmarks/targets.py`; the ones that miss stand "
        "beside the ones that hold.",
        "",
        "## Targets",
        "",
        *_readings_table(readings, link="", folder="../benchmarks/results", anchors=True),
        "",
        "## Runs",
        "",
    ]
    unknown = sorted({run.bench for run, _ in current} - set(BENCHES))
    if unknown:
        raise ConfigError(
            "--results-dir",
            f"no tables for bench(es) {unknown}: add them to BENCHES in benchmarks/report.py",
        )
    by_bench = {b: [(r, s) for r, s in current if r.bench == b] for b in BENCHES}
    by_bench = {bench: mine for bench, mine in by_bench.items() if mine}
    lines += [
        f"- [{bench}](#bench-{bench}): {len(mine)} run(s)" for bench, mine in by_bench.items()
    ]
    for bench, mine in by_bench.items():
        lines += ["", f'<a id="bench-{bench}"></a>', f"## {bench}", "", BENCHES[bench][0], ""]
        for t in readings:
            if t.target.bench == bench and t.run is not None:
                lines.append(f"- Target: {t.target.figure}: **{t.shown}** against {t.target.bound_text}, {t.verdict} ([run](#{t.run.name})).")  # fmt: skip
        for device in dict.fromkeys(run.device for run, _ in mine):
            lines += ["", f"### {bench} on {device}", ""]
            lines += [_run_section(run, sections, "../benchmarks/results")
                      for run, sections in mine if run.device == device]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"


def readme_table(results: Results) -> str:
    """The README's results table: the headline targets."""
    readings = [read(t, results) for t in TARGETS if t.headline]
    table = _readings_table(readings, link="docs/results.md", folder="benchmarks/results")
    return "\n".join([README_BEGIN, *table, README_END])


def readme_with(text: str, results: Results) -> str:
    """``text`` (README.md) with the block between its results markers rewritten."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ConfigError(
            "--readme",
            f"the file has no results block: put the two lines {README_BEGIN!r} and "
            f"{README_END!r} where the table goes",
        )
    return text[:start] + readme_table(results) + text[end + len(README_END) :]


# -- the command -----------------------------------------------------------------------------------


def _stale(console: Console, runs: Sequence[Run], root: Path) -> None:
    console.print("code changed since each current run (git diff of its bench's code):")
    for run, _ in current_runs(runs):
        changed = changed_since(run, root)
        what = ("unknown (no commit in this history)" if changed is None
                else "unchanged" if not changed else f"{len(changed)} files, e.g. {changed[0]}")  # fmt: skip
        console.print(f"  {run.name}: {what}", markup=False)


def run(args: argparse.Namespace, console: Console, parser: argparse.ArgumentParser) -> int:
    """``parser``: the CLI's, to read each run's command as it would ([Note: latest runs])."""
    root = Path.cwd()
    folder = Path(args.results_dir) if args.results_dir else root / "benchmarks" / "results"
    results = Results.load(folder, parser)
    if args.prune and not args.check:
        for old in replaced_runs(results.runs):
            for path in (old.path, old.path.with_suffix(".png")):
                path.unlink(missing_ok=True)
            console.print(f"removed {old.path.name} (replaced by a later run)")
        results = Results.load(folder, parser)
    page, readme = Path(args.page), Path(args.readme)
    wanted = {page: render(results), readme: readme_with(readme.read_text(), results)}
    if args.stale:
        _stale(console, results.runs, root)
    if args.check:
        differ = [str(p) for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
        for name in differ:
            console.print(f"{name} is not what `tidal bench report` writes: run it", markup=False)
        return 1 if differ else 0
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    console.print(f"wrote {page} ({len(current_runs(results.runs))} runs) and {readme}'s results table")  # fmt: skip
    return 0
