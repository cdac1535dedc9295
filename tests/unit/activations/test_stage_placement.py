"""Which rank runs which stage ([Note: stage placement] in tidal/activations/placement.py): the
heavy early stages of 1F1B go behind host links of their own, the map is never priced worse
than the one given, and model data moves with its stage."""

from __future__ import annotations

import random

from tidal.activations import Links, Saved, TensorClass, plan_greedy
from tidal.activations.placement import place_stages, with_stage_ranks

MiB = 1 << 20


def _saved(num_stages: int, *, num_bytes: int, recompute_s: float) -> list[Saved]:
    """Two blocks per stage; under 1F1B stage s keeps num_stages - s microbatches."""
    return [Saved(stage=s, block=b, tensor_class=cls, num_bytes=n * num_bytes,
                  copies=num_stages - s, uses_per_step=8, recompute_s=rec, idle_s=0.0)
            for s in range(num_stages) for b in range(2)
            for cls, n, rec in ((TensorClass.BLOCK_INPUT, 1, None),
                                (TensorClass.MLP, 4, recompute_s))]  # fmt: skip


def _paired_links(budget: int | list[int], *, host_gbps: float, base: list[int]) -> Links:
    """Four ranks, two behind each host link, no peer links."""
    n = 4
    budgets = tuple(budget) if isinstance(budget, list) else (budget,) * n
    return Links(stage_rank=tuple(range(n)), budget_bytes=budgets, base_bytes=tuple(base),
                 host_link=(0, 0, 1, 1), host_bandwidth=(host_gbps * 1e9,) * 2,
                 host_budget_bytes=(None, None),
                 peer_bandwidth=tuple((0.0,) * n for _ in range(n)))  # fmt: skip


def test_the_heaviest_stage_goes_to_the_device_with_the_most_memory() -> None:
    # Stage 0 keeps 4 copies of 5 x 8 MiB a block (320 MiB), stage 3 one (80 MiB); rank 3 has
    # 400 MiB, the others 200. Given the identity map stage 0 must move 120 MiB (recompute
    # costs more than a host round trip: to the host); on rank 3 it moves nothing.
    saved = _saved(4, num_bytes=8 * MiB, recompute_s=0.05)
    base = [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB]
    links = _paired_links([200 * MiB, 200 * MiB, 200 * MiB, 400 * MiB], host_gbps=10.0,
                          base=base)  # fmt: skip
    given = plan_greedy(saved, links)
    placed, plan = place_stages(saved, links)
    assert plan.fits and given.fits
    assert placed.stage_rank[0] == 3
    assert plan.added_step_s < given.added_step_s
    for stage, rank in enumerate(placed.stage_rank):  # model data moved with its stage
        assert placed.base_bytes[rank] == base[stage]
    assert all(p <= b for p, b in zip(plan.peak_bytes, placed.budget_bytes, strict=True))


def test_a_loaded_stage_goes_beside_a_lender_it_has_a_link_to() -> None:
    # Peer links only between ranks 2 and 3 (NVLink between two of four devices); the host may
    # hold nothing and nothing is recomputed: stage 0 (4 blocks x 10 MiB x 4 copies, 160 MiB
    # against 130) fits only by lending a block, so it must run on rank 2 or 3.
    saved = [Saved(stage=s, block=b, tensor_class=TensorClass.BLOCK_INPUT, num_bytes=10 * MiB,
                   copies=4 - s, uses_per_step=8, recompute_s=None, idle_s=1.0)
             for s in range(4) for b in range(4)]  # fmt: skip
    n = 4
    peer = tuple(tuple(50e9 if {a, b} == {2, 3} else 0.0 for b in range(n)) for a in range(n))
    links = Links(stage_rank=tuple(range(n)), budget_bytes=(130 * MiB,) * n, base_bytes=(0,) * n,
                  host_link=(0, 0, 1, 1), host_bandwidth=(1e9, 1e9), host_budget_bytes=(0, 0),
                  peer_bandwidth=peer)  # fmt: skip
    assert not plan_greedy(saved, links).fits
    placed, plan = place_stages(saved, links)
    assert plan.fits and placed.stage_rank[0] in (2, 3)
    assert plan.lent_bytes[5 - placed.stage_rank[0]] == 40 * MiB  # the other holds one block


def test_the_map_is_never_priced_worse_than_the_one_given() -> None:
    rng = random.Random(5)
    for _ in range(8):
        saved = _saved(4, num_bytes=rng.randint(1, 8) * MiB, recompute_s=rng.uniform(1e-3, 5e-2))
        links = _paired_links(rng.randint(60, 200) * MiB, host_gbps=rng.choice([2.0, 10.0]),
                              base=[rng.randint(0, 8) * MiB for _ in range(4)])  # fmt: skip
        given = plan_greedy(saved, links)
        placed, plan = place_stages(saved, links)
        assert sorted(placed.stage_rank) == [0, 1, 2, 3]
        assert plan.fits or not given.fits
        if given.fits:
            assert plan.added_step_s <= given.added_step_s + 1e-12
        assert sum(placed.base_bytes) == sum(links.base_bytes)


def test_several_stages_on_a_rank_keep_their_map() -> None:
    saved = _saved(4, num_bytes=MiB, recompute_s=1e-3)
    links = Links(stage_rank=(0, 1, 0, 1), budget_bytes=(1 << 30,) * 2, base_bytes=(0, 0),
                  host_link=(0, 0), host_bandwidth=(1e10,), host_budget_bytes=(None,),
                  peer_bandwidth=((0.0, 0.0), (0.0, 0.0)))  # fmt: skip
    placed, plan = place_stages(saved, links)
    assert placed == links and plan.fits


def test_moving_stages_moves_their_model_data() -> None:
    links = _paired_links(1 << 30, host_gbps=10.0, base=[10, 20, 30, 40])
    moved = with_stage_ranks(links, [3, 2, 1, 0])
    assert moved.stage_rank == (3, 2, 1, 0) and moved.base_bytes == (40, 30, 20, 10)
    assert moved.budget_bytes == links.budget_bytes and moved.host_link == links.host_link


def test_the_ranks_that_host_swap_go_behind_links_of_their_own() -> None:
    # Stages hold 320 / 240 / 160 / 80 MiB with nothing moved, 200 MiB each: stages 0 and 1
    # must swap to the host (recompute costs 2 s), 2 and 3 move nothing. Behind one link (the
    # given map) they share its bandwidth; the placed map puts them behind different links.
    saved = _saved(4, num_bytes=8 * MiB, recompute_s=2.0)
    links = _paired_links(200 * MiB, host_gbps=10.0, base=[0] * 4)
    given = plan_greedy(saved, links)
    placed, plan = place_stages(saved, links)
    assert given.fits and plan.fits
    assert placed.host_link[placed.stage_rank[0]] != placed.host_link[placed.stage_rank[1]]
    assert plan.added_step_s < 0.6 * given.added_step_s  # about half: the link is its own
