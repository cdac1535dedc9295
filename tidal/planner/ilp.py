"""Solve: the plan as an integer linear program on scipy's HiGHS (``scipy.optimize.milp``).

[Note: the ILP]
Variables, for one mesh:

- ``x[u,k]`` binary: unit ``u`` takes candidate ``k`` (strategy and ZeRO level); one per unit,
  shared by every occurrence of a repeated block's unit;
- ``r[b,mode]`` binary: repeated block ``b`` recomputes with ``mode`` (none, selective, full);
- ``y[u,k,mode]`` continuous, ``>= x[u,k] + r[b,mode] - 1``: the product of the two, for units
  inside a block (activation bytes and recompute time depend on both);
- ``e[edge,a,b]`` continuous: the edge's producer gives layout class ``a`` and its consumer takes
  class ``b``; row and column sums equal the two units' ``x`` sums (integral once ``x`` is);
- ``M`` continuous: the peak, ``M >= base + transient_k`` for each transient ``k``
  ([Note: peak memory] in cost_model.py).

With model data offloaded, a row more keeps the units' host bytes within the device's share of
its node's host memory, and one its NVMe bytes within its share of the node's disk ([Note:
model data offload] in strategies.py).

[Note: activations on the host]
A block may also keep its saved tensors on the host (``Recompute.SWAP``, MPress's host swap,
searched only where asked): each goes down after the block's forward and comes back before its
backward, on a side stream, so the device holds none of the block's activations between the
two, but the block input full recomputation keeps is not kept either. Per micro-batch the
device holds at most two blocks' worth (one in use, the next coming back: a transient), and
the host ``in_flight`` micro-batches' worth of every swapped block (the host row). The copies,
``2 * activations / host_link_bandwidth`` a block and micro-batch, overlap the block's own
forward and backward (``compute_s`` of its units): only what exceeds them adds to the step,
``z_b >= sum over the block's units (copy - compute)``, ``z_b >= 0`` (a continuous variable per
block, exact at an optimum since it only costs time). The host link is also what offloaded
model data crosses; the two are priced as if each had it alone. ``tidal train --plan`` runs it
with the activation savers' host swap on every repetition of the block (``_recompute`` in
tidal/parallel/plan_apply.py; [Note: savers in place] in tidal/activations/apply.py), which
copies a DTensor's local share.

Every coefficient a product variable carries is non-negative and the products only appear on
the cost side, so the lower bounds alone make them exact at an optimum. Objectives: minimum time
with ``M <= device memory``, or minimum ``M`` with time ``<= (1 + eps) * T*``; each with a tiny
weight on the other term to break ties. The LP relaxation is solved first; its bound gives the
reported gap.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from tidal.planner.block_savers import HOST_MODES
from tidal.planner.cluster import ClusterSpec, Mesh
from tidal.planner.cost_model import Assignment, block_input, edge_s
from tidal.planner.ilp_blocks import GiB, Sums, block_rows, block_unit_terms, lend_terms
from tidal.planner.ilp_blocks import add as _add
from tidal.planner.measure import ModelGraph
from tidal.planner.plan import NO_OFFLOAD, Offload, Recompute
from tidal.planner.strategies import Candidate, TrainingSpec
from tidal.planner.wiring import code_to_code

__all__ = ["Problem", "Solution", "build_problem", "on_threads"]

T = TypeVar("T")
R = TypeVar("R")

_MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
_TIE = 1e-4
MIP_REL_GAP = 1e-4  # HiGHS stops within this relative gap of its bound


@dataclass(kw_only=True, slots=True)
class Solution:
    """An optimum: the assignment, the objective's two terms as the ILP sees them, the gap."""

    assignment: Assignment | None
    status: str
    peak_bytes: float = float("inf")
    step_time_s: float = float("inf")
    lp_bound: float = float("nan")
    objective: float = float("nan")
    solve_s: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.assignment is not None

    @property
    def lp_gap(self) -> float:
        """Relative gap between the MILP optimum and its LP relaxation (0 = LP was integral)."""
        if not self.feasible or not np.isfinite(self.lp_bound) or self.objective == 0:
            return float("nan")
        return max(0.0, (self.objective - self.lp_bound) / abs(self.objective))


@dataclass(kw_only=True)
class Problem:
    """The ILP of one graph on one mesh; :meth:`solve` for an objective."""

    graph: ModelGraph
    mesh: Mesh
    options: dict[str, list[Candidate]]
    offload: Offload = NO_OFFLOAD  # the spec's ([Note: model data offload] in strategies.py)
    # the blocks' modes with a variable: SWAP only where some block may take it
    modes: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    seconds: list[int] = field(default_factory=list)  # continuous variables not within [0, 1]
    num_vars: int = 0
    integer: list[int] = field(default_factory=list)
    x: dict[tuple[str, int], int] = field(default_factory=dict)
    r: dict[tuple[str, Recompute], int] = field(default_factory=dict)
    time_row: dict[int, float] = field(default_factory=dict)
    base_row: dict[int, float] = field(default_factory=dict)
    # [Note: activations on a peer] in pipelines.py: the column of the bytes a micro-batch
    # lends (in GiB; None: no mirror), the bytes on the mirror's device, the middle stages'
    # peaks as shifts of base_row (name, coefficients)
    lend: int | None = None
    lent_row: dict[int, float] = field(default_factory=dict)
    base_shifts: list[tuple[str, dict[int, float]]] = field(default_factory=list)
    transient_rows: list[tuple[str, dict[int, float]]] = field(default_factory=list)
    rows: list[tuple[str, dict[int, float], float, float]] = field(default_factory=list)
    # the constraint matrix with its bounds, built at the first solve ([Note: the ILP])
    _rows: tuple[Any, np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _bounds_seen: dict[tuple[Any, ...], float] = field(default_factory=dict, repr=False)

    def var(self, integer: bool = False) -> int:
        self.num_vars += 1
        if integer:
            self.integer.append(self.num_vars - 1)
        return self.num_vars - 1

    def row(self, name: str, coeffs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((name, coeffs, lo, hi))

    # -- solving ---------------------------------------------------------------------------
    def solve(
        self,
        *,
        objective: str,
        memory_limit: float = float("inf"),
        time_limit: float = float("inf"),
        solver_time_limit_s: float = 60.0,
        refine: bool = True,
        gap: float = MIP_REL_GAP,
        mirror_peak: float = -float("inf"),
    ) -> Solution:
        """``objective="time"``: fastest under ``memory_limit``; ``"memory"``: smallest peak
        under ``time_limit`` (seconds per step). With ``refine``, ties in the objective go to
        the other term: a second solve holds the first optimum and minimises the other. ``gap``:
        HiGHS stops within this relative gap of its bound. ``mirror_peak``: the peak of the
        stage that holds what this one lends, before it does; the peak covers it with the lent
        bytes ([Note: activations on a peer] in pipelines.py)."""
        first = self._solve(objective, memory_limit, time_limit, solver_time_limit_s, gap,
                            mirror_peak)  # fmt: skip
        if not first.feasible or not refine:
            return first
        slack = 1 + 1e-6
        if objective == "time":
            limits = (memory_limit, first.step_time_s * slack + 1e-9)
        else:
            limits = (first.peak_bytes * slack + 1.0, time_limit)
        other = "memory" if objective == "time" else "time"
        second = self._solve(other, *limits, solver_time_limit_s, gap, mirror_peak)
        if not second.feasible:  # numerically at the edge: keep the first optimum
            return first
        second.lp_bound, second.objective = first.lp_bound, first.objective
        second.solve_s += first.solve_s
        return second

    def bound(
        self,
        *,
        objective: str,
        memory_limit: float = float("inf"),
        time_limit: float = float("inf"),
        mirror_peak: float = -float("inf"),
    ) -> float:
        """A lower bound on :meth:`solve`'s optimum for ``objective`` (step seconds, or peak
        bytes): the LP relaxation without the tie-break term; inf where even it is infeasible.
        Cheaper than a solve, so a search over many problems solves only those it cannot rule
        out. Each is computed once: the rows do not change after the first solve or bound."""
        key = (objective, memory_limit, time_limit, mirror_peak)
        if key not in self._bounds_seen:
            c, constraint, peak = self._program(objective, memory_limit, time_limit, mirror_peak,
                                                tie=0.0)  # fmt: skip
            with _native_stdout_silenced():
                relaxed = milp(c, constraints=constraint, bounds=self._bounds(peak))
            self.num_vars -= 1
            found = float("inf") if relaxed.x is None else float(relaxed.fun)
            self._bounds_seen[key] = found * (GiB if objective == "memory" else 1.0)
        return self._bounds_seen[key]

    def _program(
        self, objective: str, memory_limit: float, time_limit: float,
        mirror_peak: float = -float("inf"), *, tie: float = _TIE,
    ) -> tuple[np.ndarray, LinearConstraint, int]:  # fmt: skip
        """The objective vector, the constraints and the peak's column of one solve (the peak
        variable is this solve's: the caller gives it back). The rows are built once per
        problem; a solve changes only the limits, the last three rows."""
        peak = self.var()  # in GiB: byte-sized coefficients would upset HiGHS's tolerances
        c = np.zeros(self.num_vars)
        for col, v in self.time_row.items():
            c[col] += (1.0 if objective == "time" else tie) * v
        c[peak] = tie if objective == "time" else 1.0
        if self._rows is None:
            self._rows = self._limit_rows(peak)
        matrix, lo, hi = self._rows
        lo, hi = lo.copy(), hi.copy()
        lo[-3] = mirror_peak / GiB
        hi[-2], hi[-1] = memory_limit / GiB, time_limit
        return c, LinearConstraint(matrix, lo, hi), peak

    def _limit_rows(self, peak: int) -> tuple[Any, np.ndarray, np.ndarray]:
        rows = list(self.rows)
        for shift_name, shift in [("", {}), *self.base_shifts]:
            base = dict(self.base_row)
            for col, v in shift.items():
                base[col] = base.get(col, 0.0) + v
            for name, transient in self.transient_rows:
                coeffs = {col: -v / GiB for col, v in base.items()}
                for col, v in transient.items():
                    coeffs[col] = coeffs.get(col, 0.0) - v / GiB
                coeffs[peak] = 1.0
                rows.append((f"peak{shift_name}>={name}", coeffs, 0.0, np.inf))
        mirror = {col: -v / GiB for col, v in self.lent_row.items()}
        mirror[peak] = 1.0
        rows.append(("peak>=mirror+lent", mirror, -np.inf, np.inf))
        rows.append(("peak<=device_memory", {peak: 1.0}, -np.inf, np.inf))
        rows.append(("time<=limit", dict(self.time_row), -np.inf, np.inf))
        built = _constraints(rows, self.num_vars)
        return built.A, np.asarray(built.lb, dtype=float), np.asarray(built.ub, dtype=float)

    def _solve(
        self,
        objective: str,
        memory_limit: float,
        time_limit: float,
        solver_time_limit_s: float,
        gap: float = MIP_REL_GAP,
        mirror_peak: float = -float("inf"),
    ) -> Solution:
        started = time.perf_counter()
        c, constraint, peak = self._program(objective, memory_limit, time_limit, mirror_peak)
        integrality = np.zeros(self.num_vars)
        options = {"time_limit": solver_time_limit_s, "mip_rel_gap": gap}
        with _native_stdout_silenced():
            relaxed = milp(c, constraints=constraint, bounds=self._bounds(peak))
            integrality[self.integer] = 1
            result = milp(
                c,
                constraints=constraint,
                integrality=integrality,
                bounds=self._bounds(peak),
                options=options,
            )
        self.num_vars -= 1  # the peak variable belongs to this solve only
        elapsed = time.perf_counter() - started
        if result.x is None:
            return Solution(assignment=None, status=result.message, solve_s=elapsed)
        values = result.x
        return Solution(
            assignment=self._assignment(values),
            status=result.message,
            peak_bytes=float(values[peak]) * GiB,
            step_time_s=float(sum(v * values[col] for col, v in self.time_row.items())),
            lp_bound=float(relaxed.fun) if relaxed.x is not None else float("nan"),
            objective=float(result.fun),
            solve_s=elapsed,
        )

    def _bounds(self, peak: int):
        upper = np.ones(self.num_vars)
        upper[peak] = np.inf
        upper[self.seconds] = np.inf
        return Bounds(np.zeros(self.num_vars), upper)

    def _assignment(self, values: np.ndarray) -> Assignment:
        choice = {}
        for unit in self.graph.units:
            opts = self.options[unit.name]
            k = max(range(len(opts)), key=lambda i: values[self.x[(unit.name, i)]])
            choice[unit.name] = opts[k]
        recompute = {
            b: max(self.modes, key=lambda mode: values[self.r[(b, mode)]])
            for b in self.graph.blocks
        }
        lent = 0.0 if self.lend is None else max(0.0, float(values[self.lend])) * GiB
        return Assignment(mesh=self.mesh, choice=choice, recompute=recompute,
                          offload=self.offload, lent_bytes=lent)  # fmt: skip


class _StdoutSilencer:
    """HiGHS 1.x prints a debugging line from C++ on some MIP solves, past ``disp=False``; keep
    it off the user's terminal by pointing file descriptor 1 at /dev/null meanwhile. Solves may
    run on several threads at once (HiGHS releases the GIL): the first to enter redirects, the
    last to leave restores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._saved: tuple[int, int] | None = None  # (stdout's copy, /dev/null)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._saved = self._redirect()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0 and self._saved is not None:
                    saved, devnull = self._saved
                    os.dup2(saved, 1)
                    os.close(saved)
                    os.close(devnull)
                    self._saved = None

    @staticmethod
    def _redirect() -> tuple[int, int] | None:
        sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no file descriptor 1 (an embedding host): nothing to silence
            return None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        return saved, devnull


_native_stdout_silenced = _StdoutSilencer()


def on_threads(solve: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``solve`` on each item, two at a time, results in order: HiGHS releases the GIL, so two
    ILPs solve at once (the stdout silencer above is shared by them)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(solve, items))


def _constraints(rows: list, num_vars: int) -> LinearConstraint:
    data, cols, indptr, lo, hi = [], [], [0], [], []
    for _, coeffs, low, high in rows:
        for col, v in coeffs.items():
            if v != 0.0:
                cols.append(col)
                data.append(v)
        indptr.append(len(cols))
        lo.append(low)
        hi.append(high)
    matrix = csr_array((data, cols, indptr), shape=(len(rows), num_vars))
    return LinearConstraint(matrix, np.array(lo), np.array(hi))


def build_problem(
    graph: ModelGraph,
    mesh: Mesh,
    options: dict[str, list[Candidate]],
    cluster: ClusterSpec,
    spec: TrainingSpec,
    *,
    recompute_modes: dict[str, tuple[Recompute, ...]] | None = None,
) -> Problem:
    """The ILP of [Note: the ILP] for ``graph`` on ``mesh`` with the candidates ``options``."""
    problem = Problem(graph=graph, mesh=mesh, options=options, offload=spec.offload)
    asked = {mode for modes in (recompute_modes or {}).values() for mode in modes}
    problem.modes = (*_MODES, *(m for m in HOST_MODES if m in asked))
    for unit in graph.units:
        if not options[unit.name]:
            raise ValueError(f"unit {unit.name} has no candidate strategy on {mesh}")
        cols = [problem.var(integer=True) for _ in options[unit.name]]
        for k, col in enumerate(cols):
            problem.x[(unit.name, k)] = col
        problem.row(f"one_strategy[{unit.name}]", dict.fromkeys(cols, 1.0), 1.0, 1.0)
    for prefix in graph.blocks:
        allowed = (recompute_modes or {}).get(prefix, _MODES)
        cols = [problem.var(integer=True) for _ in problem.modes]
        for mode, col in zip(problem.modes, cols, strict=True):
            problem.r[(prefix, mode)] = col
            if mode not in allowed:
                problem.row(f"recompute_not_allowed[{prefix},{mode}]", {col: 1.0}, 0.0, 0.0)
        problem.row(f"one_recompute[{prefix}]", dict.fromkeys(cols, 1.0), 1.0, 1.0)
    _unit_terms(problem, cluster, spec)
    _edge_terms(problem, cluster, spec)
    _tie_terms(problem)
    _fused_projection_terms(problem)
    return problem


def _unit_terms(problem: Problem, cluster: ClusterSpec, spec: TrainingSpec) -> None:
    graph, m, held = problem.graph, spec.slots, spec.in_flight
    sums = Sums()
    kept_src = {prefix: block_input(graph, prefix) for prefix in graph.blocks}
    for unit in graph.units:
        block, n = graph.block_of(unit), unit.count
        transient: dict[int, float] = {}
        selective_extra: dict[int, float] = {}
        for k, cand in enumerate(problem.options[unit.name]):
            x = problem.x[(unit.name, k)]
            _add(problem.base_row, x, n * cand.memory.resident)
            _add(sums.compute, x, n * cand.compute_s)
            _add(problem.time_row, x, n * (m * (cand.compute_s + cand.comm_s) + cand.sync_s))
            _add(transient, x, cand.memory.transient)
            _add(sums.host, x, n * cand.memory.host)
            _add(sums.nvme, x, n * cand.memory.nvme)
            if block is None:
                _add(problem.base_row, x, held * n * cand.memory.activations)
                _add(sums.kept, x, n * cand.memory.activations)
                continue
            block_unit_terms(problem, cluster, spec, sums, unit=unit, k=k, x=x, block=block,
                             kept_src=kept_src[block], selective_extra=selective_extra)  # fmt: skip
        problem.transient_rows.append((unit.name, transient))
        if selective_extra:
            problem.transient_rows.append((f"selective[{unit.name}]", selective_extra))
    block_rows(problem, spec, sums)
    if spec.peer_stages:
        lend_terms(problem, spec, {**sums.kept, **sums.lendable}, sums.lendable, sums.compute)
    if sums.host:  # the node's devices together within its host memory
        problem.row("host_memory", sums.host, 0.0, cluster.host_bytes_per_device)
    if sums.nvme:  # ... and its disk (none: a plan that puts bytes there is infeasible)
        problem.row("nvme", sums.nvme, 0.0, cluster.nvme_bytes_per_device)


def _edge_terms(problem: Problem, cluster: ClusterSpec, spec: TrainingSpec) -> None:
    m, mesh = spec.slots, problem.mesh
    verbatim = code_to_code(problem.graph)  # [Note: plan realisation] in plan_apply.py
    for edge in problem.graph.edges:
        a_opts, b_opts = problem.options[edge.src], problem.options[edge.dst]
        if edge.src == edge.dst:
            for k, cand in enumerate(a_opts):
                cost = edge_s(cand, cand, edge.nbytes, mesh, cluster)
                _add(problem.time_row, problem.x[(edge.src, k)], edge.count * m * cost)
            continue
        a_classes = _classes(a_opts, lambda c: (c.out_layout,))
        b_classes = _classes(b_opts, lambda c: (c.in_layout, c.in_grad))
        e = {}
        for ia, a_members in a_classes.items():
            for ib, b_members in b_classes.items():
                if (edge.src, edge.dst) in verbatim and ia[0] != ib[0]:
                    continue  # code hands code its tensor as it made it
                col = problem.var()
                e[(ia, ib)] = col
                cost = edge_s(
                    a_opts[a_members[0]], b_opts[b_members[0]], edge.nbytes, mesh, cluster
                )
                _add(problem.time_row, col, edge.count * m * cost)
        tag = f"{edge.src}->{edge.dst}"
        for ia, members in a_classes.items():
            coeffs = {e[(ia, ib)]: 1.0 for ib in b_classes if (ia, ib) in e}
            for k in members:
                coeffs[problem.x[(edge.src, k)]] = -1.0
            problem.row(f"edge_out[{tag},{ia}]", coeffs, 0.0, 0.0)
        for ib, members in b_classes.items():
            coeffs = {e[(ia, ib)]: 1.0 for ia in a_classes if (ia, ib) in e}
            for k in members:
                coeffs[problem.x[(edge.dst, k)]] = -1.0
            problem.row(f"edge_in[{tag},{ib}]", coeffs, 0.0, 0.0)


def _classes(options: list[Candidate], key) -> dict[tuple, list[int]]:
    classes: dict[tuple, list[int]] = {}
    for k, cand in enumerate(options):
        classes.setdefault(key(cand), []).append(k)
    return classes


def _fused_projection_terms(problem: Problem) -> None:
    """Heads split only what a column-parallel fused projection gives them.

    A fused q/k/v output (an attention input larger than the attention's output) laid out
    ``[q; k; v]`` splits into whole heads only from a column-parallel projection whose rows are
    ordered per rank ([Note: fused qkv under tensor parallelism] in parallel/plan_apply.py); slicing,
    reduce-scattering or all-to-all-ing the fused tensor along its last dim would hand a rank
    part of q and part of k."""
    from tidal.planner.plan import StrategyName

    graph = problem.graph
    for edge in graph.edges:
        dst = graph.unit(edge.dst)
        if dst.kind != "attention" or edge.nbytes <= 1.5 * dst.out_bytes:
            continue
        coeffs = {
            problem.x[(edge.dst, k)]: 1.0
            for k, c in enumerate(problem.options[edge.dst])
            if c.strategy is StrategyName.HEADS
        }
        for k, c in enumerate(problem.options[edge.src]):
            if c.strategy is StrategyName.COLWISE:
                coeffs[problem.x[(edge.src, k)]] = -1.0
        if coeffs:
            problem.row(f"fused_heads[{edge.src}->{edge.dst}]", coeffs, -np.inf, 0.0)


def _tie_terms(problem: Problem) -> None:
    """A shared weight has one placement in every unit that uses it (its ZeRO level is the
    owner's: the other units count none of its bytes)."""
    for unit in problem.graph.units:
        for i, p in enumerate(unit.params):
            if p.tied_to is None:
                continue
            owner = problem.graph.unit(p.tied_to)
            j = next(
                (j for j, q in enumerate(owner.params) if q.tied_to is None and q.shape == p.shape),
                None,
            )
            if j is None:
                raise ValueError(f"{p.name} is tied to {p.tied_to}, which has no such parameter")
            mine = _classes(problem.options[unit.name], lambda c, i=i: (c.placements[i],))
            theirs = _classes(problem.options[owner.name], lambda c, j=j: (c.placements[j],))
            for key in set(mine) | set(theirs):
                coeffs = {problem.x[(unit.name, k)]: 1.0 for k in mine.get(key, [])}
                for k in theirs.get(key, []):
                    coeffs[problem.x[(owner.name, k)]] = -1.0
                problem.row(f"tied[{p.name},{key[0]}]", coeffs, 0.0, 0.0)
