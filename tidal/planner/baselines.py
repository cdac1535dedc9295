"""Baselines priced by the planner's own cost model: Megatron-LM's layouts and plain ZeRO.

Each baseline is the planner's ILP with the candidates cut down to what that system does, solved
for time on its fixed mesh. So a baseline is the best its family can do under the same rules, and
the planner's saving against it comes from choices the family does not have.

- ``megatron``: tensor parallel within a node (column-parallel QKV and MLP up-projection,
  row-parallel output projections, heads split, vocabulary-parallel embedding, LM head and
  loss), data parallel across, replicated norms, dropout and residuals, selective recompute:
  ``sbh(10 + 24/t)`` activation bytes per layer;
- ``megatron_sp``: the same with sequence parallelism (norms, dropout and residuals split on the
  sequence, the linear's gathered input re-gathered in backward): ``34 sbh / t``;
- ``megatron_no_recompute``: neither sequence parallelism nor recompute;
- ``zero1`` / ``zero2`` / ``zero3``: data parallel on every device, no recompute;
- ``zero3_full``: ZeRO-3 with full recompute, as DeepSpeed's docs set it up for large models
  (activation checkpointing on). FSDP2 (``fully_shard``, resharding after forward) moves the
  same bytes as ZeRO-3 here, so it has no row of its own;
- ``zero3_offload``: ``zero3_full`` with its fp32 masters and optimizer state on the host and
  updated there (DeepSpeed's ``offload_optimizer`` to the CPU, ZeRO-Offload), priced as [Note:
  model data offload] in strategies.py says;
- ``fsdp2_cpu_offload``: ``zero3_full`` with its parameters, gradients and optimizer state on
  the host and the step run there (FSDP2's ``CPUOffloadPolicy``; DeepSpeed's ``offload_param``
  and ``offload_optimizer`` to the CPU price the same here). FSDP2 steps with torch's CPU
  AdamW, slower than DeepSpeed's CPU Adam, whose rate is the one priced: this row is FSDP2's
  faster side;
- ``zero_infinity``: ``fsdp2_cpu_offload`` with the optimizer state on the nodes' NVMe
  (DeepSpeed's ``offload_optimizer`` to ``nvme``); only where the cluster has a disk.

These are layouts on the plan's own mesh (the seed paper's comparison); Megatron-LM at its real
configuration, with pipeline stages and its distributed optimizer, is megatron.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tidal.planner.cluster import ClusterSpec, Mesh
from tidal.planner.cost_model import Costed, evaluate
from tidal.planner.ilp import Solution, build_problem
from tidal.planner.measure import ModelGraph, Unit
from tidal.planner.plan import NO_OFFLOAD, Layout, Offload, Recompute, StrategyName
from tidal.planner.strategies import Candidate, TrainingSpec, unit_options
from tidal.planner.wiring import input_layouts

__all__ = ["Baseline", "BASELINES", "baseline", "megatron_tp"]

S = StrategyName


@dataclass(kw_only=True, slots=True)
class Baseline:
    name: str
    mesh: Mesh
    solution: Solution
    costed: Costed | None

    @property
    def peak_memory_bytes(self) -> float:
        return self.costed.memory.total if self.costed else float("inf")

    @property
    def step_time_s(self) -> float:
        return self.costed.step_time_s if self.costed else float("inf")


def _is_vocabulary(unit: Unit, graph: ModelGraph) -> bool:
    """The word embedding: the largest embedding table (tied to the LM head if any)."""
    tables = [u for u in graph.units if u.kind == "embedding"]
    return bool(tables) and unit is max(tables, key=lambda u: u.num_params)


def _megatron_rule(sp: bool) -> Callable[[Unit, Candidate, ModelGraph], bool]:
    token_wise = S.SEQUENCE if sp else S.REPLICATE

    def allowed(unit: Unit, cand: Candidate, graph: ModelGraph) -> bool:
        if unit.kind == "linear":
            if cand.strategy is S.ROWWISE:
                return True
            return cand.strategy is S.COLWISE and cand.in_layout is (Layout.SEQ if sp else Layout.R)
        if unit.kind == "embedding":
            return cand.strategy is (S.VOCAB if _is_vocabulary(unit, graph) else token_wise)
        if unit.kind == "attention":
            return cand.strategy is S.HEADS
        if unit.kind == "loss":
            return cand.in_layout is Layout.HID
        if unit.kind == "norm":
            return cand.strategy is token_wise
        if unit.name in split_work_units(graph):  # e.g. the MLP's activation
            return cand.strategy is S.HIDDEN
        return cand.strategy is token_wise

    return allowed


def split_work_units(graph: ModelGraph) -> set[str]:
    """Element-wise units that Megatron runs on tensor-split features: those fed only by linears
    (or other such units) and feeding only linears, attention (or other such units), like an
    MLP's activation or the reshapes of q, k and v. The residual stream is never among them."""
    kinds = {u.name: u.kind for u in graph.units}
    inside = {u.name for u in graph.units if u.kind == "elementwise"}
    changed = True
    while changed:
        changed = False
        for name in sorted(inside):
            into = [
                kinds[e.src] if e.src not in inside else "ok" for e in graph.edges if e.dst == name
            ]
            out = [
                kinds[e.dst] if e.dst not in inside else "ok" for e in graph.edges if e.src == name
            ]
            good = into and out and set(into) <= {"linear", "ok"}
            good = good and set(out) <= {"linear", "attention", "ok"}
            if not good:
                inside.discard(name)
                changed = True
    return inside


def megatron_tp(graph: ModelGraph, cluster: ClusterSpec, valid: list[int]) -> int:
    """Megatron's usual tensor-parallel size: the largest valid one within a node."""
    return max(t for t in valid if t <= cluster.devices_per_node)


def _solve_family(
    name: str,
    graph: ModelGraph,
    mesh: Mesh,
    cluster: ClusterSpec,
    spec: TrainingSpec,
    rule: Callable[[Unit, Candidate, ModelGraph], bool],
    zero: int,
    recompute: Recompute,
) -> Baseline:
    options, every = {}, unit_options(graph, mesh, cluster, spec)
    whole = input_layouts(graph)
    for unit in graph.units:
        opts = every[unit.name]
        level = [c for c in opts if c.zero == min(zero, max(o.zero for o in opts))]
        kept = [c for c in level if rule(unit, c, graph)]
        # a unit that must keep the sequence whole does so under any system's rule
        options[unit.name] = level if unit.name in whole and not kept else kept
    modes: dict[str, tuple[Recompute, ...]] = dict.fromkeys(graph.blocks, (recompute,))
    problem = build_problem(graph, mesh, options, cluster, spec, recompute_modes=modes)
    solution = problem.solve(objective="time")
    assignment = solution.assignment if solution.feasible else None
    costed = evaluate(graph, assignment, cluster, spec) if assignment is not None else None
    return Baseline(name=name, mesh=mesh, solution=solution, costed=costed)


def _any(unit: Unit, cand: Candidate, graph: ModelGraph) -> bool:
    return True


_ON_HOST = Offload(optimizer=1.0, params=1.0)

BASELINES: dict[str, tuple[str, bool, int, Recompute, Offload]] = {
    # name: (family, sequence parallel, ZeRO level, recompute, model data off the device)
    "megatron": ("megatron", False, 0, Recompute.SELECTIVE, NO_OFFLOAD),
    "megatron_sp": ("megatron", True, 0, Recompute.SELECTIVE, NO_OFFLOAD),
    "megatron_no_recompute": ("megatron", False, 0, Recompute.NONE, NO_OFFLOAD),
    "zero1": ("zero", False, 1, Recompute.NONE, NO_OFFLOAD),
    "zero2": ("zero", False, 2, Recompute.NONE, NO_OFFLOAD),
    "zero3": ("zero", False, 3, Recompute.NONE, NO_OFFLOAD),
    "zero3_full": ("zero", False, 3, Recompute.FULL, NO_OFFLOAD),
    "zero3_offload": ("zero", False, 3, Recompute.FULL, Offload(optimizer=1.0)),
    "fsdp2_cpu_offload": ("zero", False, 3, Recompute.FULL, _ON_HOST),
    "zero_infinity": ("zero", False, 3, Recompute.FULL, dataclasses.replace(_ON_HOST, nvme=1.0)),
}


def baseline(
    name: str,
    graph: ModelGraph,
    cluster: ClusterSpec,
    spec_for: Callable[[Mesh], TrainingSpec | None],
    tensor_size: int,
) -> Baseline | None:
    """Baseline ``name`` (a key of :data:`BASELINES`); ``None`` when the global batch does not
    split over its mesh, or it needs a disk the cluster does not have."""
    family, sp, zero, recompute, offload = BASELINES[name]
    if offload.nvme and not cluster.nvme_bytes_per_node:
        return None
    t = tensor_size if family == "megatron" else 1
    mesh = Mesh(dp=cluster.devices // t, tp=t)
    spec = spec_for(mesh)
    if spec is None:
        return None
    spec = dataclasses.replace(spec, offload=offload)
    rule = _megatron_rule(sp) if family == "megatron" else _any
    return _solve_family(name, graph, mesh, cluster, spec, rule, zero, recompute)
