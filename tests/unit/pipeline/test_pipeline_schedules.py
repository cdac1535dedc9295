"""Schedule generators: valid programs, versions as the [Note] says, errors for bad input."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tidal.config import ConfigError
from tidal.pipeline.ir import Kind, Schedule, format_program, parse_program, with_communication
from tidal.pipeline.schedules import SCHEDULE_NAMES, make_schedule

_SIZES = [(1, 1), (1, 3), (2, 1), (3, 2), (4, 4), (4, 8), (3, 7)]  # (stages, microbatches)


def _cases():
    for name, (p, m), steps in itertools.product(SCHEDULE_NAMES, _SIZES, (1, 3)):
        if name == "interleaved":
            yield name, p, p * max(1, m // p), 2, steps
        elif name != "2bw" or m >= p:
            yield name, p, m, 1, steps


def _check_valid(schedule: Schedule, steps: int) -> None:
    m, total = schedule.num_microbatches, schedule.num_microbatches * steps
    for s in range(schedule.num_stages):
        rank = schedule.rank_of(s)
        program = [a for a in schedule.programs[rank] if a.stage == s]
        forwards = [a.microbatch for a in program if a.kind is Kind.FORWARD]
        backwards = [a.microbatch for a in program if a.kind is Kind.BACKWARD]
        assert Counter(forwards) == Counter(range(total)), (s, forwards)
        assert Counter(backwards) == Counter(range(total)), (s, backwards)
        position = {(a.kind, a.microbatch): i for i, a in enumerate(program)}
        for mb in range(total):
            assert position[(Kind.FORWARD, mb)] < position[(Kind.BACKWARD, mb)], (s, mb)
        updates = [a for a in program if a.kind is Kind.UPDATE]
        assert [u.version for u in updates] == list(range(1, steps + 1)), (s, updates)
        assert all(a.version is not None for a in program), program
        # an update follows exactly m backwards since the previous one
        since = 0
        for a in program:
            since += a.kind is Kind.BACKWARD
            if a.kind is Kind.UPDATE:
                assert since == m, (s, program)
                since = 0
    assert schedule.num_steps == steps


@pytest.mark.parametrize(("name", "p", "m", "v", "steps"), list(_cases()))
def test_generated_schedules_are_valid_and_round_trip(name, p, m, v, steps) -> None:
    schedule = make_schedule(name, stages=p, microbatches=m, virtual=v, steps=steps)
    _check_valid(schedule, steps)
    for program in with_communication(schedule).programs:
        assert tuple(parse_program(format_program(program))) == program


def test_synchronous_versions_are_the_step_index() -> None:
    for name in ("gpipe", "1f1b", "interleaved"):
        schedule = make_schedule(name, stages=2, microbatches=4, steps=3)
        for _, a in schedule.actions():
            if a.kind is not Kind.UPDATE:
                assert a.version == a.microbatch // 4, (name, a)


def test_pipemare_backward_uses_the_current_version_and_pipedream_its_forwards() -> None:
    kw = {"stages": 4, "microbatches": 2, "steps": 4}
    for name in ("pipemare", "pipedream"):
        schedule = make_schedule(name, **kw)
        current = [0] * 4
        forward_version = {}
        newer = 0
        for s, program in enumerate(schedule.programs):
            for a in program:
                if a.kind is Kind.UPDATE:
                    current[s] += 1
                    assert a.version == current[s]
                elif a.kind is Kind.FORWARD:
                    assert a.version == current[s]
                    forward_version[(s, a.microbatch)] = a.version
                elif name == "pipemare":
                    assert a.version == current[s]
                    newer += a.version > forward_version[(s, a.microbatch)]
                else:
                    assert a.version == forward_version[(s, a.microbatch)]
        assert schedule.asynchronous
        if name == "pipemare":
            assert newer > 0  # some backward really ran on newer weights than its forward


def test_async_keeps_p_minus_s_in_flight_without_flush() -> None:
    p, m = 4, 3
    schedule = make_schedule("pipemare", stages=p, microbatches=m, steps=3)
    for s, program in enumerate(schedule.programs):
        in_flight = peak = 0
        for a in program:
            in_flight += {Kind.FORWARD: 1, Kind.BACKWARD: -1}.get(a.kind, 0)
            peak = max(peak, in_flight)
        assert peak == p - s
        # no flush: stages before the last already run forwards of step 1 before updating
        first_update = [a.kind for a in program].index(Kind.UPDATE)
        early = [a.microbatch for a in program[:first_update] if a.kind is Kind.FORWARD]
        assert (max(early) >= m) == (s < p - 1), (s, early)


def test_2bw_forwards_see_a_new_version_only_at_batch_starts() -> None:
    schedule = make_schedule("2bw", stages=3, microbatches=3, steps=4)
    for program in schedule.programs:
        by_batch: dict[int, set[int]] = {}
        for a in program:
            if a.kind is Kind.FORWARD:
                by_batch.setdefault(a.microbatch // 3, set()).add(a.version)
        assert all(len(versions) == 1 for versions in by_batch.values()), by_batch
    assert schedule.stashing == 2


def test_pipemarew_is_synchronous_first() -> None:
    schedule = make_schedule("pipemarew", stages=3, microbatches=2, steps=4, sync_steps=2)
    assert schedule.asynchronous and schedule.notes["sync_steps"] == "2"
    program = schedule.programs[0]
    first_update = [a.kind for a in program].index(Kind.UPDATE)
    # flush: both backwards of step 0 come before the update, no forward of step 1 before it
    assert {a.microbatch for a in program[:first_update]} == {0, 1}
    sync = make_schedule("1f1b", stages=3, microbatches=2, steps=2)
    assert schedule.programs[1][: len(sync.programs[1])] == sync.programs[1]


def test_interleaved_places_stage_s_on_rank_s_mod_p() -> None:
    schedule = make_schedule("interleaved", stages=3, microbatches=6, virtual=2)
    assert schedule.num_stages == 6 and schedule.num_virtual == 2
    for rank, program in enumerate(schedule.programs):
        assert {a.stage for a in program} == {rank, rank + 3}


@pytest.mark.parametrize(
    ("name", "kwargs", "fragment"),
    [
        ("zb", {}, "choose one of gpipe"),
        ("gpipe", {"stages": 0}, "stages"),
        ("1f1b", {"microbatches": 0}, "microbatches"),
        ("gpipe", {"steps": 0}, "steps"),
        ("1f1b", {"virtual": 2}, "use virtual=1 or the interleaved"),
        ("interleaved", {"microbatches": 5, "virtual": 2}, "multiple of stages"),
        ("2bw", {"microbatches": 2}, "at least 4 microbatches"),
        ("pipemarew", {"sync_steps": 3}, "sync_steps"),
    ],
)
def test_bad_input_raises_config_error(name, kwargs, fragment) -> None:
    args = {"stages": 4, "microbatches": 4, "steps": 2} | kwargs
    with pytest.raises(ConfigError, match=fragment):
        make_schedule(name, **args)


def test_small_m_is_allowed_where_the_brief_says() -> None:
    for name in ("gpipe", "1f1b", "pipedream", "pipemare"):
        schedule = make_schedule(name, stages=4, microbatches=2, steps=2)
        _check_valid(schedule, 2)
