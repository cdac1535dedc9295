"""``tidal plan``: measure a model, solve for a plan, print it and write it as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tidal.cli.plan_command import how_to_train, is_hf_config
from tidal.config.configurable import ConfigError, format_bytes, parse_bytes

__all__ = [
    "add_parser",
    "add_search_arguments",
    "is_hf_config",
    "PRICED_ONLY",
    "run_plan",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``tidal plan`` among the commands of the command line."""
    plan = sub.add_parser(
        "plan",
        help="choose per-unit data / tensor / sequence sharding, ZeRO and recompute (an ILP)",
        description="Trace the model on the meta device, price every strategy of every unit on "
        "each dp x tp mesh, solve for the plan with the least memory within --eps of the "
        "fastest (or the fastest that fits), and compare with Megatron-LM and ZeRO in the same "
        "cost model. Prints the `tidal train --plan` command that trains the plan.",
    )
    plan.add_argument(
        "--model", required=True, metavar="PRESET_OR_CONFIG",
        help="a GPT preset (see `tidal models`), or a Hugging Face config.json (or a folder "
        "holding one) of a LLaMA or GPT-2 decoder, built offline on the meta device",
    )  # fmt: skip
    plan.add_argument("--devices", type=int, required=True, metavar="N",
                      help="devices to plan for: the plan's dp x tp ranks (tidal train --nproc N)")  # fmt: skip
    plan.add_argument("--devices-per-node", type=int, default=8, metavar="N",
                      help="devices per machine, joined by the fast links (default 8)")  # fmt: skip
    plan.add_argument(
        "--device-memory", default=None, metavar="SIZE",
        help="per device, e.g. 80GiB (default: the cluster's)",
    )  # fmt: skip
    plan.add_argument("--cluster", default="h100", help="device and link figures: h100 or a100")
    plan.add_argument(
        "--objective", choices=("memory", "time"), default="memory",
        help="memory: the least memory within --eps of the fastest plan that fits (default); "
        "time: the fastest plan that fits",
    )  # fmt: skip
    plan.add_argument(
        "--eps", type=float, default=0.05,
        help="memory objective: allowed slowdown over the fastest plan that fits (default 0.05)",
    )  # fmt: skip
    plan.add_argument("--micro-batch", type=int, default=1, metavar="B",
                      help="sequences per micro-batch on each data-parallel rank (default 1)")  # fmt: skip
    plan.add_argument(
        "--global-batch", type=int, default=None, metavar="SEQUENCES",
        help="sequences per step (default: one micro-batch per device)",
    )  # fmt: skip
    plan.add_argument(
        "--seq-len", type=int, default=None,
        help="tokens per sequence (default: the preset's, or a Hugging Face model's positions)",
    )  # fmt: skip
    plan.add_argument(
        "--dropout", type=float, default=0.1,
        help="dropout a preset trains with (a Hugging Face model has its config's)",
    )  # fmt: skip
    plan.add_argument("--tp", type=int, default=None, help="force the tensor-parallel size")
    plan.add_argument("--pp", type=int, default=None,
                      help="force the pipeline size: 1 for flat plans only (default: the better "
                      "of the flat and the pipelined plan)")  # fmt: skip
    plan.add_argument(
        "--pareto", default="0,0.02,0.05,0.1,0.2,0.5,1", metavar="EPS,EPS",
        help="slowdowns at which to report the least memory (the frontier); '' for none",
    )  # fmt: skip
    add_search_arguments(plan)
    plan.add_argument(
        "--pipeline-pareto", default="", metavar="EPS,EPS",
        help="the same for the pipelined plans (a search over every option each; off by default)",
    )  # fmt: skip
    plan.add_argument(
        "--baselines",
        default="megatron,megatron_sp,megatron_no_recompute,zero1,zero2,zero3,zero3_full,"
        "zero3_offload,fsdp2_cpu_offload,zero_infinity",
        metavar="A,B", help="layouts to price on the plan's mesh in the same cost model",
    )  # fmt: skip
    plan.add_argument("--json", default=None, metavar="PATH",
                      help="write the plan here, for tidal train --plan PATH")  # fmt: skip


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """What the search tries, shared with ``tidal bench plan``."""
    parser.add_argument(
        "--schedules", default="1f1b,interleaved", metavar="S,S",
        help="pipeline schedules to search: 1f1b, interleaved, pipemare (asynchronous)",
    )  # fmt: skip
    parser.add_argument(
        "--offload", default="0", metavar="F,F",
        help="fractions of the fp32 masters and optimizer state to search on the host, updated "
        "there (tidal train --plan runs them), e.g. 0,0.5,1 (default 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--offload-params", default="0", metavar="F,F",
        help="fractions of a ZeRO-3 unit's parameters (and gradients) to search on the host, "
        "each with at least as much of the optimizer (--offload), e.g. 0,1 (default 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--swap", action="store_true",
        help="also search keeping a block's saved activations on the host between its forward "
        "and backward (MPress's host swap), all of them or by class: the attention's, the "
        "MLP's, or the MLP's with the attention core recomputed",
    )  # fmt: skip
    parser.add_argument(
        "--peer", action="store_true",
        help="also search keeping a block's saved activations on the mirror pipeline stage's "
        "device, the first stages lending to the last (MPress's peer swap; pipelined plans "
        "only, priced)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", default="bf16", choices=("bf16", "fp32"),
        help="the run's: bf16 (default: bf16 weights and activations, fp32 masters and AdamW "
        "state) or fp32 (every byte fp32, as a CPU run trains); the model is traced in it",
    )  # fmt: skip
    parser.add_argument(
        "--model-data", default="fsdp2", choices=("fsdp2", "auto", "chunks"),
        help="what holds each stage's model data: FSDP2's units (default), or tidal's chunks "
        "under the plan's byte budgets: auto, where a stage keeps model data off the device and "
        "chunks can hold it (one tensor rank, ZeRO-3 units); chunks, wherever they can",
    )  # fmt: skip
    parser.add_argument("--stage-splits", default="even", metavar="S,S",
                        help="pipeline stage splits to search: even, time, memory")  # fmt: skip
    parser.add_argument("--micro-batches", default="", metavar="B,B",
                        help="pipelined plans' micro-batch sizes to search, e.g. 1,2,4")  # fmt: skip
    parser.add_argument(
        "--nvme", default=None, metavar="SIZE",
        help="each node's NVMe for offloaded optimizer state, e.g. 30TB (a DGX H100's eight "
        "drives); the search then also puts all of that state on the disk (default: no disk)",
    )  # fmt: skip


def _gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1024**3:.2f}"


def _cluster(args: argparse.Namespace):
    from tidal.planner import CLUSTER_PRESETS, ClusterSpec

    if args.cluster not in CLUSTER_PRESETS:
        raise ConfigError(
            "cluster", f"unknown {args.cluster!r}; choose {', '.join(CLUSTER_PRESETS)}"
        )
    values: dict[str, Any] = dict(CLUSTER_PRESETS[args.cluster])
    if args.device_memory is not None:
        values["device_memory_bytes"] = parse_bytes(args.device_memory)
    if args.nvme is not None:
        values["nvme_bytes_per_node"] = parse_bytes(args.nvme)
    return ClusterSpec(devices=args.devices, devices_per_node=args.devices_per_node, **values)


def _graph(args: argparse.Namespace):
    """The measured graph of ``--model``, whether its attention core can be recomputed alone
    (tidal's GPT's can; a Hugging Face model's is code inside its attention forward), its
    sizes for Megatron-LM's grid, and its tracer at other micro-batch sizes."""
    if is_hf_config(args.model):
        return _hf_graph(args)
    from tidal.models import PRESETS, GPTSpec, preset

    if args.model not in PRESETS:
        raise ConfigError(
            "--model",
            f"unknown preset {args.model!r}; choose one of: {', '.join(PRESETS)}, or give the "
            f"path of a Hugging Face config.json",
        )
    config = preset(args.model)
    overrides = {"dropout": args.dropout}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    spec = GPTSpec(config=dataclasses.replace(config, **overrides))

    def trace(micro_batch: int):  # noqa: ANN202
        graph = spec.graph(micro_batch=micro_batch, dtype=_dtype(args))
        graph.name = args.model
        return graph

    return trace(args.micro_batch), True, spec.transformer_shape(), trace


def _hf_graph(args: argparse.Namespace):
    """A Hugging Face decoder built from its config on the meta device, in bf16, measured at
    ``--seq-len`` tokens (default: its positions) with its own dropout."""
    from tidal.models import HFModelConfig, HFSpec

    config = HFModelConfig.load(
        args.model, seq_len=args.seq_len, key="--model", seq_len_key="--seq-len"
    )
    spec = HFSpec(config=config)

    def trace(micro_batch: int):  # noqa: ANN202
        return spec.graph(micro_batch=micro_batch, dtype=_dtype(args))

    return trace(args.micro_batch), False, spec.transformer_shape(), trace


def _dtype(args: argparse.Namespace) -> Any:
    """The dtype the model is traced in: ``--precision``'s (a ``torch.dtype``)."""
    import torch

    return torch.float32 if args.precision == "fp32" else torch.bfloat16


# bytes a parameter's weight, gradient and optimizer state take in each --precision (AdamW)
PRECISION_BYTES = {"bf16": {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12},
                   "fp32": {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}}  # fmt: skip


def run_plan(args: argparse.Namespace, console: Console) -> int:
    from tidal.planner import PlannerConfig, Recompute, make_plan
    from tidal.planner.report import plan_report

    cluster = _cluster(args)
    pareto, pipeline_pareto = (
        _numbers(args.pareto, "--pareto"),
        _numbers(args.pipeline_pareto, "--pipeline-pareto"),
    )
    started = time.perf_counter()
    graph, selective, shape, retrace = _graph(args)
    traced_s = time.perf_counter() - started
    # A line per stage of the search, the long part; the first comes once the meshes are
    # known, so a bad input still fails in one line.
    say = _progress(started)
    modes = (Recompute.NONE, *([Recompute.SELECTIVE] if selective else []), Recompute.FULL)
    if args.swap:  # [Note: savers per tensor class] in tidal/planner/block_savers.py
        modes = (*modes, Recompute.SWAP, Recompute.SWAP_ATTENTION, Recompute.SWAP_MLP,
                 *([Recompute.SELECTIVE_SWAP_MLP] if selective else []))  # fmt: skip
    config = PlannerConfig(
        objective=args.objective,
        eps=args.eps,
        global_batch=args.global_batch,
        tp=args.tp,
        pp=args.pp,
        pareto=pareto,
        pipeline_pareto=pipeline_pareto,
        schedules=tuple(x.strip() for x in args.schedules.split(",") if x.strip()),
        offload=_numbers(args.offload, "--offload"),
        offload_params=_numbers(args.offload_params, "--offload-params"),
        offload_nvme=(0.0, 1.0) if args.nvme else (0.0,),
        baselines=tuple(x.strip() for x in args.baselines.split(",") if x.strip()),
        recompute=modes,
        peer=args.peer,  # [Note: activations on a peer] in tidal/planner/pipelines.py
        stage_splits=_names(args.stage_splits),
        micro_batches=_sizes(args.micro_batches, "--micro-batches"),
        model_data=args.model_data,  # [Note: chunk stages in plans] in planner/model_data.py
        param_bytes=PRECISION_BYTES[args.precision]["param_bytes"],
        grad_bytes=PRECISION_BYTES[args.precision]["grad_bytes"],
        optimizer_bytes=PRECISION_BYTES[args.precision]["optimizer_bytes"],
    )
    result = make_plan(graph, cluster, config, progress=say, shape=shape, retrace=retrace)
    report = plan_report(result, cluster)
    # The whole command's wall time, Python's start and the imports (torch, scipy) included
    # where the process can tell its age; each phase listed, what is left being the report.
    before_s = _process_age_s(time.perf_counter() - started)
    total_s = time.perf_counter() - started + before_s
    phases = {"start and imports": before_s, "trace": traced_s, **report["phases_s"]}
    phases["other"] = max(0.0, total_s - sum(phases.values()))
    report["solve_s"] = total_s
    report["timing_s"] = {"trace": traced_s, "total": total_s, "phases": phases}
    console.print(units_table(report))
    console.print(UNITS_LEGEND, style="dim", soft_wrap=True)
    console.print(baselines_table(report))
    console.print(BASELINES_LEGEND, style="dim", soft_wrap=True)
    if report.get("pipeline_search"):
        chosen = "chosen" if report.get("pipeline") else "not chosen: the flat plan is better"
        console.print(f"{pipeline_line(report['pipeline_search'])}; {chosen}", soft_wrap=True)
    if report.get("megatron_best"):
        console.print(megatron_table(report))
        console.print(MEGATRON_LEGEND, style="dim", soft_wrap=True)
    for line in _why_more_memory(report):
        console.print(line, soft_wrap=True)
    console.print(summary_line(report, cluster), soft_wrap=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"plan: {args.json}")
    console.print(how_to_train(result.plan, args), soft_wrap=True, markup=False)
    console.print(PRICED_ONLY, soft_wrap=True, markup=False)
    return 0


# what a search prices that ``tidal train --plan`` does not run: every plan of tidal's runs
# (``check.not_run`` refuses only hand-made ones), the other systems' layouts do not
PRICED_ONLY = ("priced, not run by tidal train: the baselines and Megatron-LM (other systems' "
               "layouts, priced to compare)")  # fmt: skip


UNITS_LEGEND = (
    "unit: a module (blocks.* is every block alike) or a run of a module's own ops, named by "
    "them; x: how many units the row stands for; strategy and layout: how the unit's work is "
    "split over the tp ranks, input -> output (R replicated, S(dim) split along dim, P partial "
    "sums); zero: its parameter state split over the dp ranks (0 none, 1 optimizer state, 2 and "
    "gradients, 3 and weights); params+grads+opt, activations, redundant (bytes held on more "
    "than one device, what the plan minimises): GiB per device over the row's units; time s: "
    "the row's forward and backward per step."
)
BASELINES_LEGEND = (
    "plan saves: 1 - the plan's peak / the baseline's (negative: the plan holds more); at its "
    "step time: the smallest plan no slower than the baseline, and what that saves."
)


def _numbers(text: str, key: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(key, f"expected numbers such as 0,0.1, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _sizes(text: str, key: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _names(text))
    except ValueError:
        raise ConfigError(key, f"expected whole numbers such as 1,2,4, got {text!r}") from None


def _process_age_s(since_start_s: float) -> float:
    """Seconds this process ran before ``run_plan`` started its clock (``since_start_s`` ago):
    from Linux's /proc, else 0 (the phases then start at the trace)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            up_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, up_s - started_ticks / os.sysconf("SC_CLK_TCK") - since_start_s)


def _progress(started: float):  # noqa: ANN202
    """A line per stage on stderr, so a long search is not silence (stdout keeps the tables)."""

    def say(line: str) -> None:
        print(f"tidal plan: {time.perf_counter() - started:6.1f} s  {line}", file=sys.stderr,
              flush=True)  # fmt: skip

    return say


def _why_more_memory(report: dict) -> list[str]:
    """For each baseline that holds less than the plan, why: the plan is faster."""
    lines = []
    for name, base in report["baselines"].items():
        saving, base_s = base["saving"], base["step_time_s"]
        if saving is None or saving >= 0 or not base_s:
            continue
        same = base["at_same_step_time"] or {}
        lines.append(
            f"{name} holds less ({_gib(base['peak_memory_bytes'])} vs "
            f"{_gib(report['peak_memory_bytes'])} GiB) at {base_s / report['step_time_s']:.1f}x "
            f"the plan's step time: the plan spends memory for speed; no slower than {name}, "
            f"a plan needs {_gib(same.get('peak_memory_bytes'))} GiB "
            f"({_percent(same.get('saving'))} saved)"
        )
    best = report.get("megatron_best") or {}
    fastest = best.get("fastest")
    if fastest and best.get("plan_at_fastest_step_time") is None:
        lines.append(
            f"no plan, flat or pipelined, is as fast as Megatron-LM's fastest configuration "
            f"that fits ({fastest['name']}: {_seconds(fastest['step_time_s'])} s, "
            f"{_gib(fastest['peak_memory_bytes'])} GiB)"
        )
    near = best.get("plan_near_fastest_step_time")
    if fastest and near:
        lines.append(
            f"within {best['slack']:.0%} of Megatron-LM's fastest step time the smallest plan "
            f"({near['layout']}) holds {_gib(near['peak_memory_bytes'])} GiB, "
            f"{_percent(near['saving'])} less than its {_gib(fastest['peak_memory_bytes'])}, at "
            f"{near['step_time_ratio']:.2f}x its step time"
        )
    same = best.get("plan_at_fastest_step_time")
    if fastest and same and same["saving"] < 0:
        lines.append(
            f"at Megatron-LM's fastest step time the smallest plan ({same['layout']}) holds "
            f"{_gib(same['peak_memory_bytes'])} GiB, more than its "
            f"{_gib(fastest['peak_memory_bytes'])}: Megatron-LM is priced without the "
            f"memory-bound ops (norms, dropout, residual adds) the plans pay for, so matching its "
            f"speed costs the plans memory (docs/planner.md)"
        )
    return lines


def _unit_name(unit: dict) -> str:
    ops = unit.get("ops") or []
    return (
        f"{unit['name']}: {', '.join(ops)}" if unit["segment"] is not None and ops else unit["name"]
    )


def units_table(report: dict) -> Table:
    mesh = report["mesh"]
    recompute = ", ".join(f"{k}: {v}" for k, v in report["recompute"].items()) or "none"
    stages = ""
    if report.get("pipeline"):
        first = report["pipeline"]["stages"]["first"]["blocks"]
        stages = f"pp {mesh['pp']} x "
        mesh_note = f", the first stage's {first} blocks"
    else:
        mesh_note = ""
    table = Table(
        title=f"{report['model']} on {stages}dp {mesh['dp']} x tp {mesh['tp']}{mesh_note} "
        f"({report['num_microbatches']} micro-batches of {report['micro_batch']}; "
        f"recompute {recompute}); GiB per device",
        title_justify="left",
    )
    for column in ("unit", "x", "strategy", "layout", "zero", "params+grads+opt", "activations",
                   "redundant", "time s"):  # fmt: skip
        table.add_column(
            column, justify="left" if column in ("unit", "strategy", "layout") else "right"
        )
    for unit in report["units"]:
        memory, n = unit["memory"], unit["count"]
        states = (memory["params"] + memory["grads"] + memory["optimizer"]) * n
        table.add_row(
            _unit_name(unit), str(n), unit["strategy"], f"{unit['in_layout']} -> {unit['out_layout']}",
            str(unit["zero"]), _gib(states), _gib(memory["activations"] * n),
            _gib(memory["redundant"] * n), _seconds(unit["time_s"]),
        )  # fmt: skip
    return table


def baselines_table(report: dict) -> Table:
    table = Table(title="against the layout baselines on the plan's dp x tp mesh (the seed "
                  "paper's comparison: Megatron-LM's intra-operator layouts without pipeline "
                  "stages or its distributed optimizer, and ZeRO; same cost model)",
                  title_justify="left")  # fmt: skip
    for column in ("system", "mesh", "peak GiB", "fits", "step s", "plan saves",
                   "at its step time: plan GiB", "saves"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("system", "mesh") else "right")
    table.add_row(
        "tidal plan", f"{report['mesh']['dp']}x{report['mesh']['tp']}",
        _gib(report["peak_memory_bytes"]), "yes", _seconds(report["step_time_s"]), "", "", "",
    )  # fmt: skip
    for name, base in report["baselines"].items():
        same = base["at_same_step_time"] or {}
        table.add_row(
            name, f"{base['mesh']['dp']}x{base['mesh']['tp']}", _gib(base["peak_memory_bytes"]),
            "yes" if base["fits"] else "no",
            _seconds(base["step_time_s"]),
            _percent(base["saving"]), _gib(same.get("peak_memory_bytes")),
            _percent(same.get("saving")),
        )  # fmt: skip
    return table


MEGATRON_LEGEND = (
    "Megatron-LM at its real configuration: every t x p x d mesh, sequence parallelism, "
    "selective or full recompute, the distributed optimizer, interleaved stages and micro-batch "
    "sizes, its memory by its own estimator's formulas and its step time by the same cluster "
    "rules (docs/planner.md). Each of its rows sits beside the plan that compares with it: the "
    "smallest plan at its step time (none: no plan is that fast), the smallest at any speed."
)


def pipeline_line(pipeline: dict) -> str:
    stages = "; ".join(
        f"{name} stage {_gib(stage['peak_memory_bytes'])} GiB, {_seconds(stage['step_time_s'])} s"
        for name, stage in pipeline["stages"].items()
    )
    if pipeline.get("lent_bytes"):
        stages += (f"; the first lends {_gib(pipeline['lent_bytes'])} GiB to the last, middle "
                   f"stages at most {_gib(pipeline['middle_peak_bytes'])} GiB")  # fmt: skip
    return (
        f"with pipeline stages ({pipeline['options_solved']} of {pipeline['options']} "
        f"p x dp x tp x v options solved, the rest bounded out): {pipeline['layout']}, "
        f"{_gib(pipeline['peak_memory_bytes'])} GiB, step {_seconds(pipeline['step_time_s'])} s "
        f"({stages}; sends {_seconds(pipeline['send_s'])} s)"
    )


def megatron_table(report: dict) -> Table:
    best = report["megatron_best"]
    table = Table(title=f"against Megatron-LM's best of {best['num_configs']} configurations",
                  title_justify="left")  # fmt: skip
    for column in ("Megatron-LM", "configuration", "peak GiB", "fits", "step s", "tidal plan",
                   "plan GiB", "plan step s", "plan saves", "plan step / its"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("Megatron-LM", "configuration")
                         else "right")  # fmt: skip
    pairs = (("fastest that fits", best["fastest"], best["plan_at_fastest_step_time"]),
             ("least memory", best["least_memory"], best["plan_least_memory"]))  # fmt: skip
    for label, row, mine in pairs:
        if row is None:
            table.add_row(label, "none fits", "", "", "", "", "", "", "", "")
            continue
        mine = mine or {}
        ratio = mine.get("step_time_ratio")
        table.add_row(
            label, row["name"], _gib(row["peak_memory_bytes"]), "yes" if row["fits"] else "no",
            _seconds(row["step_time_s"]), mine.get("layout", "none that fast"),
            _gib(mine.get("peak_memory_bytes")),
            _seconds(mine.get("step_time_s")), _percent(mine.get("saving")),
            "-" if ratio is None else f"{ratio:.2f}x",
        )  # fmt: skip
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def summary_line(report: dict, cluster) -> str:
    gap = report["lp_gap"]
    timing = report["timing_s"]
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timing["phases"].items())
    host = ""
    from tidal.planner.check import not_run
    from tidal.planner.plan import Plan

    plan = Plan.from_dict(report)
    if any(plan.offloads()):  # [Note: model data offload] in tidal/planner/strategies.py
        ranks = [plan.rank_memory(r) for r in range(plan.pp)]
        host_bytes, nvme_bytes = max(m.host for m in ranks), max(m.nvme for m in ranks)
        disk = f", {format_bytes(nvme_bytes)} on NVMe" if nvme_bytes else ""
        priced = "; priced, not run" if not_run(plan) else ""
        most = "at most " if plan.pp > 1 else ""
        what = plan.describe_offload()
        if len(set(plan.offloads())) > 1:  # [Note: offload per stage] in planner/pipelines.py
            what = f"each stage's own offload ({what})"
        chunked = sum(plan.rank_chunks(r) is not None for r in range(plan.pp))
        held = ("" if not chunked else ", in tidal's chunks" if chunked == plan.pp
                else f", in tidal's chunks on {chunked} of {plan.pp} pipeline ranks")  # fmt: skip
        host = (f" with {what} ({most}{format_bytes(host_bytes)} a device on the host{disk}"
                f"{held}{priced})")  # fmt: skip
    return (
        f"peak {format_bytes(report['peak_memory_bytes'])} of "
        f"{format_bytes(cluster.device_memory_bytes)} per device{host}, step "
        f"{_seconds(report['step_time_s'])} s (fastest that fits "
        f"{_seconds(report['fastest_step_time_s'])} s), "
        f"planned in {timing['total']:.1f} s ({phases}), LP gap "
        + ("-" if gap is None else f"{100 * gap:.2f}%")
    )
