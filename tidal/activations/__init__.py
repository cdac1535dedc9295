"""Saved-tensor decisions: keep, recompute, or swap to the host or a peer (MPress); see plan.py."""

from tidal.activations.costs import (
    Links,
    Saved,
    Saver,
    SaverPlan,
    Stripe,
    TensorClass,
    evaluate,
    keep_all,
    least_peak_bytes,
)
from tidal.activations.exact import plan_exact
from tidal.activations.greedy import plan_greedy
from tidal.activations.placement import place_stages
from tidal.activations.plan import plan_savers

__all__ = [
    "Links",
    "Saved",
    "Saver",
    "SaverPlan",
    "Stripe",
    "TensorClass",
    "evaluate",
    "keep_all",
    "least_peak_bytes",
    "plan_exact",
    "plan_greedy",
    "place_stages",
    "plan_savers",
]
