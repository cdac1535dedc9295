"""The ILP's terms of what the repeated blocks save: each mode's memory, recomputation and host
copies per unit ([Note: savers per tensor class] in block_savers.py, [Note: activations on the
host] in ilp.py), and the activations a pipeline's first stage lends ([Note: activations on a
peer] in pipelines.py). :func:`~tidal.planner.ilp.build_problem` calls them; the cost model
prices the same fates unit by unit (cost_model.evaluate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tidal.planner.block_savers import HOST_MODES, Fate, fate
from tidal.planner.plan import Layout, Recompute

if TYPE_CHECKING:
    from tidal.planner.cluster import ClusterSpec, Mesh
    from tidal.planner.graph import ModelGraph, Unit
    from tidal.planner.strategies import Candidate, TrainingSpec

__all__ = ["GiB", "Sums", "add", "block_rows", "block_unit_terms", "lend_terms"]


class Problem(Protocol):
    """The ILP as these terms write it (ilp.Problem)."""

    graph: ModelGraph
    mesh: Mesh
    options: dict[str, list[Candidate]]
    modes: tuple[Recompute, ...]
    r: dict[tuple[str, Recompute], int]
    base_row: dict[int, float]
    time_row: dict[int, float]
    seconds: list[int]
    transient_rows: list[tuple[str, dict[int, float]]]
    lend: int | None
    lent_row: dict[int, float]
    base_shifts: list[tuple[str, dict[int, float]]]

    def var(self, integer: bool = False) -> int: ...

    def row(self, name: str, coeffs: dict[int, float], lo: float, hi: float) -> None: ...


GiB = 1024**3
# the modes whose blocks keep all they save, which plan runs lend from ([Note: lending in plan
# runs] in tidal/train/plan_lending.py)
_KEEPING = (Recompute.NONE, Recompute.SELECTIVE)


@dataclass(slots=True)
class Sums:
    """What the units add up to, by column, before the rows that bound them are made."""

    host: dict[int, float] = field(default_factory=dict)  # bytes on the host (model data too)
    nvme: dict[int, float] = field(default_factory=dict)  # ... and on the node's disk
    # [Note: activations on a peer] in pipelines.py: a micro-batch's kept on the device, by
    kept: dict[int, float] = field(default_factory=dict)  # units outside the blocks, inputs
    lendable: dict[int, float] = field(default_factory=dict)  # ... blocks that keep all
    compute: dict[int, float] = field(default_factory=dict)  # ... and its compute seconds
    full_block: dict[str, dict[int, float]] = field(default_factory=dict)  # recomputed whole
    # [Note: activations on the host], by block and mode: what goes, and its copies' seconds
    # past the block's compute
    swapped: dict[tuple[str, Recompute], dict[int, float]] = field(default_factory=dict)
    excess: dict[tuple[str, Recompute], dict[int, float]] = field(default_factory=dict)


def block_unit_terms(problem: Problem, cluster: ClusterSpec, spec: TrainingSpec, sums: Sums, *,
                     unit: Unit, k: int, x: int, block: str, kept_src: tuple[str, float],
                     selective_extra: dict[int, float]) -> None:  # fmt: skip
    """Candidate ``k`` of ``unit`` in ``block`` (its column ``x``) under each of the block's
    modes: a product variable per mode, priced by the unit's fate under it."""
    graph, m, held, n = problem.graph, spec.slots, spec.in_flight, unit.count
    cand = problem.options[unit.name][k]
    y = {mode: _product(problem, x, problem.r[(block, mode)], unit.name, mode)
         for mode in problem.modes}  # fmt: skip
    act = cand.memory.activations
    for mode in problem.modes:
        found = fate(graph, unit, mode)
        kept_now = cand.selective_activations if found is Fate.SELECTIVE else act
        if found in (Fate.KEPT, Fate.SELECTIVE):
            add(problem.base_row, y[mode], held * n * kept_now)
        if found in (Fate.KEPT, Fate.SELECTIVE) and mode in _KEEPING:
            add(sums.lendable, y[mode], n * kept_now)
        if found in (Fate.RECOMPUTED, Fate.SELECTIVE):
            add(problem.time_row, y[mode], n * m * cand.forward_s)
        if found is Fate.RECOMPUTED:
            add(sums.full_block.setdefault(block, {}), y[mode], act)
        if found is Fate.SELECTIVE:
            add(selective_extra, y[mode], act - cand.selective_activations)
        if mode not in HOST_MODES:
            continue
        # the excess row gives some products negative coefficients: bound them above too
        problem.row(f"swap<=x[{unit.name},{k},{mode}]", {y[mode]: 1.0, x: -1.0}, -np.inf, 0.0)
        problem.row(f"swap<=r[{unit.name},{k},{mode}]",
                    {y[mode]: 1.0, problem.r[(block, mode)]: -1.0}, -np.inf, 0.0)  # fmt: skip
        on_host = act if found is Fate.ON_HOST else 0.0
        add(sums.host, y[mode], held * n * on_host)
        add(sums.swapped.setdefault((block, mode), {}), y[mode], 2 * on_host)
        copy_s = 2 * on_host / cluster.host_link_bandwidth - cand.compute_s
        add(sums.excess.setdefault((block, mode), {}), y[mode], copy_s)
    src, nbytes = kept_src
    if unit.name == src:  # a full recomputation keeps the block's input
        split = cand.out_layout in (Layout.SEQ, Layout.HID)
        kept_in = nbytes / (problem.mesh.tp if split else 1)
        add(problem.base_row, y[Recompute.FULL], held * graph.blocks[block] * kept_in)
        add(sums.kept, y[Recompute.FULL], graph.blocks[block] * kept_in)


def block_rows(problem: Problem, spec: TrainingSpec, sums: Sums) -> None:
    """The transients of recomputed and swapped blocks, and the copies' excess seconds."""
    for block, coeffs in sums.full_block.items():
        problem.transient_rows.append((f"recomputed[{block}]", coeffs))
    for (block, mode), coeffs in sums.swapped.items():
        problem.transient_rows.append((f"swapped[{block},{mode}]", coeffs))
    for (block, mode), coeffs in sums.excess.items():
        z = problem.var()
        problem.seconds.append(z)
        problem.row(f"swap_excess[{block},{mode}]",
                    {z: 1.0, **{c: -v for c, v in coeffs.items()}}, 0.0, np.inf)  # fmt: skip
        add(problem.time_row, z, problem.graph.blocks[block] * spec.slots)


def lend_terms(problem: Problem, spec: TrainingSpec, kept: dict[int, float], lendable: dict[int, float], compute: dict[int, float]) -> None:  # fmt: skip
    """[Note: activations on a peer] in pipelines.py, of what its blocks keep."""
    lend = problem.lend = problem.var()  # GiB a micro-batch: bytes would upset HiGHS
    problem.seconds.append(lend)
    held, p, blocks = spec.in_flight, spec.peer_stages, sum(problem.graph.blocks.values())
    add(problem.base_row, lend, -held * GiB)
    problem.row("lent<=lendable", {**{c: v / GiB for c, v in lendable.items()}, lend: -1.0}, 0.0, np.inf)  # fmt: skip
    problem.transient_rows.append(("lent_coming_back", {lend: 2 * GiB / blocks}))
    z = problem.var()  # the copies' seconds a micro-batch past the stage's compute
    problem.seconds.append(z)
    problem.row("lend_excess", {z: 1.0, lend: -2 * GiB / spec.peer_bandwidth, **compute},
                0.0, np.inf)  # fmt: skip
    add(problem.time_row, z, spec.slots)
    problem.lent_row = {lend: held * GiB}
    for s in sorted({1, p - 2}) if p >= 3 else ():
        # f(s) (a - l) + f(p - 1 - s) l against f(0) (a - l): f(s) = f(0) - s step
        fewer = s * spec.in_flight_step
        shift = {c: -fewer * v for c, v in kept.items()}
        shift[lend] = (2 * fewer + spec.mirror_in_flight) * GiB
        problem.base_shifts.append((f"[stage {s}]", shift))


def _product(problem: Problem, x: int, r: int, name: str, mode: Recompute) -> int:
    y = problem.var()
    problem.row(f"product[{name},{mode}]", {y: 1.0, x: -1.0, r: -1.0}, -1.0, np.inf)
    return y


def add(target: dict[int, float], col: int, value: float) -> None:
    """``value`` more on column ``col`` of ``target``: a row's coefficients, or a sum's."""
    if value:
        target[col] = target.get(col, 0.0) + value
