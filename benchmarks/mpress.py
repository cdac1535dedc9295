"""``tidal bench mpress``: MPress's saver plan against one saver for everything, predicted for
8 GPUs (this file) and measured on gloo ranks under a budget (``--section measured``:
benchmarks/mpress_measured.py, [Note: what the bench measures]).

A model family (``--family gpt``: GPT-3-like, 4096 wide, sequence 2048, one sequence a microbatch;
``--family bert``: BERT-large-like, 1024 wide, 16 heads, sequence 512, vocabulary 30522, eight
sequences a microbatch; each shape can be set; blocks added ``--step-layers`` at a time) is cut
into ``--stages`` pipeline stages, one GPU each, on a DGX-class server: ``--device-memory`` per
GPU, a PCIe host link shared by each pair of GPUs (``--host-gbps`` each way), every pair of GPUs
joined by NVSwitch (``--peer-gbps``), or (``--topology dgx1``) the NVLink mesh of a DGX-1, where
a peer swap striped over several peers is faster than to one ([Note: two server topologies] in
tidal/activations/topology.py). Under 1F1B and PipeDream, each strategy is asked for the
largest model it fits and, at the largest model recompute-only fits, the simulated step.
PipeDream updates its weights after every microbatch, as PipeDream does (``--pipedream-updates
microbatch``: stage s stashes p - s versions), or once per ``--microbatches`` (``step``, as
``tidal train --schedule pipedream`` does: at most two versions live). The strategies:

- ``none``: keep everything;
- ``recompute``: every block recomputed (its input kept); ``selective``: the attention
  internals only (Megatron's selective recompute);
- ``host``: everything a block saves, and stashed weight versions, swapped to the host;
- ``peer``: the saver planner with peer swap only; ``mpress``: the planner with every saver;
  ``mpress-unstriped``: the same, each lent tensor to one lender (what stripes buy);
- ``zero3`` and ``zero3-offload``: no pipeline, data parallel over every GPU, model data sharded
  (and on the host), benchmarks/mpress_zero3.py.

Writes ``benchmarks/results/mpress-*.json``, a table, and a PNG beside the JSON.

[Note: what the bench predicts]
Everything here is the simulator's and the planner's: layer profiles traced on the meta device
at H100-like rates (bf16), each block's saved bytes split by class with Megatron's count
(``models.gpt_saved_shares``), model data at 16 bytes per parameter (bf16 weights, fp32
gradients, masters and AdamW moments). No model is trained. ZeRO-3 at the same memory is the
planner's cost model's, on the same graph and rates ([Note: ZeRO-3 in the predicted table] in
benchmarks/mpress_zero3.py).

Every strategy is priced on two stage splits and keeps the better: the split balanced by time
(the least bottleneck stage, what MPress starts from), and the fastest split whose stages fit
the budget with recompute-only's memory (model data, stashed versions and each block's input for
every microbatch in flight: [Note: stage memory] in tidal/pipeline/partition.py), which moves
blocks off the early stages, as a memory-aware partitioner would for a baseline that cannot move
what piles up there. A strategy fits a model if it fits on either split; its step at
recompute-only's largest model is the faster split's that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.mpress_measured import add_measured_arguments, bench_measured
from benchmarks.mpress_zero3 import ZERO3_ROWS, Zero3Pricer
from benchmarks.tables import ResultTable
from tidal.activations import (
    Links,
    Saved,
    Saver,
    SaverPlan,
    TensorClass,
    evaluate,
    keep_all,
    plan_savers,
)
from tidal.activations.topology import TOPOLOGIES, peer_links
from tidal.config import ConfigError, format_bytes, parse_bytes
from tidal.models import gpt_saved_shares, profile_gpt
from tidal.models.gpt import GPTConfig
from tidal.pipeline.ir import Schedule
from tidal.pipeline.partition import LayerProfile, Partition, PartitionInfeasible, partition
from tidal.pipeline.savers import BlockSaves, saved_tensors, step_with_savers
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import Simulation, StageCosts, simulate

__all__ = ["STRATEGIES", "add_arguments", "bench_mpress", "run"]

STRATEGIES = ("none", "recompute", "selective", "host", "peer", "mpress", "mpress-unstriped")
SCHEDULES = ("1f1b", "pipedream")
SPLITS = ("time", "memory")  # [Note: what the bench predicts]
BYTES_PER_PARAM = 16  # bf16 weights; fp32 gradients, masters, AdamW's two moments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt",
                        help="the model family's shapes (gpt: 4096 wide; bert: BERT-large's)")  # fmt: skip
    parser.add_argument("--width", type=int, default=None, help="d_model (the family's)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences a microbatch")
    parser.add_argument("--stages", type=int, default=8, help="GPUs, one stage each (8)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--pipedream-updates", choices=("microbatch", "step"), default="microbatch",
                        help="PipeDream updates after every microbatch (PipeDream's own: p - s "
                        "stashed versions on stage s) or once per --microbatches (step)")  # fmt: skip
    parser.add_argument("--device-memory", default="80GiB", metavar="SIZE")
    parser.add_argument("--host-gbps", type=float, default=25.0)
    parser.add_argument(
        "--peer-gbps",
        type=float,
        default=300.0,
        help="--topology nvswitch: any pair of GPUs, GB/s each way",
    )
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="nvswitch",
        help="how the GPUs are linked ([Note: two server topologies])",
    )
    parser.add_argument(
        "--nvlink-gbps", type=float, default=25.0, help="--topology dgx1: one NVLink, GB/s each way"
    )
    parser.add_argument("--step-layers", type=int, default=8, help="blocks added per size")
    parser.add_argument("--max-layers", type=int, default=320)
    parser.add_argument("--results-dir", default=None, metavar="DIR")
    parser.add_argument("--section", action="append", choices=("predicted", "measured"),
                        help="predicted (the simulator, 8 GPUs) and/or measured (gloo ranks "
                        "under a budget); both by default")  # fmt: skip
    add_measured_arguments(parser)


# The families' shapes: vocabulary, width, heads, sequence, sequences a microbatch. BERT's
# encoder blocks cost what a GPT block of its shape costs (attention is not causal, which the
# traced profile does not count), so the family is GPT blocks at BERT-large's shapes.
FAMILIES = {
    "gpt": {"vocab_size": 50257, "width": 4096, "heads": 32, "seq_len": 2048, "micro_batch": 1},
    "bert": {"vocab_size": 30522, "width": 1024, "heads": 16, "seq_len": 512, "micro_batch": 8},
}


def _shape(args: argparse.Namespace, name: str) -> int:
    given = getattr(args, name)
    return int(FAMILIES[args.family][name] if given is None else given)


@dataclasses.dataclass(frozen=True, slots=True)
class _Family:
    config: GPTConfig
    embed: LayerProfile
    block: LayerProfile
    head: LayerProfile

    def profiles(self, layers: int) -> list[LayerProfile]:
        blocks = [dataclasses.replace(self.block, name=f"blocks.{i}") for i in range(layers)]
        return [self.embed, *blocks, self.head]


def _family(args: argparse.Namespace) -> _Family:
    seq_len = _shape(args, "seq_len")
    config = GPTConfig(vocab_size=FAMILIES[args.family]["vocab_size"], seq_len=seq_len,
                       num_layers=1, num_heads=_shape(args, "heads"),
                       d_model=_shape(args, "width"))  # fmt: skip
    embed, block, head = profile_gpt(config, micro_batch=_shape(args, "micro_batch"),
                                     seq_len=seq_len,
                                     dtype=torch.bfloat16)  # fmt: skip
    return _Family(config, embed, block, head)


def _schedule(schedule_name: str, args: argparse.Namespace) -> Schedule:
    """The schedule simulated: one step of 1F1B; PipeDream over three steps' microbatches (its
    steady state), with an update after each microbatch or after each step's."""
    if schedule_name != "pipedream":
        return make_schedule(schedule_name, stages=args.stages, microbatches=args.microbatches)
    if args.pipedream_updates == "microbatch":
        return make_schedule("pipedream", stages=args.stages, microbatches=1,
                             steps=3 * args.microbatches)  # fmt: skip
    return make_schedule("pipedream", stages=args.stages, microbatches=args.microbatches, steps=3)


def _split(family: _Family, profiles: list[LayerProfile], shape: Simulation, split_by: str,
           args: argparse.Namespace) -> Partition | None:  # fmt: skip
    """The stage split ``split_by`` names ([Note: what the bench predicts]); None if no split
    fits the budget with recompute-only's memory."""
    in_flight = shape.peak_activations
    versions = [v - 1 for v in shape.weight_versions]
    if split_by == "time":
        return partition(profiles, args.stages, in_flight=in_flight, weight_versions=versions)
    share = gpt_saved_shares(family.config, seq_len=family.config.seq_len)[TensorClass.BLOCK_INPUT]
    kept = [dataclasses.replace(p, activation_bytes=int(p.activation_bytes * share))
            if p.name.startswith("blocks.") else p for p in profiles]  # fmt: skip
    try:
        return partition(kept, args.stages, in_flight=in_flight, weight_versions=versions,
                         memory_limit_bytes=parse_bytes(args.device_memory, key="--device-memory"),
                         state_bytes_per_param_byte=BYTES_PER_PARAM // 2)  # fmt: skip
    except PartitionInfeasible:
        return None


def _case(family: _Family, layers: int, schedule_name: str, args: argparse.Namespace,
          split_by: str = "time") -> tuple[Simulation, list[Saved], Links] | None:  # fmt: skip
    schedule = _schedule(schedule_name, args)
    shape = simulate(schedule)
    profiles = family.profiles(layers)
    split = _split(family, profiles, shape, split_by, args)
    if split is None:
        return None

    def per_stage(field: str) -> tuple[float, ...]:
        return tuple(sum(getattr(p, field) for p in profiles[a:b]) for a, b in split.unit_ranges)

    sim = simulate(schedule, StageCosts(forward_s=per_stage("forward_s"),
                                        backward_s=per_stage("backward_s")))  # fmt: skip
    shares = gpt_saved_shares(family.config, seq_len=family.config.seq_len)
    blocks = []
    for stage, (start, end) in enumerate(split.unit_ranges):
        for unit in range(start, end):
            layer = profiles[unit]
            by_class = ({c: int(layer.activation_bytes * f) for c, f in shares.items()}
                        if layer.name.startswith("blocks.")
                        else {TensorClass.OTHER: layer.activation_bytes})  # fmt: skip
            blocks.append(BlockSaves(stage=stage, block=unit, bytes_by_class=by_class,
                                     forward_s=layer.forward_s))  # fmt: skip
    weight_bytes = [int(per_stage("param_bytes")[s]) for s in range(args.stages)]
    per_param_byte = BYTES_PER_PARAM // 2  # the profile's weights are bf16
    budget = parse_bytes(args.device_memory, key="--device-memory")
    n = args.stages
    peer, egress = peer_links(args.topology, n, pair_gbps=args.peer_gbps,
                              nvlink_gbps=args.nvlink_gbps)  # fmt: skip
    links = Links(stage_rank=tuple(range(n)), budget_bytes=(budget,) * n,
                  base_bytes=tuple(per_param_byte * w for w in weight_bytes),
                  host_link=tuple(r // 2 for r in range(n)),
                  host_bandwidth=(args.host_gbps * 1e9,) * ((n + 1) // 2),
                  host_budget_bytes=(None,) * ((n + 1) // 2),
                  peer_bandwidth=peer, peer_egress=egress)  # fmt: skip
    return sim, saved_tensors(sim, blocks, weight_bytes=weight_bytes), links


def _priced(family: _Family, layers: int, schedule: str, name: str,
            args: argparse.Namespace) -> tuple[str, Simulation, SaverPlan] | None:  # fmt: skip
    """``name``'s plan on the split where its step is shortest, with the split's name and the
    simulated step; None if it fits on neither."""
    best = None
    for split_by in SPLITS:
        case = _case(family, layers, schedule, args, split_by)
        if case is None:
            continue
        sim, saved, links = case
        plan = _strategy(name, saved, links)
        if not plan.fits:
            continue
        stepped = step_with_savers(sim, plan)
        if best is None or stepped.makespan_s < best[1].makespan_s:
            best = (split_by, stepped, plan)
    return best


def _strategy(name: str, saved: list[Saved], links: Links) -> SaverPlan:
    """``name``'s plan (``fits`` False when it cannot fit)."""
    if name in ("peer", "mpress", "mpress-unstriped"):
        if name == "mpress-unstriped":  # each tensor to one lender ([Note: stripes])
            links = dataclasses.replace(links, max_stripe=1)
        if name == "peer":  # nothing recomputed, nothing on the host: only lending is left
            saved = [dataclasses.replace(s, recompute_s=None) for s in saved]
            links = dataclasses.replace(links, host_budget_bytes=(0,) * len(links.host_bandwidth))
        try:
            return plan_savers(saved, links)
        except ConfigError:
            return dataclasses.replace(keep_all(saved, links), fits=False)
    inside = {"none": set(), "selective": {TensorClass.ATTENTION},
              "recompute": {TensorClass.ATTENTION, TensorClass.MLP, TensorClass.NORM},
              "host": {TensorClass.BLOCK_INPUT, TensorClass.ATTENTION, TensorClass.MLP,
                       TensorClass.NORM, TensorClass.WEIGHTS}}[name]  # fmt: skip
    saver = Saver.HOST if name == "host" else Saver.RECOMPUTE
    choices = [(saver if s.tensor_class in inside else Saver.KEEP, None) for s in saved]
    return evaluate(saved, choices, links, name)


def _largest(family: _Family, schedule: str, name: str, split_by: str,
             args: argparse.Namespace) -> int:  # fmt: skip
    """The most blocks (a multiple of --step-layers) ``name`` fits on ``split_by``; 0 if none."""

    def fits(layers: int) -> bool:
        case = _case(family, layers, schedule, args, split_by)
        return case is not None and _strategy(name, case[1], case[2]).fits

    low, high = 0, args.max_layers // args.step_layers  # in steps: low fits (or 0), high not
    if fits(high * args.step_layers):
        return high * args.step_layers
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * args.step_layers) else (low, mid)
    return low * args.step_layers


def _base_row(args: argparse.Namespace, schedule: str, name: str, most: int, at: int,
              on_time: int, params_per_block: int) -> dict[str, Any]:  # fmt: skip
    """What every predicted row records: ``most`` blocks against recompute-only's ``at`` (its
    best split) and ``on_time`` (the split by time, as MPress compares)."""
    return {"section": "predicted", "family": args.family, "topology": args.topology,
            "micro_batch": _shape(args, "micro_batch"), "schedule": schedule, "strategy": name,
            "pipedream_updates": args.pipedream_updates if schedule == "pipedream" else None,
            "largest_layers": most, "largest_params": most * params_per_block,
            "vs_recompute": (most / at) if at else None,
            "vs_recompute_time_split": (most / on_time) if on_time else None}  # fmt: skip


def _lent(plan: SaverPlan) -> dict[str, int]:
    """How many tensors ``plan`` lends, and how many of them it stripes over several lenders."""
    lent = [lenders for saver, lenders in plan.choices if saver is Saver.PEER and lenders]
    return {"tensors": len(lent), "striped": sum(1 for lenders in lent if len(lenders) > 1)}


def _collective_gbps(args: argparse.Namespace) -> float:
    """What ZeRO-3's collectives get per GPU: a pair's bandwidth on an NVSwitch; on a DGX-1 all
    six links of a GPU (NCCL's rings over the mesh use them all: the most ZeRO-3 could get)."""
    _, egress = peer_links(args.topology, args.stages, pair_gbps=args.peer_gbps,
                           nvlink_gbps=args.nvlink_gbps)  # fmt: skip
    return egress[0] / 1e9


def bench_mpress(args: argparse.Namespace) -> list[dict[str, Any]]:
    family = _family(args)
    params_per_block = family.block.param_bytes // 2
    sequences = args.microbatches * _shape(args, "micro_batch")
    zero3 = Zero3Pricer(family.config, sequences_per_step=sequences, gpus=args.stages,
                        device_memory_bytes=parse_bytes(args.device_memory, key="--device-memory"),
                        host_gbps=args.host_gbps, peer_gbps=_collective_gbps(args))  # fmt: skip
    zero3_largest = {name: zero3.largest(name, step_layers=args.step_layers,
                                         max_layers=args.max_layers) for name in ZERO3_ROWS}  # fmt: skip
    rows = []
    for schedule in SCHEDULES:
        by_split = {name: {split_by: _largest(family, schedule, name, split_by, args)
                           for split_by in SPLITS} for name in STRATEGIES}  # fmt: skip
        largest = {name: max(by_split[name].values()) for name in STRATEGIES}
        at, on_time = largest["recompute"], by_split["recompute"]["time"]
        for name in STRATEGIES:
            row = _base_row(args, schedule, name, largest[name], at, on_time, params_per_block)
            row["largest_split"] = (max(SPLITS, key=lambda by: by_split[name][by])
                                    if largest[name] else None)  # fmt: skip
            row["largest_layers_by_split"] = by_split[name]
            priced = _priced(family, at, schedule, name, args) if at else None
            row["split_at_recompute_largest"] = None if priced is None else priced[0]
            row["step_s_at_recompute_largest"] = None if priced is None else priced[1].makespan_s
            row["peak_bytes_at_recompute_largest"] = (
                None if priced is None else max(priced[2].peak_bytes)
            )
            row["lent_at_recompute_largest"] = None if priced is None else _lent(priced[2])
            rows.append(row)
        spanned = _schedule(schedule, args)  # [Note: ZeRO-3 in the predicted table]
        steps = spanned.num_microbatches * spanned.num_steps / args.microbatches
        for name in ZERO3_ROWS:
            row = _base_row(
                args, schedule, name, zero3_largest[name], at, on_time, params_per_block
            )
            biggest = zero3.fastest(name, zero3_largest[name]) if zero3_largest[name] else None
            there = zero3.fastest(name, at) if at else None
            row.update(largest_split=None, largest_layers_by_split=None,
                       split_at_recompute_largest=None, zero3_steps_in_span=steps,
                       zero3_at_largest=None if biggest is None else biggest.to_json(),
                       zero3_at_recompute_largest=None if there is None else there.to_json(),
                       step_s_at_recompute_largest=None if there is None else steps * there.step_s,
                       step_s_floor_at_recompute_largest=(None if there is None
                                                          else steps * there.step_s_floor),
                       peak_bytes_at_recompute_largest=None if there is None else there.peak_bytes)  # fmt: skip
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Per schedule: the largest model each strategy fits (bars) and its step at recompute-only's
    largest model (dots, right axis; none where it does not fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCHEDULES), figsize=(6.0 * len(SCHEDULES), 4.0), squeeze=False)
    for ax, schedule in zip(axes[0], SCHEDULES, strict=True):
        mine = [r for r in rows if r["schedule"] == schedule and r["section"] == "predicted"]
        x = range(len(mine))
        ax.bar(x, [r["largest_params"] / 1e9 for r in mine], color="tab:blue", alpha=0.7)
        ax.set_xticks(list(x), [r["strategy"] for r in mine], fontsize=8)
        ax.set_ylabel("largest model (billion parameters)")
        ax.set_title(f"{schedule} (predicted)", fontsize=10)
        steps = ax.twinx()
        steps.plot([i for i, r in enumerate(mine) if r.get("step_s_at_recompute_largest")],
                   [r["step_s_at_recompute_largest"] for r in mine
                    if r.get("step_s_at_recompute_largest")], "o", color="tab:red")  # fmt: skip
        steps.set_ylabel("step s at recompute-only's largest (dots)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show

    sections = args.section or ["predicted", "measured"]
    rows = bench_mpress(args) if "predicted" in sections else []
    if "measured" in sections:
        rows += bench_measured(args)
    folder = None if args.results_dir is None else Path(args.results_dir)
    path = write_results("mpress", rows, folder=folder)
    if "predicted" in sections:
        console.print(f"plot: {plot(rows, path.with_suffix('.png'))}")
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def tables(result: dict[str, Any], args: argparse.Namespace) -> list[ResultTable]:
    """The measured table, then the predicted one, as far as the result holds them ([Note: one
    table per result] in benchmarks/tables.py)."""
    measured = [r for r in result["rows"] if r["section"] == "measured"]
    predicted = [r for r in result["rows"] if r["section"] == "predicted"]
    return [
        *([_measured_table(measured, args)] if measured else []),
        *([_predicted_table(predicted, args)] if predicted else []),
    ]


def _predicted_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> ResultTable:
    title = (f"tidal bench mpress (predicted, {args.family}, {args.stages} GPUs of "
             f"{args.device_memory}, {args.topology}, PipeDream updates every "
             f"{args.pipedream_updates})")  # fmt: skip
    columns = ("schedule", "strategy", "largest blocks", "params", "x recompute", "split",
               "x recompute on the time split", "step s at recompute's largest", "split there",
               "peak there")  # fmt: skip
    cells = []
    for r in rows:
        step = r.get("step_s_at_recompute_largest")
        time_split = r.get("vs_recompute_time_split")
        cells.append([
            r["schedule"], r["strategy"], str(r["largest_layers"]), f"{r['largest_params']:,}",
            "-" if r["vs_recompute"] is None else f"{r['vs_recompute']:.2f}",
            r.get("largest_split") or "-",
            "-" if time_split is None else f"{time_split:.2f}",
            "does not fit" if step is None else f"{step:.4g}" + (
                f" (floor {r['step_s_floor_at_recompute_largest']:.4g})"
                if r["strategy"] in ZERO3_ROWS else ""),
            r.get("split_at_recompute_largest") or "-",
            "-" if step is None else format_bytes(r["peak_bytes_at_recompute_largest"]),
        ])  # fmt: skip
    return ResultTable.of(title, columns, cells, left_columns=2)


def _measured_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> ResultTable:
    title = (f"tidal bench mpress (measured: {args.measured_ranks} gloo ranks, "
             f"{args.measured_budget} each)")  # fmt: skip
    columns = ("schedule", "strategy", "largest blocks", "x recompute",
               "step s at recompute's largest")  # fmt: skip
    cells = []
    for r in rows:
        step = r["step_s_at_recompute_largest"]
        cells.append([r["schedule"], r["strategy"], str(r["largest_layers"]),
                      "-" if r["vs_recompute"] is None else f"{r['vs_recompute']:.2f}",
                      "does not train" if step is None else f"{step:.4g}"])  # fmt: skip
    return ResultTable.of(title, columns, cells, left_columns=2)
