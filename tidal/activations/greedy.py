"""MPress's greedy saver planner ([Note: the saver planners] in ``plan.py``) and a refinement of
its plan one tensor at a time.

Every price comes from the cost model (``costs.py``: [Note: saver costs]); this module only
searches. The greedy stops once every rank fits; :func:`_refine` then lowers the slowest rank's
added seconds one tensor (or a pair) at a time while the plan still fits. Its moves can make
room: on a lender, by moving the lender's own tensors to recompute or the host; on a full host,
by moving other tensors back from it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.activations.costs import (
    Choice,
    Links,
    Saved,
    Saver,
    SaverPlan,
    evaluate,
    host_ranks,
    host_users,
    least_peak_bytes,
    lent_shares,
    price_s,
    saver_options,
    transient_bytes,
    transient_bytes_per_rank,
)

__all__ = ["plan_greedy"]

PAIR_SEARCH_MAX_ITEMS = 24  # the refinement tries pairs of a rank's tensors up to this many
EXCHANGE_MAX_TRIALS = 16  # the most moves a stuck greedy tries making room for


def plan_greedy(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """MPress's greedy, with every saver open to every tensor and with recomputable tensors
    only recomputed (which leaves the host and the lenders to the tensors that cannot be), each
    reserving the whole of a rank's largest copy back, then half, a quarter and none of it (a
    rank whose moves are all small holds less, and one whose largest copy is a stashed weight
    version it need not move holds none of it back; the plan is evaluated as it is, so a smaller
    reserve only ever adds plans); the fastest plan that fits, else the first (``fits`` False)."""
    table = _offer_table(saved, links)
    plans = [_greedy(saved, links, table, scarce_for_all=all_, reserve_share=share)
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
    users = host_users(links, host_ranks(saved, plan.choices, links), slowest)
    for index in mine:
        now = plan.choices[index]
        if now[0] is Saver.KEEP:
            continue
        cost = plan.item_added_s[index]
        for choice in saver_options(saved[index], links):
            if price_s(saved[index], choice, links, users) >= cost:  # the plan prices it whole
                continue
            changes = [[(index, choice)]]
            if len(mine) <= PAIR_SEARCH_MAX_ITEMS:  # pairs cost len(mine)^2 plans
                changes += [[(index, choice), (other, second)] for other in mine if other != index
                            for second in saver_options(saved[other], links)]  # fmt: skip
            for change in changes:
                trial = _try(saved, links, plan, change)
                if trial is not None:
                    return trial
    return None


def _try(saved: Sequence[Saved], links: Links, plan: SaverPlan,
         change: list[tuple[int, Choice]]) -> SaverPlan | None:  # fmt: skip
    trial = evaluate(saved, _with_room(saved, links, plan.choices, change), links, plan.solver)
    return trial if trial.fits and _step_key(trial) < _step_key(plan) else None


def _with_room(saved: Sequence[Saved], links: Links, choices: Sequence[Choice],
               change: list[tuple[int, Choice]]) -> list[Choice]:  # fmt: skip
    """``choices`` with ``change`` made and room made for it where it went: on each lender of a
    peer swap (the lender's own tensors moved), on the host of a host swap (other tensors moved
    back from it)."""
    trial = list(choices)
    for index, choice in change:
        trial[index] = choice
    for index, (saver, lenders) in change:
        if saver is Saver.PEER:
            assert lenders is not None
            for lender in lenders:
                trial = _make_room(saved, links, trial, lender)
        if saver is Saver.HOST:
            link = links.host_link[links.stage_rank[saved[index].stage]]
            trial = _make_host_room(saved, links, trial, link, {i for i, _ in change})
    return trial


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
            for choice in saver_options(item, links):
                if choice[0] is Saver.HOST:
                    continue
                if _still_fits(saved, links, choices, plan, index, choice):
                    # off the host, its price does not depend on who shares the link
                    added = price_s(item, choice, links, 1) - plan.item_added_s[index]
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
        grown.update(lent_shares(item, choice[1], links))  # a lender is never the rank itself
    if plan.peak_bytes[rank] + grown[rank] > links.budget_bytes[rank]:
        after = [*choices[:index], choice, *choices[index + 1 :]]
        shrunk = (
            transient_bytes_per_rank(saved, after, links)[rank]
            - transient_bytes_per_rank(saved, choices, links)[rank]
        )
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
    transient = transient_bytes(saved, choices, links, mine)
    hosting = host_ranks(saved, choices, links)
    moves: list[tuple[float, int, Choice]] = []
    priced_for = 0  # the host users the moves are priced for (0: not yet priced)
    while peak > links.budget_bytes[lender]:
        users = host_users(links, hosting, lender)
        if users != priced_for:  # a move's price changes only with its link's users
            moves = [
                (price_s(saved[index], choice, links, users)
                 / (saved[index].held_bytes - saved[index].held_under(choice[0])), index, choice)
                for index in mine if choices[index][0] is Saver.KEEP
                for choice in saver_options(saved[index], links)[1:]
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
        before, transient = transient, transient_bytes(saved, choices, links, mine)
        peak += transient - before - (saved[index].held_bytes - saved[index].held_under(choice[0]))
    return choices


def _greedy(saved: Sequence[Saved], links: Links, table: _OfferTable, *, scarce_for_all: bool,
            reserve_share: float) -> SaverPlan:  # fmt: skip
    choices: list[Choice] = [(Saver.KEEP, None)] * len(saved)
    # A rank that moves anything holds one copy back for its block's backward: reserve its
    # largest copy up front, so that every move frees all it holds ([Note: saver costs]).
    start = evaluate(saved, choices, links, "greedy")
    reserve = [0] * links.num_ranks
    for rank in range(links.num_ranks):
        if start.peak_bytes[rank] > links.budget_bytes[rank]:
            reserve[rank] = math.ceil(reserve_share * _largest_copy(saved, links, rank))
    least = least_peak_bytes(saved, links)
    while True:
        plan = evaluate(saved, choices, links, "greedy")
        over = _overloads(plan, saved, choices, links, reserve)
        rank = max(range(links.num_ranks), key=lambda r: over[r])
        if over[rank] <= 0:
            return plan
        best = _best_move(saved, choices, links, plan, rank, table, scarce_for_all=scarce_for_all)
        if best is not None:
            index, choice = best
            choices[index] = choice
            continue
        exchanged = None if least[rank] > links.budget_bytes[rank] else _exchange(
            saved, links, choices, plan, rank, reserve
        )  # fmt: skip
        if exchanged is None:
            return plan  # fits is False: over budget with nothing left to move
        choices = exchanged


def _overloads(plan: SaverPlan, saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
               reserve: Sequence[int]) -> list[int]:  # fmt: skip
    """Per rank, the bytes it is over its budget (a reserving rank: with its reserve in place
    of its transient copy)."""
    return [_kept_peak(plan, saved, choices, links, r) + reserve[r] - links.budget_bytes[r]
            if reserve[r] else plan.peak_bytes[r] - links.budget_bytes[r]
            for r in range(links.num_ranks)]  # fmt: skip


def _exchange(saved: Sequence[Saved], links: Links, choices: list[Choice], plan: SaverPlan,
              rank: int, reserve: Sequence[int]) -> list[Choice] | None:  # fmt: skip
    """Where no move fits ``rank``: one to the host or a peer that fits once room is made for
    it (other tensors moved back from a full host, a lender's own tensors moved), kept if it
    lowers ``rank``'s overload and no other rank's overload or host grows past its budget; of
    those the least overloaded and then the fastest plan (None: none). A small tensor that is
    free on the host can take the room a larger one needs that has nowhere else to go. Only the
    moves that would free the most are tried (each trial makes room: tens of evaluations)."""
    candidates = sorted(
        (-(item.held_under(choices[index][0]) - item.held_under(choice[0])), index, choice)
        for index, item in enumerate(saved)
        if links.stage_rank[item.stage] == rank
        and choices[index][0] in (Saver.KEEP, Saver.RECOMPUTE)
        for choice in saver_options(item, links)
        if choice[0] in (Saver.HOST, Saver.PEER)
        and item.held_under(choice[0]) < item.held_under(choices[index][0])
    )  # fmt: skip
    before = _overloads(plan, saved, choices, links, reserve)
    best: tuple[tuple[int, float], list[Choice]] | None = None
    for _, index, choice in candidates[:EXCHANGE_MAX_TRIALS]:
        trial = _with_room(saved, links, choices, [(index, choice)])
        after_plan = evaluate(saved, trial, links, "greedy")
        if any(cap is not None and held > cap for held, cap
               in zip(after_plan.host_bytes, links.host_budget_bytes, strict=True)):  # fmt: skip
            continue
        after = _overloads(after_plan, saved, trial, links, reserve)
        if after[rank] >= before[rank] or any(
            after[r] > max(before[r], 0) for r in range(links.num_ranks) if r != rank
        ):
            continue
        key = (sum(max(o, 0) for o in after), after_plan.added_step_s)
        if best is None or key < best[0]:
            best = (key, trial)
    return None if best is None else best[1]


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
    return plan.peak_bytes[rank] - transient_bytes_per_rank(saved, choices, links)[rank]


@dataclass(frozen=True, slots=True)
class _Offer:
    """A saver a tensor could move to, with what does not change while the greedy runs."""

    choice: Choice
    held_bytes: int  # what its rank holds of the tensor under it
    fixed_s: float  # the seconds it adds (a host swap's depend on its link's users: unused)
    lent: tuple[tuple[int, int], ...]  # a peer swap's: what each lender holds of it


@dataclass(frozen=True, slots=True)
class _OfferTable:
    """Per saved tensor its offers but keep, per rank the tensors its stages save: the greedy
    asks for them at every move of every rank (pricing each again was most of its time)."""

    offers: tuple[tuple[_Offer, ...], ...]
    by_rank: tuple[tuple[int, ...], ...]


def _offer_table(saved: Sequence[Saved], links: Links) -> _OfferTable:
    offers = tuple(
        tuple(_Offer(choice=choice, held_bytes=item.held_under(choice[0]),
                     fixed_s=0.0 if choice[0] is Saver.HOST else price_s(item, choice, links, 1),
                     lent=tuple(lent_shares(item, choice[1], links))
                     if choice[0] is Saver.PEER else ())
              for choice in saver_options(item, links)[1:])
        for item in saved
    )  # fmt: skip
    by_rank = tuple(tuple(i for i, item in enumerate(saved) if links.stage_rank[item.stage] == r)
                    for r in range(links.num_ranks))  # fmt: skip
    return _OfferTable(offers=offers, by_rank=by_rank)


def _best_move(saved: Sequence[Saved], choices: list[Choice], links: Links, plan: SaverPlan,
               rank: int, table: _OfferTable, *,
               scarce_for_all: bool) -> tuple[int, Choice] | None:  # fmt: skip
    spare = [b - p for b, p in zip(links.budget_bytes, plan.peak_bytes, strict=True)]
    host_room = [math.inf if cap is None else cap - held
                 for cap, held in zip(links.host_budget_bytes, plan.host_bytes, strict=True)]  # fmt: skip
    # A host swap is priced with this rank on its link, plus, if the rank joins the link, what
    # the ranks already swapping over it then add: a second user halves everyone's bandwidth.
    hosting = host_ranks(saved, choices, links)
    users = host_users(links, hosting, rank)
    link = links.host_link[rank]
    joining_s = 0.0 if rank in hosting else sum(
        price_s(item, choice, links, users) - plan.item_added_s[index]
        for index, (item, choice) in enumerate(zip(saved, choices, strict=True))
        if choice[0] is Saver.HOST and links.host_link[links.stage_rank[item.stage]] == link
    )  # fmt: skip
    best: tuple[tuple[float, float], int, Choice] | None = None
    for index in table.by_rank[rank]:
        item, now = saved[index], choices[index][0]
        if now is not Saver.KEEP and now is not Saver.RECOMPUTE:
            continue
        held_now = item.held_under(now)
        if held_now == 0:  # nothing left to free (a recompute keeping nothing)
            continue
        # a recomputable tensor leaves the host and the lenders to those that cannot be
        kept_off = not scarce_for_all and item.recompute_s is not None and now is Saver.KEEP
        for offer in table.offers[index]:
            freed = held_now - offer.held_bytes
            saver = offer.choice[0]
            if freed <= 0 or kept_off and saver is not Saver.RECOMPUTE:
                continue
            if saver is Saver.HOST:
                added = price_s(item, offer.choice, links, users) - plan.item_added_s[index]
                added += joining_s
            else:
                added = offer.fixed_s - plan.item_added_s[index]
            key = (added / freed, -freed)  # s per byte freed; free ones by size
            if best is not None and not key < best[0]:
                continue
            # where it goes must have room (asked only of a move that would be the best)
            if saver is Saver.HOST and host_room[link] < item.held_bytes:
                continue
            if saver is Saver.PEER and any(spare[to] < b for to, b in offer.lent):
                continue
            best = (key, index, offer.choice)
    return None if best is None else (best[1], best[2])
