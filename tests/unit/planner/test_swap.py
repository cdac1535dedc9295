"""A block's activations on the host between its forward and backward ([Note: activations on
the host] in tidal/planner/ilp.py): priced by hand, chosen where it is the fastest way to fit,
searched only where asked, and run by apply (issue 51)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from tidal.planner import ClusterSpec, Infeasible, Mesh, PlannerConfig, Recompute, make_plan
from tidal.planner.check import check_plan
from tidal.planner.cost_model import Assignment, evaluate
from tidal.planner.graph import ModelGraph
from tidal.planner.search import PlanResult, _problem, _spec

FLAT = PlannerConfig(pareto=(), baselines=(), pipelines=False)
WITH_SWAP = dataclasses.replace(FLAT, recompute=(*FLAT.recompute, Recompute.SWAP))
MiB = 1024**2


def _priced(graph: ModelGraph, cluster: ClusterSpec, mode: Recompute, in_flight: float = 1.0):
    """One assignment (each unit's first candidate on dp 4 x tp 2) evaluated with ``mode``."""
    mesh = Mesh(dp=4, tp=2)
    spec = dataclasses.replace(_spec(graph, mesh, FLAT, 8), in_flight=in_flight)
    options = _problem(graph, mesh, cluster, spec, FLAT).options
    choice = {u.name: options[u.name][0] for u in graph.units}
    assignment = Assignment(mesh=mesh, choice=choice, recompute={"blocks.*": mode})
    return choice, spec, evaluate(graph, assignment, cluster, spec)


def _as_the_cost_model_prices(graph: ModelGraph, cluster: ClusterSpec, config: PlannerConfig,
                              found: PlanResult) -> None:  # fmt: skip
    """The solver's figures for its plan are the cost model's."""
    assignment = found.solution.assignment
    assert assignment is not None
    again = evaluate(graph, assignment, cluster, _spec(graph, assignment.mesh, config, 8))
    assert again.step_time_s == pytest.approx(found.plan.step_time_s, rel=1e-6)
    assert again.memory.total == pytest.approx(found.plan.peak_memory_bytes, rel=1e-6)


@pytest.mark.parametrize("link", [1e14, 1e8])
def test_swapped_activations_are_priced_by_hand(graph: ModelGraph, link: float) -> None:
    cluster = ClusterSpec(devices=8, host_link_bandwidth=link)
    held = 3.0  # micro-batches in flight, as a pipeline stage holds them
    choice, spec, kept = _priced(graph, cluster, Recompute.NONE, held)
    _, _, swapped = _priced(graph, cluster, Recompute.SWAP, held)
    inside = [u for u in graph.units if graph.block_of(u) == "blocks.*"]
    blocks = graph.blocks["blocks.*"]
    act = {u.name: choice[u.name].memory.activations for u in inside}
    # the blocks' activations leave the device for the host, in_flight micro-batches of each
    assert kept.memory.activations - swapped.memory.activations == pytest.approx(
        held * blocks * sum(act.values())
    )
    assert swapped.memory.host == pytest.approx(held * blocks * sum(act.values()))
    assert kept.memory.host == 0
    # two blocks' worth at once on the device: one in use, the next coming back
    assert swapped.memory.transient >= 2 * sum(act.values()) - 1e-6
    # the copies add only what the block's compute does not cover
    copies = sum(2 * a / link for a in act.values())
    compute = sum(choice[u.name].compute_s for u in inside)
    added = blocks * spec.slots * max(0.0, copies - compute)
    assert swapped.step_time_s - kept.step_time_s == pytest.approx(added, abs=1e-12)
    # a slow link shows; a fast one hides behind compute (this small model's compute is short:
    # at an H100's 50 GB/s its copies show too)
    assert (added > 0) == (link < 1e9)


def test_a_fast_host_link_makes_swap_the_fastest_plan_that_fits(graph: ModelGraph) -> None:
    """At a budget the blocks' activations do not fit in, keeping them on the host beats
    recomputing them when the link is fast; a slow link makes recompute the faster again."""
    fast = ClusterSpec(devices=8, device_memory_bytes=8 * MiB, host_link_bandwidth=1e14)
    no_swap = make_plan(graph, fast, dataclasses.replace(FLAT, objective="time"))
    assert no_swap.plan.recompute["blocks.*"] is not Recompute.NONE
    swap = make_plan(graph, fast, dataclasses.replace(WITH_SWAP, objective="time"))
    assert swap.plan.recompute["blocks.*"] is Recompute.SWAP
    assert swap.plan.step_time_s < no_swap.plan.step_time_s
    assert swap.plan.memory.host > 0 and swap.plan.peak_memory_bytes <= 8 * MiB
    _as_the_cost_model_prices(graph, fast, WITH_SWAP, swap)
    slow = dataclasses.replace(fast, host_link_bandwidth=1e6)
    plan = make_plan(graph, slow, dataclasses.replace(WITH_SWAP, objective="time")).plan
    assert plan.recompute["blocks.*"] is not Recompute.SWAP


def test_swap_within_the_host_memory_and_only_where_asked(graph: ModelGraph) -> None:
    cluster = ClusterSpec(devices=8, device_memory_bytes=8 * MiB, host_link_bandwidth=1e14)
    assert Recompute.SWAP not in PlannerConfig().recompute  # opt-in: priced, not run
    tiny_host = dataclasses.replace(cluster, host_memory_per_node_bytes=8)
    plan = make_plan(graph, tiny_host, dataclasses.replace(WITH_SWAP, objective="time")).plan
    assert plan.recompute["blocks.*"] is not Recompute.SWAP and plan.memory.host == 0
    with pytest.raises(Infeasible):
        make_plan(graph, dataclasses.replace(cluster, device_memory_bytes=MiB), WITH_SWAP)


def test_a_plan_that_swaps_runs_where_one_that_offloads_part_does_not(graph: ModelGraph) -> None:
    """Issue 51: check_plan takes a swapping plan (apply runs the activation savers' host swap
    on every block: tests/distributed/test_train_plan_pipeline.py trains one), one keeping half
    its optimizer on the host (host_optimizer.py) and one keeping a quarter of its parameters
    there (FSDP2's offload of some groups), on one device too (FSDP2 on a mesh of one); units
    below ZeRO-3 with parameters on the host are refused in one line, before tracing."""
    from tidal.models import GPTConfig, build_gpt
    from tidal.planner import Offload

    plan = make_plan(graph, ClusterSpec(devices=8), FLAT).plan
    swapped = dataclasses.replace(plan, recompute={"blocks.*": Recompute.SWAP})
    config = GPTConfig(
        vocab_size=512, seq_len=128, num_layers=8, num_heads=4, d_model=128, dropout=0.1
    )  # fmt: skip (the graph fixture's model)
    check_plan(build_gpt(config, device="meta"), swapped)
    half = dataclasses.replace(swapped, offload=Offload(optimizer=0.5, nvme=0.5))
    check_plan(build_gpt(config, device="meta"), half)
    quarter = Offload(optimizer=0.5, params=0.25)
    below = dataclasses.replace(swapped, offload=quarter)
    assert below.dp > 1 and any(u.zero != 3 for u in below.units if u.memory.params)
    with pytest.raises(ValueError, match="are not ZeRO-3, which is priced but not run yet"):
        check_plan(build_gpt(config, device="meta"), below)  # FSDP2 offloads ZeRO-3 groups
    units = [dataclasses.replace(u, zero=3) for u in swapped.units]
    part = dataclasses.replace(swapped, offload=quarter, units=units)
    check_plan(build_gpt(config, device="meta"), part)  # FSDP2's offload of some groups
    alone = dataclasses.replace(part, dp=1, devices=plan.tp)
    check_plan(build_gpt(config, device="meta"), alone)  # dp 1: FSDP2 on a mesh of one
    whole = dataclasses.replace(alone, units=swapped.units)
    with pytest.raises(ValueError, match="keeps 50% of the optimizer on the host, 25% of the "
                       "parameters; .* are not ZeRO-3, which is priced"):  # fmt: skip
        check_plan(nn.Linear(2, 2), whole)  # refused before tracing


def test_megatron_moves_its_activations_where_the_search_swaps() -> None:
    """Against Megatron-LM at its best ([Note: Megatron's activation offload] in megatron.py):
    where tidal's search may keep activations on the host, Megatron's grid may too (its
    fine-grained activation offloading, with selective recompute), and only there."""
    from tidal.models import GPTConfig, GPTSpec
    from tidal.models.gpt import measure_gpt

    config = GPTConfig(vocab_size=512, seq_len=128, num_layers=8, num_heads=4, d_model=128)
    graph, shape = measure_gpt(config, micro_batch=1), GPTSpec(config=config).transformer_shape()
    cluster = ClusterSpec(devices=8)
    plain = make_plan(graph, cluster, FLAT, shape=shape).megatron
    swapping = make_plan(graph, cluster, WITH_SWAP, shape=shape).megatron
    assert plain is not None and swapping is not None
    moved = swapping.num_configs - plain.num_configs
    assert moved > 0  # selective configurations, once more with their activations moved
    assert not any(r.config.activation_offload for r in plain.frontier)


CLASS_MODES = (Recompute.SWAP_ATTENTION, Recompute.SWAP_MLP, Recompute.SELECTIVE_SWAP_MLP)


@pytest.mark.parametrize("mode", CLASS_MODES)
def test_a_class_on_the_host_is_priced_by_hand(graph: ModelGraph, mode: Recompute) -> None:
    """[Note: savers per tensor class] in tidal/planner/block_savers.py: the class's units'
    activations go to the host, the others stay (the attention core's selective share where
    the mode recomputes it), and the class's copies add what the whole block's compute does
    not cover."""
    from tidal.planner.block_savers import unit_class

    link, held = 1e8, 2.0
    cluster = ClusterSpec(devices=8, host_link_bandwidth=link)
    choice, spec, kept = _priced(graph, cluster, Recompute.NONE, held)
    _, _, priced = _priced(graph, cluster, mode, held)
    inside = [u for u in graph.units if graph.block_of(u) == "blocks.*"]
    assert {unit_class(graph, u) for u in inside} == {"attention", "mlp", "rest"}
    moved = "attention" if mode is Recompute.SWAP_ATTENTION else "mlp"
    blocks = graph.blocks["blocks.*"]
    act = {u.name: choice[u.name].memory.activations for u in inside}
    on_host = sum(act[u.name] for u in inside if unit_class(graph, u) == moved)
    core = next(u for u in inside if u.kind == "attention")
    recomputed = mode is Recompute.SELECTIVE_SWAP_MLP
    saved = act[core.name] - choice[core.name].selective_activations if recomputed else 0.0
    assert priced.memory.host == pytest.approx(held * blocks * on_host) and on_host > 0
    assert kept.memory.activations - priced.memory.activations == pytest.approx(
        held * blocks * (on_host + saved)
    )
    compute = sum(choice[u.name].compute_s for u in inside)
    added = blocks * spec.slots * max(0.0, 2 * on_host / link - compute)
    again = blocks * spec.slots * choice[core.name].forward_s if recomputed else 0.0
    assert priced.step_time_s - kept.step_time_s == pytest.approx(added + again, abs=1e-12)
    assert added > 0  # the slow link shows


def test_the_search_keeps_one_class_on_the_host_where_that_is_the_fastest_fit(
    graph: ModelGraph,
) -> None:
    """Where the block's compute hides the MLP's copies but not the whole block's, at a device
    between what keeping the MLP's activations on the host and keeping nothing there need, one
    class goes to the host: faster than every whole-block mode that fits; the solver's figures
    are the cost model's."""
    config = dataclasses.replace(FLAT, objective="time", tp=2)
    cluster = ClusterSpec(devices=8, device_memory_bytes=int(15.3 * MiB),
                          host_link_bandwidth=3e11)  # fmt: skip
    whole = dataclasses.replace(config, recompute=(*FLAT.recompute, Recompute.SWAP))
    by_class = dataclasses.replace(whole, recompute=(*whole.recompute, *CLASS_MODES))
    found = make_plan(graph, cluster, by_class)
    assert found.plan.recompute["blocks.*"] in CLASS_MODES
    assert found.plan.step_time_s < make_plan(graph, cluster, whole).plan.step_time_s
    assert found.plan.memory.host > 0 and found.plan.peak_memory_bytes <= 15.3 * MiB
    _as_the_cost_model_prices(graph, cluster, by_class, found)
