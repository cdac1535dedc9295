"""Which saved tensors of a pipeline stay, are recomputed, or swap to the host or a peer (MPress).

:func:`plan_savers` is the one entry: per saved tensor what to do, what each rank then holds
(lent bytes included) and what the savers add to a step, as a :class:`SaverPlan`. The layer's
parts, each pure (plain numbers in, plain data out; nothing touches a tensor or a process group):

    costs.py   the data (``Saved``, ``Links``, ``Stripe``, ``SaverPlan``) and the cost model that
               prices one choice per tensor (:func:`~tidal.activations.costs.evaluate`):
               [Note: saver costs], [Note: stripes]
    greedy.py  MPress's greedy and its refinement
    exact.py   the same model as a mixed-integer program

[Note: the saver planners]
``greedy`` (MPress): while some rank is over its budget, take the most overloaded one and apply,
among its kept tensors and the savers that fit (a lender's spare bytes, the host link's), the
one that saves the most bytes per added second (free ones first, largest first; a host swap
that brings a rank onto its link also pays what the ranks already on it then add); a recomputed
tensor that still keeps its inputs may move on to the host or a peer the same way. A rank that
still cannot move anything tries the moves that free the most once room is made for them (a
full host gives back tensors, a lender moves its own): the cheapest-per-byte order can give
the host's room to a small free tensor that a large one with nowhere else to go needed.
``exact``: the same model as a mixed-integer program on scipy's HiGHS
(``scipy.optimize.milp``; [Note: the exact program] in ``exact.py``).
:func:`plan_savers` runs both and keeps the faster plan that fits (by ``pipeline_added_s``,
which the exact program minimises: [Note: the exact program]): the greedy, then the exact
program for at most ``EXACT_TIME_LIMIT_S`` and within ``EXACT_REL_GAP`` of its best. Neither
alone is enough. The greedy misses plans that take several ranks lending to each other at once
(deciding whether any plan fits packs bytes into bins, which no greedy always does) and can be
far from the best on large instances: on the DGX-1 PipeDream case of ``tidal bench mpress`` (56
blocks split by time, 233 tensors) its plan adds 0.84 s to each update where the exact program's
adds 0.30 s, found in half a second. The exact program does not always finish in its time on a thousand tensors,
where its best plan so far can be slower than the greedy's. With the time limit the exact plan
may depend on the machine's speed: a run whose ranks plan alone takes rank 0's plan
([Note: pipeline memory] in tidal/train/pipeline_memory.py). A node limit would not make it
depend on the instance alone: on the bench's largest instances (585 to 1353 tensors) HiGHS is
still in its first or second node when the 10 s pass, and ``scipy.optimize.milp`` offers no
other limit on the work.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.activations.costs import Links, Saved, SaverPlan, least_peak_bytes
from tidal.activations.exact import plan_exact
from tidal.activations.greedy import plan_greedy
from tidal.config import ConfigError, format_bytes

__all__ = ["plan_savers"]

EXACT_TIME_LIMIT_S = 10.0  # the most the exact program runs after the greedy
EXACT_REL_GAP = 0.01  # the exact program stops within this share of its best plan


def plan_savers(saved: Sequence[Saved], links: Links, *,
                exact_time_limit_s: float = EXACT_TIME_LIMIT_S) -> SaverPlan:  # fmt: skip
    """The faster of the greedy's and the exact program's plans ([Note: the saver planners];
    ``exact_time_limit_s`` 0: the greedy alone); none fits: a
    :class:`~tidal.config.ConfigError` naming the least budget."""
    plan = plan_greedy(saved, links)
    if exact_time_limit_s > 0:
        exact = plan_exact(saved, links, time_limit_s=exact_time_limit_s, rel_gap=EXACT_REL_GAP)
        if exact.fits and (not plan.fits or exact.pipeline_added_s < plan.pipeline_added_s):
            plan = exact
        elif not plan.fits and exact.solver != "exact":  # not proven: say why
            raise ConfigError("memory.device_budget", _no_plan(saved, links, exact.solver))
    if plan.fits:
        return plan
    raise ConfigError("memory.device_budget", _no_plan(saved, links))


def _no_plan(saved: Sequence[Saved], links: Links, unproven: str = "") -> str:
    least = least_peak_bytes(saved, links)
    worst = max(range(links.num_ranks), key=lambda r: least[r] - links.budget_bytes[r])
    stages = [s for s, r in enumerate(links.stage_rank) if r == worst]
    if least[worst] > links.budget_bytes[worst]:
        return (
            f"no saver plan fits: rank {worst} (stages {stages}) needs at least "
            f"{format_bytes(least[worst])} with every saved tensor moved, over its budget of "
            f"{format_bytes(links.budget_bytes[worst])}; raise the budget to at least that, or "
            f"use more pipeline stages"
        )
    if unproven:
        return (
            f"no saver plan found: the greedy found none and the exact program stopped "
            f"({unproven}) before finding one or proving there is none; raise "
            f"memory.device_budget or the host budget"
        )
    return (
        "no saver plan fits: the host and the peers have too little room for what must move "
        f"(host budgets {['unlimited' if c is None else format_bytes(c) for c in links.host_budget_bytes]}"
        "; peers' spare room under their own budgets); "
        "raise memory.device_budget or the host budget"
    )
