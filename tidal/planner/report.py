"""Emit: a planner result as the JSON ``tidal plan --json`` writes.

The file is a :class:`~tidal.planner.plan.Plan` (so ``Plan.load`` and ``tidal train --plan``
read it) with the search's figures beside it: solve time, LP gap, the meshes tried, the
memory-time frontier and the baselines with their own peak and step time and what the plan
saves against each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tidal.planner.cluster import ClusterSpec
from tidal.planner.megatron import MegatronRow
from tidal.planner.pipelines import PipelinePlan
from tidal.planner.search import MEGATRON_SLACK, Compared, PlanResult

__all__ = ["plan_report"]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def plan_report(result: PlanResult, cluster: ClusterSpec) -> dict[str, Any]:
    """Everything ``tidal plan`` knows about ``result``, JSON-ready."""
    plan = result.plan
    baselines = {}
    for name, base in result.baselines.items():
        matched = result.matched.get(name)
        baselines[name] = {
            "mesh": {"dp": base.mesh.dp, "tp": base.mesh.tp},
            "peak_memory_bytes": _finite(base.peak_memory_bytes),
            "step_time_s": _finite(base.step_time_s),
            "fits": base.peak_memory_bytes <= cluster.device_memory_bytes,
            "memory": base.costed.memory.to_dict() if base.costed else None,
            "saving": _finite(result.saving(name)),
            "at_same_step_time": None
            if matched is None
            else {
                "peak_memory_bytes": matched.peak_bytes,
                "step_time_s": matched.step_time_s,
                "saving": _finite(result.matched_saving(name)),
            },
        }
    return {
        **plan.to_dict(),
        "solve_s": result.solve_s,
        "phases_s": result.phases_s,
        "lp_gap": _finite(result.solution.lp_gap),
        "fastest_step_time_s": _fastest_s(result),
        "cluster": dataclasses.asdict(cluster),
        "meshes": [
            {
                "dp": r.mesh.dp,
                "tp": r.mesh.tp,
                "offload": r.problem.offload.to_dict(),
                "fastest_step_time_s": _finite(r.fastest.step_time_s),
                "status": r.fastest.status,
            }
            for r in result.meshes
        ],
        "pareto": result.pareto,
        "baselines": baselines,
        "pipeline_search": _pipeline(result),
        "megatron_best": _megatron(result, cluster),
    }


def _fastest_s(result: PlanResult) -> float:
    """The fastest plan that fits, flat or pipelined ([Note: the chosen plan] in search.py)."""
    fastest = None if result.pipelines is None else result.pipelines.fastest
    return min(result.fastest_s, fastest.fastest_s if fastest is not None else float("inf"))


def _row(row: MegatronRow | None, cluster: ClusterSpec) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "config": row.config.as_dict(),
        "name": row.config.name,
        "peak_memory_bytes": row.peak_memory_bytes,
        "estimator_bytes": row.memory.estimator_bytes,
        "weights_and_optimizer_bytes": row.memory.weights_and_optimizer,
        "activation_bytes": row.memory.activations,
        "transient_bytes": row.memory.transient,
        "host_bytes": row.memory.host,
        "step_time_s": row.step_time_s,
        "fits": row.peak_memory_bytes <= cluster.device_memory_bytes,
    }


def _compared(mine: Compared | None, against: MegatronRow | None) -> dict[str, Any] | None:
    if mine is None or against is None:
        return None
    return {
        "peak_memory_bytes": mine.peak_memory_bytes,
        "step_time_s": mine.step_time_s,
        "layout": mine.layout,
        "saving": 1.0 - mine.peak_memory_bytes / against.peak_memory_bytes,
        "step_time_ratio": mine.step_time_s / against.step_time_s,
    }


def _pipeline(result: PlanResult) -> dict[str, Any] | None:
    """The best pipelined plan ([Note: pipeline stages] in pipelines.py): its stages' figures."""
    plan: PipelinePlan | None = result.pipeline
    if plan is None:
        return None
    o = plan.option
    stages = {}
    # a device's peak: the last stage's with what the first lends it ([Note: activations on a
    # peer] in tidal/planner/ilp.py)
    peaks = plan.stage_peaks()
    names = ("first", "last", "middle")[: len(plan.costed)]
    for name, costed, solution in zip(names, plan.costed, plan.stages, strict=True):
        assert solution.assignment is not None
        stages[name] = {
            "peak_memory_bytes": peaks[name],
            "memory": costed.memory.to_dict(),
            "step_time_s": costed.step_time_s,
            "recompute": {k: str(v) for k, v in solution.assignment.recompute.items()},
            "offload": solution.assignment.offload.to_dict(),
        }
    return {
        "layout": plan.describe(),
        "pp": o.pp, "vp": o.vp, "dp": o.mesh.dp, "tp": o.mesh.tp, "schedule": o.schedule,
        "num_microbatches": o.num_microbatches, "micro_batch": o.micro_batch,
        "split": o.split.kind, "stage_blocks": list(o.split.blocks),
        "peak_memory_bytes": plan.peak_memory_bytes,
        "step_time_s": plan.step_time_s,
        "send_s": o.send_s,
        "stages": stages,
        "lent_bytes": plan.lent_bytes,
        "middle_peak_bytes": peaks.get("middle"),
        "pareto": [
            {"eps": eps, "peak_memory_bytes": p.peak_memory_bytes, "step_time_s": p.step_time_s,
             "layout": p.describe()}
            for eps, p in result.pipeline_pareto
        ],
        "options_solved": result.pipelines.num_solved if result.pipelines else 0,
        "options": len(result.pipelines.options) if result.pipelines else 0,
    }  # fmt: skip


def _megatron(result: PlanResult, cluster: ClusterSpec) -> dict[str, Any] | None:
    """Megatron-LM's fastest fitting configuration and its least-memory one, each beside the
    plan that compares with it: the smallest at the fastest one's step time (None: no plan is
    that fast), and the smallest at any speed."""
    best = result.megatron
    if best is None:
        return None
    plan = result.plan
    near = None
    if best.fastest is not None:
        limit = (1 + MEGATRON_SLACK) * best.fastest.step_time_s
        near = min((r for r in best.frontier if r.step_time_s <= limit
                    and r.peak_memory_bytes <= cluster.device_memory_bytes),
                   key=lambda r: r.peak_memory_bytes, default=None)  # fmt: skip
    return {
        "num_configs": best.num_configs,
        "frontier": [
            {
                "name": r.config.name,
                "peak_memory_bytes": r.peak_memory_bytes,
                "step_time_s": r.step_time_s,
            }
            for r in best.frontier
        ],  # fmt: skip
        "fastest": _row(best.fastest, cluster),
        "least_memory": _row(best.least_memory, cluster),
        "plan_against_fastest": None
        if best.fastest is None
        else {
            "saving": 1.0 - plan.peak_memory_bytes / best.fastest.peak_memory_bytes,
            "step_time_ratio": plan.step_time_s / best.fastest.step_time_s,
        },
        "plan_at_fastest_step_time": _compared(
            result.against_megatron.get("at_fastest_step_time"), best.fastest
        ),
        "slack": MEGATRON_SLACK,
        "plan_near_fastest_step_time": _compared(
            result.against_megatron.get("within_slack_of_fastest"), best.fastest
        ),
        # Megatron's own least memory within the same slack of its fastest step: the stronger
        # side of the comparison above (its frontier, not only its fastest configuration)
        "near_fastest": _row(near, cluster),
        "plan_near_its_near_fastest": _compared(
            result.against_megatron.get("within_slack_of_fastest"), near
        ),
        "plan_least_memory": _compared(
            result.against_megatron.get("least_memory"), best.least_memory
        ),
    }
