"""``tidal bench plan-check``: the planner's prediction for a plan against that plan trained on
this device.

For each (model, device budget): trace the model as ``tidal plan`` does, solve for the plan on
one device under that budget, then train the recipe with it (``tidal train --plan``) for a few
steps in a process of its own, and compare the plan's predicted peak memory and step time with
the allocator's peak and the median steady step. Each plan is the fastest that fits its
budget: budgets below what the model needs without recompute make the planner choose
recompute, so one model gives several plans. The cluster figures are the preset's
(``--cluster``), not measured: the ratio is the cost model's error on this device. The defaults
are the run docs/planner.md quotes ("Checked on a GPU").
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.tables import ResultTable
from tidal.config import format_bytes, parse_bytes

__all__ = ["add_arguments", "add_parser", "bench_plan_check", "run", "tables"]

_RUN_OVERRIDES = (
    "checkpoint.every_steps=0",
    "checkpoint.at_end=false",
    "training.val_every=0",
    "training.val_batches=1",
    "engine=reference",
)


def add_parser(benches: argparse._SubParsersAction) -> None:
    """``tidal bench plan-check`` among the benches of the command line."""
    check = benches.add_parser(
        "plan-check",
        help="the planner's predicted peak and step time against its plan trained on this device",
        description="For each model and device budget, solve for the plan on one device (the "
        "cluster preset's figures), train the recipe with it for a few steps in a process of "
        "its own, and compare the allocator's peak and the median steady step with the plan's "
        "prediction. Writes benchmarks/results/plan-check-*.json.",
    )
    add_arguments(check)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt3-1.3b,gpt3-2.7b",
                        help="GPT presets, comma-separated (gpt3-1.3b,gpt3-2.7b)")  # fmt: skip
    parser.add_argument("--device-memory", default="80GiB,46GiB,30GiB", metavar="SIZE,SIZE",
                        help="budgets to plan each model under (80GiB,46GiB,30GiB)")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per step (4)")
    parser.add_argument("--cluster", default="h100", help="the cost model's device figures (h100)")
    parser.add_argument(
        "--recipe", default="gpt2-small", help="the data and optimizer (gpt2-small)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                        help="an override for every run, e.g. training.device=cpu")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="steps per plan (10)")
    parser.add_argument("--warmup-steps", type=int, default=4,
                        help="leading steps left out of the figures (4)")  # fmt: skip
    parser.add_argument("--results-dir", default=None, metavar="DIR")
    parser.add_argument(
        "--ranks", type=int, default=1,
        help="1: one-device plans on this device (default); N > 1: the plans the search makes "
        "for --model on N devices of a CPU cluster calibrated here, each trained on N gloo "
        "ranks (benchmarks/plan_check_ranks.py)",
    )  # fmt: skip
    parser.add_argument("--model", default="demo",
                        help="with --ranks: the GPT preset to plan and train (demo)")  # fmt: skip
    parser.add_argument("--timeout-s", type=int, default=600,
                        help="with --ranks: each plan's run on the ranks (600)")  # fmt: skip
    parser.add_argument("--cases", default=None, metavar="NAME;NAME",
                        help="with --ranks: the cases to run, by name, ';' between them "
                        "(all: benchmarks/plan_check_ranks.py's CASES)")  # fmt: skip


def bench_plan_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (model, budget): the plan's prediction beside its measured run."""
    from tidal.train import load_job
    from tidal.train.job import find_recipe

    if args.steps <= args.warmup_steps:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    budgets = [parse_bytes(b.strip(), key="--device-memory") for b in
               args.device_memory.split(",") if b.strip()]  # fmt: skip
    rows = []
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tidal-plan-check-") as folder:
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            overrides = [*_RUN_OVERRIDES, *args.overrides, f"model.preset={model}",
                         f"training.batch_size={args.micro_batch}",
                         f"training.steps={args.steps}"]  # fmt: skip
            job = load_job(find_recipe(args.recipe), overrides)  # a bad input fails before any run
            for budget in budgets:
                plan_path = Path(folder) / f"{model}-{budget}.json"
                predicted = _plan(job, budget, args, plan_path)
                if predicted["plan"] is None:
                    rows.append({"model": model, "device_memory_bytes": budget, **predicted})
                    continue
                run_dir = Path(folder) / f"run-{model}-{budget}"
                with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                    measured = pool.submit(_train, args.recipe, (*overrides, f"run_dir={run_dir}"),
                                           str(plan_path), args.warmup_steps).result()  # fmt: skip
                rows.append(_row(model, budget, predicted, measured))
    return rows


def _plan(job: Any, budget: int, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The plan under ``budget`` on one device, written to ``path``; its predictions."""
    from tidal.models import GPTSpec
    from tidal.planner import CLUSTER_PRESETS, ClusterSpec, Infeasible, PlannerConfig, make_plan

    values: dict[str, Any] = {**CLUSTER_PRESETS[args.cluster], "device_memory_bytes": budget}
    cluster = ClusterSpec(devices=1, devices_per_node=1, **values)
    spec = GPTSpec(config=job.model.resolve())
    graph = spec.graph(micro_batch=args.micro_batch)
    config = PlannerConfig(objective="time", pareto=(), baselines=(), pipelines=False)
    try:
        result = make_plan(graph, cluster, config)
    except Infeasible as error:
        return {"plan": None, "infeasible": str(error)}
    plan = result.plan
    plan.save(path)
    modes: dict[str, int] = {}
    for mode in plan.recompute.values():
        modes[str(mode)] = modes.get(str(mode), 0) + 1
    return {
        "plan": f"dp {plan.dp} x tp {plan.tp}",
        "recompute": modes,
        "predicted_peak_bytes": plan.peak_memory_bytes,
        "predicted_step_s": plan.step_time_s,
        "predicted_memory": plan.memory.to_dict(),
    }


def _train(recipe: str, overrides: tuple[str, ...], plan: str, warmup_steps: int) -> dict[str, Any]:
    from tidal.train import Trainer, load_job
    from tidal.train.job import find_recipe
    from tidal.train.metrics import read_metrics

    job = load_job(find_recipe(recipe), list(overrides))
    trainer = Trainer(job, plan=plan)
    summary = trainer.fit()
    steady = [r["step_s"] for r in read_metrics(trainer.run_dir) if r["kind"] == "train"
              and r["step"] > warmup_steps]  # fmt: skip
    peaks = summary["peak_memory_bytes"] or {}
    return {
        "device": str(trainer.device),
        "precision": job.training.precision,
        "num_params": trainer.num_params,
        "steady_steps": len(steady),
        "measured_step_s": statistics.median(steady),
        "measured_peak_bytes": peaks.get("device"),
        "host_peak_bytes": peaks.get("host"),
        "final_loss": summary["final_loss"],
    }


def _row(model: str, budget: int, predicted: dict[str, Any], measured: dict[str, Any]) -> dict:
    peak = measured["measured_peak_bytes"]
    return {
        "model": model,
        "device_memory_bytes": budget,
        **predicted,
        **measured,
        "step_measured_over_predicted": measured["measured_step_s"] / predicted["predicted_step_s"],
        "peak_measured_over_predicted": None
        if peak is None
        else peak / predicted["predicted_peak_bytes"],
    }


def run(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show

    folder = None if args.results_dir is None else Path(args.results_dir)
    if args.ranks > 1:
        from benchmarks.plan_check_ranks import bench_plan_check_ranks
        from benchmarks.plan_check_ranks import tables as ranks_tables

        path = write_results("plan-check-ranks", bench_plan_check_ranks(args), folder=folder)
        show(console, ranks_tables(read_results(path), args))
        console.print(f"results: {path}")
        return 0
    rows = bench_plan_check(args)
    path = write_results("plan-check", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def tables(result: dict[str, Any], args: argparse.Namespace) -> list[ResultTable]:
    """Each plan's prediction beside its run ([Note: one table per result] in
    benchmarks/tables.py)."""
    columns = ("model", "budget", "recompute", "peak predicted", "allocator peak", "ratio",
               "step s predicted", "step s measured", "ratio")  # fmt: skip
    cells = []
    for r in result["rows"]:
        budget = format_bytes(r["device_memory_bytes"])
        if r["plan"] is None:
            cells.append([r["model"], budget, "infeasible", *["-"] * 6])
            continue
        peak, ratio = r["measured_peak_bytes"], r["peak_measured_over_predicted"]
        cells.append([
            r["model"], budget, ", ".join(f"{k} {v}" for k, v in r["recompute"].items()),
            format_bytes(r["predicted_peak_bytes"]), "-" if peak is None else format_bytes(peak),
            "-" if ratio is None else f"{ratio:.2f}", f"{r['predicted_step_s']:.4f}",
            f"{r['measured_step_s']:.4f}", f"{r['step_measured_over_predicted']:.2f}",
        ])  # fmt: skip
    title = (f"tidal bench plan-check: each plan's prediction ({args.cluster} figures) against "
             "its run")  # fmt: skip
    return [ResultTable.of(title, columns, cells)]
