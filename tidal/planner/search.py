"""The planner's front door: measure -> model -> solve over every mesh -> emit a :class:`Plan`.

:func:`make_plan` tries each ``dp x tp`` factorisation the model allows (``tp`` within a node,
dividing the heads and feature sizes, ``dp`` dividing the global batch), solves each mesh's ILP,
and keeps the best plan for the objective:

- ``memory``: the smallest peak whose step time is within ``(1 + eps)`` of the fastest plan that
  fits (the fastest over all meshes);
- ``time``: the fastest plan that fits in the device memory.

When nothing fits, it solves for the smallest peak on each mesh and reports that as the least
device memory that would work, with the units holding most of it ([`Infeasible`]).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tidal.config.configurable import ConfigError, format_bytes, require
from tidal.planner.baselines import Baseline, baseline, megatron_tp
from tidal.planner.cluster import ClusterSpec, Mesh
from tidal.planner.config import PlannerConfig
from tidal.planner.cost_model import Costed, evaluate
from tidal.planner.emit import to_pipelined_plan, to_plan
from tidal.planner.ilp import Problem, Solution, build_problem, on_threads
from tidal.planner.measure import ModelGraph
from tidal.planner.megatron import MegatronBest, TransformerShape, megatron_best, megatron_grid
from tidal.planner.model_data import with_model_data
from tidal.planner.pipelines import PipelinePlan, PipelineSearch, Retrace, search_pipelines
from tidal.planner.plan import NO_OFFLOAD, Offload, Plan, Recompute
from tidal.planner.strategies import (
    TrainingSpec,
    indivisible,
    unit_options,
    valid_tensor_sizes,
)
from tidal.planner.wiring import structure_graph

__all__ = ["Infeasible", "PlannerConfig", "PlanResult", "make_plan", "plan_for", "to_plan"]


class Infeasible(ValueError):
    """No plan fits the device memory; says the least memory that would do and who needs it."""

    def __init__(
        self, device_memory: float, needed: float, mesh: Mesh, top: list[tuple[str, float]]
    ):
        self.needed_bytes = needed
        self.mesh = mesh
        self.top_units = top
        units = ", ".join(f"{name} {format_bytes(int(b))}" for name, b in top)
        super().__init__(
            f"no plan fits in {format_bytes(int(device_memory))} per device: the least any plan "
            f"needs is {format_bytes(int(needed))} (dp {mesh.dp} x tp {mesh.tp}); most of it is "
            f"held by {units}. Use devices with at least that much memory, more devices, "
            "or a smaller micro-batch"
        )


@dataclass(kw_only=True, slots=True)
class MeshResult:
    mesh: Mesh
    fastest: Solution
    problem: Problem


@dataclass(kw_only=True, frozen=True, slots=True)
class Compared:
    """A plan, flat or pipelined, as it is set beside a baseline."""

    peak_memory_bytes: float
    step_time_s: float
    layout: str  # "dp 8 x tp 8", or a pipeline's description

    @classmethod
    def of(cls, plan: Solution | PipelinePlan) -> Compared:
        if isinstance(plan, PipelinePlan):
            return cls(peak_memory_bytes=plan.peak_memory_bytes, step_time_s=plan.step_time_s,
                       layout=plan.describe())  # fmt: skip
        assert plan.assignment is not None
        mesh = plan.assignment.mesh
        return cls(peak_memory_bytes=plan.peak_bytes, step_time_s=plan.step_time_s,
                   layout=f"dp {mesh.dp} x tp {mesh.tp}")  # fmt: skip


def _smaller(*plans: Compared | None) -> Compared | None:
    found = [p for p in plans if p is not None]
    return min(found, key=lambda p: (p.peak_memory_bytes, p.step_time_s)) if found else None


@dataclass(kw_only=True, slots=True)
class PlanResult:
    """What :func:`make_plan` found: ``plan`` is the chosen one, flat or pipelined ([Note: the
    chosen plan]); ``solution`` and ``costed`` are the best flat plan's."""

    plan: Plan
    solution: Solution
    costed: Costed
    solve_s: float  # the whole search, every phase below included
    fastest_s: float
    meshes: list[MeshResult]
    baselines: dict[str, Baseline] = field(default_factory=dict)
    pareto: list[dict[str, float]] = field(default_factory=list)

    matched: dict[str, Solution] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)  # seconds of each phase, in order
    # the best pipelined plan for the objective, chosen as the flat one is among its kind
    pipeline: PipelinePlan | None = None
    pipelines: PipelineSearch | None = None
    pipeline_pareto: list[tuple[float, PipelinePlan]] = field(default_factory=list)
    # Megatron-LM at its real configuration ([Note: Megatron's memory] in megatron.py), and the
    # plans set beside its rows: the smallest at its fastest fitting configuration's step time
    # and the smallest at any speed, flat or pipelined
    megatron: MegatronBest | None = None
    # the best flat plan, where the pipelined one was chosen ([Note: the chosen plan])
    flat: Plan | None = None
    against_megatron: dict[str, Compared | None] = field(default_factory=dict)

    def saving(self, name: str) -> float:
        """Fraction of the baseline's peak memory this plan saves."""
        other = self.baselines[name].peak_memory_bytes
        return 1.0 - self.plan.peak_memory_bytes / other if math.isfinite(other) else float("nan")

    def matched_saving(self, name: str) -> float:
        """Fraction of the baseline's peak memory saved by the smallest plan that is at least
        as fast as the baseline (the paper's "at similar throughput")."""
        other = self.baselines[name].peak_memory_bytes
        mine = self.matched[name].peak_bytes if name in self.matched else float("nan")
        return 1.0 - mine / other if math.isfinite(other) else float("nan")


def _spec(graph: ModelGraph, mesh: Mesh, config: PlannerConfig, devices: int,
          offload: Offload = NO_OFFLOAD) -> TrainingSpec:  # fmt: skip
    """The training figures on ``mesh``, which :func:`meshes_for` kept: its batch splits."""
    spec = _spec_if_split(graph, mesh, config, devices, offload)
    assert spec is not None, f"{mesh} does not split the global batch: meshes_for drops it"
    return spec


def _spec_if_split(
    graph: ModelGraph,
    mesh: Mesh,
    config: PlannerConfig,
    devices: int,
    offload: Offload = NO_OFFLOAD,
) -> TrainingSpec | None:
    global_batch = config.global_batch or devices * graph.micro_batch
    per_step = graph.micro_batch * mesh.dp
    if global_batch % per_step:
        return None
    return TrainingSpec(
        num_microbatches=global_batch // per_step,
        param_bytes=config.param_bytes,
        grad_bytes=config.grad_bytes,
        optimizer_bytes=config.optimizer_bytes,
        offload=offload,
        chunked_weights=config.model_data == "chunks",  # [Note: chunk stages in plans]
    )


def meshes_for(graph: ModelGraph, cluster: ClusterSpec, config: PlannerConfig) -> list[Mesh]:
    valid = valid_tensor_sizes(graph.units, cluster.devices, cluster.devices_per_node)
    if config.tp is not None:
        if config.tp not in valid:
            blocker = indivisible(graph.units, config.tp)
            why = f": {blocker}" if blocker else ""
            raise ConfigError(
                "tp",
                f"{config.tp} does not split this model on {cluster.devices} devices "
                f"(it must divide the devices and every attention unit's heads and feature "
                f"size, and fit in a node of {cluster.devices_per_node}){why}; choose one of "
                f"{', '.join(map(str, valid))}",
            )
        valid = [config.tp]
    meshes = [Mesh(dp=cluster.devices // t, tp=t) for t in valid]
    meshes = [mesh for mesh in meshes if _spec_if_split(graph, mesh, config, cluster.devices)]
    if not meshes:
        raise ConfigError(
            "global_batch",
            f"{config.global_batch} sequences do not split into micro-batches of "
            f"{graph.micro_batch} over any data-parallel size; use a multiple of "
            f"{graph.micro_batch * cluster.devices}",
        )
    return meshes


def _problem(
    graph: ModelGraph, mesh: Mesh, cluster: ClusterSpec, spec: TrainingSpec, config: PlannerConfig
) -> Problem:
    options = unit_options(graph, mesh, cluster, spec)
    # PipeMare recomputes nothing ([Note: PipeMare plans] in pipelines.py)
    modes = dict.fromkeys(graph.blocks, (Recompute.NONE,) if spec.versioned_weights
                          else config.recompute)  # fmt: skip
    return build_problem(graph, mesh, options, cluster, spec, recompute_modes=modes)


def make_plan(
    graph: ModelGraph,
    cluster: ClusterSpec,
    config: PlannerConfig,
    *,
    progress: Callable[[str], None] | None = None,
    shape: TransformerShape | None = None,
    retrace: Retrace | None = None,
) -> PlanResult:
    """The best plan for ``config.objective``; raises :class:`Infeasible` when none fits.
    ``progress`` is told each stage of the search as it starts (a mesh, a baseline). ``shape``:
    the decoder's sizes, to price Megatron-LM's whole grid beside the layout baselines.
    ``retrace``: the model's graph at another micro-batch size, for ``config.micro_batches``
    (default: ``graph`` scaled, [Note: micro-batch scaling] in graph.py)."""
    say = progress or (lambda _line: None)
    started = clock = time.perf_counter()
    phases_s: dict[str, float] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases_s[phase] = now - clock
        clock = now

    require(
        cluster.nvme_bytes_per_node > 0 or not any(o.nvme for o in config.offloads()),
        "offload_nvme",
        "puts optimizer state on the nodes' NVMe, and the cluster has none: give its size "
        "(tidal plan --nvme 30TB, ClusterSpec.nvme_bytes_per_node)",
    )
    limit = float(cluster.device_memory_bytes)
    results = _solve_meshes(graph, cluster, config, limit, say)
    feasible = [r for r in results if r.fastest.feasible]
    if not feasible:
        raise _diagnose(graph, cluster, results, config)
    fastest_s = min(r.fastest.step_time_s for r in feasible)
    best = _best(feasible, config, limit, fastest_s, config.eps)
    lap("meshes")
    assignment = best.assignment
    assert assignment is not None, "_best chooses among feasible solutions only"
    spec = _spec(graph, assignment.mesh, config, cluster.devices, assignment.offload)
    costed = evaluate(graph, assignment, cluster, spec)
    plan = to_plan(graph, assignment, costed, spec)
    result = PlanResult(
        plan=plan,
        solution=best,
        costed=costed,
        solve_s=0.0,
        fastest_s=fastest_s,
        meshes=results,
        phases_s=phases_s,
    )
    if config.pipelines and config.pp != 1:
        _search_pipelines(result, graph, cluster, config, limit, say, retrace)
        _choose(result, config)
        lap("pipelines")
    result.plan = with_model_data(result.plan, config.model_data)
    if config.pareto:
        say("the memory-time frontier")
        result.pareto = _pareto(graph, cluster, feasible, config, limit, fastest_s)
        lap("pareto")
    if config.pipeline_pareto:
        say("the pipelined plans' memory-time frontier")
        result.pipeline_pareto = _pipeline_pareto(result, config)
        lap("pipeline pareto")
    if config.baselines:
        _compare_with_baselines(result, graph, cluster, config, say)
        lap("baselines")
    if shape is not None:
        _compare_with_megatron(result, shape, cluster, config, graph.micro_batch, say)
        lap("megatron")
    result.solve_s = time.perf_counter() - started
    return result


def plan_for(
    model: nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    devices: int,
    cluster: ClusterSpec | None = None,
    config: PlannerConfig | None = None,
) -> Plan:
    """The plan for your own ``model`` on ``devices`` devices, traced on ``inputs`` (a sample
    of what it is called with, on any device: only shapes and dtypes are read; dim 0 is the
    rows of one micro-batch on one data-parallel rank); train with it through
    ``tidal.Trainer(model, config, train_data=..., plan=plan)``. ``cluster``: the devices'
    figures (default: an H100 node's); ``config``: the search (default: the plan alone, no
    pipelines, frontier or baselines). See [Note: models without tokens] in wiring.py."""
    cluster = cluster or ClusterSpec(devices=devices, devices_per_node=min(devices, 8))
    require(
        cluster.devices == devices, "cluster", f"is for {cluster.devices} devices, not {devices}"
    )
    config = config or PlannerConfig(pareto=(), baselines=(), pipelines=False)
    sample = inputs if isinstance(inputs, tuple) else (inputs,)
    return make_plan(structure_graph(model, inputs=sample), cluster, config).plan


def _solve_meshes(graph: ModelGraph, cluster: ClusterSpec, config: PlannerConfig, limit: float,
                  say: Callable[[str], None]) -> list[MeshResult]:  # fmt: skip
    """Each ``dp x tp`` mesh's ILP (one per offload), solved for its fastest plan that fits."""
    results = []
    for mesh in meshes_for(graph, cluster, config):
        for offload in config.offloads():
            host = f", {offload.describe()}" if offload else ""
            say(f"solving dp {mesh.dp} x tp {mesh.tp}{host}")
            spec = _spec(graph, mesh, config, cluster.devices, offload)
            problem = _problem(graph, mesh, cluster, spec, config)
            fastest = problem.solve(
                objective="time",
                memory_limit=limit,
                solver_time_limit_s=config.solver_time_limit_s,
                refine=config.objective == "time",
            )
            results.append(MeshResult(mesh=mesh, fastest=fastest, problem=problem))
    return results


def _compare_with_baselines(result: PlanResult, graph: ModelGraph, cluster: ClusterSpec,
                            config: PlannerConfig, say: Callable[[str], None]) -> None:  # fmt: skip
    """The layout baselines, each with the smallest plan at its step time."""
    say(f"the baselines: {', '.join(config.baselines)}")
    result.baselines = _baselines(graph, cluster, config)
    for name, base in result.baselines.items():
        if base.solution.feasible:
            say(f"the smallest plan at {name}'s step time")
            matched = _smallest_within(result.meshes, config, base.step_time_s)
            if matched is not None:
                result.matched[name] = matched


def _search_pipelines(result: PlanResult, graph: ModelGraph, cluster: ClusterSpec,
                      config: PlannerConfig, limit: float, say: Callable[[str], None],
                      retrace: Retrace | None) -> None:  # fmt: skip
    """Pipeline stages of the model's repeated block, the best chosen as the flat plan is."""

    def meshes(stage: ClusterSpec) -> list[Mesh]:
        sizes = valid_tensor_sizes(graph.units, stage.devices, stage.devices_per_node)
        return [Mesh(dp=stage.devices // t, tp=t) for t in sizes if config.tp in (None, t)]

    def problem(stage_graph: ModelGraph, mesh: Mesh, stage: ClusterSpec,
                spec: TrainingSpec) -> Problem:  # fmt: skip
        return _problem(stage_graph, mesh, stage, spec, config)

    say("pipeline stages: every p x dp x tp, 1F1B and interleaved")
    base = _spec_if_split(graph, Mesh(dp=1, tp=1), config, cluster.devices)
    assert base is not None  # one micro-batch a step always splits
    search = search_pipelines(
        graph, cluster, global_batch=config.global_batch or cluster.devices * graph.micro_batch,
        base=base, meshes=meshes, problem=problem, memory_limit=limit,
        solver_time_limit_s=config.solver_time_limit_s, slack=config.eps,
        schedules=config.schedules, offloads=config.offloads(),
        peer=config.peer, splits=config.stage_splits, micro_batches=config.micro_batches,
        retrace=retrace, pp=config.pp,
    )  # fmt: skip
    result.pipelines = search
    fastest = search.fastest
    if fastest is None or fastest.fastest is None:
        return
    if config.objective == "time":
        result.pipeline = fastest.plan(fastest.fastest)
    else:
        result.pipeline = search.smallest(time_limit=(1 + config.eps) * fastest.fastest_s)


def _choose(result: PlanResult, config: PlannerConfig) -> None:
    """Make the pipelined plan the chosen one where it beats the flat one.

    [Note: the chosen plan]
    The flat plan is the best of the ``dp x tp`` meshes and the pipelined one the best of the
    pipelines, each chosen within its kind. Across the two: under ``time`` the faster; under
    ``memory`` the smaller of those within ``1 + eps`` of the faster one's fastest step (each
    kind's own choice is within ``1 + eps`` of its fastest, so the kind holding the overall
    fastest step always qualifies). Ties keep the flat plan: it needs no pipeline.
    """
    pipelined, search = result.pipeline, result.pipelines
    fastest = None if search is None else search.fastest
    if pipelined is None or fastest is None:
        require(config.pp is None, "pp", f"no plan of {config.pp} pipeline stages fits: "
                "use another --pp, or leave it out")  # fmt: skip
        return
    flat = result.plan
    if config.pp is not None:
        better = True  # the pipeline asked for
    elif config.objective == "time":
        better = pipelined.step_time_s < flat.step_time_s
    else:
        window = (1 + config.eps) * min(result.fastest_s, fastest.fastest_s)
        if flat.step_time_s > window * (1 + 1e-9):
            better = True
        else:
            better = (pipelined.step_time_s <= window * (1 + 1e-9)
                      and pipelined.peak_memory_bytes < flat.peak_memory_bytes)  # fmt: skip
    if better:
        result.flat = flat
        result.plan = to_pipelined_plan(pipelined)


def _pipeline_pareto(result: PlanResult, config: PlannerConfig) -> list[tuple[float, PipelinePlan]]:
    """The pipelined plans' frontier: the least memory within each ``eps`` of their fastest."""
    search = result.pipelines
    fastest = search.fastest if search is not None else None
    if search is None or fastest is None:
        return []
    frontier = []
    for eps in config.pipeline_pareto:
        plan = search.smallest(time_limit=(1 + eps) * fastest.fastest_s)
        if plan is not None:
            frontier.append((eps, plan))
    return frontier


MEGATRON_SLACK = 0.05  # a plan compared with Megatron-LM's fastest at up to this much slower


def _compare_with_megatron(result: PlanResult, shape: TransformerShape, cluster: ClusterSpec,
                           config: PlannerConfig, micro_batch: int,
                           say: Callable[[str], None]) -> None:  # fmt: skip
    """Megatron-LM's grid for the same global batch, and the plans to set beside its best: the
    smallest at its fastest fitting configuration's step time and at ``1 + MEGATRON_SLACK``
    times it (issue 24's target compares there), and the smallest at any speed."""
    say("Megatron-LM's grid (t x p x d, sequence parallel, recompute, distributed optimizer, "
        "interleaving, micro-batch)")  # fmt: skip
    global_batch = config.global_batch or cluster.devices * micro_batch
    # Megatron-Core offloads its optimizer only ([Note: Megatron's optimizer offload]), and its
    # activations where tidal's search has its host swap ([Note: Megatron's activation offload])
    offloads = tuple(sorted({o.optimizer for o in config.offloads()}))
    swaps = (False, True) if Recompute.SWAP in config.recompute else (False,)
    rows = megatron_grid(shape, cluster, global_batch=global_batch, offloads=offloads,
                         activation_offloads=swaps)  # fmt: skip
    result.megatron = megatron_best(rows, cluster.device_memory_bytes)
    fastest = result.megatron.fastest
    found: dict[str, Compared | None] = {"at_fastest_step_time": None}
    if fastest is not None:
        say("the smallest plan at Megatron-LM's best step time")
        found["at_fastest_step_time"] = _smallest_plan(result, config, fastest.step_time_s)
        limit = (1 + MEGATRON_SLACK) * fastest.step_time_s
        found["within_slack_of_fastest"] = _smallest_plan(result, config, limit)
    say("the smallest plan at any speed")
    found["least_memory"] = _smallest_plan(result, config, math.inf)
    result.against_megatron = found


def _smallest_plan(result: PlanResult, config: PlannerConfig, time_limit: float) -> Compared | None:
    """The smallest plan, flat or pipelined, no slower than ``time_limit``; fitting or not."""
    flat = _smallest_within(result.meshes, config, time_limit)
    piped = None
    if result.pipelines is not None:
        piped = result.pipelines.smallest(time_limit=time_limit, memory_limit=math.inf)
    return _smaller(
        None if flat is None else Compared.of(flat), None if piped is None else Compared.of(piped)
    )


def _smallest_within(
    results: list[MeshResult], config: PlannerConfig, time_limit: float
) -> Solution | None:
    """The smallest peak of any plan no slower than ``time_limit``, on any mesh, fitting or
    not (a baseline need not fit either)."""
    best = None
    solutions = on_threads(
        lambda r: r.problem.solve(
            objective="memory",
            time_limit=time_limit * (1 + 1e-9),
            solver_time_limit_s=config.solver_time_limit_s,
            refine=False,
        ),
        results,
    )
    for solution in solutions:
        if solution.feasible and (best is None or solution.peak_bytes < best.peak_bytes):
            best = solution
    return best


def _best(
    feasible: list[MeshResult], config: PlannerConfig, limit: float, fastest_s: float, eps: float
) -> Solution:
    if config.objective == "time":
        return min((r.fastest for r in feasible), key=lambda s: s.step_time_s)
    solutions = []
    for r in feasible:
        if r.fastest.step_time_s > (1 + eps) * fastest_s:
            continue
        solution = r.problem.solve(
            objective="memory",
            memory_limit=limit,
            time_limit=(1 + eps) * fastest_s * (1 + 1e-9),  # eps = 0 keeps the fastest itself
            solver_time_limit_s=config.solver_time_limit_s,
        )
        if solution.feasible:
            solutions.append(solution)
    if not solutions:  # only numerical edge cases: the fastest plan always qualifies
        return min((r.fastest for r in feasible), key=lambda s: s.step_time_s)
    return min(solutions, key=lambda s: (s.peak_bytes, s.step_time_s))


def _pareto(
    graph: ModelGraph,
    cluster: ClusterSpec,
    feasible: list[MeshResult],
    config: PlannerConfig,
    limit: float,
    fastest_s: float,
) -> list[dict[str, Any]]:
    frontier = []
    for eps in config.pareto:
        sweep = dataclasses.replace(config, objective="memory")
        best = _best(feasible, sweep, limit, fastest_s, eps)
        assert best.assignment is not None, "_best chooses among feasible solutions only"
        mesh = best.assignment.mesh
        frontier.append(
            {
                "eps": eps,
                "peak_memory_bytes": best.peak_bytes,
                "step_time_s": best.step_time_s,
                "dp": mesh.dp,
                "tp": mesh.tp,
                "offload": best.assignment.offload.to_dict(),
            }
        )
    return frontier


def _baselines(
    graph: ModelGraph, cluster: ClusterSpec, config: PlannerConfig
) -> dict[str, Baseline]:
    valid = valid_tensor_sizes(graph.units, cluster.devices, cluster.devices_per_node)
    t = megatron_tp(graph, cluster, valid)

    def spec_for(mesh: Mesh) -> TrainingSpec | None:
        return _spec(graph, mesh, config, cluster.devices)

    found = {}
    for name in config.baselines:
        result = baseline(name, graph, cluster, spec_for, t)
        if result is not None:
            found[name] = result
    return found


def _diagnose(
    graph: ModelGraph, cluster: ClusterSpec, results: list[MeshResult], config: PlannerConfig
) -> Infeasible:
    smallest = None
    for r in results:
        solution = r.problem.solve(
            objective="memory", solver_time_limit_s=config.solver_time_limit_s
        )
        if solution.feasible and (smallest is None or solution.peak_bytes < smallest.peak_bytes):
            smallest = solution
    if smallest is None or smallest.assignment is None:  # each offload overflows the host
        disk = (f" and {format_bytes(cluster.nvme_bytes_per_node)} of NVMe"
                if cluster.nvme_bytes_per_node else "")  # fmt: skip
        raise ConfigError(
            "offload",
            f"no plan's offloaded model data fits the host memory of "
            f"{format_bytes(int(cluster.host_memory_per_node_bytes))}{disk} per node at the "
            f"fractions {', '.join(map(str, config.offload))}; add smaller ones (0 keeps it on "
            "the device)",
        )
    mesh, offload = smallest.assignment.mesh, smallest.assignment.offload
    costed = evaluate(
        graph, smallest.assignment, cluster, _spec(graph, mesh, config, cluster.devices, offload)
    )
    held = {
        u.name: u.count
        * (costed.unit_memory[u.name].resident + costed.unit_memory[u.name].activations)
        for u in graph.units
    }
    top = sorted(held.items(), key=lambda kv: -kv[1])[:3]
    return Infeasible(cluster.device_memory_bytes, costed.memory.total, mesh, top)
