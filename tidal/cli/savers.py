"""``tidal simulate --model P --device-memory B``: MPress's savers for a split GPT, per rank.

``--device-memory`` is one budget for every rank, or one per rank (``80GiB,80GiB,40GiB,40GiB``:
devices that differ); with one stage per rank the stages are placed on the ranks where the plan
is best ([Note: stage placement] in tidal/activations/placement.py), and the table's ``stages``
column shows the map.

The stages' saved tensors come from the model's traced profile (each block's bytes split by
class as :func:`~tidal.models.gpt_saved_shares` says) and the schedule's simulation
([Note: savers on a schedule] in tidal/pipeline/savers.py); each rank also holds its stages'
model data, counted as fp32 weights, gradients and AdamW's two moments (4 x the weights).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from tidal.activations import Links, Saver, SaverPlan, TensorClass, keep_all, plan_savers
from tidal.activations.placement import place_stages
from tidal.activations.topology import peer_links
from tidal.config import ConfigError, format_bytes, parse_bytes
from tidal.pipeline.lending import lender_ranks
from tidal.pipeline.partition import LayerProfile, Partition
from tidal.pipeline.savers import BlockSaves, saved_tensors, step_with_savers
from tidal.pipeline.simulate import Simulation

__all__ = ["plan_stage_savers", "saver_json", "saver_table"]

MODEL_DATA_PER_WEIGHT_BYTE = 4  # fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq

# before, every tensor kept, the plan, the step with it, the ranks' links
Savers = tuple[Simulation, SaverPlan, SaverPlan, Simulation, Links]


def plan_stage_savers(args: argparse.Namespace, sim: Simulation, split: Partition,
                      profiles: list[LayerProfile]) -> Savers:  # fmt: skip
    from tidal.models import gpt_saved_shares, preset

    config = preset(args.model)
    shares = gpt_saved_shares(config, seq_len=config.seq_len)
    blocks = []
    for stage, (start, end) in enumerate(split.unit_ranges):
        for unit in range(start, end):
            layer = profiles[unit]
            if layer.name.startswith("blocks."):
                by_class = {
                    cls: int(layer.activation_bytes * share) for cls, share in shares.items()
                }
            else:
                by_class = {TensorClass.OTHER: layer.activation_bytes}
            blocks.append(BlockSaves(stage=stage, block=unit, bytes_by_class=by_class,
                                     forward_s=layer.forward_s))  # fmt: skip
    weight_bytes = [sum(p.param_bytes for p in profiles[a:b]) for a, b in split.unit_ranges]
    saved = saved_tensors(sim, blocks, weight_bytes=weight_bytes)
    schedule = sim.schedule
    num_ranks = schedule.num_ranks
    base = [0] * num_ranks
    for stage, num_bytes in enumerate(weight_bytes):
        base[schedule.rank_of(stage)] += MODEL_DATA_PER_WEIGHT_BYTE * num_bytes
    peer, egress = peer_links(args.topology, num_ranks, pair_gbps=args.peer_gbps,
                              nvlink_gbps=args.nvlink_gbps)  # fmt: skip
    links = Links(
        stage_rank=tuple(schedule.rank_of(s) for s in range(schedule.num_stages)),
        budget_bytes=rank_budgets(args.device_memory, num_ranks),
        base_bytes=tuple(base),
        host_link=tuple(range(num_ranks)),
        host_bandwidth=(args.host_gbps * 1e9,) * num_ranks,
        host_budget_bytes=(None,) * num_ranks,
        peer_bandwidth=peer,
        peer_egress=egress,
        # what the runtime can carry out ([Note: lending] in tidal/pipeline/lending.py): one
        # stage per rank, any other rank (so any stage-to-rank map); with virtual stages, the
        # ranks with a stage after the borrower
        stage_lenders=None
        if schedule.num_virtual == 1
        else tuple(lender_ranks(schedule, s) for s in range(schedule.num_stages)),
    )
    placed, priced = place_stages(saved, links)  # the map, priced with the greedy
    if priced.fits:
        links = placed
    # on it, the faster of the greedy's and the exact program's plans, or the one-line error
    plan = plan_savers(saved, links)
    return sim, keep_all(saved, links), plan, step_with_savers(sim, plan), links


def rank_budgets(text: str, num_ranks: int) -> tuple[int, ...]:
    """``--device-memory``: one size for every rank, or one per rank, comma-separated."""
    sizes = [parse_bytes(part.strip(), key="--device-memory") for part in text.split(",")]
    if len(sizes) == 1:
        return (sizes[0],) * num_ranks
    if len(sizes) != num_ranks:
        raise ConfigError("--device-memory", f"{len(sizes)} sizes for {num_ranks} ranks: give "
                          "one for every rank, or one per rank")  # fmt: skip
    return tuple(sizes)


def _per_rank(plan: SaverPlan, rank: int, links: Links) -> dict[str, Any]:
    held = {saver: 0 for saver in Saver}
    lent_to: set[int] = set()
    for item, (saver, lender) in zip(plan.saved, plan.choices, strict=True):
        if links.stage_rank[item.stage] == rank:
            held[saver] += item.held_bytes
            lent_to.update(lender or ())
    return {"rank": rank, "stages": [s for s, r in enumerate(links.stage_rank) if r == rank],
            "peak_bytes": plan.peak_bytes[rank], "kept_bytes": held[Saver.KEEP],
            "recomputed_bytes": held[Saver.RECOMPUTE], "host_bytes": held[Saver.HOST],
            "peer_bytes": held[Saver.PEER], "lent_to": sorted(lent_to),
            "holds_for_others_bytes": plan.lent_bytes[rank], "added_s": plan.added_s[rank]}  # fmt: skip


def saver_table(before: Simulation, kept: SaverPlan, plan: SaverPlan, after: Simulation,
                links: Links) -> Table:  # fmt: skip
    table = Table(title=f"savers ({plan.solver}): what each rank holds and moves",
                  title_justify="left")  # fmt: skip
    for name in ("rank", "stages", "held before", "held after", "recomputed", "to host",
                 "to peers", "holds for peers", "added s/step"):  # fmt: skip
        table.add_column(name, justify="right")
    for rank in range(len(plan.peak_bytes)):
        row = _per_rank(plan, rank, links)
        peers = f" -> {','.join(map(str, row['lent_to']))}" if row["lent_to"] else ""
        table.add_row(
            str(rank), ",".join(map(str, row["stages"])), format_bytes(kept.peak_bytes[rank]),
            format_bytes(row["peak_bytes"]), format_bytes(row["recomputed_bytes"]),
            format_bytes(row["host_bytes"]), format_bytes(row["peer_bytes"]) + peers,
            format_bytes(row["holds_for_others_bytes"]), f"{row['added_s']:.4g}",
        )  # fmt: skip
    table.caption = (
        f"step {before.makespan_s:.4g} s -> {after.makespan_s:.4g} s with the savers "
        f"(simulated); {_budgets(links.budget_bytes)}"
    )
    return table


def _budgets(budget_bytes: tuple[int, ...]) -> str:
    if len(set(budget_bytes)) == 1:
        return f"budget {format_bytes(budget_bytes[0])} per rank"
    return "budgets " + ", ".join(format_bytes(b) for b in budget_bytes)


def saver_json(before: Simulation, kept: SaverPlan, plan: SaverPlan, after: Simulation,
               links: Links) -> dict[str, Any]:  # fmt: skip
    return {
        "solver": plan.solver,
        "budget_bytes": list(links.budget_bytes),
        "step_s_before": before.makespan_s,
        "step_s_after": after.makespan_s,
        "peak_bytes_before": list(kept.peak_bytes),
        "ranks": [_per_rank(plan, r, links) for r in range(len(plan.peak_bytes))],
        "choices": [
            {
                "stage": i.stage,
                "block": i.block,
                "class": i.tensor_class.value,
                "bytes": i.held_bytes,
                "saver": s.value,
                "lenders": None if lender is None else list(lender),
            }
            for i, (s, lender) in zip(plan.saved, plan.choices, strict=True)
        ],  # fmt: skip
    }
