"""Saved-tensor decisions: keep, recompute, or swap to the host or a peer (MPress); see plan.py."""

from tidal.activations.placement import place_stages
from tidal.activations.plan import (
    Links,
    Saved,
    Saver,
    SaverPlan,
    Stripe,
    TensorClass,
    evaluate,
    keep_all,
    least_peak_bytes,
    plan_exact,
    plan_greedy,
    plan_savers,
)

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
