"""Which device runs which stage: the map under which the savers' plan is fastest (MPress's
device mapping).

[Note: stage placement]
A saver plan depends on where the stages run: a rank's budget, its host link (and the host bytes
that link may hold) and its peer links stay with the rank, while the stage brings what it saves
and its model data. Under 1F1B and PipeDream the early stages hold the most, so on ranks that
differ (a device with more memory, lenders with faster links to some ranks than to others) the
identity map can waste them. With one stage per rank, :func:`place_stages` prices maps with the
greedy (:func:`~tidal.activations.greedy.plan_greedy`): the given map; one that deals the stages,
heaviest first (what each holds with nothing moved, over its budget), to the ranks with the
largest budgets first, taking the host links in turn among equals; then, from the better of the
two, it swaps the stages of two ranks while a swap gives a better plan (one that fits where none
did, else a shorter step, else a lower highest fill), at most ``max_rounds`` passes over the
pairs. The cost model divides a host link's bandwidth among the ranks behind it that swap over
it ([Note: saver costs] in costs.py), so a map that puts the ranks that must host-swap behind
links of their own prices faster than one that crowds them behind one.

Training keeps the schedule's map (rank r runs stage r): its ranks have one budget and the links
it measures are the same for every rank and pair, so every map prices alike there; the map is for
planning machines whose ranks differ (``tidal simulate --device-memory``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tidal.activations.costs import Links, Saved, SaverPlan, keep_all
from tidal.activations.greedy import plan_greedy

__all__ = ["place_stages", "with_stage_ranks"]


def with_stage_ranks(links: Links, stage_rank: Sequence[int]) -> Links:
    """``links`` with stage s on rank ``stage_rank[s]``, its base bytes moved with it (one stage
    per rank)."""
    _check_one_per_rank(links)
    assert sorted(stage_rank) == sorted(links.stage_rank), stage_rank
    base = list(links.base_bytes)
    for stage, rank in enumerate(stage_rank):
        base[rank] = links.base_bytes[links.stage_rank[stage]]
    return dataclasses.replace(links, stage_rank=tuple(stage_rank), base_bytes=tuple(base))


def place_stages(saved: Sequence[Saved], links: Links, *,
                 max_rounds: int = 3) -> tuple[Links, SaverPlan]:  # fmt: skip
    """The links with the stage-to-rank map whose greedy plan is best, and that plan
    ([Note: stage placement]); with several stages on a rank, ``links`` as given."""
    if sorted(links.stage_rank) != list(range(links.num_ranks)):
        return links, plan_greedy(saved, links)
    best = min((_priced(saved, candidate) for candidate in
                (links, with_stage_ranks(links, _dealt(saved, links)))), key=_key)  # fmt: skip
    for _ in range(max_rounds):
        better = _better_swap(saved, best)
        if better is None:
            break
        best = better
    return best


def _check_one_per_rank(links: Links) -> None:
    assert sorted(links.stage_rank) == list(range(links.num_ranks)), "one stage per rank"


def _priced(saved: Sequence[Saved], links: Links) -> tuple[Links, SaverPlan]:
    return links, plan_greedy(saved, links)


def _key(placed: tuple[Links, SaverPlan]) -> tuple[bool, float, float]:
    links, plan = placed
    fullest = max(p / b for p, b in zip(plan.peak_bytes, links.budget_bytes, strict=True))
    return (not plan.fits, plan.added_step_s, fullest)


def _dealt(saved: Sequence[Saved], links: Links) -> list[int]:
    """Stages heaviest first (over their rank's budget with nothing moved) dealt to the ranks
    with the largest budgets first, the host links in turn among equal budgets."""
    kept = keep_all(saved, links)
    over = {s: kept.peak_bytes[r] - links.budget_bytes[r] for s, r in enumerate(links.stage_rank)}
    by_link: dict[int, list[int]] = {}
    for rank, link in enumerate(links.host_link):
        by_link.setdefault(link, []).append(rank)
    turns = [r for turn in itertools.zip_longest(*by_link.values()) for r in turn if r is not None]
    ranks = sorted(turns, key=lambda r: (-links.budget_bytes[r], turns.index(r)))
    stage_rank = [0] * links.num_ranks
    for rank, stage in zip(ranks, sorted(over, key=lambda s: (-over[s], s)), strict=True):
        stage_rank[stage] = rank
    return stage_rank


def _better_swap(saved: Sequence[Saved],
                 best: tuple[Links, SaverPlan]) -> tuple[Links, SaverPlan] | None:  # fmt: skip
    """The first swap of two ranks' stages that prices better than ``best``; None if none."""
    links = best[0]
    for a, b in itertools.combinations(range(links.num_ranks), 2):
        swapped = [b if r == a else a if r == b else r for r in links.stage_rank]
        trial = _priced(saved, with_stage_ranks(links, swapped))
        if _key(trial) < _key(best):
            return trial
    return None
