"""``tidal bench plan``: the planner against Megatron-LM and ZeRO-3 on GPT-3 sizes and clusters.

For each (model, devices) it measures the model on the meta device, solves for the plan with the
least memory within ``eps`` of the fastest plan that fits, and prices the baselines in the same
cost model. A row holds the plan's peak and step time, each baseline's, the saving in percent,
the saving at the baseline's own step time, and the solve time (the issue's target: 10 s for
175B on 64 devices). Figures are the cost model's, for the cluster preset (H100 by default);
no model is trained here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.tables import ResultTable
from tidal.models import GPTConfig, GPTSpec
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Infeasible, PlannerConfig, Recompute, make_plan
from tidal.planner.graph import ModelGraph
from tidal.planner.report import plan_report

__all__ = ["MODELS", "DEVICES", "MEGATRON_COLUMNS", "bench_plan", "largest_fitting",
           "largest_tables", "megatron_rows", "plot", "rows_table", "run", "tables"]  # fmt: skip

MODELS = ("gpt3-1.3b", "gpt3-13b", "gpt3-175b")
DEVICES = (8, 64, 512)
PARETO = (0.0, 0.1, 0.25, 0.5, 1.0)  # slowdowns over the fastest plan the frontier is taken at
# the layout baselines priced on the plan's mesh (zero_infinity only where the nodes have a disk)
BASELINES = ("megatron", "megatron_sp", "zero3", "zero3_full", "zero3_offload",
             "fsdp2_cpu_offload", "zero_infinity")  # fmt: skip


def bench_plan(
    models: tuple[str, ...] = MODELS,
    devices: tuple[int, ...] = DEVICES,
    *,
    devices_per_node: int = 8,
    device_memory_bytes: int = 80 * 1024**3,
    eps: float = 0.05,
    micro_batch: int = 1,
    pareto: tuple[float, ...] = PARETO,
    schedules: tuple[str, ...] = ("1f1b", "interleaved"),
    offload: tuple[float, ...] = (0.0,),
    offload_params: tuple[float, ...] = (0.0,),
    nvme_bytes_per_node: int = 0,
    swap: bool = False,
    peer: bool = False,
    stage_splits: tuple[str, ...] = ("even",),
    micro_batches: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    from tidal.models import preset

    rows = []
    for name in models:
        started = time.perf_counter()
        config = dataclasses.replace(preset(name), dropout=0.1)
        graph = measure_gpt(config, micro_batch=micro_batch)
        shape = GPTSpec(config=config).transformer_shape()
        graph.name = name
        measure_s = time.perf_counter() - started
        for n in devices:
            cluster = ClusterSpec(
                devices=n,
                devices_per_node=devices_per_node,
                device_memory_bytes=device_memory_bytes,
                nvme_bytes_per_node=nvme_bytes_per_node,
            )
            planner = PlannerConfig(
                eps=eps,
                pareto=pareto,
                pipeline_pareto=pareto,
                schedules=schedules,
                offload=offload,
                offload_params=offload_params,
                offload_nvme=(0.0, 1.0) if nvme_bytes_per_node else (0.0,),
                baselines=BASELINES,
                recompute=(*PlannerConfig().recompute, *([Recompute.SWAP] if swap else [])),
                peer=peer,
                stage_splits=stage_splits,
                micro_batches=micro_batches,
            )
            row: dict[str, Any] = {"model": name, "devices": n, "measure_s": measure_s,
                                   "schedules": list(schedules), "offload": list(offload),
                                   "offload_params": list(offload_params),
                                   "nvme_bytes_per_node": nvme_bytes_per_node, "swap": swap,
                                   "peer": peer, "stage_splits": list(stage_splits),
                                   "micro_batches": list(micro_batches),
                                   "cluster_memory_bytes": device_memory_bytes}  # fmt: skip
            try:
                result = make_plan(graph, cluster, planner, shape=shape,
                                   retrace=functools.partial(_trace, config))  # fmt: skip
            except Infeasible as err:
                rows.append({**row, "infeasible": str(err), "needed_bytes": err.needed_bytes})
                continue
            report = plan_report(result, cluster)
            row.update(
                mesh=report["mesh"],
                num_microbatches=report["num_microbatches"],
                recompute=report["recompute"],
                peak_memory_bytes=report["peak_memory_bytes"],
                step_time_s=report["step_time_s"],
                fastest_step_time_s=report["fastest_step_time_s"],
                solve_s=report["solve_s"],
                lp_gap=report["lp_gap"],
                memory=report["memory"],
                baselines=report["baselines"],
                pareto=report["pareto"],
                megatron_best=report["megatron_best"],
                pipeline=report["pipeline_search"],
                phases_s=report["phases_s"],
            )
            rows.append(row)
    return rows


def _trace(config: GPTConfig, micro_batch: int) -> ModelGraph:
    return measure_gpt(config, micro_batch=micro_batch)


def _mesh(mesh: dict[str, int]) -> str:
    """``"8 x 8"``, or ``"p16 x 1 x 4"`` where the chosen plan is pipelined (issue 51; runs
    before it chose flat plans only and wrote no ``pp``)."""
    flat = f"{mesh['dp']} x {mesh['tp']}"
    return flat if mesh.get("pp", 1) == 1 else f"p{mesh['pp']} x {flat}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024**3:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


COLUMNS = (
    "model", "N", "plan [pp x] dp x tp", "plan GiB", "plan s", "megatron GiB", "megatron s",
    "saves", "at megatron's s", "megatron-sp GiB", "saves", "zero3 GiB", "zero3 s", "saves",
    "solve s", "LP gap",
)  # fmt: skip


def rows_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The printed table: one list of cells per row, in :data:`COLUMNS` order."""
    cells = []
    for row in rows:
        if "infeasible" in row:
            cells.append([row["model"], str(row["devices"]), "does not fit"] + [""] * 13)
            continue
        mega, sp, z3 = (row["baselines"][k] for k in ("megatron", "megatron_sp", "zero3"))
        same = mega["at_same_step_time"] or {}
        cells.append(
            [
                row["model"], str(row["devices"]), _mesh(row["mesh"]),
                _gib(row["peak_memory_bytes"]), f"{row['step_time_s']:.3f}",
                _gib(mega["peak_memory_bytes"]) + ("" if mega["fits"] else " (no fit)"),
                f"{mega['step_time_s']:.3f}", _pct(mega["saving"]), _pct(same.get("saving")),
                _gib(sp["peak_memory_bytes"]), _pct(sp["saving"]),
                _gib(z3["peak_memory_bytes"]) + ("" if z3["fits"] else " (no fit)"),
                f"{z3['step_time_s']:.3f}", _pct(z3["saving"]),
                f"{row['solve_s']:.2f}", _pct(row["lp_gap"]),
            ]
        )  # fmt: skip
    return cells


MEGATRON_COLUMNS = (
    "model", "N", "pipelined plan", "GiB", "s", "Megatron fastest that fits", "GiB", "s",
    "plan at its s", "GiB", "saves", "Megatron least memory", "GiB", "s", "smallest plan", "GiB",
    "saves", "its s / Megatron's",
)  # fmt: skip


def megatron_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The second table: Megatron-LM at its best (tidal/planner/megatron.py) beside the plans
    that compare with it, in :data:`MEGATRON_COLUMNS` order."""
    cells = []
    for row in rows:
        best = row.get("megatron_best")
        if best is None:
            cells.append([row["model"], str(row["devices"]), "plan does not fit"] + [""] * 15)
            continue
        fast, least = best["fastest"], best["least_memory"]
        at_fast = best["plan_at_fastest_step_time"] or {}
        mine = best["plan_least_memory"] or {}
        piped = row.get("pipeline") or {}
        cells.append(
            [
                row["model"], str(row["devices"]), piped.get("layout", "-"),
                _gib(piped.get("peak_memory_bytes")), _secs(piped.get("step_time_s")),
                fast["name"] if fast else "none fits", _gib(fast and fast["peak_memory_bytes"]),
                _secs(fast and fast["step_time_s"]),
                at_fast.get("layout", "none that fast"), _gib(at_fast.get("peak_memory_bytes")),
                _pct(at_fast.get("saving")),
                least["name"], _gib(least["peak_memory_bytes"]), _secs(least["step_time_s"]),
                mine.get("layout", "-"), _gib(mine.get("peak_memory_bytes")),
                _pct(mine.get("saving")),
                f"{mine['step_time_ratio']:.2f}x" if mine else "-",
            ]
        )  # fmt: skip
    return cells


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Per (model, devices): peak memory against step time of the flat plans' frontier, the
    pipelined plans' frontier, Megatron-LM's frontier over its grid (its fastest fitting and
    least-memory configurations marked) and the layout baselines; the device memory dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "infeasible" not in r]
    cols = min(3, len(shown)) or 1
    rows_n = -(-len(shown) // cols) or 1
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.0 * cols, 3.8 * rows_n), squeeze=False)
    gib = 1024**3
    for ax, row in zip(axes.flat, shown, strict=False):
        best = row["megatron_best"]
        for points, style, label in (
            (row["pareto"], "o-", "tidal, dp x tp"),
            ((row.get("pipeline") or {}).get("pareto", []), "s-", "tidal, pipelined"),
            (best["frontier"], "^--", "Megatron-LM grid"),
        ):
            pts = sorted((p["step_time_s"], p["peak_memory_bytes"] / gib) for p in points)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label, markersize=4)
        for key, marker in (("fastest", "*"), ("least_memory", "P")):
            if best[key]:
                ax.plot(best[key]["step_time_s"], best[key]["peak_memory_bytes"] / gib, marker,
                        markersize=11, color="tab:red")  # fmt: skip
        for name, base in row["baselines"].items():
            if base["step_time_s"] and base["peak_memory_bytes"]:
                ax.plot(base["step_time_s"], base["peak_memory_bytes"] / gib, "x", color="grey")
                ax.annotate(name, (base["step_time_s"], base["peak_memory_bytes"] / gib),
                            fontsize=6, color="grey")  # fmt: skip
        ax.axhline(row["cluster_memory_bytes"] / gib, linestyle=":", color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{row['model']} on {row['devices']}", fontsize=10)
        ax.set_xlabel("step time s (cost model)")
        ax.set_ylabel("peak GiB per device")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def largest_fitting(name: str, devices: int, *, device_memory_bytes: int = 80 * 1024**3,
                    devices_per_node: int = 8, micro_batch: int = 1,
                    nvme_bytes_per_node: int = 0) -> dict[str, Any]:  # fmt: skip
    """The most layers at preset ``name``'s width whose least-memory configuration fits the
    devices: for tidal's flat plans (the ILP at any speed; pipelined plans hold no less, as
    [Note: pipeline stages] in tidal/planner/pipelines.py lets one see) and for Megatron-LM's
    grid; and for tidal's flat plans with model data off the device too ([Note: model data
    offload] in tidal/planner/strategies.py: the optimizer state and parameters on the host, and
    that state on the nodes' NVMe when they have one) beside Megatron-LM's
    grid with its optimizer on the CPU (all it can offload), each with the step time at its
    largest. Layers are added to the measured graph (one block's units, repeated), not traced
    again."""
    from tidal.models import preset
    from tidal.planner.megatron import megatron_best, megatron_grid
    from tidal.planner.pipelines import stage_graph

    config = dataclasses.replace(preset(name), dropout=0.1)
    graph = measure_gpt(config, micro_batch=micro_batch)
    shape = GPTSpec(config=config).transformer_shape()
    cluster = ClusterSpec(devices=devices, devices_per_node=devices_per_node,
                          device_memory_bytes=device_memory_bytes,
                          nvme_bytes_per_node=nvme_bytes_per_node)  # fmt: skip
    planner = PlannerConfig(pareto=(), baselines=(), pipelines=False)
    offloading = dataclasses.replace(planner, offload=(0.0, 1.0), offload_params=(0.0, 1.0),
                                     offload_nvme=(0.0, 1.0) if nvme_bytes_per_node else (0.0,))  # fmt: skip

    def tidal_plan(layers: int, config: PlannerConfig) -> Any:
        try:
            return make_plan(stage_graph(graph, blocks=layers, first=True, last=True), cluster,
                             config)  # fmt: skip
        except Infeasible:
            return None

    def tidal_fits(layers: int) -> bool:
        return tidal_plan(layers, planner) is not None

    def offloaded_fits(layers: int) -> bool:
        return tidal_plan(layers, offloading) is not None

    def megatron_best_at(layers: int, offloads: tuple[float, ...]) -> Any:
        rows = megatron_grid(dataclasses.replace(shape, num_layers=layers), cluster,
                             global_batch=devices * micro_batch, offloads=offloads)  # fmt: skip
        return megatron_best(rows, device_memory_bytes).fastest if rows else None

    def megatron_fits(layers: int) -> bool:
        return megatron_best_at(layers, (0.0,)) is not None

    def megatron_offloaded_fits(layers: int) -> bool:
        return megatron_best_at(layers, (0.0, 1.0)) is not None

    def most(fits: Any) -> int:
        low, high = 0, 1
        while fits(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    per_layer = sum(u.num_params for u in graph.units if graph.block_of(u))
    outside = graph.num_params - per_layer * config.num_layers
    tidal_layers = most(tidal_fits)  # more layers never need less memory on the same meshes
    offload_layers = most(offloaded_fits)
    at_most = tidal_plan(offload_layers, offloading)
    # Megatron's stages must divide the layers, so fitting is not monotone in them: past the
    # bisection's answer, every count up to twice it is tried
    found = most(megatron_fits)
    megatron_layers = max(
        [found] + [n for n in range(found + 1, 2 * found + 2) if megatron_fits(n)]
    )
    found = most(megatron_offloaded_fits)
    megatron_offload_layers = max(
        [found] + [n for n in range(found + 1, 2 * found + 2) if megatron_offloaded_fits(n)]
    )
    megatron_at_most = megatron_best_at(megatron_offload_layers, (0.0, 1.0))
    return {
        "model": name, "devices": devices, "device_memory_bytes": device_memory_bytes,
        "hidden": config.d_model, "tidal_layers": tidal_layers,
        "tidal_params": outside + per_layer * tidal_layers,
        "megatron_layers": megatron_layers,
        "megatron_params": outside + per_layer * megatron_layers,
        "ratio": (outside + per_layer * tidal_layers) / max(1, outside + per_layer * megatron_layers),
        "tidal_offload_layers": offload_layers,
        "tidal_offload_params": outside + per_layer * offload_layers,
        "megatron_offload_layers": megatron_offload_layers,
        "megatron_offload_params": outside + per_layer * megatron_offload_layers,
        "offload_ratio": (outside + per_layer * offload_layers)
        / max(1, outside + per_layer * megatron_offload_layers),
        "megatron_offload_config": None if megatron_at_most is None else {
            "name": megatron_at_most.config.name, "step_time_s": megatron_at_most.step_time_s,
            "peak_memory_bytes": megatron_at_most.peak_memory_bytes,
            "host_bytes_per_device": megatron_at_most.memory.host,
        },
        "nvme_bytes_per_node": nvme_bytes_per_node,
        "offload_plan": None if at_most is None else {
            "offload": at_most.plan.offload.to_dict(),
            "mesh": f"dp {at_most.plan.dp} x tp {at_most.plan.tp}",
            "step_time_s": at_most.plan.step_time_s,
            "peak_memory_bytes": at_most.plan.peak_memory_bytes,
            "host_bytes_per_device": at_most.plan.memory.host,
            "nvme_bytes_per_device": at_most.plan.memory.nvme,
        },
    }  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    """``tidal bench plan``: the table rows, the Megatron-LM table, the JSON and the plot; with
    ``--largest`` the largest model that fits instead."""
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show
    from tidal.config import parse_bytes

    if args.largest:
        return _run_largest(args, console)
    rows = bench_plan(
        tuple(args.models.split(",")),
        tuple(int(n) for n in args.devices.split(",")),
        devices_per_node=args.devices_per_node,
        device_memory_bytes=parse_bytes(args.device_memory),
        eps=args.eps,
        schedules=tuple(x.strip() for x in args.schedules.split(",") if x.strip()),
        offload=tuple(float(x) for x in args.offload.split(",") if x.strip()),
        offload_params=tuple(float(x) for x in args.offload_params.split(",") if x.strip()),
        nvme_bytes_per_node=parse_bytes(args.nvme) if args.nvme else 0,
        swap=args.swap,
        peer=args.peer,
        stage_splits=tuple(x.strip() for x in args.stage_splits.split(",") if x.strip()),
        micro_batches=tuple(int(x) for x in args.micro_batches.split(",") if x.strip()),
    )
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("plan", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    console.print(f"plot: {plot(rows, path.with_suffix('.png'))}")
    return 0


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """The plans against the layout baselines, then against Megatron-LM at its best ([Note: one
    table per result] in benchmarks/tables.py)."""
    rows = result["rows"]
    return [
        ResultTable.of("tidal bench plan (cost model, H100 cluster)", COLUMNS, rows_table(rows)),
        ResultTable.of(
            "against Megatron-LM at its best (t x p x d grid, same cluster rules)",
            MEGATRON_COLUMNS,
            megatron_rows(rows),
        ),
    ]


def largest_tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """``tidal bench plan --largest``: tidal's and Megatron-LM's largest model side by side."""
    columns = ("width of", "N", "tidal layers", "tidal B params", "Megatron-LM layers",
               "Megatron-LM B params", "tidal / Megatron-LM", "offloaded: tidal",
               "Megatron-LM", "ratio", "tidal step s", "Megatron-LM step s")  # fmt: skip
    cells = []
    for row in result["rows"]:
        step = row["offload_plan"]["step_time_s"] if row["offload_plan"] else float("nan")
        theirs = row["megatron_offload_config"]
        cells.append([
            row["model"], str(row["devices"]), str(row["tidal_layers"]),
            f"{row['tidal_params'] / 1e9:.1f}", str(row["megatron_layers"]),
            f"{row['megatron_params'] / 1e9:.1f}", f"{row['ratio']:.2f}x",
            f"{row['tidal_offload_params'] / 1e9:.1f}B",
            f"{row['megatron_offload_params'] / 1e9:.1f}B", f"{row['offload_ratio']:.2f}x",
            f"{step:.1f}", f"{theirs['step_time_s']:.1f}" if theirs else "-",
        ])  # fmt: skip
    title = "the largest model whose least-memory configuration fits (cost model)"
    return [ResultTable.of(title, columns, cells)]


def _run_largest(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show
    from tidal.config import parse_bytes

    rows = [
        largest_fitting(
            model,
            int(n),
            device_memory_bytes=parse_bytes(args.device_memory),
            devices_per_node=args.devices_per_node,
            nvme_bytes_per_node=parse_bytes(args.nvme) if args.nvme else 0,
        )  # fmt: skip
        for model in args.models.split(",")
        for n in args.devices.split(",")
    ]
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("plan-largest", rows, folder=folder)
    show(console, largest_tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0
