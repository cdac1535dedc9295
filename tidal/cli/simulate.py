"""``tidal simulate``: time a pipeline schedule, print bubbles, memory and delay per stage."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.table import Table

from tidal.activations.topology import TOPOLOGIES
from tidal.config import ConfigError, format_bytes, parse_bytes

__all__ = ["add_arguments", "run"]

_DEFAULT_ASYNC_STEPS = 4  # enough for an asynchronous schedule to reach its steady state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tidal.pipeline.schedules import SCHEDULE_NAMES

    parser.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    parser.add_argument("--stages", type=int, default=4, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8, metavar="M", help="per step")
    parser.add_argument(
        "--virtual", type=int, default=1, metavar="V", help="chunks per rank (interleaved)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default 1 for synchronous schedules, {_DEFAULT_ASYNC_STEPS} "
        "for asynchronous ones)",
    )
    parser.add_argument(
        "--sync-steps", type=int, default=1, help="pipemarew: synchronous steps first"
    )
    for flag, default, what in (
        ("--forward-s", "1", "forward"),
        ("--backward-s", "2", "full backward"),
        ("--weight-grad-s", "0", "weight-gradient part of the backward"),
        ("--update-s", "0", "optimizer update"),
    ):
        parser.add_argument(
            flag, default=default, metavar="S", help=f"{what} seconds: one value or one per stage"
        )
    parser.add_argument("--p2p-s", type=float, default=0.0, help="seconds per message")
    parser.add_argument(
        "--activation-bytes",
        default="0",
        metavar="BYTES",
        help="kept per in-flight microbatch: one size (e.g. 64MiB) or one per stage",
    )
    parser.add_argument(
        "--model", default=None, metavar="PRESET",
        help="cut this GPT preset into stages with the balanced partitioner and take each "
        "stage's forward/backward seconds and activation bytes from its profile (analytic, "
        "H100-like rates) instead of --forward-s/--backward-s/--activation-bytes",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batch", type=int, default=1, metavar="ROWS", help="sequences per microbatch"
    )
    parser.add_argument(
        "--stage-memory", default=None, metavar="BYTES",
        help="with --model: what each stage may hold (e.g. 80GiB); the split respects it",
    )  # fmt: skip
    parser.add_argument(
        "--device-memory", default=None, metavar="BYTES",
        help="with --model: each rank's budget (e.g. 16GiB, or one per rank: 16GiB,16GiB,8GiB,"
        "8GiB); places the stages and plans MPress's savers (recompute, host swap, peer swap) so "
        "every rank fits, and prints what each stage saves and how",
    )  # fmt: skip
    parser.add_argument("--host-gbps", type=float, default=25.0,
                        help="with --device-memory: each rank's host link, GB/s each way")  # fmt: skip
    parser.add_argument("--peer-gbps", type=float, default=300.0,
                        help="with --device-memory: between any two ranks, GB/s (0: no link)")  # fmt: skip
    parser.add_argument("--topology", choices=TOPOLOGIES, default="nvswitch",
                        help="with --device-memory: how the GPUs are linked: nvswitch (any pair "
                        "at --peer-gbps) or dgx1 (8 GPUs, a DGX-1's NVLink mesh at --nvlink-gbps "
                        "a link; a peer swap may stripe over several peers)")  # fmt: skip
    parser.add_argument("--nvlink-gbps", type=float, default=25.0,
                        help="with --topology dgx1: one NVLink, GB/s each way")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--png", default=None, metavar="PATH", help="draw the timeline here")
    parser.add_argument("--programs", action="store_true", help="print each rank's program")


T = TypeVar("T")


def _per_stage(text: str, flag: str, parse: Callable[[str], T]) -> T | tuple[T, ...]:
    try:
        values = tuple(parse(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(flag, f"expected a number or a comma list, got {text!r}") from None
    if not values:
        raise ConfigError(flag, f"expected a number or a comma list, got {text!r}")
    return values[0] if len(values) == 1 else values


def _costs(args: argparse.Namespace):
    from tidal.pipeline.simulate import StageCosts

    return StageCosts(
        forward_s=_per_stage(args.forward_s, "--forward-s", float),
        backward_s=_per_stage(args.backward_s, "--backward-s", float),
        weight_grad_s=_per_stage(args.weight_grad_s, "--weight-grad-s", float),
        update_s=_per_stage(args.update_s, "--update-s", float),
        p2p_s=args.p2p_s,
        activation_bytes=_per_stage(args.activation_bytes, "--activation-bytes", parse_bytes),
    )


def run(args: argparse.Namespace, console: Console) -> int:
    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.simulate import simulate

    steps = args.steps
    if steps is None:
        steps = 1 if args.schedule in ("gpipe", "1f1b", "interleaved") else _DEFAULT_ASYNC_STEPS
    schedule = make_schedule(
        args.schedule,
        stages=args.stages,
        microbatches=args.microbatches,
        virtual=args.virtual,
        steps=steps,
        sync_steps=args.sync_steps,
    )
    costs, split, profiles = _costs(args), None, None
    if args.model is not None:
        split, costs, profiles = _model_costs(args, schedule, costs)
    elif args.device_memory is not None:
        raise ConfigError("--device-memory", "needs --model (the stages' saved tensors)")
    sim = simulate(schedule, costs)
    if args.programs:
        console.print(str(schedule), markup=False)
    console.print(stage_table(sim, split))
    console.print(summary_line(sim))
    savers = None
    if args.device_memory is not None:
        from tidal.cli.savers import plan_stage_savers, saver_table

        assert split is not None and profiles is not None  # --model is required with it
        savers = plan_stage_savers(args, sim, split, profiles)
        console.print(saver_table(*savers))
    if args.json:
        report = sim.to_json()
        if split is not None:
            report["model"] = args.model
            report["block_ranges"] = [list(r) for r in split.block_ranges]
            report["stage_memory_bytes"] = list(split.stage_memory_bytes)
        if savers is not None:
            from tidal.cli.savers import saver_json

            report["savers"] = saver_json(*savers)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"results: {args.json}")
    if args.png:
        from tidal.pipeline.timeline import draw_timeline

        console.print(f"timeline: {draw_timeline(sim, args.png)}")
    return 0


def _model_costs(args: argparse.Namespace, schedule, costs):
    """The balanced split of ``--model`` under ``schedule``, and its per-stage costs."""
    import dataclasses

    from tidal.models import preset, profile_gpt
    from tidal.pipeline.partition import PartitionInfeasible, partition
    from tidal.pipeline.simulate import simulate

    try:
        config = preset(args.model)
    except (KeyError, ValueError) as err:
        raise ConfigError("--model", str(err)) from None
    profiles = profile_gpt(config, micro_batch=args.micro_batch, seq_len=config.seq_len)
    shape = simulate(schedule)  # in-flight microbatches and versions do not depend on costs
    limit = None
    if args.stage_memory is not None:
        limit = parse_bytes(args.stage_memory, key="--stage-memory")
    try:
        split = partition(
            profiles,
            schedule.num_stages,
            memory_limit_bytes=limit,
            in_flight=shape.peak_activations,
            weight_versions=[v - 1 for v in shape.weight_versions],
        )
    except PartitionInfeasible as err:
        raise ConfigError("--stage-memory", str(err)) from None

    def per_stage(field: str) -> tuple:
        return tuple(sum(getattr(p, field) for p in profiles[a:b]) for a, b in split.unit_ranges)

    costs = dataclasses.replace(
        costs,
        forward_s=per_stage("forward_s"),
        backward_s=per_stage("backward_s"),
        activation_bytes=tuple(int(x) for x in per_stage("activation_bytes")),
    )
    return split, costs, profiles


def stage_table(sim, split=None) -> Table:
    schedule = sim.schedule
    table = Table(title=f"tidal simulate {schedule.name}", title_justify="left")
    columns = ["stage", "rank", "busy s", "peak act.", "act. bytes", "versions", "delay"]
    if split is not None:
        columns += ["blocks", "stage memory"]
    for name in columns:
        table.add_column(name, justify="right")
    for s in range(schedule.num_stages):
        rank = schedule.rank_of(s)
        row = [
            str(s),
            str(rank),
            f"{sim.busy_s[rank]:.4g}",
            str(sim.peak_activations[s]),
            format_bytes(sim.peak_activation_bytes[s]),
            str(sim.weight_versions[s]),
            str(sim.delay[s]),
        ]
        if split is not None:
            start, end = split.block_ranges[s]
            row += [f"{start}-{end - 1}" if end > start else "-",
                    format_bytes(split.stage_memory_bytes[s])]  # fmt: skip
        table.add_row(*row)
    return table


def summary_line(sim) -> str:
    schedule = sim.schedule
    kind = "asynchronous" if schedule.asynchronous else "synchronous"
    return (
        f"{schedule.name} ({kind}): {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches x {schedule.num_steps} steps; "
        f"makespan {sim.makespan_s:.4g} s, bubble {sim.bubble_fraction:.2%}, "
        f"steady bubble {sim.steady_bubble_fraction:.2%}"
    )
