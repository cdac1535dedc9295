"""A solution as a :class:`~tidal.planner.plan.Plan`, flat or pipelined: what ``tidal plan``
writes and ``tidal train --plan`` runs."""

from __future__ import annotations

import dataclasses

from tidal.planner.cost_model import Assignment, Costed
from tidal.planner.measure import ModelGraph
from tidal.planner.pipelines import PipelinePlan
from tidal.planner.plan import PipelineLayout, Plan, StageChoices, UnitChoice
from tidal.planner.strategies import TrainingSpec

__all__ = ["stage_kinds", "to_pipelined_plan", "to_plan"]


def _unit_choices(graph: ModelGraph, assignment: Assignment, costed: Costed) -> list[UnitChoice]:
    units = []
    for unit in graph.units:
        cand = assignment.choice[unit.name]
        units.append(
            UnitChoice(
                name=unit.name,
                module=unit.module,
                segment=unit.segment,
                kind=unit.kind,
                strategy=cand.strategy,
                in_layout=cand.in_layout,
                out_layout=cand.out_layout,
                zero=cand.zero,
                count=unit.count,
                memory=costed.unit_memory[unit.name],
                time_s=costed.unit_time_s[unit.name],
                ops=unit.ops,
            )
        )
    return units


def to_plan(graph: ModelGraph, assignment: Assignment, costed: Costed, spec: TrainingSpec) -> Plan:
    """The :class:`Plan` (plain data) of a costed assignment."""
    units = _unit_choices(graph, assignment, costed)
    mesh = assignment.mesh
    return Plan(
        model=graph.name,
        devices=mesh.devices,
        dp=mesh.dp,
        tp=mesh.tp,
        micro_batch=graph.micro_batch,
        seq_len=graph.seq_len,
        num_microbatches=spec.num_microbatches,
        units=units,
        recompute=dict(assignment.recompute),
        memory=costed.memory,
        step_time_s=costed.step_time_s,
        edges=[(e.src, e.dst, e.count) for e in graph.edges],
        offload=assignment.offload,
        activation_element_bytes=graph.element_bytes,
    )


def stage_kinds(blocks: tuple[int, ...], virtual_stages: int, *,
                middle: bool) -> tuple[str, ...]:  # fmt: skip
    """Whose choices each of the ``len(blocks) * virtual_stages`` stages takes ([Note: pipeline
    stages] in pipelines.py): its rank's, as the rank was priced (its model chunks together are
    one stage of the search): the first's on rank 0, the last's on the rank holding the last
    stage, the middle's where it was solved, else the first's."""
    pp = len(blocks)
    ranks = ["first" if r == 0 else "last" if r == pp - 1 else "middle" if middle else "first"
             for r in range(pp)]  # fmt: skip
    return tuple(ranks[s % pp] for s in range(pp * virtual_stages))


def _block_ranges(blocks: tuple[int, ...], virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """Each stage's blocks: rank ``r`` holds ``blocks[r]``, over its ``virtual_stages`` chunks
    of equal size when interleaved (the planner interleaves even splits only)."""
    sizes = list(blocks)
    if virtual_stages > 1:
        assert len(set(blocks)) == 1 and blocks[0] % virtual_stages == 0, blocks
        sizes = [blocks[0] // virtual_stages] * (len(blocks) * virtual_stages)
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


def to_pipelined_plan(pipelined: PipelinePlan) -> Plan:
    """The :class:`Plan` of a pipelined solution ([Note: plan pipelines] in plan.py)."""
    option = pipelined.option
    names = ("first", "last", "middle")[: len(option.graphs)]
    stages = {}
    for name, graph, solution, costed in zip(names, option.graphs, pipelined.stages,
                                             pipelined.costed, strict=True):  # fmt: skip
        assert solution.assignment is not None
        (count,) = graph.blocks.values()  # stage_graph's: the one repeated block
        stages[name] = StageChoices(
            kind=name, blocks=count, units=_unit_choices(graph, solution.assignment, costed),
            recompute=dict(solution.assignment.recompute), memory=costed.memory,
            step_time_s=costed.step_time_s, offload=solution.assignment.offload,
        )  # fmt: skip
    blocks = option.split.blocks
    layout = PipelineLayout(
        pp=option.pp, virtual_stages=option.vp, schedule=option.schedule,
        block_ranges=_block_ranges(blocks, option.vp),
        kinds=stage_kinds(blocks, option.vp, middle=option.split.needs_middle),
        stages=stages, send_s=option.send_s,
    )  # fmt: skip
    peak = max(stages.values(), key=lambda c: c.memory.total)
    first = pipelined.stages[0].assignment
    assert first is not None
    # the first stage's plan, then what the whole pipeline holds and takes
    return dataclasses.replace(
        to_plan(option.graphs[0], first, pipelined.costed[0], option.specs[0]),
        devices=option.pp * option.mesh.devices, memory=peak.memory,
        step_time_s=pipelined.step_time_s, pipeline=layout,
    )  # fmt: skip
