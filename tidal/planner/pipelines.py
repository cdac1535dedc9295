"""Pipeline stages in the planner's search: ``p`` stages of a ``dp x tp`` mesh each, 1F1B or
interleaved with ``v`` model chunks a rank, each stage priced by the per-unit ILP.

[Note: pipeline stages]
A model with one repeated block of ``L`` layers splits into ``p`` stages of ``k = L / p`` blocks
(Megatron's even split; others in [Note: stage splits] in stage_split.py): the first stage also
holds what comes before the blocks (the embeddings), the last what comes after (the final norm,
the head, the loss); a weight tied across them (GPT's embedding and head) is a copy on each, as
Megatron keeps it. Each stage is
the ILP of its own graph ([Note: the ILP] in ilp.py) with two figures of the schedule:

- ``in_flight``, the micro-batches whose activations a rank holds at once: under 1F1B ``min(p,
  m)`` on the first stage and 1 on the last; interleaved, rank 0 warms up with ``2 (p - 1) + (v
  - 1) p + 1`` chunk micro-batches of ``k / v`` blocks, that is ``p + (p - 1) / v`` of its ``k``
  blocks (Megatron's ``1 + (p - 1) / (p v)`` penalty), and the last rank ``p - (p - 1) / v``,
  each at most ``m``: the warm-up stops at the step's ``m v`` chunk micro-batches (with ``m =
  p = v = 2`` rank 0 holds 2, not 2.5: measured on the chunk stores' meters, which priced
  2.5 over-predicted its activations by 25%);
- ``time_slots``, how often a micro-batch's work lies on the step's critical path: ``m + (p - 1)
  / v`` (the bubble), where ``m`` micro-batches would be ``m``.

PipeMare (asynchronous, opt-in: it trains with weights a few updates stale, so its step time is
not a synchronous schedule's) never drains: ``m`` slots, ``p`` micro-batches in flight on the
first stage whatever ``m`` is, and one weight-sized copy more per stage (its delta for the
discrepancy correction), plus one more built for a unit's backward while it runs ([Note:
backward weights] in tidal/runtime/weights.py).

[Note: PipeMare plans]
PipeMare updates a stage's weights in place between a micro-batch's forward and its backward,
which reads them back through the saved-tensor redirection ([Note: saved-tensor redirection]
in tidal/runtime/weights.py): by the storage of the parameters themselves. A tensor-parallel
stage's DTensors and FSDP2's gathered copies hide that storage, a recompute would run on the
updated weights, and the host optimizer updates elsewhere. So its options are the stages a plan
run can version: one tensor rank, every unit ZeRO-0 (whole on each data rank, whose gradients
the layout's hooks all-reduce), nothing recomputed, none of the model data off the device
(``TrainingSpec.versioned_weights``: the stage's ILP offers nothing else); PipeMare is not
searched where ``--offload`` leaves no offload of none, and lends nothing (plan runs lend
under 1F1B). ``tidal train --plan`` then trains every PipeMare plan ``tidal plan`` makes.

Only the first and the last stage are solved: a middle stage given the first stage's choices
holds fewer micro-batches and no embedding, so it needs no more memory or time than the first.
The step time is the slower of the two, plus the sends between stages (each micro-batch's block
output, ``1 / t`` of it from each tensor rank as Megatron's scatter-gather does, forward and its
gradient back, ``v`` times interleaved), over a node's links while the whole mesh fits in one
node, else the inter-node ones; the gradient collectives of each stage are its own (its
parameters over its data axis). The peak is the larger stage's. ``tidal train --plan`` runs such a
plan ([Note: planned pipeline stages] in tidal/train/plan_stage.py).

[Note: activations on a peer]
MPress's swap to a lightly loaded device, in a pipeline: stage ``s`` of ``p`` holds ``f(s)``
micro-batches in flight, falling linearly from the first stage's ``f(0)`` to the last's (1F1B
with ``m >= p`` and PipeMare: ``p - s``; interleaved: ``p + (p - 1 - 2 s) / v``), so the first
stages overflow while the last have room. Stages pair as MPress pairs them, ``s`` with its
mirror ``p - 1 - s`` (``f(s) + f(p - 1 - s)`` in flight between the two, the same for every
pair), laid out on one node where two stages' devices fit in it (then the pair's link is the
node's, else the inter-node one; the sends between neighbouring stages cross nodes either way
once the pipeline spans more than one). The first stage may keep ``l`` bytes of each
micro-batch's saved activations on its mirror's device: a continuous variable, at most what its
blocks keep that are neither recomputed whole nor swapped to the host (the tensors a plan run
lends, whole blocks and a class of one: [Note: lending in plan runs] in
tidal/train/plan_lending.py), of the ``a`` the stage keeps a micro-batch; under 1F1B with
``m >= p``, where plan runs lend.
They go after the forward and come back before the backward, spread over the stage's ``k``
blocks: the device holds two blocks' worth coming back (``2 l / k``, a transient), and the
copies (``2 l`` a micro-batch over the pair's link) add only what the stage's compute does not
cover (an excess variable). Every stage but the last takes the first stage's choices ([Note:
pipeline stages]), so each middle stage both lends and holds what its mirror lends; the last
lends nothing. With ``D`` the first stage's model data and ``t`` its largest transient:

- the first stage holds ``D + f(0) (a - l) + t``;
- its mirror, the last stage, holds its own peak plus ``f(0) l``: a row more, ``M >=
  peak_last + f(0) l`` (the last stage is solved first, its choices its own: MPress lends what
  the light stages have spare; so ``M``, within the device, covers the lender too);
- middle stage ``s`` holds at most ``D + f(s) (a - l) + f(p - 1 - s) l + t`` (no embedding:
  ``D`` over-counts it), linear in ``s``, so the peak rows for ``s = 1`` and ``s = p - 2``
  bound them all (1F1B under a clipped ``min(p - s, m)``, ``m < p``, is not linear: no lending
  there).

So the ILP's peak ``M`` has a row per transient for each of the three (``lend``, ``lent_row``
and ``base_shifts`` of its ``Problem``, ``_lend_terms`` in ilp.py). Opt-in (``--peer``), for
pipelined plans only (a flat plan's devices are alike: none has room to lend).

[Note: offload per stage]
Each kind of stage keeps its own share of model data off the device (Mist's per-stage offload
ratios): the first stage, holding the most micro-batches in flight, may move its optimizer to
the host while the last keeps all of it. A stage's offload changes only that stage's memory and
time: its host memory, CPUs and disk are its own devices' share of the node's
(``_stage_cluster``), and the sends between stages do not depend on it. So for one option (p, mesh, split,
schedule, micro-batches) the fastest plan that fits is each stage at its own fastest offload
that fits, and the smallest within a step time each stage at its own smallest within it: the
choice is separable, and solving each stage once per offload (``o`` solves, not ``o`` to the
number of stages) finds the best of every combination. :meth:`PipelineOption._best` solves a
stage's offloads in the order of their LP bounds and stops where the next bound cannot beat the
best found. Lending ties the first stage to the last one's peak; there the last is solved
first (its offload its own, as its choices are) and the first chooses given it. A pipeline
rank's model chunks are one stage of this search, so ``tidal train --plan`` gives each rank
its kind's offload for all its chunks (``Plan.rank_offload``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.planner.cluster import ClusterSpec, Mesh
from tidal.planner.cost_model import Costed, block_input, evaluate, mirror_peaks
from tidal.planner.graph import ModelGraph, ParamInfo, Unit, with_micro_batch
from tidal.planner.ilp import Problem, Solution, on_threads
from tidal.planner.plan import NO_OFFLOAD, Offload
from tidal.planner.stage_split import StageSplit, repeated_block, stage_splits
from tidal.planner.strategies import TrainingSpec

__all__ = [
    "PipelineOption",
    "PipelinePlan",
    "PipelineSearch",
    "pipeline_options",
    "search_pipelines",
    "stage_graph",
]


def stage_graph(graph: ModelGraph, *, blocks: int, first: bool, last: bool) -> ModelGraph:
    """The graph of one stage: ``blocks`` of the repeated block, with the units before them if
    ``first`` and those after them if ``last``; see [Note: pipeline stages]."""
    found = repeated_block(graph)
    assert found is not None, "stage_graph needs a model with one repeated block"
    prefix, count = found
    assert blocks >= 1  # more than the model has: the same block repeated further
    inside = [i for i, u in enumerate(graph.units) if graph.block_of(u) == prefix]
    start, end = inside[0], inside[-1]
    kept: list[Unit] = []
    for i, unit in enumerate(graph.units):
        if i < start and not first or i > end and not last:
            continue
        kept.append(dataclasses.replace(unit, count=blocks) if start <= i <= end else unit)
    names = {u.name for u in kept}
    kept = [_untie(u, names) for u in kept]
    edges = []
    for e in graph.edges:
        if e.src in names and e.dst in names:
            both = e.src in _names(graph, prefix) and e.dst in _names(graph, prefix)
            edges.append(dataclasses.replace(e, count=e.count - (count - blocks)) if both else e)
    # a stage of one block keeps its block-to-block edge at count 0: it names what the block
    # hands on (what full recomputation keeps), and costs nothing
    reads = {module: tuple(n for n in units if n in names)
             for module, units in graph.shape_reads.items()}  # fmt: skip
    return dataclasses.replace(graph, units=kept, edges=edges, blocks={prefix: blocks},
                               shape_reads={m: u for m, u in reads.items() if u},
                               handed=not first)  # fmt: skip


def _names(graph: ModelGraph, prefix: str) -> set[str]:
    return {u.name for u in graph.units if graph.block_of(u) == prefix}


def _untie(unit: Unit, present: set[str]) -> Unit:
    """A weight tied to a unit on another stage is a copy of its own here."""
    if all(p.tied_to is None or p.tied_to in present for p in unit.params):
        return unit
    params = [
        p if p.tied_to is None or p.tied_to in present else ParamInfo(name=p.name, shape=p.shape,
                                                                    nbytes=p.nbytes)
        for p in unit.params
    ]  # fmt: skip
    return dataclasses.replace(unit, params=params)


ProblemFn = Callable[[ModelGraph, Mesh, ClusterSpec, TrainingSpec], Problem]
Retrace = Callable[[int], ModelGraph]  # the model's graph at micro-batches of that many rows


@dataclass(kw_only=True, slots=True)
class PipelineOption:
    """One point of the pipeline search: ``pp`` stages of ``mesh`` split as ``split``, ``vp``
    chunks a rank, and the ILPs of its first and last stage, and of a middle one where the
    first does not bound them ([Note: stage splits] in stage_split.py), in that order, each
    once per offload in ``offloads`` (built by :meth:`build`; each stage takes its best:
    [Note: offload per stage])."""

    pp: int
    vp: int
    schedule: str  # one of SCHEDULES
    mesh: Mesh
    cluster: ClusterSpec  # a stage's: N / p devices
    num_microbatches: int
    split: StageSplit
    graphs: tuple[ModelGraph, ...]  # first, last[, middle]
    specs: tuple[TrainingSpec, ...]  # each stage's, its offload one of `offloads`
    send_s: float  # the sends between stages over the whole step
    offloads: tuple[Offload, ...] = (NO_OFFLOAD,)
    problems: tuple[tuple[Problem, ...], ...] | None = None  # each stage's, one per offload
    fastest: tuple[Solution, ...] | None = None

    @property
    def micro_batch(self) -> int:
        return self.graphs[0].micro_batch

    @property
    def lends(self) -> bool:
        """Whether the first stage may keep activations on its mirror ([Note: activations on
        a peer])."""
        return bool(self._problems()[0][0].lent_row)

    def spec(self, stage: int, offload: Offload) -> TrainingSpec:
        """Stage ``stage``'s training spec with ``offload``."""
        return dataclasses.replace(self.specs[stage], offload=offload)

    def _each(self, best: Callable[[int], Any]) -> tuple[Any, ...]:
        """``best`` on every stage at once (HiGHS releases the GIL)."""
        return tuple(on_threads(best, range(len(self.graphs))))

    def _lending(self, best: Callable[..., Solution]) -> tuple[Solution, Solution]:
        """``best`` on the last stage, then on the first, whose peak covers the last's with
        what it lends: the lender's plan first ([Note: activations on a peer]; even splits
        only, so two stages)."""
        last_solved = best(1)
        if not last_solved.feasible:
            return Solution(assignment=None, status="the last stage does not fit"), last_solved
        return best(0, mirror_peak=last_solved.peak_bytes), last_solved

    def build(self, problem: ProblemFn) -> None:
        self.problems = tuple(
            tuple(problem(g, self.mesh, self.cluster, self.spec(i, o)) for o in self.offloads)
            for i, g in enumerate(self.graphs)
        )

    def _problems(self) -> tuple[tuple[Problem, ...], ...]:
        assert self.problems is not None, "build() first"
        return self.problems

    def _best(self, stage: int, solve: Callable[..., Solution], bound: Callable[[Problem], float],
              key: Callable[[Solution], float], mirror_peak: float = -float("inf")) -> Solution:  # fmt: skip
        """Stage ``stage``'s best solution over its offloads (the least ``key``, which
        ``bound`` bounds from below for each offload's problem): solved in the order of their
        bounds until the next bound reaches the best found ([Note: offload per stage])."""
        problems = self._problems()[stage]
        if len(problems) == 1:
            return solve(problems[0], mirror_peak)
        best: Solution | None = None
        for b, i in sorted((bound(p), i) for i, p in enumerate(problems)):
            if best is not None and best.feasible and b >= key(best):
                break
            solved = solve(problems[i], mirror_peak)
            if best is None or solved.feasible and (not best.feasible or key(solved) < key(best)):
                best = solved
        assert best is not None
        return best

    def time_bound_s(self, *, memory_limit: float) -> float:
        """No plan of this option that fits ``memory_limit`` steps faster (LP relaxations)."""
        stages = self._each(lambda i: min(p.bound(objective="time", memory_limit=memory_limit)
                                          for p in self._problems()[i]))  # fmt: skip
        return max(stages) + self.send_s

    def memory_bound_bytes(self, *, time_limit: float) -> float:
        """No plan of this option no slower than ``time_limit`` holds less."""
        budget = time_limit - self.send_s
        if budget <= 0:
            return float("inf")
        return max(self._each(lambda i: min(p.bound(objective="memory", time_limit=budget)
                                            for p in self._problems()[i])))  # fmt: skip

    @property
    def fastest_s(self) -> float:
        if self.fastest is None or not all(s.feasible for s in self.fastest):
            return float("inf")
        return max(s.step_time_s for s in self.fastest) + self.send_s

    def solve_fastest(self, *, memory_limit: float, solver_time_limit_s: float) -> float:
        def solve(problem: Problem, mirror_peak: float) -> Solution:
            return problem.solve(objective="time", memory_limit=memory_limit,
                                 solver_time_limit_s=solver_time_limit_s, refine=False,
                                 mirror_peak=mirror_peak)  # fmt: skip

        def best(stage: int, mirror_peak: float = -float("inf")) -> Solution:
            return self._best(stage, solve, key=lambda s: s.step_time_s, mirror_peak=mirror_peak,
                              bound=lambda p: p.bound(objective="time", memory_limit=memory_limit,
                                                      mirror_peak=mirror_peak))  # fmt: skip

        self.fastest = self._lending(best) if self.lends else self._each(best)
        return self.fastest_s

    def smallest(self, *, memory_limit: float, time_limit: float,
                 solver_time_limit_s: float) -> PipelinePlan | None:  # fmt: skip
        """Every stage at its least memory with the step no slower than ``time_limit``."""
        budget = time_limit - self.send_s
        if budget <= 0:
            return None

        def solve(problem: Problem, mirror_peak: float) -> Solution:
            return problem.solve(objective="memory", memory_limit=memory_limit,
                                 time_limit=budget * (1 + 1e-9),
                                 solver_time_limit_s=solver_time_limit_s, refine=False,
                                 mirror_peak=mirror_peak)  # fmt: skip

        def best(stage: int, mirror_peak: float = -float("inf")) -> Solution:
            return self._best(stage, solve, key=lambda s: s.peak_bytes, mirror_peak=mirror_peak,
                              bound=lambda p: p.bound(objective="memory", time_limit=budget,
                                                      mirror_peak=mirror_peak))  # fmt: skip

        solved = self._lending(best) if self.lends else self._each(best)
        if not all(s.feasible for s in solved):
            return None
        return self.plan(solved)

    def plan(self, solved: tuple[Solution, ...]) -> PipelinePlan:
        costed = []
        for i, (graph, solution) in enumerate(zip(self.graphs, solved, strict=True)):
            assert solution.assignment is not None
            spec = self.spec(i, solution.assignment.offload)
            costed.append(evaluate(graph, solution.assignment, self.cluster, spec))
        return PipelinePlan(option=self, stages=solved, costed=tuple(costed))


@dataclass(kw_only=True, slots=True)
class PipelinePlan:
    """A pipelined plan: the first stage's choices for every stage but the last, or the middle
    stage's for every middle one where it is solved ([Note: stage splits] in stage_split.py)."""

    option: PipelineOption
    stages: tuple[Solution, ...]  # first, last[, middle]
    costed: tuple[Costed, ...]

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_peaks().values())

    def stage_peaks(self) -> dict[str, float]:
        """Each kind of stage's device peak: the first (and, when it lends, the middle stages
        at the two ends of their range), and the last with what the first lends it ([Note:
        activations on a peer])."""
        first, last = self.costed[:2]
        peaks = {"first": first.memory.total, "last": last.memory.total + first.memory.lent}
        middle = [c.memory.total for c in self.costed[2:]]
        middle += mirror_peaks(first.memory, self.option.specs[0])[1:]
        if middle:
            peaks["middle"] = max(middle)
        return peaks

    @property
    def lent_bytes(self) -> float:
        """What a first-stage device keeps on its mirror's (none unless it lends)."""
        return self.costed[0].memory.lent

    @property
    def step_time_s(self) -> float:
        return max(c.step_time_s for c in self.costed) + self.option.send_s

    def describe(self) -> str:
        o = self.option
        chunks = f", v{o.vp}" if o.vp > 1 else ""
        schedule = ", PipeMare (asynchronous)" if o.schedule == "pipemare" else ""
        host = self.describe_offload()
        host = f", {host}" if host else ""
        lent = ", activations lent to the mirror stage" if self.lent_bytes else ""
        split = "" if o.split.is_even else f", blocks {o.split.describe()}"
        return (f"p{o.pp} x dp {o.mesh.dp} x tp {o.mesh.tp}{chunks}{schedule}, "
                f"{o.num_microbatches} micro-batches of {o.micro_batch}{split}{host}{lent}")  # fmt: skip

    def offloads(self) -> tuple[Offload, ...]:
        """Each stage's offload: the first's, the last's[, the middle's]."""
        return tuple(s.assignment.offload for s in self.stages if s.assignment is not None)

    def describe_offload(self) -> str:
        """One offload, or each stage's where they differ; ``""`` for none."""
        offloads = self.offloads()
        if len(set(offloads)) == 1:
            return offloads[0].describe()
        names = ("first", "last", "middle")
        return "; ".join(f"{n} stage: {o.describe() or 'all on the device'}"
                         for n, o in zip(names, offloads, strict=False))  # fmt: skip


def _in_flight(p: int, v: int, m: int) -> tuple[float, float, float]:
    """(first, last, second) stage's micro-batches in flight; see [Note: pipeline stages]."""
    if v == 1:
        return float(min(p, m)), 1.0, float(min(p - 1, m))
    return min(p + (p - 1) / v, m), min(p - (p - 1) / v, m), min(p + (p - 3) / v, m)


def _send_s(graph: ModelGraph, mesh: Mesh, pp: int, vp: int, slots: float,
            cluster: ClusterSpec) -> float:  # fmt: skip
    found = repeated_block(graph)
    assert found is not None
    _, nbytes = block_input(graph, found[0])
    if mesh.devices * pp <= cluster.devices_per_node:
        alpha, bandwidth = cluster.intra_node_latency_s, cluster.intra_node_bandwidth
    else:
        alpha, bandwidth = cluster.inter_node_latency_s, cluster.inter_node_bandwidth
    return slots * vp * 2 * (alpha + nbytes / mesh.tp / bandwidth)


def _peer_bandwidth(mesh: Mesh, cluster: ClusterSpec) -> float:
    """A stage's link to its mirror: the node's where two stages' devices fit in one
    ([Note: activations on a peer]), else the inter-node one."""
    if 2 * mesh.devices <= cluster.devices_per_node:
        return cluster.intra_node_bandwidth
    return cluster.inter_node_bandwidth


def pipeline_options(graph: ModelGraph, cluster: ClusterSpec, *, global_batch: int,
                     base: TrainingSpec, meshes: Callable[[ClusterSpec], list[Mesh]],
                     schedules: tuple[str, ...] = ("1f1b", "interleaved"),
                     offloads: tuple[Offload, ...] = (NO_OFFLOAD,),
                     peer: bool = False, splits: tuple[str, ...] = ("even",),
                     micro_batches: tuple[int, ...] = (),
                     retrace: Retrace | None = None,
                     pp: int | None = None) -> list[PipelineOption]:  # fmt: skip
    """Every ``p > 1`` dividing the devices, each split of the blocks into ``p`` stages
    (``splits``: [Note: stage splits] in stage_split.py), each mesh of the ``N / p`` devices a
    stage has (``meshes``), each micro-batch size (``micro_batches``, default the graph's; the
    model traced at that size by ``retrace``, else the graph scaled: [Note: micro-batch
    scaling] in graph.py) whose micro-batches split the global batch, 1F1B
    and, on even splits, each interleaving ``v`` the micro-batches allow (``m`` divisible by
    ``p``, ``v`` dividing the ``k`` blocks a rank holds); each stage of an option takes its
    own of ``offloads`` ([Note: offload per stage]). ``peer``: on even splits the first stage may lend to its mirror
    where the stages' micro-batches in flight fall linearly (all but 1F1B with ``m < p``:
    [Note: activations on a peer]). ``pp``: that many stages only."""
    if repeated_block(graph) is None:
        return []
    options = []
    for b in micro_batches or (graph.micro_batch,):
        scaled = graph
        if b != graph.micro_batch:
            traced = retrace(b) if retrace is not None else with_micro_batch(graph, b)
            scaled = dataclasses.replace(traced, name=graph.name)
        options += _options_at(scaled, cluster, global_batch=global_batch, base=base,
                               meshes=meshes, schedules=schedules, offloads=offloads, peer=peer,
                               splits=splits, pp=pp)  # fmt: skip
    return options


def _options_at(graph: ModelGraph, cluster: ClusterSpec, *, global_batch: int,
                base: TrainingSpec, meshes: Callable[[ClusterSpec], list[Mesh]],
                schedules: tuple[str, ...], offloads: tuple[Offload, ...], peer: bool,
                splits: tuple[str, ...], pp: int | None) -> list[PipelineOption]:  # fmt: skip
    """:func:`pipeline_options` at the graph's micro-batch size."""
    options = []
    for p in range(2, cluster.devices + 1):
        if cluster.devices % p or pp not in (None, p):
            continue
        stage_cluster = _stage_cluster(cluster, p)
        for split in stage_splits(graph, p, kinds=splits, spec=base, cluster=cluster):
            graphs = _stage_graphs(graph, split)
            for mesh in meshes(stage_cluster):
                per_step = graph.micro_batch * mesh.dp
                if global_batch % per_step:
                    continue
                m = global_batch // per_step
                runs = _runs(schedules, split, m)
                for schedule, v in runs:
                    versioned = schedule == "pipemare"  # [Note: PipeMare plans]
                    stage_offloads = tuple(o for o in offloads if not o) if versioned else offloads
                    if versioned and (mesh.tp > 1 or not stage_offloads):
                        continue
                    slots, flights, copies = _schedule_figures(schedule, p, v, m)
                    specs = tuple(
                        dataclasses.replace(base, num_microbatches=m, in_flight=f,
                                            time_slots=slots, weight_copies=copies,
                                            versioned_weights=versioned)
                        for f in flights[: len(graphs)]
                    )  # fmt: skip
                    # plan runs lend under 1F1B ([Note: lending in plan runs] in
                    # tidal/train/plan_lending.py), with m >= p: fewer clip f(s), not linear
                    if peer and split.is_even and schedule == "1f1b" and m >= p:
                        lender = dataclasses.replace(specs[0], peer_stages=p,
                                                     mirror_in_flight=flights[1],
                                                     peer_bandwidth=_peer_bandwidth(mesh, cluster))  # fmt: skip
                        specs = (lender, *specs[1:])
                    options.append(PipelineOption(
                        pp=p, vp=v, schedule=schedule, mesh=mesh, cluster=stage_cluster,
                        num_microbatches=m, split=split, graphs=graphs, specs=specs,
                        send_s=_send_s(graph, mesh, p, v, slots, cluster),
                        offloads=stage_offloads,
                    ))  # fmt: skip
    return options


def _stage_graphs(graph: ModelGraph, split: StageSplit) -> tuple[ModelGraph, ...]:
    """The first and last stage's graphs, and the middle one's where it is solved ([Note:
    stage splits] in stage_split.py)."""
    graphs: tuple[ModelGraph, ...] = (
        stage_graph(graph, blocks=split.first, first=True, last=False),
        stage_graph(graph, blocks=split.last, first=False, last=True),
    )
    if split.needs_middle:
        graphs += (stage_graph(graph, blocks=split.middle, first=False, last=False),)
    return graphs


def _runs(schedules: tuple[str, ...], split: StageSplit, m: int) -> list[tuple[str, int]]:
    """(schedule, v) of each schedule searched: interleaving only on even splits, its ``v``
    dividing the blocks a rank holds, with ``m`` divisible by ``p``."""
    runs: list[tuple[str, int]] = [(s, 1) for s in ("1f1b", "pipemare") if s in schedules]
    if "interleaved" in schedules and split.is_even and m % len(split.blocks) == 0:
        k = split.first
        runs += [("interleaved", v) for v in range(2, k + 1) if k % v == 0]
    return runs


SCHEDULES = ("1f1b", "interleaved", "pipemare")


def _stage_cluster(cluster: ClusterSpec, p: int) -> ClusterSpec:
    """A stage's ``N / p`` devices; when they are fewer than a node's, the node's host memory,
    CPUs and disk still serve all its devices, so a device's share of them stays as it was."""
    stage = dataclasses.replace(cluster, devices=cluster.devices // p)
    share = stage.devices_on_node / cluster.devices_on_node
    return dataclasses.replace(
        stage, host_memory_per_node_bytes=int(cluster.host_memory_per_node_bytes * share),
        host_adam_params_per_s=cluster.host_adam_params_per_s * share,
        nvme_bytes_per_node=int(cluster.nvme_bytes_per_node * share),
        nvme_bandwidth=cluster.nvme_bandwidth * share,
    )  # fmt: skip


def _schedule_figures(
    schedule: str, p: int, v: int, m: int
) -> tuple[float, tuple[float, float, float], float]:
    """(time slots, (first, last, second) stage's micro-batches in flight, weight copies) of a
    schedule; see [Note: pipeline stages]."""
    if schedule == "pipemare":
        return float(m), (float(p), 1.0, float(max(p - 1, 1))), 1.0
    return m + (p - 1) / v, _in_flight(p, v, m), 0.0


@dataclass(kw_only=True, slots=True)
class PipelineSearch:
    """Every option, built; those :func:`search_pipelines` could not rule out are solved for
    their fastest step."""

    options: list[PipelineOption]
    memory_limit: float
    solver_time_limit_s: float

    @property
    def fastest(self) -> PipelineOption | None:
        solved = [o for o in self.options if o.fastest_s < float("inf")]
        return min(solved, key=lambda o: o.fastest_s) if solved else None

    @property
    def num_solved(self) -> int:
        return sum(o.fastest is not None for o in self.options)

    def smallest(
        self, *, time_limit: float, memory_limit: float | None = None
    ) -> PipelinePlan | None:
        """The smallest pipelined plan no slower than ``time_limit`` (fitting ``memory_limit``,
        by default the device's): options in the order of their LP bound on memory, solved
        until the bound reaches the smallest found ([Note: pipeline stages])."""
        limit = self.memory_limit if memory_limit is None else memory_limit
        bounded = [(o.memory_bound_bytes(time_limit=time_limit), i)
                   for i, o in enumerate(self.options)]  # fmt: skip
        best: PipelinePlan | None = None
        for bound, i in sorted(bounded):
            if bound > limit or (best is not None and bound >= best.peak_memory_bytes):
                break
            plan = self.options[i].smallest(memory_limit=limit, time_limit=time_limit,
                                            solver_time_limit_s=self.solver_time_limit_s)  # fmt: skip
            if plan is not None and (
                best is None or plan.peak_memory_bytes < best.peak_memory_bytes
            ):
                best = plan
        return best


def search_pipelines(graph: ModelGraph, cluster: ClusterSpec, *, global_batch: int,
                     base: TrainingSpec, meshes: Callable[[ClusterSpec], list[Mesh]],
                     problem: ProblemFn, memory_limit: float, solver_time_limit_s: float,
                     slack: float, schedules: tuple[str, ...] = ("1f1b", "interleaved"),
                     offloads: tuple[Offload, ...] = (NO_OFFLOAD,),
                     peer: bool = False, splits: tuple[str, ...] = ("even",),
                     micro_batches: tuple[int, ...] = (),
                     retrace: Retrace | None = None,
                     pp: int | None = None) -> PipelineSearch:  # fmt: skip
    """Build every option, bound each one's fastest step by its LP relaxations, and solve them
    in that order until the bound passes ``1 + slack`` times the fastest found (an option
    further out cannot hold a plan within ``slack`` of the fastest)."""
    options = pipeline_options(graph, cluster, global_batch=global_batch, base=base,
                               meshes=meshes, schedules=schedules, offloads=offloads,
                               peer=peer, splits=splits, micro_batches=micro_batches,
                               retrace=retrace, pp=pp)  # fmt: skip
    for option in options:
        option.build(problem)
    bounded = sorted((o.time_bound_s(memory_limit=memory_limit), i) for i, o in enumerate(options))
    best = float("inf")
    for bound, i in bounded:
        if bound > (1 + slack) * best or bound == float("inf"):
            break
        found = options[i].solve_fastest(memory_limit=memory_limit,
                                         solver_time_limit_s=solver_time_limit_s)  # fmt: skip
        best = min(best, found)
    return PipelineSearch(options=options, memory_limit=memory_limit,
                          solver_time_limit_s=solver_time_limit_s)  # fmt: skip
