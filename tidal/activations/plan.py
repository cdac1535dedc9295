"""Which saved tensors of a pipeline stay, are recomputed, or swap to the host or a peer (MPress).

Pure: the inputs are plain numbers (what each block saves per microbatch and how many copies the
schedule keeps live, the ranks' budgets, the links); :func:`plan_savers` returns a
:class:`SaverPlan`, which says per saved tensor what to do, what each rank then holds (lent bytes
included) and what the savers add to a step. Nothing here touches a tensor or a process group.

[Note: saver costs]
A pipeline leaves memory imbalanced: under 1F1B stage s keeps p - s microbatches' activations
while the last stage keeps one, so the first ranks overflow while the last have room to lend.
Per saved tensor (a :class:`Saved`: one class of one block of one stage), with ``n`` uses per
step (microbatches) and ``c`` copies live at the stage's peak:

    keep       the rank holds c x bytes; costs nothing
    recompute  (activations only) the rank keeps what the recompute starts from (c x
               ``recompute_keeps_bytes``: the inputs of the submodule run again; 0 where that
               is an item of its own, a block's input) and runs the forward again in its
               backward: n x recompute_s added to the rank's backward
    host swap  out after the last forward use, back before the first backward use, over the rank's
               host link (its bandwidth split evenly among the ranks behind it that host-swap
               anything: a rank that swaps nothing takes none of it): each use costs 2 x bytes /
               bandwidth, of which the idle window between those uses hides idle_s; the host
               holds c x bytes
    peer swap  the same over the links to one or more lender ranks (a stripe), which hold the
               c x bytes in their own budgets, split in proportion to their links' bandwidths
               so that every part arrives at once: a use costs 2 x bytes / the stripe's
               bandwidth (the sum of its links', at most what the rank sends at once,
               ``Links.peer_egress``), less its idle window as a host swap's does

[Note: stripes]
A peer swap may split a tensor over several lenders (MPress sends over several NVLinks at
once). Two things a stripe buys: time, where a rank's links to its peers are separate (a
DGX-1's hybrid cube mesh: one or two 25 GB/s NVLinks to each of four peers, 150 GB/s in all),
and room, where no one lender has spare enough for a tensor that several together have (on
an NVSwitch every pair already gets the whole of a rank's links: no time, only room). Every
subset of lenders would be an option, exponential in the ranks; the options are each linked
lender alone and, per k >= 2, the k fastest (ties to the later stage's rank: under every
schedule tidal runs a later stage keeps fewer copies, so it has the room), which covers both:
more links is faster, and the k most likely to have room come first. The lenders' shares are
fixed by the links (:class:`Stripe`), so the planners price a stripe as they price one lender.
The model does not charge a lender's link for what two borrowers send it at once.

A tensor that is not kept is back on its rank for its block's backward, one block at a time: a
rank holds, beside what it keeps, the largest single copy of what it does not keep (``transient``);
where host swaps fetch the next block's copy ahead (``Links.host_prefetch``, on CUDA), also its
largest host-swapped copy.
A step then takes the schedule's step time plus the added seconds of the slowest rank (each
rank's savers lengthen its own backward, and the pipeline runs at its slowest stage); the
planners minimise that.

[Note: the saver planners]
``greedy`` (MPress): while some rank is over its budget, take the most overloaded one and apply,
among its kept tensors and the savers that fit (a lender's spare bytes, the host link's), the
one that saves the most bytes per added second (free ones first, largest first; a host swap
that brings a rank onto its link also pays what the ranks already on it then add); a recomputed
tensor that still keeps its inputs may move on to the host or a peer the same way. ``exact``: the
same model as a mixed-integer program on scipy's HiGHS (``scipy.optimize.milp``), for small
instances and to bound the greedy's gap in tests. :func:`plan_savers` runs the greedy and,
when it finds no plan and the instance is small, the exact program: a greedy can spend a host
link or a lender on tensors that could have been recomputed and then find nowhere to put one
that cannot.

[Note: one file for the model and both planners]
This module is over 600 lines (about 830 with stripes) on purpose: the greedy and the exact
program price a choice with the same private helpers (``_options``, ``_added_s``,
``_host_users``, ``_transients``, ``_lent_shares``), and a second module could only reach them
as private imports, which tests/unit/test_layers.py forbids. The split it now wants: the data
(``Saved``, ``Links``, ``Stripe``, ``SaverPlan``) and :func:`evaluate` with those helpers made
public in a cost-model module, the greedy and its refinement in one module and the exact
program in another. It was not made with the stripes because moving the code stales every
saver and MPress figure measured on it (the claims check's rule), which a session then has to
measure again; until then one file keeps one implementation of every price.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.config import ConfigError, format_bytes, require

__all__ = [
    "Choice",
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
    "plan_savers",
]

EXACT_MAX_ITEMS = 60  # plan_savers falls back to the exact program up to this many tensors
PAIR_SEARCH_MAX_ITEMS = 24  # the refinement tries pairs of a rank's tensors up to this many


class TensorClass(enum.StrEnum):
    BLOCK_INPUT = "block_input"  # what a recompute starts from: never recomputed itself
    ATTENTION = "attention"
    MLP = "mlp"
    NORM = "norm"
    OTHER = "other"  # what a block-less unit saves (an embedding's output, a head's logits)
    WEIGHTS = "weights"  # a stashed weight version (PipeDream, 2BW): never recomputed


class Saver(enum.StrEnum):
    KEEP = "keep"
    RECOMPUTE = "recompute"
    HOST = "host"
    PEER = "peer"


@dataclass(kw_only=True, frozen=True, slots=True)
class Saved:
    """One class of tensors one block of one stage saves ([Note: saver costs]): the bytes of one
    copy, the copies live at the stage's peak, its uses per step, the seconds to recompute one
    copy (None: it cannot be, as block inputs and weight versions), and the shortest window
    between a copy's last forward use and first backward use."""

    stage: int
    block: int
    tensor_class: TensorClass
    num_bytes: int
    copies: int
    uses_per_step: int
    recompute_s: float | None
    idle_s: float = 0.0
    path: str = ""  # the submodule of its stage that saves it, where training carries it out
    recompute_keeps_bytes: int = 0  # of one copy: the inputs a recompute of it starts from
    fixed: bool = False  # saved outside every submodule a saver wraps (a loss): always kept
    # it may wait on the host, not on a peer: a stashed weight version ([Note: stashes on the
    # host] in tidal/pipeline/weights.py), which no lending action carries
    host_only: bool = False

    def __post_init__(self) -> None:
        require(self.num_bytes >= 0 and self.copies >= 0 and self.uses_per_step >= 0,
                "saved tensors", f"bytes, copies and uses must be >= 0: {self}")  # fmt: skip
        require(0 <= self.recompute_keeps_bytes <= self.num_bytes, "saved tensors",
                f"a recompute keeps at most what is saved: {self}")  # fmt: skip
        if self.fixed or self.tensor_class in (TensorClass.BLOCK_INPUT, TensorClass.WEIGHTS):
            require(self.recompute_s is None, "saved tensors",
                    f"{self.tensor_class} cannot be recomputed: {self}")  # fmt: skip

    @property
    def held_bytes(self) -> int:
        return self.num_bytes * self.copies

    def held_under(self, saver: Saver) -> int:
        """What its rank holds of it under ``saver`` (lent and hosted bytes are elsewhere)."""
        if saver is Saver.KEEP:
            return self.held_bytes
        return self.recompute_keeps_bytes * self.copies if saver is Saver.RECOMPUTE else 0


@dataclass(kw_only=True, frozen=True, slots=True)
class Links:
    """Where stages run and what connects the ranks: per rank its budget, the bytes no saver
    moves (model data, communication buffers) and its host link; per host link its bandwidth
    (bytes/s each way) and the bytes the host may hold for it (None: no limit); per pair of
    ranks the peer bandwidth (0: no link)."""

    stage_rank: tuple[int, ...]
    budget_bytes: tuple[int, ...]
    base_bytes: tuple[int, ...]
    host_link: tuple[int, ...]
    host_bandwidth: tuple[float, ...]
    host_budget_bytes: tuple[int | None, ...]
    peer_bandwidth: tuple[tuple[float, ...], ...]
    # per rank, the most bytes/s it sends to (or takes from) its peers at once (None: the sum of
    # its links; an NVSwitch gives one pair all of a rank's links: a stripe is then no faster)
    peer_egress: tuple[float, ...] | None = None
    # Host swaps fetch the next group back while a backward reads one ([Note: host swap
    # prefetch] in runtime.py): a rank then also holds its largest host-swapped item.
    host_prefetch: bool = False
    max_stripe: int | None = None  # the most lenders a tensor is split over (None: every linked)
    # derived once from the fields above: per rank, the lenders of each peer option, and each
    # stripe's shares of a size ([Note: stripes]; the planners ask for them millions of times)
    _peer_options: tuple[tuple[tuple[int, ...], ...], ...] = field(init=False, repr=False,
                                                                   compare=False)  # fmt: skip
    _shares: dict[tuple[int, tuple[int, ...], int], tuple[int, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        n = len(self.budget_bytes)
        require(len(self.base_bytes) == n and len(self.host_link) == n, "links",
                f"one budget, base and host link per rank: {n} budgets")  # fmt: skip
        require(all(0 <= r < n for r in self.stage_rank), "links",
                f"stages mapped to ranks {self.stage_rank}, but there are {n} ranks")  # fmt: skip
        require(len(self.peer_bandwidth) == n and all(len(row) == n for row in self.peer_bandwidth),
                "links", f"the peer bandwidth matrix must be {n} x {n}")  # fmt: skip
        links = len(self.host_bandwidth)
        require(all(0 <= h < links for h in self.host_link) and len(self.host_budget_bytes) == links,
                "links", f"host links {self.host_link} outside the {links} given")  # fmt: skip
        require(self.peer_egress is None or (len(self.peer_egress) == n
                                              and all(e > 0 for e in self.peer_egress)),
                "links", f"one positive peer egress per rank: {self.peer_egress}")  # fmt: skip
        require(self.max_stripe is None or self.max_stripe >= 1, "links",
                f"a stripe has at least one lender, not {self.max_stripe}")  # fmt: skip
        object.__setattr__(self, "_peer_options", tuple(self._stripes_of(r) for r in range(n)))

    def _stripes_of(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """``rank``'s peer options: each linked lender alone, then the k fastest together, ties
        to the later stage's rank ([Note: stripes])."""
        last_stage = {r: s for s, r in enumerate(self.stage_rank)}
        row = self.peer_bandwidth[rank]
        linked = sorted((r for r in range(self.num_ranks) if r != rank and row[r] > 0),
                        key=lambda r: (-row[r], -last_stage.get(r, -1), -r))  # fmt: skip
        widest = len(linked) if self.max_stripe is None else min(len(linked), self.max_stripe)
        return (*((r,) for r in sorted(linked)),
                *(tuple(sorted(linked[:k])) for k in range(2, widest + 1)))  # fmt: skip

    def peer_options(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """The lenders of each peer swap ``rank`` may make."""
        return self._peer_options[rank]

    def shares(self, rank: int, lenders: tuple[int, ...], num_bytes: int) -> tuple[int, ...]:
        """What each of ``lenders`` holds of ``num_bytes`` ``rank`` lends them."""
        key = (rank, lenders, num_bytes)
        if key not in self._shares:
            self._shares[key] = self.stripe(rank, lenders).split(num_bytes)
        return self._shares[key]

    @property
    def num_ranks(self) -> int:
        return len(self.budget_bytes)

    def sharers(self, link: int) -> int:
        return sum(1 for h in self.host_link if h == link)

    def stripe(self, rank: int, lenders: tuple[int, ...]) -> Stripe:
        """How ``rank``'s peer swaps to ``lenders`` split ([Note: stripes])."""
        return Stripe(lenders=lenders, weights=tuple(self.peer_bandwidth[rank][r] for r in lenders))

    def stripe_bandwidth(self, rank: int, lenders: tuple[int, ...]) -> float:
        """Bytes/s a peer swap from ``rank`` to ``lenders`` moves: its links', at most the
        rank's egress."""
        total = sum(self.peer_bandwidth[rank][r] for r in lenders)
        return total if self.peer_egress is None else min(total, self.peer_egress[rank])


@dataclass(frozen=True, slots=True)
class Stripe:
    """The lenders a peer-swapped tensor is split over, with each one's share of its bytes in
    proportion to ``weights`` (its link's bandwidth: every part arrives at once)."""

    lenders: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        require(len(self.lenders) == len(self.weights) > 0 and all(w > 0 for w in self.weights),
                "links", f"a stripe needs one link per lender, each above 0 bytes/s: {self}")  # fmt: skip

    def split(self, num_bytes: int) -> tuple[int, ...]:
        """``num_bytes`` in one share per lender, in proportion (largest remainders first),
        summing to it exactly: the planner's held bytes and the runtime's message sizes."""
        total = sum(self.weights)
        exact = [num_bytes * w / total for w in self.weights]
        shares = [min(int(x), num_bytes) for x in exact]
        rest = num_bytes - sum(shares)
        assert 0 <= rest <= len(shares), (num_bytes, self)
        for i in sorted(range(len(shares)), key=lambda i: (shares[i] - exact[i], i))[:rest]:
            shares[i] += 1
        return tuple(shares)


Choice = tuple[Saver, tuple[int, ...] | None]  # (saver, its lenders for PEER: [Note: stripes])


@dataclass(kw_only=True, frozen=True, slots=True)
class SaverPlan:
    """Per saved tensor its saver; per rank what it holds at its peak (lent bytes included) and
    the seconds its savers add to a step; per host link what the host holds."""

    saved: tuple[Saved, ...]
    choices: tuple[Choice, ...]
    peak_bytes: tuple[int, ...]
    lent_bytes: tuple[int, ...]  # held for other ranks
    host_bytes: tuple[int, ...]
    added_s: tuple[float, ...]
    item_added_s: tuple[float, ...]  # per saved tensor, what its saver adds to its rank's step
    solver: str
    links: Links
    fits: bool = field(default=True)

    @property
    def added_step_s(self) -> float:
        """What the savers add to a step: the slowest rank's added seconds."""
        return max(self.added_s, default=0.0)

    def stripe(self, index: int) -> Stripe | None:
        """How saved tensor ``index`` splits over its lenders (None: it is not lent)."""
        saver, lenders = self.choices[index]
        if saver is not Saver.PEER:
            return None
        assert lenders is not None
        return self.links.stripe(self.links.stage_rank[self.saved[index].stage], lenders)


# -- the model of [Note: saver costs] ----------------------------------------------------------


def _options(item: Saved, links: Links) -> list[Choice]:
    rank = links.stage_rank[item.stage]
    out: list[Choice] = [(Saver.KEEP, None)]
    if item.fixed:
        return out
    if item.recompute_s is not None:
        out.append((Saver.RECOMPUTE, None))
    out.append((Saver.HOST, None))
    if item.host_only:
        return out
    out += [(Saver.PEER, lenders) for lenders in links.peer_options(rank)]
    return out


def _lent_shares(item: Saved, lenders: tuple[int, ...] | None,
                 links: Links) -> list[tuple[int, int]]:  # fmt: skip
    """What each lender of ``item``'s stripe holds of it: its share of each copy."""
    assert lenders is not None
    shares = links.shares(links.stage_rank[item.stage], lenders, item.num_bytes)
    return [(to, item.copies * b) for to, b in zip(lenders, shares, strict=True)]


def _host_ranks(saved: Sequence[Saved], choices: Sequence[Choice], links: Links) -> frozenset[int]:
    """The ranks that host-swap anything under ``choices``."""
    return frozenset(links.stage_rank[item.stage]
                     for item, (saver, _) in zip(saved, choices, strict=True)
                     if saver is Saver.HOST)  # fmt: skip


def _host_users(links: Links, host_ranks: frozenset[int], rank: int) -> int:
    """How many ranks share ``rank``'s host link when ``rank`` host-swaps: those of
    ``host_ranks`` behind the same link, ``rank`` included."""
    link = links.host_link[rank]
    return len({r for r in host_ranks if links.host_link[r] == link} | {rank})


def _added_s(item: Saved, choice: Choice, links: Links, host_users: int) -> float:
    """Seconds ``choice`` adds to ``item``'s rank per step; a host swap shares its link's
    bandwidth with ``host_users`` ranks, its own included."""
    saver, lender = choice
    rank = links.stage_rank[item.stage]
    if saver is Saver.KEEP:
        return 0.0
    if saver is Saver.RECOMPUTE:
        assert item.recompute_s is not None
        return item.uses_per_step * item.recompute_s
    if saver is Saver.HOST:
        bandwidth = links.host_bandwidth[links.host_link[rank]] / host_users
    else:
        assert lender is not None
        bandwidth = links.stripe_bandwidth(rank, lender)
    if item.num_bytes == 0:
        return 0.0
    per_use = 2 * item.num_bytes / bandwidth
    return item.uses_per_step * max(0.0, per_use - item.idle_s)


def evaluate(saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
             solver: str) -> SaverPlan:  # fmt: skip
    """What ``choices`` (one per saved tensor) make each rank hold and add ([Note: saver costs])."""
    n = links.num_ranks
    kept, lent = list(links.base_bytes), [0] * n
    host = [0] * len(links.host_bandwidth)
    added = [0.0] * n
    hosting = _host_ranks(saved, choices, links)
    users = [_host_users(links, hosting, rank) for rank in range(n)]
    per_item = tuple(_added_s(item, choice, links, users[links.stage_rank[item.stage]])
                     for item, choice in zip(saved, choices, strict=True))  # fmt: skip
    for item, choice, item_added in zip(saved, choices, per_item, strict=True):
        rank = links.stage_rank[item.stage]
        saver, lender = choice
        added[rank] += item_added
        kept[rank] += item.held_under(saver)
        if saver is Saver.HOST:
            host[links.host_link[rank]] += item.held_bytes
        elif saver is Saver.PEER:
            for to, num_bytes in _lent_shares(item, lender, links):
                lent[to] += num_bytes
    transient = _transients(saved, choices, links)
    peak = tuple(k + lent_ + t for k, lent_, t in zip(kept, lent, transient, strict=True))
    fits = all(p <= b for p, b in zip(peak, links.budget_bytes, strict=True)) and all(
        cap is None or held <= cap for held, cap in zip(host, links.host_budget_bytes, strict=True)
    )
    return SaverPlan(saved=tuple(saved), choices=tuple(choices), peak_bytes=peak,
                     lent_bytes=tuple(lent), host_bytes=tuple(host), added_s=tuple(added),
                     item_added_s=per_item, solver=solver, links=links, fits=fits)  # fmt: skip


# -- the planners ([Note: the saver planners]) ---------------------------------------------------


def keep_all(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """Every tensor kept: what each rank holds without savers."""
    return evaluate(saved, [(Saver.KEEP, None)] * len(saved), links, "none")


def plan_greedy(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """MPress's greedy, with every saver open to every tensor and with recomputable tensors
    only recomputed (which leaves the host and the lenders to the tensors that cannot be), each
    reserving the whole of a rank's largest copy back, then half, a quarter and none of it (a
    rank whose moves are all small holds less, and one whose largest copy is a stashed weight
    version it need not move holds none of it back; the plan is evaluated as it is, so a smaller
    reserve only ever adds plans); the fastest plan that fits, else the first (``fits`` False)."""
    plans = [_greedy(saved, links, scarce_for_all=all_, reserve_share=share)
             for all_ in (True, False) for share in (1.0, 0.5, 0.25, 0.0)]  # fmt: skip
    fitting = [_refine(saved, links, p) for p in plans if p.fits]
    return min(fitting, key=_step_key) if fitting else plans[0]


def _step_key(plan: SaverPlan) -> tuple[float, float]:
    return (plan.added_step_s, sum(plan.added_s))


def _refine(saved: Sequence[Saved], links: Links, plan: SaverPlan) -> SaverPlan:
    """Lower the slowest rank's added seconds one tensor at a time: give one of its moved
    tensors a cheaper saver (making room on a lender by moving the lender's own tensors to
    recompute or the host, and on a full host by moving other tensors back from it), while the
    plan fits and its step gets shorter (at most 64 times)."""
    for _ in range(min(4 * len(saved), 64)):
        better = _cheaper(saved, links, plan)
        if better is None:
            return plan
        plan = better
    return plan


def _cheaper(saved: Sequence[Saved], links: Links, plan: SaverPlan) -> SaverPlan | None:
    """A plan that fits with a shorter step, by changing one moved tensor of the slowest rank
    (to a cheaper saver, keep included), or that and one more of its tensors; None if none."""
    slowest = max(range(links.num_ranks), key=lambda r: plan.added_s[r])
    mine = [i for i, item in enumerate(saved) if links.stage_rank[item.stage] == slowest]
    users = _host_users(links, _host_ranks(saved, plan.choices, links), slowest)
    for index in mine:
        now = plan.choices[index]
        if now[0] is Saver.KEEP:
            continue
        cost = plan.item_added_s[index]
        for choice in _options(saved[index], links):
            if _added_s(saved[index], choice, links, users) >= cost:  # the plan prices it whole
                continue
            changes = [[(index, choice)]]
            if len(mine) <= PAIR_SEARCH_MAX_ITEMS:  # pairs cost len(mine)^2 plans
                changes += [[(index, choice), (other, second)] for other in mine if other != index
                            for second in _options(saved[other], links)]  # fmt: skip
            for change in changes:
                trial = _try(saved, links, plan, change)
                if trial is not None:
                    return trial
    return None


def _try(saved: Sequence[Saved], links: Links, plan: SaverPlan,
         change: list[tuple[int, Choice]]) -> SaverPlan | None:  # fmt: skip
    choices = list(plan.choices)
    for index, choice in change:
        choices[index] = choice
    for index, (saver, lenders) in change:
        if saver is Saver.PEER:
            assert lenders is not None
            for lender in lenders:
                choices = _make_room(saved, links, choices, lender)
        if saver is Saver.HOST:
            link = links.host_link[links.stage_rank[saved[index].stage]]
            choices = _make_host_room(saved, links, choices, link, {i for i, _ in change})
    trial = evaluate(saved, choices, links, plan.solver)
    return trial if trial.fits and _step_key(trial) < _step_key(plan) else None


def _make_host_room(saved: Sequence[Saved], links: Links, choices: list[Choice], link: int,
                    changed: set[int]) -> list[Choice]:  # fmt: skip
    """``choices`` with other tensors on ``link``'s host moved back (kept, lent or recomputed,
    the fewest added seconds per byte first, each where its rank and lender still fit) until
    the host holds at most its budget, if it can."""
    cap = links.host_budget_bytes[link]
    choices = list(choices)
    while True:
        plan = evaluate(saved, choices, links, "")
        if cap is None or plan.host_bytes[link] <= cap:
            return choices
        moves = []
        for index, item in enumerate(saved):
            rank = links.stage_rank[item.stage]
            if index in changed or choices[index][0] is not Saver.HOST or not item.held_bytes:
                continue
            if links.host_link[rank] != link:
                continue
            for choice in _options(item, links):
                if choice[0] is Saver.HOST:
                    continue
                if _still_fits(saved, links, choices, plan, index, choice):
                    # off the host, its price does not depend on who shares the link
                    added = _added_s(item, choice, links, 1) - plan.item_added_s[index]
                    moves.append((added / item.held_bytes, -item.held_bytes, index, choice))
        if not moves:
            return choices
        _, _, index, choice = min(moves)
        choices[index] = choice


def _still_fits(saved: Sequence[Saved], links: Links, choices: list[Choice], plan: SaverPlan,
                index: int, choice: Choice) -> bool:  # fmt: skip
    """Whether moving host-swapped tensor ``index`` to ``choice`` leaves every rank whose peak
    grows within its budget: its own rank (what it keeps; its transient copy can only shrink)
    and, lent, the lender. Priced without the shrinking first; only a rank that then looks over
    budget is priced exactly (evaluating every candidate move whole made the greedy quadratic)."""
    item = saved[index]
    rank = links.stage_rank[item.stage]
    grown = {rank: item.held_under(choice[0]) - item.held_under(Saver.HOST)}
    if choice[0] is Saver.PEER:
        grown.update(_lent_shares(item, choice[1], links))  # a lender is never the rank itself
    if plan.peak_bytes[rank] + grown[rank] > links.budget_bytes[rank]:
        after = [*choices[:index], choice, *choices[index + 1 :]]
        shrunk = _transients(saved, after, links)[rank] - _transients(saved, choices, links)[rank]
        grown[rank] += shrunk
    return all(plan.peak_bytes[r] + more <= links.budget_bytes[r]
               for r, more in grown.items() if more > 0)  # fmt: skip


def _make_room(saved: Sequence[Saved], links: Links, choices: list[Choice],
               lender: int) -> list[Choice]:  # fmt: skip
    """``choices`` with the lender's own kept tensors moved (cheapest seconds per byte first,
    to recompute or the host) until it is within its budget, if it can be. Its peak is priced
    once and then moved by what each move changes (its kept bytes and its transient copy: what
    others lend it stays), not evaluated whole again."""
    choices = list(choices)
    peak = evaluate(saved, choices, links, "").peak_bytes[lender]
    mine = [i for i, item in enumerate(saved) if links.stage_rank[item.stage] == lender]
    transient = _transient(saved, choices, links, mine)
    hosting = _host_ranks(saved, choices, links)
    moves: list[tuple[float, int, Choice]] = []
    priced_for = 0  # the host users the moves are priced for (0: not yet priced)
    while peak > links.budget_bytes[lender]:
        users = _host_users(links, hosting, lender)
        if users != priced_for:  # a move's price changes only with its link's users
            moves = [
                (_added_s(saved[index], choice, links, users)
                 / (saved[index].held_bytes - saved[index].held_under(choice[0])), index, choice)
                for index in mine if choices[index][0] is Saver.KEEP
                for choice in _options(saved[index], links)[1:]
                if choice[0] is not Saver.PEER
                and saved[index].held_under(choice[0]) < saved[index].held_bytes
            ]  # fmt: skip
            heapq.heapify(moves)
            priced_for = users
        while moves and choices[moves[0][1]][0] is not Saver.KEEP:  # moved already
            heapq.heappop(moves)
        if not moves:
            return choices
        _, index, choice = heapq.heappop(moves)
        choices[index] = choice
        if choice[0] is Saver.HOST:
            hosting |= {lender}
        before, transient = transient, _transient(saved, choices, links, mine)
        peak += transient - before - (saved[index].held_bytes - saved[index].held_under(choice[0]))
    return choices


def _greedy(saved: Sequence[Saved], links: Links, *, scarce_for_all: bool,
            reserve_share: float) -> SaverPlan:  # fmt: skip
    choices: list[Choice] = [(Saver.KEEP, None)] * len(saved)
    # A rank that moves anything holds one copy back for its block's backward: reserve its
    # largest copy up front, so that every move frees all it holds ([Note: saver costs]).
    start = evaluate(saved, choices, links, "greedy")
    reserve = [0] * links.num_ranks
    for rank in range(links.num_ranks):
        if start.peak_bytes[rank] > links.budget_bytes[rank]:
            reserve[rank] = math.ceil(reserve_share * _largest_copy(saved, links, rank))
    while True:
        plan = evaluate(saved, choices, links, "greedy")
        over = [_kept_peak(plan, saved, choices, links, r) + reserve[r] - links.budget_bytes[r]
                if reserve[r] else plan.peak_bytes[r] - links.budget_bytes[r]
                for r in range(links.num_ranks)]  # fmt: skip
        rank = max(range(links.num_ranks), key=lambda r: over[r])
        if over[rank] <= 0:
            return plan
        best = _best_move(saved, choices, links, plan, rank, scarce_for_all=scarce_for_all)
        if best is None:
            return plan  # fits is False: over budget with nothing left to move
        index, choice = best
        choices[index] = choice


def _largest_copy(saved: Sequence[Saved], links: Links, rank: int) -> int:
    """What a rank that moves anything holds back at once, at most: one copy, two when host
    swaps fetch ahead."""
    largest = max((item.num_bytes for item in saved
                   if links.stage_rank[item.stage] == rank and item.copies and not item.fixed),
                  default=0)  # fmt: skip
    return 2 * largest if links.host_prefetch else largest


def _kept_peak(plan: SaverPlan, saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
               rank: int) -> int:  # fmt: skip
    """``rank``'s peak without its transient copy."""
    return plan.peak_bytes[rank] - _transients(saved, choices, links)[rank]


def _best_move(saved: Sequence[Saved], choices: list[Choice], links: Links, plan: SaverPlan,
               rank: int, *, scarce_for_all: bool) -> tuple[int, Choice] | None:  # fmt: skip
    spare = [b - p for b, p in zip(links.budget_bytes, plan.peak_bytes, strict=True)]
    host_room = [math.inf if cap is None else cap - held
                 for cap, held in zip(links.host_budget_bytes, plan.host_bytes, strict=True)]  # fmt: skip
    # A host swap is priced with this rank on its link, plus, if the rank joins the link, what
    # the ranks already swapping over it then add: a second user halves everyone's bandwidth.
    hosting = _host_ranks(saved, choices, links)
    users = _host_users(links, hosting, rank)
    link = links.host_link[rank]
    joining_s = 0.0 if rank in hosting else sum(
        _added_s(item, choice, links, users) - plan.item_added_s[index]
        for index, (item, choice) in enumerate(zip(saved, choices, strict=True))
        if choice[0] is Saver.HOST and links.host_link[links.stage_rank[item.stage]] == link
    )  # fmt: skip
    best: tuple[tuple[float, float], int, Choice] | None = None
    for index, item in enumerate(saved):
        now = choices[index]
        if links.stage_rank[item.stage] != rank or now[0] not in (Saver.KEEP, Saver.RECOMPUTE):
            continue
        if item.held_under(now[0]) == 0:  # nothing left to free (a recompute keeping nothing)
            continue
        for choice in _options(item, links)[1:]:
            saver, lender = choice
            freed = item.held_under(now[0]) - item.held_under(saver)
            if freed <= 0:
                continue
            if (
                saver in (Saver.HOST, Saver.PEER)
                and not scarce_for_all
                and item.recompute_s is not None
                and now[0] is Saver.KEEP
            ):
                continue
            if saver is Saver.HOST and host_room[link] < item.held_bytes:
                continue
            if saver is Saver.PEER and any(
                spare[to] < num_bytes for to, num_bytes in _lent_shares(item, lender, links)
            ):
                continue
            added = _added_s(item, choice, links, users) - plan.item_added_s[index]
            added += joining_s if saver is Saver.HOST else 0.0
            key = (added / freed, -freed)  # s per byte freed; free ones by size
            if best is None or key < best[0]:
                best = (key, index, choice)
    return None if best is None else (best[1], best[2])


def _transient(saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
               mine: Sequence[int]) -> int:  # fmt: skip
    """What one rank, whose saved tensors are ``mine``, holds back at once: its largest moved
    copy (and, fetching ahead, its largest host-swapped one beside it)."""
    moved = ahead = 0
    for index in mine:
        item, saver = saved[index], choices[index][0]
        if saver is Saver.KEEP or not item.copies:
            continue
        moved = max(moved, item.num_bytes)
        if saver is Saver.HOST and links.host_prefetch:
            ahead = max(ahead, item.num_bytes)
    return moved + ahead


def _transients(saved: Sequence[Saved], choices: Sequence[Choice], links: Links) -> list[int]:
    """What each rank holds back at once: its largest moved copy (and, fetching ahead, its
    largest host-swapped one beside it)."""
    mine: list[list[int]] = [[] for _ in range(links.num_ranks)]
    for index, item in enumerate(saved):
        mine[links.stage_rank[item.stage]].append(index)
    return [_transient(saved, choices, links, indices) for indices in mine]


def plan_exact(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """The least added step time over every assignment, as a MILP (``fits`` False if none).

    A host swap's price depends on how many ranks share its link ([Note: saver costs]), so each
    host option is offered once per possible count ``k`` of users of its link, priced at ``k``:
    a binary per rank says it host-swaps anything, and choosing an option at ``k`` caps its
    link's users at ``k``. The least step takes, per item, the count that is the link's own.
    Bytes count in units of the largest budget and seconds in units of the dearest option: rows
    in bytes beside rows in seconds once made HiGHS return, as optimal, twice the best step."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    def user_counts(item: Saved, choice: Choice) -> range:
        sharers = links.sharers(links.host_link[links.stage_rank[item.stage]])
        return range(1, sharers + 1) if choice[0] is Saver.HOST else range(1, 2)

    options = [[(choice, users) for choice in _options(item, links)
                for users in user_counts(item, choice)] for item in saved]  # fmt: skip
    index = [(i, o) for i, opts in enumerate(options) for o in range(len(opts))]
    n, num_x = links.num_ranks, len(index)
    # Variables: x (one per item and option), then t (transient per rank), h (host-swapped
    # copy fetched ahead, per rank), u (the rank host-swaps anything), then z (step).
    num_vars = num_x + 3 * n + 1
    t0, h0, u0, z = num_x, num_x + n, num_x + 2 * n, num_x + 3 * n
    rows: list[np.ndarray] = []
    bounds: list[tuple[float, float]] = []
    per_byte = 1.0 / max(max(links.budget_bytes), 1)
    priced = [_added_s(saved[i], options[i][o][0], links, options[i][o][1]) for i, o in index]
    per_s = 1.0 / max(max(priced, default=0.0), 1e-12)

    def row() -> np.ndarray:
        return np.zeros(num_vars)

    def add(r: np.ndarray, low: float, high: float) -> None:
        rows.append(r)
        bounds.append((low, high))

    for i in range(len(saved)):  # one option per item
        r = row()
        for k, (j, _) in enumerate(index):
            r[k] = 1.0 if j == i else 0.0
        add(r, 1.0, 1.0)
    for rank in range(n):  # peak within the budget; added seconds below z
        mem, time = row(), row()
        for k, (i, o) in enumerate(index):
            item, ((saver, lender), users) = saved[i], options[i][o]
            owner = links.stage_rank[item.stage]
            if owner == rank:
                time[k] = per_s * priced[k]
                mem[k] = item.held_under(saver)
            if saver is Saver.PEER:
                mem[k] += dict(_lent_shares(item, lender, links)).get(rank, 0)
        mem[:num_x] *= per_byte
        mem[t0 + rank] = 1.0
        mem[h0 + rank] = 1.0 if links.host_prefetch else 0.0
        add(mem, -np.inf, per_byte * (links.budget_bytes[rank] - links.base_bytes[rank]))
        time[z] = -1.0
        add(time, -np.inf, 0.0)
    for k, (i, o) in enumerate(index):
        item, ((saver, _), users) = saved[i], options[i][o]
        owner = links.stage_rank[item.stage]
        if saver is not Saver.KEEP and item.copies:  # a moved copy is back for its backward
            r = row()
            r[k], r[t0 + owner] = per_byte * item.num_bytes, -1.0
            add(r, -np.inf, 0.0)
        if saver is Saver.HOST and item.copies and links.host_prefetch:
            r = row()
            r[k], r[h0 + owner] = per_byte * item.num_bytes, -1.0
            add(r, -np.inf, 0.0)
        if saver is Saver.HOST:  # its rank uses the link, whose users are then at most `users`
            r = row()
            r[k], r[u0 + owner] = 1.0, -1.0
            add(r, -np.inf, 0.0)
            link = links.host_link[owner]
            sharers = links.sharers(link)
            r = row()
            for other in range(n):
                if links.host_link[other] == link:
                    r[u0 + other] = 1.0
            r[k] = float(sharers)
            add(r, -np.inf, float(users + sharers))
    for link, cap in enumerate(links.host_budget_bytes):
        if cap is None:
            continue
        r = row()
        for k, (i, o) in enumerate(index):
            item = saved[i]
            if (
                options[i][o][0][0] is Saver.HOST
                and links.host_link[links.stage_rank[item.stage]] == link
            ):
                r[k] = per_byte * item.held_bytes
        add(r, -np.inf, per_byte * cap)
    cost = row()
    cost[z] = 1.0
    binary = np.concatenate([np.ones(num_x), np.zeros(2 * n), np.ones(n), np.zeros(1)])
    upper = np.concatenate([np.ones(num_x), np.full(2 * n, np.inf), np.ones(n), [np.inf]])
    low, high = zip(*bounds, strict=True)
    result = milp(cost, constraints=LinearConstraint(np.array(rows), low, high),
                  integrality=binary, bounds=Bounds(np.zeros(num_vars), upper))  # fmt: skip
    if result.x is None:  # infeasible: no assignment fits
        kept = evaluate(saved, [(Saver.KEEP, None)] * len(saved), links, "exact")
        return dataclasses.replace(kept, fits=False)
    choices: list[Choice] = [(Saver.KEEP, None)] * len(saved)
    for k, (i, o) in enumerate(index):
        if result.x[k] > 0.5:
            choices[i] = options[i][o][0]
    return evaluate(saved, choices, links, "exact")


def plan_savers(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """The greedy's plan, else the exact program's on small instances ([Note: the saver
    planners]); none fits: a :class:`~tidal.config.ConfigError` naming the least budget."""
    plan = plan_greedy(saved, links)
    if not plan.fits and len(saved) <= EXACT_MAX_ITEMS:
        plan = plan_exact(saved, links)
    if plan.fits:
        return plan
    raise ConfigError("memory.device_budget", _no_plan(saved, links))


def least_peak_bytes(saved: Sequence[Saved], links: Links) -> tuple[int, ...]:
    """Per rank, the least it can hold with every tensor moved that can be (its base, what no
    saver moves, and the largest single copy of its own tensors): a budget below this cannot
    fit."""
    least = list(links.base_bytes)
    for rank in range(links.num_ranks):
        mine = [item for item in saved if links.stage_rank[item.stage] == rank and item.copies]
        least[rank] += sum(item.held_bytes for item in mine if item.fixed)
        least[rank] += max((item.num_bytes for item in mine if not item.fixed), default=0)
    return tuple(least)


def _no_plan(saved: Sequence[Saved], links: Links) -> str:
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
    return (
        "no saver plan fits: the host and the peers have too little room for what must move "
        f"(host budgets {['unlimited' if c is None else format_bytes(c) for c in links.host_budget_bytes]}"
        "; peers' spare room under their own budgets); "
        "raise memory.device_budget or the host budget"
    )
