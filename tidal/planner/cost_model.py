"""Model, part two: resharding between units, and the cost of a whole assignment.

:func:`evaluate` prices a complete choice (one candidate per unit, one recomputation mode per
repeated block) the way the ILP does, term by term, so the solver can be checked against brute
force and the baselines are priced by the same rules as the plans they are compared with.

[Note: peak memory]
The peak per device is the model data (parameters, gradients, optimizer state), plus every
activation saved for backward (all of them are alive when the last forward ends and backward
begins), plus the largest transient: one unit's gathered weights or full-size buffers, or the
activations a recomputed block brings back during its backward. It is a maximum over transients,
not a sum: the ILP writes it as ``M >= base + transient_k`` for every candidate transient ``k``.

[Note: edge costs]
An edge from producer ``a`` to consumer ``b`` converts ``a``'s output layout to ``b``'s input
layout in forward, and in backward converts the gradient ``b`` returns (its ``in_grad``) to the
layout ``a`` needs for its output's gradient (the same layout, except that a partial-sum output
takes a replicated gradient). A column-parallel linear fed a replicated input returns a partial
gradient: that is the all-reduce Megatron's ``f`` operator does in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.planner.block_savers import HOST_MODES, Fate, fate
from tidal.planner.cluster import Axis, ClusterSpec, Collective, Mesh, collective_s
from tidal.planner.measure import ModelGraph
from tidal.planner.plan import NO_OFFLOAD, Layout, MemoryBreakdown, Offload, Recompute
from tidal.planner.strategies import Candidate, TrainingSpec

__all__ = ["Assignment", "Costed", "block_input", "convert_s", "edge_s", "evaluate", "mirror_peaks"]


def convert_s(src: Layout, dst: Layout, nbytes: float, mesh: Mesh, cluster: ClusterSpec) -> float:
    """Seconds to turn a tensor of ``nbytes`` (whole) from layout ``src`` into ``dst``."""
    if src is dst or (src is Layout.R and dst is not Layout.P):
        return 0.0

    def tp(kind: Collective) -> float:
        return collective_s(kind, nbytes, mesh, Axis.TENSOR, cluster)

    if src is Layout.P:
        return tp(Collective.ALL_REDUCE if dst is Layout.R else Collective.REDUCE_SCATTER)
    if dst is Layout.R:
        return tp(Collective.ALL_GATHER)
    if dst is Layout.P:
        raise AssertionError("no unit takes a partial-sum input")
    return tp(Collective.ALL_TO_ALL)


def _grad_layout(out: Layout) -> Layout:
    return Layout.R if out is Layout.P else out


def edge_s(a: Candidate, b: Candidate, nbytes: float, mesh: Mesh, cluster: ClusterSpec) -> float:
    """Forward plus backward resharding on one edge, per micro-batch; see [Note: edge costs]."""
    forward = convert_s(a.out_layout, b.in_layout, nbytes, mesh, cluster)
    backward = convert_s(b.in_grad, _grad_layout(a.out_layout), nbytes, mesh, cluster)
    return forward + backward


def block_input(graph: ModelGraph, prefix: str) -> tuple[str, float]:
    """The unit of block ``prefix`` whose output enters the next block, and its bytes: what full
    recomputation keeps."""
    order = {u.name: i for i, u in enumerate(graph.units)}
    inside = {u.name for u in graph.units if graph.block_of(u) == prefix}
    for e in graph.edges:
        if e.src in inside and e.dst in inside and order[e.src] > order[e.dst]:
            return e.src, e.nbytes
    raise ValueError(f"block {prefix} has no edge into its next repetition")


@dataclass(kw_only=True, slots=True)
class Assignment:
    """A complete choice: a candidate per unit name, a recomputation mode per block."""

    mesh: Mesh
    choice: dict[str, Candidate]
    recompute: dict[str, Recompute]
    offload: Offload = NO_OFFLOAD  # [Note: model data offload] in strategies.py
    # bytes of each micro-batch's saved activations kept on the mirror stage's device
    # ([Note: activations on a peer] in pipelines.py)
    lent_bytes: float = 0.0


@dataclass(kw_only=True, slots=True)
class Costed:
    memory: MemoryBreakdown
    step_time_s: float
    unit_memory: dict[str, MemoryBreakdown]
    unit_time_s: dict[str, float]


def _activations(found: Fate, cand: Candidate) -> float:
    """What a unit keeps on the device between its forward and backward, by its fate."""
    if found is Fate.SELECTIVE:
        return cand.selective_activations
    return cand.memory.activations if found is Fate.KEPT else 0.0


def evaluate(
    graph: ModelGraph, assignment: Assignment, cluster: ClusterSpec, spec: TrainingSpec
) -> Costed:
    """Peak memory ([Note: peak memory]) and step time of ``assignment``."""
    mesh, choice, m, held = assignment.mesh, assignment.choice, spec.slots, spec.in_flight
    total = MemoryBreakdown()
    unit_memory: dict[str, MemoryBreakdown] = {}
    unit_time: dict[str, float] = {}
    transients = [0.0]
    recomputed: dict[str, float] = {}
    swapped: dict[str, float] = {}  # [Note: activations on the host] in ilp.py
    excess: dict[str, float] = {}
    for unit in graph.units:
        cand = choice[unit.name]
        block = graph.block_of(unit)
        mode = assignment.recompute.get(block, Recompute.NONE) if block else Recompute.NONE
        # [Note: savers per tensor class] in block_savers.py
        found = Fate.KEPT if block is None else fate(graph, unit, mode)
        mine = MemoryBreakdown(
            params=cand.memory.params,
            grads=cand.memory.grads,
            optimizer=cand.memory.optimizer,
            activations=held * _activations(found, cand),
            transient=cand.memory.transient,
            redundant=cand.memory.redundant,
            host=cand.memory.host,
            nvme=cand.memory.nvme,
        )
        if block is not None and mode in HOST_MODES:
            on_host = cand.memory.activations if found is Fate.ON_HOST else 0.0
            mine.host += held * on_host
            swapped[block] = swapped.get(block, 0.0) + 2 * on_host
            copy_s = 2 * on_host / cluster.host_link_bandwidth - cand.compute_s
            excess[block] = excess.get(block, 0.0) + copy_s
        unit_memory[unit.name] = mine
        for name in ("params", "grads", "optimizer", "activations", "redundant", "host", "nvme"):
            setattr(total, name, getattr(total, name) + unit.count * getattr(mine, name))
        transients.append(cand.memory.transient)
        if block is not None and found is Fate.RECOMPUTED:
            recomputed[block] = recomputed.get(block, 0.0) + cand.memory.activations
        elif found is Fate.SELECTIVE:
            transients.append(cand.memory.activations - cand.selective_activations)
        again_s = cand.forward_s if found in (Fate.RECOMPUTED, Fate.SELECTIVE) else 0.0
        per_mb = cand.compute_s + cand.comm_s + again_s
        unit_time[unit.name] = unit.count * (m * per_mb + cand.sync_s)
    for prefix, mode in assignment.recompute.items():
        if mode is Recompute.FULL:
            src, nbytes = block_input(graph, prefix)
            layout = choice[src].out_layout
            kept = nbytes / (mesh.tp if layout in (Layout.SEQ, Layout.HID) else 1)
            total.activations += held * graph.blocks[prefix] * kept
    transients.extend(recomputed.values())
    transients.extend(swapped.values())
    lend_s = 0.0
    if assignment.lent_bytes:  # [Note: activations on a peer] in pipelines.py
        lent = assignment.lent_bytes
        assert spec.peer_stages and lent <= total.activations / held * (1 + 1e-6), (
            f"lends {lent} bytes a micro-batch, of {total.activations / held} it keeps, to "
            f"{'a' if spec.peer_stages else 'no'} mirror"
        )
        total.activations -= held * lent
        total.lent = held * lent
        transients.append(2 * lent / sum(graph.blocks.values()))
        compute_s = sum(u.count * choice[u.name].compute_s for u in graph.units)
        lend_s = m * max(0.0, 2 * lent / spec.peer_bandwidth - compute_s)
    total.transient = max(transients)
    edges_s = sum(
        e.count * m * edge_s(choice[e.src], choice[e.dst], e.nbytes, mesh, cluster)
        for e in graph.edges
    )
    swap_s = sum(graph.blocks[b] * m * max(0.0, seconds) for b, seconds in excess.items())
    step = sum(unit_time.values()) + edges_s + swap_s + lend_s
    return Costed(memory=total, step_time_s=step, unit_memory=unit_memory, unit_time_s=unit_time)


def mirror_peaks(memory: MemoryBreakdown, spec: TrainingSpec) -> list[float]:
    """The device peaks of the stages that take the first stage's choices when it lends
    ([Note: activations on a peer] in pipelines.py): the first's own, and the middle stages' at the
    two ends of their range (each holds its own kept activations and what its mirror lends).
    One peak, the first's, for a stage that does not lend or a pipeline of two."""
    peaks = [memory.total]
    p = spec.peer_stages
    if p < 3:
        return peaks
    kept = memory.activations / spec.in_flight  # per micro-batch in flight
    lent = memory.lent / spec.in_flight
    for s in sorted({1, p - 2}):  # it holds s * step fewer; its mirror s * step more than the last
        fewer = s * spec.in_flight_step
        peaks.append(memory.total - fewer * kept + (spec.mirror_in_flight + fewer) * lent)
    return peaks
