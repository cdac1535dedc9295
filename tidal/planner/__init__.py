"""The planner: measure a model, model its strategies' costs, solve an ILP, emit a plan.

``measure`` (measure.py) traces a model on the meta device into decision units; ``candidates``
(strategies.py) and ``evaluate`` (cost_model.py) are the cost model; ``build_problem`` (ilp.py)
is the ILP on scipy's HiGHS; ``make_plan`` (search.py) runs it over every mesh and compares with
the baselines (baselines.py); a :class:`Plan` (plan.py) is the result as plain data. Everything
here is pure: a plan is realised on a model with DTensor and FSDP2 by
``tidal.parallel.plan_apply.apply``, a layer above.

[Note: a lazy package]
Importing any module below imports this package first; it names the exports of config.py and
search.py without importing them, because they bring scipy's solver (about a second) that a
process reading a Plan, wiring one or writing a checkpoint never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# torch's and tidal's own modules: imported now (``measure`` names a module and its function)
from tidal.planner.cluster import CLUSTER_PRESETS, ClusterSpec, Mesh
from tidal.planner.measure import ModelGraph, Unit, measure
from tidal.planner.plan import Layout, Offload, Plan, Recompute, StrategyName, UnitChoice

if TYPE_CHECKING:
    from tidal.planner.config import PlannerConfig
    from tidal.planner.search import Infeasible, PlanResult, make_plan, plan_for

_HOMES = {
    "config": ("PlannerConfig",),  # imports the search's baselines
    "search": ("Infeasible", "PlanResult", "make_plan", "plan_for"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME_OF:
        raise AttributeError(f"module 'tidal.planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.planner.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CLUSTER_PRESETS",
    "ClusterSpec",
    "Infeasible",
    "Layout",
    "Mesh",
    "ModelGraph",
    "Offload",
    "Plan",
    "PlanResult",
    "PlannerConfig",
    "Recompute",
    "StrategyName",
    "Unit",
    "UnitChoice",
    "make_plan",
    "measure",
    "plan_for",
]
