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
from tidal.planner.search import PlanResult

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
        "lp_gap": _finite(result.solution.lp_gap),
        "fastest_step_time_s": result.fastest_s,
        "cluster": dataclasses.asdict(cluster),
        "meshes": [
            {
                "dp": r.mesh.dp,
                "tp": r.mesh.tp,
                "fastest_step_time_s": _finite(r.fastest.step_time_s),
                "status": r.fastest.status,
            }
            for r in result.meshes
        ],
        "pareto": result.pareto,
        "baselines": baselines,
    }
