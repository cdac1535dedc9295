"""The discrete-event simulator against closed forms, hand-timed cases and hand-made deadlocks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.config import ConfigError
from tidal.pipeline.ir import Kind, Schedule, parse_program, with_communication
from tidal.pipeline.schedules import SCHEDULE_NAMES, make_schedule
from tidal.pipeline.simulate import Deadlock, StageCosts, simulate

_UNIT = StageCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0)
_P = st.integers(1, 8)
_M = st.integers(1, 16)


def _hand(name: str, *programs: str, microbatches: int = 1) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=len(programs),
        num_stages=len(programs),
        num_microbatches=microbatches,
        programs=tuple(tuple(parse_program(p)) for p in programs),
    )


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_simulates_without_deadlock(name: str) -> None:
    p, m = 3, 3
    schedule = make_schedule(name, stages=p, microbatches=m, steps=2, virtual=1)
    sim = simulate(schedule, _UNIT)
    num_actions = sum(len(prog) for prog in with_communication(schedule).programs)
    assert len(sim.events) == num_actions
    assert sim.busy_s == pytest.approx([2 * m * 3.0] * p)  # two steps of m (F + B) each
    assert sim.makespan_s >= max(sim.busy_s)
    for rank in range(p):  # one action at a time per rank
        spans = sorted((e.start_s, e.end_s) for e in sim.events if e.rank == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))


def test_cyclic_programs_raise_deadlock_naming_each_blocked_rank() -> None:
    # rank 0 waits for the gradient of microbatch 0 before sending its activation
    schedule = _hand("cycle", "0F0 0RB0 0B0 0SF0", "1RF0 1F0 1B0 1SB0")
    with pytest.raises(Deadlock) as info:
        simulate(schedule)
    assert info.value.blocked == {0: "0RB0 waits on 1SB0", 1: "1RF0 waits on 0SF0"}
    # compute-only programs whose orders cross: stage 1 wants microbatch 1 first
    crossed = _hand("crossed", "0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0", microbatches=2)
    with pytest.raises(Deadlock, match="rank 0: 0RB0 waits on 1SB0"):
        simulate(crossed)
    with pytest.raises(ValueError, match="0F0 appears twice"):
        simulate(_hand("twice", "0F0 0F0 0B0"))


def test_single_microbatch_pays_two_messages_per_link() -> None:
    p, p2p_s = 3, 0.25
    sim = simulate(
        make_schedule("1f1b", stages=p, microbatches=1), StageCosts(p2p_s=p2p_s, update_s=0.5)
    )
    # the microbatch crosses p - 1 links forward and back; updates run after the last B
    assert sim.makespan_s == pytest.approx(p * 3.0 + 2 * (p - 1) * p2p_s + 0.5)


def test_split_backward_and_weight_grad_durations() -> None:
    schedule = _hand("zb", "0F0 0B0 0W0 0F1 0B1")
    sim = simulate(schedule, StageCosts(backward_s=2.0, weight_grad_s=0.5))
    durations = {e.action: e.end_s - e.start_s for e in sim.events}
    assert durations == {"0F0": 1.0, "0B0": 1.5, "0W0": 0.5, "0F1": 1.0, "0B1": 2.0}
    with pytest.raises(ConfigError, match="exceeds backward_s"):
        simulate(schedule, StageCosts(backward_s=1.0, weight_grad_s=1.5))


def test_per_stage_costs_and_activation_bytes() -> None:
    schedule = make_schedule("1f1b", stages=2, microbatches=4)
    costs = StageCosts(forward_s=(1.0, 3.0), backward_s=(2.0, 6.0), activation_bytes=(10, 7))
    sim = simulate(schedule, costs)
    assert sim.busy_s == (12.0, 36.0)
    assert sim.peak_activation_bytes == (2 * 10, 1 * 7)
    with pytest.raises(ConfigError, match="has 3 values but the schedule has 2 stages"):
        simulate(schedule, StageCosts(forward_s=(1.0, 1.0, 1.0)))
    with pytest.raises(ConfigError, match="forward_s"):
        StageCosts(forward_s=-1.0)


def test_delays_by_hand_for_two_stages() -> None:
    """p=2, m=1, pipemare. Stage 0 runs F0v0 F1v0 B0v0 U(->1) F2v1 B1v1 U(->2) B2v2 U(->3).

    B0's update makes version 1, so it applies to 0 = F0's version: tau 0. B1's update makes 2,
    applies to 1, F1 used 0: tau 1. B2's update makes 3, applies to 2, F2 used 1: tau 1.
    Stage 1 runs F then B of each microbatch before the next, so tau is 0 there.
    """
    sim = simulate(make_schedule("pipemare", stages=2, microbatches=1, steps=3), _UNIT)
    assert sim.delays == {(0, 0): 0, (0, 1): 1, (0, 2): 1, (1, 0): 0, (1, 1): 0, (1, 2): 0}
    assert sim.delay == (1, 0)


@settings(max_examples=25, deadline=None)
@given(p=_P, m=_M)
def test_gpipe_and_1f1b_bubble_and_memory(p: int, m: int) -> None:
    expected = (p - 1) / (m + p - 1)
    gpipe = simulate(make_schedule("gpipe", stages=p, microbatches=m), _UNIT)
    one = simulate(make_schedule("1f1b", stages=p, microbatches=m), _UNIT)
    assert abs(gpipe.bubble_fraction - expected) < 1e-9
    assert abs(one.bubble_fraction - expected) < 1e-9
    assert gpipe.peak_activations == (m,) * p
    assert one.peak_activations == tuple(min(p - s, m) for s in range(p))
    for sim in (gpipe, one):
        assert sim.delay == (0,) * p and set(sim.delays.values()) == {0}
        assert sim.weight_versions == (1,) * p


@settings(max_examples=25, deadline=None)
@given(p=_P, k=st.integers(1, 4), v=st.integers(1, 3), t_b=st.sampled_from([1.0, 2.0, 3.5]))
def test_interleaved_bubble_is_p_minus_1_over_v_m(p: int, k: int, v: int, t_b: float) -> None:
    """idle / ideal == (p - 1) / (v m) exactly, for any T_B (not only T_F = T_B).

    Every rank idles (p - 1) chunk-F plus (p - 1) chunk-B times in all, against v m of each
    busy, so the ratio does not depend on T_F / T_B (checked here for several T_B).
    """
    m = k * p
    schedule = make_schedule("interleaved", stages=p, microbatches=m, virtual=v)
    sim = simulate(schedule, StageCosts(forward_s=1.0, backward_s=t_b))
    bubble = sim.bubble_fraction
    assert abs(bubble / (1 - bubble) - (p - 1) / (v * m)) < 1e-9
    assert sim.delay == (0,) * (v * p)


@settings(max_examples=25, deadline=None)
@given(p=_P, m=_M)
def test_async_versions_delay_and_steady_bubble(p: int, m: int) -> None:
    """PipeMare delay on stage s is ceil((p - 1 - s) / m), by counting updates.

    With w = p - 1 - s warm-up forwards, F of microbatch j (j >= w) runs after the backwards
    of microbatches 0..j-w-1, i.e. after floor((j - w) / m) updates; its gradient goes into
    the update after B_j, which applies to version floor(j / m). So tau_j = floor(j / m) -
    floor((j - w) / m), at most ceil(w / m), reached once j mod m < w mod m (or w mod m == 0)
    and j >= w. PipeDream has the same delays but keeps every version its in-flight
    microbatches j-w..j used, floor((i - w) / m) for each i: 1 + ceil(w / m) distinct values
    (p - s when m = 1) once j >= 2w + m. So the run needs about 2p + m microbatches (and at
    least 3 steps for the steady state).
    """
    steps = max(3, math.ceil((2 * p + 1) / m) + 1)
    mare = simulate(make_schedule("pipemare", stages=p, microbatches=m, steps=steps), _UNIT)
    dream = simulate(make_schedule("pipedream", stages=p, microbatches=m, steps=steps), _UNIT)
    expected = tuple(math.ceil((p - 1 - s) / m) for s in range(p))
    assert mare.delay == expected and dream.delay == expected
    assert mare.weight_versions == (1,) * p
    assert dream.weight_versions == tuple(1 + d for d in expected)
    assert mare.steady_bubble_fraction == 0.0
    assert mare.peak_activations == tuple(p - s for s in range(p))
    sync = simulate(make_schedule("1f1b", stages=p, microbatches=m, steps=steps), _UNIT)
    assert mare.makespan_s <= sync.makespan_s


def test_pipedream_keeps_p_minus_s_versions_when_updating_every_microbatch() -> None:
    p = 5
    sim = simulate(make_schedule("pipedream", stages=p, microbatches=1, steps=2 * p), _UNIT)
    assert sim.weight_versions == tuple(p - s for s in range(p))


def test_2bw_keeps_two_versions_with_delay_one() -> None:
    p = 4
    sim = simulate(make_schedule("2bw", stages=p, microbatches=p, steps=4), _UNIT)
    assert sim.weight_versions == (2, 2, 2, 1)
    assert sim.delay == (1, 1, 1, 0)
    assert sim.steady_bubble_fraction == 0.0


def test_flushes_show_in_the_steady_bubble_and_pipemarew_sits_between() -> None:
    kw = {"stages": 4, "microbatches": 4, "steps": 4}
    sync = simulate(make_schedule("1f1b", **kw), _UNIT)
    warm = simulate(make_schedule("pipemarew", sync_steps=2, **kw), _UNIT)
    mare = simulate(make_schedule("pipemare", **kw), _UNIT)
    assert sync.steady_bubble_fraction > 0.0
    assert sync.bubble_fraction > warm.bubble_fraction > mare.bubble_fraction
    assert warm.delay == mare.delay  # the asynchronous part has the usual delays


def test_to_json_has_the_documented_keys() -> None:
    sim = simulate(make_schedule("pipemare", stages=2, microbatches=2, steps=3), _UNIT)
    report = sim.to_json()
    for key in (
        "schedule",
        "stages",
        "microbatches",
        "makespan",
        "bubble_fraction",
        "steady_bubble_fraction",
        "peak_activations",
        "peak_activation_bytes",
        "weight_versions",
        "delay",
        "busy_s",
    ):
        assert key in report, key
    assert report["schedule"] == "pipemare" and report["makespan"] == sim.makespan_s
    assert report["delay"] == [1, 0]
    assert Kind.UPDATE in {e.kind for e in sim.events}
