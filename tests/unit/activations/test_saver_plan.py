"""The MPress saver planners ([Note: saver costs] in tidal/activations/costs.py, [Note: the saver
planners] in tidal/activations/plan.py): hand-checked choices, the exact program against every assignment,
and the greedy against the exact program on random small instances."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from tidal.activations.costs import (
    Links,
    Saved,
    Saver,
    SaverPlan,
    Stripe,
    TensorClass,
    evaluate,
    least_peak_bytes,
    saver_options,
)
from tidal.activations.exact import plan_exact
from tidal.activations.greedy import _make_room, _still_fits, plan_greedy
from tidal.activations.plan import EXACT_REL_GAP, plan_savers
from tidal.activations.topology import peer_links
from tidal.config import ConfigError

MiB = 1 << 20


def _links(budgets: list[int], *, peer_gbps: float = 0.0, host_gbps: float = 10.0,
           host_budget: int | None = None, base: list[int] | None = None) -> Links:  # fmt: skip
    n = len(budgets)
    peer = tuple(tuple(0.0 if a == b else peer_gbps * 1e9 for b in range(n)) for a in range(n))
    return Links(stage_rank=tuple(range(n)), budget_bytes=tuple(budgets),
                 base_bytes=tuple(base or [0] * n), host_link=(0,) * n,
                 host_bandwidth=(host_gbps * 1e9,), host_budget_bytes=(host_budget,),
                 peer_bandwidth=peer)  # fmt: skip


def _one_f_one_b(num_stages: int, *, num_bytes: int, recompute_s: float, idle_s: float,
                 microbatches: int = 8) -> list[Saved]:  # fmt: skip
    """Two blocks per stage; under 1F1B stage s keeps num_stages - s microbatches."""
    out = []
    for stage in range(num_stages):
        for block in range(2):
            for cls, share, rec in ((TensorClass.BLOCK_INPUT, 1, None),
                                    (TensorClass.ATTENTION, 3, recompute_s),
                                    (TensorClass.MLP, 4, recompute_s)):  # fmt: skip
                out.append(Saved(stage=stage, block=block, tensor_class=cls,
                                 num_bytes=share * num_bytes, copies=num_stages - stage,
                                 uses_per_step=microbatches, recompute_s=rec, idle_s=idle_s))  # fmt: skip
    return out


def test_the_loaded_first_rank_borrows_from_the_light_last_one() -> None:
    # 8 MiB per unit of a block's tensors (8 units a block and copy); stage 0 keeps two
    # microbatches (2 x 2 x 8 x 8 MiB = 256 MiB), stage 1 one (128 MiB): 200 MiB each.
    saved = _one_f_one_b(2, num_bytes=8 * MiB, recompute_s=0.01, idle_s=0.005)
    links = _links([200 * MiB, 200 * MiB], peer_gbps=50.0, host_gbps=10.0)
    plan = plan_savers(saved, links)
    assert plan.fits and plan.solver == "greedy"
    assert all(p <= b for p, b in zip(plan.peak_bytes, links.budget_bytes, strict=True))
    # A 5 ms idle window hides a peer round trip of the largest tensor (2 x 32 MiB at 50 GB/s:
    # 1.3 ms) and a host one of a block input (2 x 8 MiB at 10 GB/s shared by two ranks:
    # 3.4 ms), not a host one of the largest (13 ms) nor a recompute: the plan moves only what
    # is free, lends, and rank 1 holds the lent bytes beside its own.
    moved = [(item, choice) for item, choice in zip(plan.saved, plan.choices, strict=True)
             if choice[0] is not Saver.KEEP]  # fmt: skip
    assert moved and all(item.stage == 0 for item, _ in moved)
    assert {choice for _, choice in moved} <= {(Saver.PEER, (1,)), (Saver.HOST, None)}
    assert plan.added_step_s == 0.0
    lent = sum(i.held_bytes for i, choice in moved if choice[0] is Saver.PEER)
    assert lent > 0 and plan.lent_bytes == (0, lent)
    own = sum(i.held_bytes for i in saved if i.stage == 1)
    assert plan.peak_bytes[1] == own + lent


@pytest.mark.parametrize(("host_gbps", "wanted"), [(0.5, Saver.RECOMPUTE), (100.0, Saver.HOST)])
def test_recompute_or_host_swap_whichever_costs_less(host_gbps: float, wanted: Saver) -> None:
    # No peer links and no idle window: recompute costs 1 ms per use; a host round trip of
    # 64 MiB costs 268 ms at 0.5 GB/s, 1.3 ms at 100 GB/s... per 2 x 32 MiB: see the asserts.
    saved = [Saved(stage=0, block=0, tensor_class=TensorClass.MLP, num_bytes=32 * MiB, copies=4,
                   uses_per_step=8, recompute_s=0.001, idle_s=0.0)]  # fmt: skip
    links = _links([100 * MiB])
    links = dataclasses.replace(links, host_bandwidth=(host_gbps * 1e9,))
    plan = plan_savers(saved, links)
    assert plan.choices == ((wanted, None),)
    assert plan.peak_bytes == (32 * MiB,)  # one copy back for the block's backward


def test_block_inputs_and_weight_versions_are_never_recomputed() -> None:
    with pytest.raises(ConfigError, match="cannot be recomputed"):
        Saved(stage=0, block=0, tensor_class=TensorClass.WEIGHTS, num_bytes=1, copies=1,
              uses_per_step=1, recompute_s=0.1)  # fmt: skip
    saved = _one_f_one_b(2, num_bytes=MiB, recompute_s=1e-6, idle_s=0.0)
    saved.append(Saved(stage=0, block=0, tensor_class=TensorClass.WEIGHTS, num_bytes=8 * MiB,
                       copies=1, uses_per_step=8, recompute_s=None))  # fmt: skip
    plan = plan_savers(saved, _links([10 * MiB, 64 * MiB], host_gbps=1.0))
    for item, (saver, _) in zip(plan.saved, plan.choices, strict=True):
        if item.tensor_class in (TensorClass.BLOCK_INPUT, TensorClass.WEIGHTS):
            assert saver is not Saver.RECOMPUTE


def test_a_budget_no_plan_meets_names_the_rank_and_the_least_budget() -> None:
    saved = _one_f_one_b(2, num_bytes=MiB, recompute_s=0.01, idle_s=0.0)
    links = _links([MiB, 64 * MiB], base=[2 * MiB, 0])
    least = least_peak_bytes(saved, links)
    assert least[0] == 2 * MiB + 4 * MiB  # the base and one MLP copy
    with pytest.raises(ConfigError, match=r"rank 0 \(stages \[0\]\) needs at least 6.00MiB"):
        plan_savers(saved, links)


def test_links_that_do_not_match_the_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="2 x 2"):
        Links(stage_rank=(0, 1), budget_bytes=(1, 1), base_bytes=(0, 0), host_link=(0, 0),
              host_bandwidth=(1.0,), host_budget_bytes=(None,), peer_bandwidth=((0.0,),))  # fmt: skip
    with pytest.raises(ConfigError, match="2 ranks"):
        dataclasses.replace(_links([1, 1]), stage_rank=(0, 2))


def _random_instance(rng: random.Random, prefetch: bool = False) -> tuple[list[Saved], Links]:
    num_ranks = rng.choice([2, 3])
    saved = []
    for stage in range(num_ranks):
        for block in range(2):
            for cls in (TensorClass.BLOCK_INPUT, TensorClass.MLP):
                saved.append(Saved(
                    stage=stage, block=block, tensor_class=cls,
                    num_bytes=rng.randint(1, 8) * MiB, copies=num_ranks - stage,
                    uses_per_step=4,
                    recompute_s=None if cls is TensorClass.BLOCK_INPUT else rng.uniform(1e-3, 2e-2),
                    idle_s=rng.uniform(0.0, 5e-3),
                ))  # fmt: skip
    # One kind of device: the same budget on every rank, between the least and the most any
    # rank holds with nothing moved (under 1F1B the first stage holds the most).
    held = [sum(i.held_bytes for i in saved if i.stage == r) for r in range(num_ranks)]
    budgets = [int(rng.uniform(0.5, 1.0) * max(held)) + MiB] * num_ranks
    peer = tuple(tuple(0.0 if a == b else rng.choice([0.0, 20e9, 50e9]) for b in range(num_ranks))
                 for a in range(num_ranks))  # fmt: skip
    links = Links(stage_rank=tuple(range(num_ranks)), budget_bytes=tuple(budgets),
                  base_bytes=(0,) * num_ranks, host_link=(0,) * num_ranks,
                  host_bandwidth=(rng.choice([2e9, 10e9]),),
                  host_budget_bytes=(rng.choice([None, 16 * MiB, 48 * MiB]),), peer_bandwidth=peer,
                  host_prefetch=prefetch,
                  # an egress binds only on a stripe (one link is at most 50 GB/s): from 3 ranks
                  peer_egress=None if num_ranks < 3 else (60e9,) * num_ranks)  # fmt: skip
    return saved, links


def _step_s(plan_added_s: float, saved: list[Saved], links: Links) -> float:
    """The schedule's step without savers (a forward and a backward of twice its time per
    use, from the recompute times) plus what the savers add."""
    compute = [0.0] * links.num_ranks
    for item in saved:
        compute[links.stage_rank[item.stage]] += 3 * item.uses_per_step * (item.recompute_s or 0)
    return max(compute) + plan_added_s


@pytest.mark.parametrize("slowest_only", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_exact_program_is_the_best_assignment(prefetch: bool, slowest_only: bool) -> None:
    def step(plan: SaverPlan) -> float:
        return plan.added_step_s if slowest_only else plan.pipeline_added_s

    rng = random.Random(3)
    for _ in range(6):
        saved, links = _random_instance(rng, prefetch)
        saved = saved[:5]  # every assignment: at most 6^5
        options = [saver_options(item, links) for item in saved]
        best = None
        for choices in itertools.product(*options):
            plan = evaluate(saved, list(choices), links, "all")
            if plan.fits and (best is None or step(plan) < best):
                best = step(plan)
        exact = plan_exact(saved, links, slowest_only=slowest_only)
        assert exact.fits == (best is not None)
        if best is not None:
            assert step(exact) == pytest.approx(best, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_greedy_is_within_10_percent_of_the_exact_step_and_plan_savers_takes_the_faster(
    prefetch: bool,
) -> None:
    rng = random.Random(11)
    compared = 0
    for _ in range(30):
        saved, links = _random_instance(rng, prefetch)
        # the greedy lowers the slowest rank's seconds: bounded by the program that does too
        exact = plan_exact(saved, links, slowest_only=True)
        greedy = plan_greedy(saved, links)
        assert greedy.fits == exact.fits  # on these 30; not on every instance (the test below)
        if not exact.fits:
            continue
        compared += 1
        assert greedy.added_step_s >= exact.added_step_s - 1e-12
        assert _step_s(greedy.added_step_s, saved, links) <= 1.1 * _step_s(
            exact.added_step_s, saved, links
        )
        planned = plan_savers(saved, links)  # the faster of the two, as the pipeline counts
        best = plan_exact(saved, links)
        assert planned.pipeline_added_s <= greedy.pipeline_added_s
        assert planned.pipeline_added_s <= best.pipeline_added_s * (1 + EXACT_REL_GAP) + 1e-12
    assert compared >= 20  # most instances exercise the comparison


def test_where_the_greedy_finds_no_plan_the_exact_program_does_unless_it_runs_out_of_time() -> None:
    # The 13th seed's 120th instance: every rank over, each must lend to another at once
    rng = random.Random(13)
    for _ in range(120):
        saved, links = _random_instance(rng, prefetch=True)
    assert not plan_greedy(saved, links).fits
    planned = plan_savers(saved, links)
    assert planned.fits and planned.solver == "exact"
    with pytest.raises(ConfigError, match=r"the exact program stopped \(exact: time limit\)"):
        plan_savers(saved, links, exact_time_limit_s=1e-9)
    stopped = plan_exact(saved, links, time_limit_s=1e-9)
    assert not stopped.fits and stopped.solver == "exact: time limit"
    tighter = dataclasses.replace(links, budget_bytes=(28 * MiB,) * links.num_ranks)
    with pytest.raises(ConfigError, match="no saver plan fits: the host and the peers"):
        plan_savers(saved, tighter)  # the exact program proves there is none


@pytest.mark.parametrize("exact", [False, True])
def test_a_stage_lends_only_to_the_ranks_links_allow_it(exact: bool) -> None:
    # 2 ranks, 2 chunks (stages 0-3 on ranks 0, 1, 0, 1), no host room. Rank 1 is over unless it
    # lends its large tensor: stage 1's may go to rank 0 (which runs stage 2, after it), the last
    # stage's may not
    # (no stage of rank 0 comes after stage 3: [Note: lending] in tidal/pipeline/lending.py).
    def saved(stage: int, mib: int, copies: int) -> Saved:
        return Saved(stage=stage, block=stage, tensor_class=TensorClass.BLOCK_INPUT,
                     num_bytes=mib * MiB, copies=copies, uses_per_step=4, recompute_s=None)  # fmt: skip

    # rank 1 holds 16 + 4 MiB; lending the first leaves 4 kept + 8 back for its backward
    links = dataclasses.replace(_links([64 * MiB, 14 * MiB], peer_gbps=50.0, host_budget=0),
                                stage_rank=(0, 1, 0, 1))  # fmt: skip
    planner = plan_exact if exact else plan_greedy
    allowed = dataclasses.replace(links, stage_lenders=((1,), (0,), (1,), ()))
    for lender_stage in (1, 3):
        items = [saved(lender_stage, 8, 2), saved(4 - lender_stage, 4, 1)]  # both on rank 1
        free = planner(items, links)
        assert free.fits and free.choices[0] == (Saver.PEER, (0,)), free.choices
        held = planner(items, allowed)
        assert held.fits == (lender_stage == 1), held.choices
    with pytest.raises(ConfigError, match="one tuple of lender ranks"):
        dataclasses.replace(links, stage_lenders=((1,),))


def test_a_free_small_tensor_gives_its_host_room_to_a_large_one_with_nowhere_else_to_go() -> None:
    # One rank, 16 MiB of host room, no peers. Cheapest per byte first, the greedy puts the small
    # block input (3 MiB x 2, free: its idle window hides the swap) on the host, then finds no
    # room there for the large one (8 MiB x 2, not free), which nothing else can take; the MLP
    # recomputed, the rank is still over. The exchange moves the large one to the host and the
    # small one back: 6 kept + 8 back for its backward + the recompute's nothing = 14 MiB.
    small = Saved(stage=0, block=0, tensor_class=TensorClass.BLOCK_INPUT, num_bytes=3 * MiB,
                  copies=2, uses_per_step=4, recompute_s=None, idle_s=1.0)  # fmt: skip
    mlp = Saved(stage=0, block=0, tensor_class=TensorClass.MLP, num_bytes=7 * MiB, copies=2,
                uses_per_step=4, recompute_s=0.017, idle_s=0.0)  # fmt: skip
    large = Saved(stage=0, block=1, tensor_class=TensorClass.BLOCK_INPUT, num_bytes=8 * MiB,
                  copies=2, uses_per_step=4, recompute_s=None, idle_s=0.0)  # fmt: skip
    links = _links([21 * MiB], host_budget=16 * MiB)
    plan = plan_greedy([small, mlp, large], links)
    assert plan.fits
    assert [saver for saver, _ in plan.choices] == [Saver.KEEP, Saver.RECOMPUTE, Saver.HOST]
    assert plan.peak_bytes == (14 * MiB,) and plan.host_bytes == (16 * MiB,)


@pytest.mark.parametrize("prefetch", [False, True])
def test_moving_a_tensor_off_the_host_is_priced_as_evaluating_the_whole_plan_prices_it(
    prefetch: bool,
) -> None:
    # The greedy frees host room by moving host-swapped tensors back; it checks each candidate
    # with the few ranks it changes, not by evaluating the whole plan: the two must agree on
    # whether every rank whose peak grows stays within its budget.
    rng = random.Random(5)
    checked = {True: 0, False: 0}
    for _ in range(40):
        saved, links = _random_instance(rng, prefetch)
        choices = [rng.choice(saver_options(item, links)) for item in saved]
        plan = evaluate(saved, choices, links, "")
        for index, (saver, _) in enumerate(choices):
            if saver is not Saver.HOST:
                continue
            for choice in saver_options(saved[index], links):
                if choice[0] is Saver.HOST:
                    continue
                after = evaluate(
                    saved, [*choices[:index], choice, *choices[index + 1 :]], links, ""
                )
                whole = all(after.peak_bytes[r] <= links.budget_bytes[r]
                            for r in range(links.num_ranks)
                            if after.peak_bytes[r] > plan.peak_bytes[r])  # fmt: skip
                assert _still_fits(saved, links, choices, plan, index, choice) is whole
                checked[whole] += 1
    assert min(checked.values()) >= 20, checked  # both answers are exercised


@pytest.mark.parametrize("prefetch", [False, True])
def test_making_room_on_a_lender_stops_where_evaluating_the_whole_plan_says_it_fits(
    prefetch: bool,
) -> None:
    # _make_room prices the lender's peak once and then moves it by each move's change: it must
    # stop at the first move after which the whole plan's evaluation puts the lender within
    # its budget, or run out of the lender's kept tensors trying.
    rng = random.Random(7)
    stopped = {"fits": 0, "out of moves": 0}
    for _ in range(40):
        saved, links = _random_instance(rng, prefetch)
        choices = [rng.choice(saver_options(item, links)) for item in saved]
        for lender in range(links.num_ranks):
            room = _make_room(saved, links, choices, lender)
            moved = [i for i, (a, b) in enumerate(zip(choices, room, strict=True)) if a != b]
            assert all(links.stage_rank[saved[i].stage] == lender and choices[i][0] is Saver.KEEP
                       and room[i][0] in (Saver.RECOMPUTE, Saver.HOST) for i in moved)  # fmt: skip
            peak = evaluate(saved, room, links, "").peak_bytes[lender]
            if peak <= links.budget_bytes[lender]:
                stopped["fits"] += bool(moved)
                if moved:  # the last move was needed: some move before it left it over
                    assert any(
                        evaluate(saved, [choices[k] if k == i else c for k, c in enumerate(room)],
                                 links, "").peak_bytes[lender] > links.budget_bytes[lender]
                        for i in moved
                    )  # fmt: skip
            else:
                stopped["out of moves"] += 1
                assert not any(c[0] is Saver.KEEP and not saved[i].fixed
                               for i, c in enumerate(room)
                               if links.stage_rank[saved[i].stage] == lender
                               and saved[i].held_bytes)  # fmt: skip
    assert min(stopped.values()) >= 5, stopped  # both ends are exercised


def test_a_recompute_keeps_its_inputs_and_the_greedy_moves_them_on_to_the_host() -> None:
    # Two units of 40 MiB a copy, 4 copies in flight; a recompute keeps a 10 MiB input a copy.
    # Both recomputed: 2 x 40 kept + the loss 8 (which no saver moves) + one copy back 40 = 128
    # MiB, over 100: the greedy (recompute first, the cheaper per byte) must move one on.
    unit = Saved(stage=0, block=0, tensor_class=TensorClass.MLP, num_bytes=40 * MiB, copies=4,
                 uses_per_step=8, recompute_s=1e-3, recompute_keeps_bytes=10 * MiB)  # fmt: skip
    loss = Saved(stage=0, block=-1, tensor_class=TensorClass.OTHER, num_bytes=8 * MiB, copies=1,
                 uses_per_step=8, recompute_s=None, fixed=True)  # fmt: skip
    second = Saved(stage=0, block=1, tensor_class=TensorClass.MLP, num_bytes=40 * MiB, copies=4,
                   uses_per_step=8, recompute_s=1e-3, recompute_keeps_bytes=10 * MiB)  # fmt: skip
    saved, links = [unit, second, loss], _links([100 * MiB], host_gbps=1.0)
    assert unit.held_under(Saver.RECOMPUTE) == 40 * MiB and unit.held_under(Saver.HOST) == 0
    assert saver_options(loss, links) == [(Saver.KEEP, None)]
    both = evaluate(saved, [(Saver.RECOMPUTE, None)] * 2 + [(Saver.KEEP, None)], links, "")
    assert both.peak_bytes == (40 * MiB + 40 * MiB + 8 * MiB + 40 * MiB,)  # kept + transient
    assert not both.fits
    plan = plan_greedy(saved, links)
    assert plan.fits and plan.peak_bytes[0] == 40 * MiB + 8 * MiB + 40 * MiB
    assert (Saver.HOST, None) in plan.choices and plan.choices[2] == (Saver.KEEP, None)
    assert least_peak_bytes(saved, links) == (8 * MiB + 40 * MiB,)  # the loss and one copy
    with pytest.raises(ConfigError, match="needs at least 48.00MiB"):
        plan_savers(saved, _links([47 * MiB]))
    with pytest.raises(ConfigError, match="recompute keeps at most what is saved"):
        Saved(stage=0, block=0, tensor_class=TensorClass.MLP, num_bytes=1, copies=1,
              uses_per_step=1, recompute_s=0.0, recompute_keeps_bytes=2)  # fmt: skip


def test_fetching_ahead_a_rank_holds_its_largest_host_swapped_copy_beside_the_largest_moved() -> (
    None
):
    # [Note: host swap prefetch]: a block's backward reads its copy while the one before it
    # comes back: a 40 MiB recompute and a 24 MiB host swap hold 40 + 24 at once.
    units = [Saved(stage=0, block=b, tensor_class=TensorClass.MLP, num_bytes=n * MiB, copies=1,
                   uses_per_step=4, recompute_s=1e-3) for b, n in enumerate([40, 24, 16])]  # fmt: skip
    choices = [(Saver.RECOMPUTE, None), (Saver.HOST, None), (Saver.HOST, None)]
    plain = evaluate(units, choices, _links([1 << 30]), "")
    links = _links([1 << 30])
    ahead = evaluate(units, choices, dataclasses.replace(links, host_prefetch=True), "")
    assert plain.peak_bytes == (40 * MiB,) and ahead.peak_bytes == (64 * MiB,)


@pytest.mark.parametrize("exact", [True, False])
def test_a_lent_weight_version_holds_a_copy_per_microbatch_in_flight_on_its_lender(
    exact: bool,
) -> None:
    """[Note: stashes on a peer] in tidal/runtime/weights.py: three stashed versions of 8 MiB,
    lent with each of the four microbatches in flight, take four copies of the lender's room."""
    weights = Saved(stage=0, block=-1, tensor_class=TensorClass.WEIGHTS, num_bytes=8 * MiB,
                    copies=3, uses_per_step=1, recompute_s=None, idle_s=1.0, copies_lent=4)  # fmt: skip
    planner = plan_exact if exact else plan_greedy
    # the host's link is too slow to pay, so the version goes to the peer where four copies fit
    roomy = _links([16 * MiB, 40 * MiB], peer_gbps=100.0, host_gbps=0.001, base=[4 * MiB, 0])
    plan = planner([weights], roomy)
    assert plan.fits and plan.choices[0][0] is Saver.PEER
    assert plan.peak_bytes[1] == 4 * 8 * MiB
    # room for the three stashes, not the four lent copies: the host it must be
    tight = dataclasses.replace(roomy, budget_bytes=(16 * MiB, 28 * MiB))
    assert planner([weights], tight).choices[0][0] is Saver.HOST
    # with copies_lent unset the lender holds what a stash would: three copies fit
    stash_like = dataclasses.replace(weights, copies_lent=None)
    assert planner([stash_like], tight).choices[0][0] is Saver.PEER


def test_a_host_link_is_shared_only_by_the_ranks_that_swap_over_it() -> None:
    # Two ranks behind one 10 GB/s link, one 8 MiB tensor each, 4 uses a step, no idle window.
    # Rank 0 alone swapping: 4 x 2 x 8 MiB / 10 GB/s. Both swapping: each at 5 GB/s.
    saved = [Saved(stage=s, block=0, tensor_class=TensorClass.MLP, num_bytes=8 * MiB, copies=1,
                   uses_per_step=4, recompute_s=1.0) for s in range(2)]  # fmt: skip
    links = _links([1 << 30, 1 << 30], host_gbps=10.0)
    alone = 4 * 2 * 8 * MiB / 10e9
    one = evaluate(saved, [(Saver.HOST, None), (Saver.KEEP, None)], links, "")
    assert one.added_s == pytest.approx((alone, 0.0), rel=1e-12)
    both = evaluate(saved, [(Saver.HOST, None), (Saver.HOST, None)], links, "")
    assert both.added_s == pytest.approx((2 * alone, 2 * alone), rel=1e-12)
    # A recompute of rank 1 does not take the link from rank 0.
    other = evaluate(saved, [(Saver.HOST, None), (Saver.RECOMPUTE, None)], links, "")
    assert other.added_s == pytest.approx((alone, 4.0), rel=1e-12)


def test_the_planners_keep_a_second_rank_off_a_link_when_sharing_costs_more() -> None:
    # Both ranks must move their 8 MiB tensor (12 MiB budgets, two copies). Rank 1's is a block
    # input: only the host takes it. Rank 0's recompute adds 1.5 x what a swap alone on the link
    # adds; a swap beside rank 1's adds 2 x. The least step recomputes on rank 0, leaving the
    # link to rank 1: 1.5 x (pricing the link as shared whether used or not gave 2 x for any plan).
    alone = 4 * 2 * 8 * MiB / 10e9
    saved = [Saved(stage=0, block=0, tensor_class=TensorClass.MLP, num_bytes=8 * MiB, copies=2,
                   uses_per_step=4, recompute_s=1.5 * alone / 4),
             Saved(stage=1, block=0, tensor_class=TensorClass.BLOCK_INPUT, num_bytes=8 * MiB,
                   copies=2, uses_per_step=4, recompute_s=None)]  # fmt: skip
    links = _links([12 * MiB, 12 * MiB], host_gbps=10.0)
    both_host = evaluate(saved, [(Saver.HOST, None)] * 2, links, "")
    assert both_host.fits and both_host.added_step_s == pytest.approx(2 * alone, rel=1e-12)
    for plan in (plan_exact(saved, links), plan_greedy(saved, links)):
        assert plan.fits, plan.solver
        assert plan.choices == ((Saver.RECOMPUTE, None), (Saver.HOST, None)), plan.solver
        assert plan.added_s == pytest.approx((1.5 * alone, alone), rel=1e-9)


def _cube_links(budgets: list[int], *, egress: float | None = None) -> Links:
    """Rank 0 linked to ranks 1-3 at 25 GB/s each (one NVLink each, as in a DGX-1's mesh), no
    other links; a slow host."""
    n = len(budgets)
    peer = tuple(tuple(25e9 if a == 0 and b > 0 else 0.0 for b in range(n)) for a in range(n))
    return Links(stage_rank=tuple(range(n)), budget_bytes=tuple(budgets), base_bytes=(0,) * n,
                 host_link=(0,) * n, host_bandwidth=(1e9,), host_budget_bytes=(None,),
                 peer_bandwidth=peer, peer_egress=None if egress is None else (egress,) * n)  # fmt: skip


def _two_blocks_inputs() -> list[Saved]:
    """Two 64 MiB block inputs of stage 0, out and back 4 times a step with no idle window:
    under a 64 MiB budget both must move (one comes back at a time for its backward)."""
    return [Saved(stage=0, block=b, tensor_class=TensorClass.BLOCK_INPUT, num_bytes=64 * MiB,
                  copies=1, uses_per_step=4, recompute_s=None) for b in range(2)]  # fmt: skip


@pytest.mark.parametrize("exact", [True, False])
def test_a_stripe_over_separate_links_is_as_many_times_faster(exact: bool) -> None:
    """[Note: stripes]: one lender at 25 GB/s costs 4 x 2 x 64 MiB / 25 GB/s a tensor, three at
    once a third of it, each holding a third; an egress of one link's bandwidth takes that back
    (as on an NVSwitch: a stripe buys room there, not time)."""
    saved = _two_blocks_inputs()
    one_lender_s = 4 * 2 * 64 * MiB / 25e9
    links = _cube_links([64 * MiB, 1 << 30, 1 << 30, 1 << 30])
    plan = (plan_exact if exact else plan_greedy)(saved, links)
    assert plan.fits and plan.choices == ((Saver.PEER, (1, 2, 3)),) * 2
    assert plan.added_step_s == pytest.approx(2 * one_lender_s / 3, rel=1e-12)
    shares = links.stripe(0, (1, 2, 3)).split(64 * MiB)
    assert plan.lent_bytes == (0, *(2 * b for b in shares)) and sum(shares) == 64 * MiB
    assert plan.stripe(0) == links.stripe(0, (1, 2, 3)) == Stripe(lenders=(1, 2, 3),
                                                                  weights=(25e9,) * 3)  # fmt: skip
    capped = _cube_links([64 * MiB, 1 << 30, 1 << 30, 1 << 30], egress=25e9)
    striped = evaluate(saved, [(Saver.PEER, (1, 2, 3))] * 2, capped, "")
    assert striped.added_step_s == pytest.approx(2 * one_lender_s, rel=1e-12)


@pytest.mark.parametrize("exact", [True, False])
def test_tensors_no_one_lender_has_room_for_are_striped_over_those_that_do(exact: bool) -> None:
    """Each lender has 48 MiB to spare, each tensor is 64 MiB and can neither be recomputed nor
    go to the host (it has no room): they fit only split over all three lenders, which the
    plan does, each lender within its budget."""
    saved = _two_blocks_inputs()
    links = dataclasses.replace(_cube_links([64 * MiB] + [48 * MiB] * 3), host_budget_bytes=(0,))
    for lender in (1, 2, 3):
        assert not evaluate(saved, [(Saver.PEER, (lender,))] * 2, links, "").fits
    plan = (plan_exact if exact else plan_greedy)(saved, links)
    assert plan.fits and plan.choices == ((Saver.PEER, (1, 2, 3)),) * 2
    assert plan.peak_bytes[0] == 64 * MiB  # one copy back at a time
    assert all(p <= b for p, b in zip(plan.peak_bytes, links.budget_bytes, strict=True))


def test_a_dgx1_gives_each_gpu_six_nvlinks_to_four_peers() -> None:
    """[Note: two server topologies]: the mesh is symmetric, each GPU has one link to two peers
    and two to two more, and its egress is all six; on an NVSwitch the egress is one pair's."""
    matrix, egress = peer_links("dgx1", 8, pair_gbps=300.0, nvlink_gbps=25.0)
    assert all(matrix[a][b] == matrix[b][a] for a in range(8) for b in range(8))
    for row, out in zip(matrix, egress, strict=True):
        assert sorted(x / 25e9 for x in row if x) == [1, 1, 2, 2] and out == 6 * 25e9
    matrix, egress = peer_links("nvswitch", 4, pair_gbps=300.0, nvlink_gbps=25.0)
    assert egress == (300e9,) * 4 and matrix[0] == (0.0, 300e9, 300e9, 300e9)
