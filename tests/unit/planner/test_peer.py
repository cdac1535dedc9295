"""Activations lent to the mirror pipeline stage (MPress's peer swap in the planner's search):
[Note: activations on a peer] in tidal/planner/pipelines.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.planner import ClusterSpec, Mesh, PlannerConfig, Recompute, make_plan
from tidal.planner.cost_model import Assignment, evaluate, mirror_peaks
from tidal.planner.graph import ModelGraph
from tidal.planner.pipelines import pipeline_options, stage_graph
from tidal.planner.strategies import TrainingSpec, candidates

KEEP = (Recompute.NONE,)  # every activation kept: lending is the only saver


def _first_stage(
    graph: ModelGraph, bandwidth: float
) -> tuple[ModelGraph, TrainingSpec, Assignment]:
    """The first of 4 stages of 2 blocks under 1F1B with 8 micro-batches, lending."""
    stage = stage_graph(graph, blocks=2, first=True, last=False)
    spec = TrainingSpec(num_microbatches=8, in_flight=4.0, time_slots=11.0, peer_stages=4,
                        mirror_in_flight=1.0, peer_bandwidth=bandwidth)  # fmt: skip
    mesh, cluster = Mesh(dp=1, tp=1), ClusterSpec(devices=1, devices_per_node=1)
    choice = {u.name: candidates(u, mesh, cluster, spec)[0] for u in stage.units}
    return stage, spec, Assignment(mesh=mesh, choice=choice, recompute={"blocks.*": Recompute.NONE})


@pytest.mark.parametrize("bandwidth", [1e6, 400e9])
def test_lent_activations_are_priced_by_hand(graph: ModelGraph, bandwidth: float) -> None:
    stage, spec, kept = _first_stage(graph, bandwidth)
    cluster = ClusterSpec(devices=1, devices_per_node=1)
    before = evaluate(stage, kept, cluster, spec)
    a = before.memory.activations / 4  # a micro-batch's
    lent = a / 2
    after = evaluate(stage, dataclasses.replace(kept, lent_bytes=lent), cluster, spec)
    assert after.memory.activations == pytest.approx(before.memory.activations - 4 * lent)
    assert after.memory.lent == pytest.approx(4 * lent)
    assert after.memory.resident == before.memory.resident
    # two of the stage's two blocks' worth coming back at once
    assert after.memory.transient == pytest.approx(max(before.memory.transient, 2 * lent / 2))
    compute_s = sum(u.count * kept.choice[u.name].compute_s for u in stage.units)
    added_s = 11 * max(0.0, 2 * lent / bandwidth - compute_s)
    assert after.step_time_s == pytest.approx(before.step_time_s + added_s)
    assert (added_s > 0) == (bandwidth == 1e6)  # a slow link outlasts the compute
    # stage 1 holds 3 micro-batches and its mirror's (stage 2's) 2; stage 2 holds 2 and 3
    total, keeps = after.memory.total, a - lent
    first, one, two = mirror_peaks(after.memory, spec)
    assert first == total
    assert one == pytest.approx(total - keeps + 2 * lent)
    assert two == pytest.approx(total - 2 * keeps + 3 * lent)


def _config(**kw: object) -> PlannerConfig:
    return PlannerConfig(schedules=("1f1b",), pareto=(), baselines=(), global_batch=32,
                         recompute=KEEP, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_lending_makes_a_1f1b_pipeline_smaller_and_fit(graph: ModelGraph) -> None:
    cluster = ClusterSpec(devices=8, devices_per_node=8)
    least, searches = {}, {}
    for peer in (False, True):
        search = make_plan(graph, cluster, _config(peer=peer)).pipelines
        assert search is not None
        searches[peer] = search
        least[peer] = search.smallest(time_limit=float("inf"))
    plain, lending = least[False], least[True]
    assert plain is not None and lending is not None
    assert plain.lent_bytes == 0 and lending.lent_bytes > 0
    assert lending.peak_memory_bytes < 0.95 * plain.peak_memory_bytes
    peaks = lending.stage_peaks()
    assert lending.peak_memory_bytes == max(peaks.values())
    assert peaks["last"] == pytest.approx(lending.costed[1].memory.total + lending.lent_bytes)
    # a device between the two: only lending gets a pipeline in
    budget = (plain.peak_memory_bytes + lending.peak_memory_bytes) / 2
    for peer, search in searches.items():
        fits = search.smallest(time_limit=float("inf"), memory_limit=budget)
        assert (fits is not None) == peer
        assert fits is None or (fits.lent_bytes > 0 and fits.peak_memory_bytes <= budget)


def test_only_a_first_stage_with_a_mirror_lends(graph: ModelGraph) -> None:
    cluster = ClusterSpec(devices=8, devices_per_node=8)
    base = TrainingSpec()

    def meshes(stage: ClusterSpec) -> list[Mesh]:
        return [Mesh(dp=stage.devices, tp=1)]

    options = [o for batch in (4, 8)  # 4: 1F1B with fewer micro-batches than stages
               for o in pipeline_options(graph, cluster, global_batch=batch, base=base,
                                         meshes=meshes, peer=True,
                                         schedules=("1f1b", "interleaved", "pipemare"))]  # fmt: skip
    for o in options:
        first, last = o.specs
        clipped = o.schedule == "1f1b" and o.num_microbatches < o.pp  # min(p - s, m) in flight
        # plan runs lend under 1F1B alone ([Note: lending in plan runs])
        held = clipped or o.schedule != "1f1b"
        assert last.peer_stages == 0 and first.peer_stages == (0 if held else o.pp)
        if held:
            continue
        assert first.mirror_in_flight == last.in_flight
        # two stages' devices fit in the node of 8: its links
        assert first.peer_bandwidth == cluster.intra_node_bandwidth
    lending = {o.schedule for o in options if o.specs[0].peer_stages}
    assert lending == {"1f1b"} and {"interleaved", "pipemare"} <= {o.schedule for o in options}
    assert any(o.specs[0].peer_stages == 0 for o in options)
    # nodes of 4: two stages of 4 devices do not fit in one, the pair crosses nodes
    small = dataclasses.replace(cluster, devices_per_node=4)
    (halves,) = [o for o in pipeline_options(graph, small, global_batch=8, base=base,
                                             meshes=meshes, peer=True, schedules=("1f1b",)) if o.pp == 2]  # fmt: skip
    assert halves.specs[0].peer_bandwidth == small.inter_node_bandwidth
    # the flat plan's devices are alike: no mirror, nothing to lend
    result = make_plan(graph, cluster, _config(peer=True))
    assert result.costed.memory.lent == 0


def test_tidal_plan_peer_lends_only_when_asked(tmp_path: Path) -> None:
    """The fastest plan on devices of 17 MiB (about 96% of what the fastest pipeline's first
    stage holds): without --peer its first stage recomputes its blocks whole, with it the
    stage keeps them and lends (the blocks a plan run lends from: [Note: lending in plan
    runs]), a faster step."""
    lent, step_s = {}, {}
    for flag in ([], ["--peer"]):
        path = tmp_path / f"plan{len(flag)}.json"
        argv = ["plan", "--model", "demo", "--devices", "8", "--schedules", "1f1b",
                "--global-batch", "64", "--pareto", "", "--baselines", "", "--objective",
                "time", "--device-memory", "17MiB", "--json", str(path), *flag]  # fmt: skip
        assert main(argv) == 0
        report = json.loads(path.read_text())
        lent[bool(flag)] = report["pipeline_search"]["lent_bytes"]
        step_s[bool(flag)] = report["step_time_s"]
    assert lent[False] == 0 and lent[True] > 0 and step_s[True] < step_s[False]
