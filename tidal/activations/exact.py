"""The exact saver planner: the cost model of ``costs.py`` ([Note: saver costs]) as a mixed-integer
program on scipy's HiGHS (``scipy.optimize.milp``): beside the greedy in ``plan_savers`` (within a
time limit) and in tests to bound the greedy's gap ([Note: the saver planners] in ``plan.py``).

[Note: the exact program]
A host swap's price depends on how many ranks share its link ([Note: saver costs]), so each host
option is offered once per possible count ``k`` of users of its link, priced at ``k``: a binary
per rank says it host-swaps anything, and choosing an option at ``k`` caps its link's users at
``k``. The least step takes, per item, the count that is the link's own. Bytes count in units of
the largest budget and seconds in units of the dearest offer: rows in bytes beside rows in
seconds once made HiGHS return, as optimal, twice the best step. The objective is the plan's
``pipeline_added_s``: z (the slowest rank's added seconds) plus every offer's seconds over the
microbatches of a step. With z alone HiGHS was free to spread seconds over every other rank:
a plan that lowered z by a tenth added six times the seconds in all and simulated slower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.activations.costs import (
    Choice,
    Links,
    Saved,
    Saver,
    SaverPlan,
    evaluate,
    lent_shares,
    microbatches_per_step,
    price_s,
    saver_options,
)

__all__ = ["plan_exact"]


@dataclass(frozen=True, slots=True)
class _Offer:
    """One option of one saved tensor, priced at one count of its host link's users."""

    item: int
    choice: Choice
    num_host_users: int
    price_s: float


@dataclass(slots=True)
class _Program:
    """The rows of the program and their bounds. Variables: x (one per offer), then t (the
    transient copy per rank), h (the host-swapped copy fetched ahead, per rank), u (the rank
    host-swaps anything), then z (the step's added seconds)."""

    saved: Sequence[Saved]
    links: Links
    offers: list[_Offer]
    rows: list[dict[int, float]] = field(default_factory=list)  # sparse: column -> coefficient
    bounds: list[tuple[float, float]] = field(default_factory=list)

    @property
    def num_x(self) -> int:
        return len(self.offers)

    @property
    def z(self) -> int:
        return self.num_x + 3 * self.links.num_ranks

    def t(self, rank: int) -> int:
        return self.num_x + rank

    def h(self, rank: int) -> int:
        return self.num_x + self.links.num_ranks + rank

    def u(self, rank: int) -> int:
        return self.num_x + 2 * self.links.num_ranks + rank

    @property
    def per_byte(self) -> float:
        return 1.0 / max(max(self.links.budget_bytes), 1)

    @property
    def per_s(self) -> float:
        return 1.0 / max(max((o.price_s for o in self.offers), default=0.0), 1e-12)

    def add(self, r: dict[int, float], low: float, high: float) -> None:
        self.rows.append(r)
        self.bounds.append((low, high))

    def matrix(self) -> Any:
        """The rows as one sparse matrix (a dense one of a few thousand tensors' offers takes
        gigabytes)."""
        from scipy.sparse import csr_array

        cols = [c for r in self.rows for c in r]
        values = [v for r in self.rows for v in r.values()]
        row_of = [i for i, r in enumerate(self.rows) for _ in r]
        return csr_array((values, (row_of, cols)), shape=(len(self.rows), self.z + 1))

    def owner(self, offer: _Offer) -> int:
        return self.links.stage_rank[self.saved[offer.item].stage]


def plan_exact(saved: Sequence[Saved], links: Links, *, time_limit_s: float | None = None,
               rel_gap: float | None = None, slowest_only: bool = False) -> SaverPlan:  # fmt: skip
    """The least added step time over every assignment, as a MILP ([Note: the exact program]):
    the least ``pipeline_added_s``, or with ``slowest_only`` the least ``added_step_s`` (what
    the greedy lowers: tests bound the greedy's gap with it).

    ``rel_gap``: stop once the plan is within that share of the least (HiGHS's default: 1e-4).
    ``time_limit_s``: stop then with the best plan found; ``solver`` says so ("exact: time
    limit"). ``fits`` False: no assignment fits (``solver`` "exact"), or none was found in the
    time (``solver`` "exact: time limit"), or HiGHS failed (``solver`` "exact: " its message).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    program = _Program(saved=saved, links=links, offers=_offers(saved, links))
    _one_offer_per_item(program)
    _ranks_within_budget_and_step(program)
    _transients_and_host_users(program)
    _host_budgets(program)
    n, num_x = links.num_ranks, program.num_x
    cost = np.zeros(program.z + 1)
    cost[program.z] = 1.0
    per_microbatch = program.per_s / microbatches_per_step(saved)
    for k, offer in enumerate(program.offers):
        cost[k] = 0.0 if slowest_only else per_microbatch * offer.price_s
    binary = np.concatenate([np.ones(num_x), np.zeros(2 * n), np.ones(n), np.zeros(1)])
    upper = np.concatenate([np.ones(num_x), np.full(2 * n, np.inf), np.ones(n), [np.inf]])
    low, high = zip(*program.bounds, strict=True)
    options: dict[str, float] = {}
    if time_limit_s is not None:
        options["time_limit"] = time_limit_s
    if rel_gap is not None:
        options["mip_rel_gap"] = rel_gap
    result = milp(cost, constraints=LinearConstraint(program.matrix(), low, high),
                  integrality=binary, bounds=Bounds(np.zeros(program.z + 1), upper),
                  options=options)  # fmt: skip
    # scipy's statuses: 0 solved, 1 a limit reached (maybe with a plan), 2 infeasible
    solver = {0: "exact", 1: "exact: time limit", 2: "exact"}.get(
        result.status, f"exact: {result.message}"
    )
    if result.x is None:
        kept = evaluate(saved, [(Saver.KEEP, None)] * len(saved), links, solver)
        return dataclasses.replace(kept, fits=False)
    choices: list[Choice] = [(Saver.KEEP, None)] * len(saved)
    for k, offer in enumerate(program.offers):
        if result.x[k] > 0.5:
            choices[offer.item] = offer.choice
    return evaluate(saved, choices, links, solver)


def _offers(saved: Sequence[Saved], links: Links) -> list[_Offer]:
    """Every option of every tensor; a host swap once per count of its link's users."""
    offers = []
    for i, item in enumerate(saved):
        sharers = links.sharers(links.host_link[links.stage_rank[item.stage]])
        for choice in saver_options(item, links):
            for users in range(1, sharers + 1) if choice[0] is Saver.HOST else range(1, 2):
                offers.append(_Offer(item=i, choice=choice, num_host_users=users,
                                     price_s=price_s(item, choice, links, users)))  # fmt: skip
    return offers


def _one_offer_per_item(program: _Program) -> None:
    offered: list[dict[int, float]] = [{} for _ in program.saved]
    for k, offer in enumerate(program.offers):
        offered[offer.item][k] = 1.0
    for r in offered:
        program.add(r, 1.0, 1.0)


def _ranks_within_budget_and_step(program: _Program) -> None:
    """Per rank: its peak (what it keeps and is lent, its transient copies) within its budget,
    and its added seconds at most z."""
    links, per_byte, per_s = program.links, program.per_byte, program.per_s
    mem: list[dict[int, float]] = [{} for _ in range(links.num_ranks)]
    time: list[dict[int, float]] = [{} for _ in range(links.num_ranks)]
    for k, offer in enumerate(program.offers):
        item, (saver, lenders) = program.saved[offer.item], offer.choice
        owner = program.owner(offer)
        time[owner][k] = per_s * offer.price_s
        mem[owner][k] = per_byte * item.held_under(saver)
        if saver is Saver.PEER:
            for to, num_bytes in lent_shares(item, lenders, links):
                mem[to][k] = mem[to].get(k, 0.0) + per_byte * num_bytes
    for rank in range(links.num_ranks):
        mem[rank][program.t(rank)] = 1.0
        if links.host_prefetch:
            mem[rank][program.h(rank)] = 1.0
        program.add(mem[rank], -np.inf,
                    per_byte * (links.budget_bytes[rank] - links.base_bytes[rank]))  # fmt: skip
        time[rank][program.z] = -1.0
        program.add(time[rank], -np.inf, 0.0)


def _transients_and_host_users(program: _Program) -> None:
    """Per offer: a moved copy is back for its backward (t, and h when host swaps fetch ahead);
    a host swap makes its rank a user of its link, whose users are then at most the offer's."""
    links, per_byte = program.links, program.per_byte
    for k, offer in enumerate(program.offers):
        item, saver, owner = program.saved[offer.item], offer.choice[0], program.owner(offer)
        if saver is not Saver.KEEP and item.copies:
            program.add({k: per_byte * item.num_bytes, program.t(owner): -1.0}, -np.inf, 0.0)
        if saver is Saver.HOST and item.copies and links.host_prefetch:
            program.add({k: per_byte * item.num_bytes, program.h(owner): -1.0}, -np.inf, 0.0)
        if saver is Saver.HOST:
            program.add({k: 1.0, program.u(owner): -1.0}, -np.inf, 0.0)
            link = links.host_link[owner]
            sharers = links.sharers(link)
            r = {program.u(other): 1.0 for other in range(links.num_ranks)
                 if links.host_link[other] == link}  # fmt: skip
            r[k] = float(sharers)
            program.add(r, -np.inf, float(offer.num_host_users + sharers))


def _host_budgets(program: _Program) -> None:
    """What each host link's host holds within its budget."""
    links, per_byte = program.links, program.per_byte
    for link, cap in enumerate(links.host_budget_bytes):
        if cap is None:
            continue
        r = {k: per_byte * program.saved[offer.item].held_bytes
             for k, offer in enumerate(program.offers)
             if offer.choice[0] is Saver.HOST and links.host_link[program.owner(offer)] == link}  # fmt: skip
        program.add(r, -np.inf, per_byte * cap)
