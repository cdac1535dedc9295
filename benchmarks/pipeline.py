"""``tidal bench pipeline``: measured pipeline throughput on gloo ranks against the simulator.

A GPT with untied embeddings (so the asynchronous schedule may run) is cut evenly into ``p``
stages, one process per stage, ``torch.set_num_threads(1)`` in each, point-to-point over gloo.
Each schedule (GPipe, 1F1B and PipeMare by default, ``m = p``) is trained for a few warm-up
steps and then timed; the simulator predicts the same step time from costs measured on the
same ranks just before.

[Note: calibration]
Every rank times its own stage in-process, through the runtime's own
:class:`~tidal.runtime.executor.StageRunner` and :class:`~tidal.runtime.pipemare.StageWeights`
(so the saved-tensor hooks are in the cost): the forward and the backward of one microbatch and
the optimizer update (AdamW), ``reps`` times after one untimed rep, median. One rank runs at a
time while the others sleep in a barrier: a core per stage, the machine the simulator models.
The p2p time is half the median round trip of one activation-sized message (the runtime's int64
shape header plus the payload) between neighbouring ranks over gloo, the median over pairs.
Other processes on the machine (test runs, other users) add noise to every figure here.

[Note: oversubscribed cores]
With more single-thread ranks than cores (4 stages on a 2-core machine) the simulator's
assumption of a processor per rank fails: a rank waiting in a bubble frees its core for a busy
one, so the bubble costs little, but the busy ranks share the cores. ``core_bound_step_s`` is
then ``max(predicted_step_s, total work / cores)`` with the work of every stage of one step
(``m (F + B) + U`` each): the simulator's critical path or the cores' capacity, whichever
binds. It is a lower bound, like the prediction itself: context switches, p2p wake-ups and the
runtime's Python are in neither. To show what the ranks actually got, each timed section also
records every rank's CPU seconds (``time.process_time``) and the seconds its main thread sat
runnable on a run queue (``/proc/self/schedstat``, Linux; 0 elsewhere), summed over ranks per
step: ``cores_used = cpu_s_per_step / measured_step_s`` is the cores the pipeline kept busy,
and ``run_queue_wait_s_per_step`` the time lost to other runnable threads (its own ranks or
anything else on the machine).

[Note: step time]
- Synchronous schedules (gpipe, 1f1b): every step is one flushed program. ``measured_step_s``
  is the median over the timed steps of the slowest rank's time from a barrier to the end of
  :meth:`~tidal.runtime.distributed.PipelineRuntime.train_step` (which ends with a broadcast of
  the loss, so no rank leaves early); ``predicted_step_s`` is the simulated makespan of one
  step (forwards, backwards and the update; the runtime's loss broadcast and its per-step
  schedule construction are not modelled).
- Asynchronous schedules (pipemare): one program runs every step with no flush, so a step
  has no wall-clock boundary. The step time is the steady-state one, ``(T(k) - T(1)) / (k - 1)``
  where ``T(n)`` is the time of an ``n``-step program (measured: slowest rank from a barrier,
  ``T(1)`` the median of ``repeats`` runs; predicted: the simulated makespans) and ``k`` the
  number of timed steps: the fill and drain that every program pays once are subtracted.
- [Note: rounds] After its warm-up steps every schedule is timed ``rounds`` times, the
  schedules taking turns (gpipe, 1f1b, pipemare, gpipe, ...), and a row reports its fastest
  round (every round is kept under ``rounds``): on a shared machine outside load only ever
  slows a round down, and taking turns keeps a burst of it from landing on one schedule only.
  PipeMare's figure is a difference of two timings, so a burst during its ``T(1)`` would lower
  it instead; ``program_s / k`` (fill and drain included) in the JSON bounds it from above.
  A round whose difference comes out at or below zero (a tiny model, few steps, a burst during
  ``T(1)``) has no steady-state figure: it reports that bound, ``program_s / k``, as its step
  time and ``steady_state_resolved: false``, never a negative or zero step time.
- ``bubble_fraction`` is the simulator's idle share of the ranks in that step time,
  ``1 - sum over stages of (m (F + B) + U) / (p * predicted_step_s)``: ``(p-1)/(m+p-1)`` plus
  the update and p2p terms for the synchronous schedules, about 0 for PipeMare.

[Note: why one file]
About a third of this file is the explanation of how each figure is measured and predicted
(calibration, steady-state step of asynchronous schedules, core-bound bound); the rest is one
bench's calibrate / run / predict / report pipeline, which reads best in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from benchmarks.tables import ResultTable
from tidal.config import ConfigError, require
from tidal.models.gpt import GPTConfig, build_gpt, split_gpt
from tidal.pipeline.schedules import SCHEDULE_NAMES
from tidal.pipeline.simulate import StageCosts, simulate
from tidal.pipeline.split import PipelineStage, even_ranges
from tidal.runtime.distributed import PipelineRuntime, RuntimeConfig
from tidal.runtime.executor import StageRunner
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode
from tidal.testing import run_on_ranks

__all__ = [
    "DEFAULT_SCHEDULES",
    "PipelineBenchConfig",
    "add_arguments",
    "bench_pipeline",
    "config_from_args",
    "cpu_info",
    "plot",
    "predict",
    "run",
    "table",
    "tables",
]

DEFAULT_SCHEDULES = ("gpipe", "1f1b", "pipemare")
_LR = 1e-3  # throughput only: any stable AdamW step will do
_WEIGHT_MODES = {"pipedream": WeightMode.STASH, "2bw": WeightMode.TWO_VERSIONS}
_HEADER_NUMEL = 10  # the runtime's int64 shape header (dtype, ndim, 8 dims)


@dataclass(kw_only=True, frozen=True, slots=True)
class PipelineBenchConfig:
    """What ``tidal bench pipeline`` runs; see the module notes for the measurements.

    Attributes:
        stages: pipeline stages ``p``, one gloo process each.
        microbatches: ``m`` per step; ``None`` means ``m = p``.
        steps: timed steps per schedule (``k`` of [Note: step time]; at least 2).
        warmup_steps: untimed steps first.
        repeats: one-step programs timed for the asynchronous ``T(1)``.
        rounds: interleaved measurement rounds; the fastest is reported ([Note: rounds]).
        reps: timed repetitions of each calibration measurement.
        rows_per_microbatch: batch rows per microbatch (batch = rows * m).
        schedules: from :data:`~tidal.pipeline.schedules.SCHEDULE_NAMES`, non-interleaved.
        timeout_s: the whole multi-process run's limit.
    """

    stages: int = 4
    microbatches: int | None = None
    steps: int = 10
    warmup_steps: int = 2
    repeats: int = 3
    rounds: int = 3
    reps: int = 5
    num_layers: int = 8
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256
    rows_per_microbatch: int = 2
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(self.stages >= 2, "stages", f"a pipeline needs >= 2 stages, got {self.stages}")
        m = self.microbatches
        require(m is None or m >= 1, "microbatches", f"must be >= 1 (or unset for m = p), got {m}")
        require(self.steps >= 2, "steps", f"must be >= 2 (see [Note: step time]), got {self.steps}")
        w = self.warmup_steps
        require(w >= 0, "warmup_steps", f"must be >= 0, got {w}")
        for key in ("repeats", "rounds", "reps", "rows_per_microbatch", "seq_len", "vocab_size"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        require(
            self.num_layers >= self.stages,
            "num_layers",
            f"{self.num_layers} blocks cannot fill {self.stages} stages; use >= {self.stages}",
        )
        require(
            self.d_model % self.num_heads == 0,
            "num_heads",
            f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})",
        )
        usable = [s for s in SCHEDULE_NAMES if s != "interleaved"]
        bad = [s for s in self.schedules if s not in usable]
        require(
            bool(self.schedules) and not bad,
            "schedules",
            f"unknown or unsupported {bad or 'empty list'}; choose from {', '.join(usable)}",
        )
        require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")

    @property
    def num_microbatches(self) -> int:
        return self.stages if self.microbatches is None else self.microbatches

    @property
    def tokens_per_step(self) -> int:
        return self.rows_per_microbatch * self.num_microbatches * self.seq_len

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_model=self.d_model,
            tie_embeddings=False,  # asynchronous schedules refuse tied copies across stages
        )


def cpu_info(num_processes: int) -> dict[str, Any]:
    """Cores the processes may use, against how many single-thread processes share them."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    usable = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "processes": num_processes,
        "threads_per_process": 1,
        "oversubscribed": num_processes > usable,
    }


# ---------------------------------------------------------------------------------------------
# the simulator's prediction


def predict(
    schedule: str, *, stages: int, microbatches: int, steps: int, costs: StageCosts
) -> dict[str, float]:
    """Predicted step time and bubble of ``schedule``; see [Note: step time].

    ``work_s`` is the busy time of every stage in one step together (the numerator of
    [Note: oversubscribed cores]).
    """
    runtime = RuntimeConfig(schedule=schedule, microbatches=microbatches)
    one = simulate(runtime.make(stages, steps=1), costs)
    if not one.schedule.asynchronous:
        step_s, program = one.makespan_s, one
    else:
        program = simulate(runtime.make(stages, steps=steps), costs)
        step_s = (program.makespan_s - one.makespan_s) / (steps - 1)
    work = [
        microbatches * (f + b) + u
        for f, b, u in zip(
            costs.per_stage("forward_s", stages),
            costs.per_stage("backward_s", stages),
            costs.per_stage("update_s", stages),
            strict=True,
        )
    ]
    return {
        "step_s": step_s,
        "work_s": sum(work),
        "bubble_fraction": 1.0 - sum(work) / (stages * step_s),
        "program_bubble_fraction": program.bubble_fraction,
        "program_makespan_s": program.makespan_s,
    }


# ---------------------------------------------------------------------------------------------
# on every rank


def _batch_fn(config: PipelineBenchConfig) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    rows = config.rows_per_microbatch * config.num_microbatches

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(config.seed * 100_003 + step)
        tokens = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    return batch


def _my_stage(config: PipelineBenchConfig, rank: int) -> PipelineStage:
    model = build_gpt(config.gpt(), seed=config.seed)
    return split_gpt(model, even_ranges(config.num_layers, config.stages))[rank]


def _weights(stage: PipelineStage, schedule: str = "1f1b") -> StageWeights:
    optimizer = torch.optim.AdamW(stage.parameters(), lr=_LR)
    mode = _WEIGHT_MODES.get(schedule, WeightMode.CURRENT)
    return StageWeights(stage, optimizer, AsyncConfig(weights=mode))


def _stage_probe(
    config: PipelineBenchConfig, stage: PipelineStage
) -> Callable[[int], tuple[float, float, float]]:
    """``probe(rep)`` times one (forward, backward, update) of one microbatch on ``stage``."""
    weights = _weights(stage)
    runner = StageRunner(
        index=stage.stage_index, num_stages=config.stages, module=stage, weights=weights
    )
    rows, t = config.rows_per_microbatch, config.seq_len
    gen = torch.Generator().manual_seed(config.seed)
    if stage.is_first:
        x = torch.randint(0, config.vocab_size, (rows, t), generator=gen)
    else:
        x = torch.randn(rows, t, config.d_model, generator=gen)
    targets = None
    if stage.is_last:
        targets = (torch.randint(0, config.vocab_size, (rows, t), generator=gen), 1.0)
    grad = None if stage.is_last else torch.randn(rows, t, config.d_model, generator=gen)

    def probe(rep: int) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        runner.forward(rep, x, targets)
        t1 = time.perf_counter()
        runner.backward(rep, grad)
        t2 = time.perf_counter()
        weights.step(lr=_LR, step=rep)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return probe


def _ping_pong(config: PipelineBenchConfig, rank: int, peer: int) -> float:
    """Half the median round trip of one activation message between ``rank`` and ``peer``."""
    payload = torch.zeros(config.rows_per_microbatch, config.seq_len, config.d_model)
    header = torch.zeros(_HEADER_NUMEL, dtype=torch.int64)
    trips = []
    for rep in range(config.reps * 4 + 1):
        t0 = time.perf_counter()
        for leg in range(2):  # there and back: the lower rank sends first
            if (rank < peer) == (leg == 0):
                dist.send(header, dst=peer)
                dist.send(payload, dst=peer)
            else:
                dist.recv(header, src=peer)
                dist.recv(payload, src=peer)
        if rep:
            trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def _calibrate(config: PipelineBenchConfig, stage: PipelineStage) -> dict[str, Any]:
    """Every rank's (forward, backward, update) medians and the p2p time, on every rank.

    One rank runs at a time while the others wait in a barrier (which sleeps, it does not
    spin), and the ranks take turns rep by rep, so a burst of outside load lands on one rep of
    every stage rather than on every rep of one stage.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = _stage_probe(config, stage)
    times = []
    for rep in range(config.reps + 1):  # rep 0 warms the allocator and kernels up
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                timing = probe(rep)
                times += [timing] if rep else []
    costs = tuple(statistics.median(column) for column in zip(*times, strict=True))
    p2p = []
    for left in range(world - 1):
        dist.barrier()
        if rank in (left, left + 1):
            p2p.append(_ping_pong(config, rank, left + 1 if rank == left else left))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"costs": costs, "p2p": p2p})
    p2p_all = [x for g in gathered for x in g["p2p"]]
    return {"stages": [g["costs"] for g in gathered], "p2p_s": statistics.median(p2p_all)}


def _run_delay_s() -> float:
    """Seconds this process's main thread has waited on a run queue (Linux schedstat), else 0."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _timed(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """(wall, CPU, run-queue wait) seconds of ``fn`` on this rank, started after a barrier."""
    dist.barrier()
    t0, c0, w0 = time.perf_counter(), time.process_time(), _run_delay_s()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0, _run_delay_s() - w0


def _over_ranks(timings: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Per timed call: the slowest rank's wall time, and CPU and run-queue wait summed."""
    wall = torch.tensor([t[0] for t in timings], dtype=torch.float64)
    used = torch.tensor([t[1:] for t in timings], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(used, op=dist.ReduceOp.SUM)
    return [(float(w), float(c), float(q)) for w, (c, q) in zip(wall, used, strict=True)]


def _lr(_step: int) -> float:
    return _LR


def _warm_runtime(config: PipelineBenchConfig, schedule: str, rank: int) -> PipelineRuntime:
    stage = _my_stage(config, rank)
    runtime = PipelineRuntime(
        RuntimeConfig(schedule=schedule, microbatches=config.num_microbatches),
        stages=[stage],
        weights=[_weights(stage, schedule)],
    )
    if config.warmup_steps:
        runtime.train(config.warmup_steps, _batch_fn(config), _lr)
    return runtime


def steady_step_s(program_s: float, one_step_s: float, steps: int) -> tuple[float, bool]:
    """A no-flush schedule's step time from a ``steps``-step and a 1-step program, and whether
    the difference resolved it (else the upper bound ``program_s / steps``); see [Note: rounds]."""
    difference_s = (program_s - one_step_s) / (steps - 1)
    if difference_s > 0:
        return difference_s, True
    return program_s / steps, False


def _measure(config: PipelineBenchConfig, runtime: PipelineRuntime) -> dict[str, Any]:
    """One round; see [Note: step time]. CPU and run-queue wait are per step, summed over ranks."""
    batch = _batch_fn(config)
    if not runtime.asynchronous:
        steps = _over_ranks(
            [_timed(lambda: runtime.train_step(batch, _lr)) for _ in range(config.steps)]
        )
        wall, cpu, wait = zip(*steps, strict=True)
        return {
            "measured_step_s": statistics.median(wall),
            "step_times_s": list(wall),
            "cpu_s_per_step": statistics.mean(cpu),
            "run_queue_wait_s_per_step": statistics.mean(wait),
        }
    ones = _over_ranks(
        [_timed(lambda: runtime.train(1, batch, _lr)) for _ in range(config.repeats)]
    )
    (many,) = _over_ranks([_timed(lambda: runtime.train(config.steps, batch, _lr))])
    one = [statistics.median(column) for column in zip(*ones, strict=True)]
    wall, cpu, wait = ((m - o) / (config.steps - 1) for m, o in zip(many, one, strict=True))
    step_s, resolved = steady_step_s(many[0], one[0], config.steps)
    return {
        "measured_step_s": step_s,
        "steady_state_resolved": resolved,
        "one_step_programs_s": [t[0] for t in ones],
        "program_s": many[0],
        "cpu_s_per_step": cpu,
        "run_queue_wait_s_per_step": wait,
    }


def _rank_main(config: PipelineBenchConfig) -> dict[str, Any] | None:
    """Run on every rank by :func:`run_on_ranks`; rank 0 returns the costs and measurements."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    calibration = _calibrate(config, _my_stage(config, rank))
    runtimes = {name: _warm_runtime(config, name, rank) for name in config.schedules}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in config.schedules}
    for _ in range(config.rounds):  # interleaved: see [Note: rounds]
        for name, runtime in runtimes.items():
            rounds[name].append(_measure(config, runtime))
    return {"calibration": calibration, "rounds": rounds} if rank == 0 else None


# ---------------------------------------------------------------------------------------------
# rows, table, plot


def _costs(per_stage: Sequence[Sequence[float]], p2p_s: float) -> StageCosts:
    fwd, bwd, upd = (tuple(float(x) for x in column) for column in zip(*per_stage, strict=True))
    return StageCosts(forward_s=fwd, backward_s=bwd, update_s=upd, p2p_s=p2p_s)


def _costs_json(costs: StageCosts, stages: int) -> dict[str, Any]:
    per_stage = {
        k: list(costs.per_stage(k, stages)) for k in ("forward_s", "backward_s", "update_s")
    }
    return {**per_stage, "p2p_s": costs.p2p_s}


def _row(
    config: PipelineBenchConfig, name: str, rounds: list[dict[str, Any]], costs: StageCosts
) -> dict[str, Any]:
    measured = min(rounds, key=lambda r: r["measured_step_s"])  # see [Note: rounds]
    shape = {"stages": config.stages, "microbatches": config.num_microbatches}
    cpu = cpu_info(config.stages)
    pred = predict(name, steps=config.steps, costs=costs, **shape)
    core_bound = max(pred["step_s"], pred["work_s"] / min(cpu["usable_cores"], config.stages))
    step_s = measured["measured_step_s"]
    definition = "median flushed step"
    if RuntimeConfig(schedule=name, microbatches=1).make(2, steps=1).asynchronous:
        definition = f"(T({config.steps}) - T(1)) / {config.steps - 1}, no flush"
    return {
        "schedule": name,
        **shape,
        "tokens_per_step": config.tokens_per_step,
        **measured,
        "tokens_per_s": config.tokens_per_step / step_s if step_s > 0 else None,
        "cores_used": measured["cpu_s_per_step"] / step_s if step_s > 0 else None,
        "predicted_step_s": pred["step_s"],
        "measured_over_predicted": step_s / pred["step_s"],
        "core_bound_step_s": core_bound,
        "measured_over_core_bound": step_s / core_bound,
        "bubble_fraction": pred["bubble_fraction"],
        "program_bubble_fraction": pred["program_bubble_fraction"],
        "work_s": pred["work_s"],
        "step_time_definition": definition,
        "costs": _costs_json(costs, config.stages),
        "cpu": cpu,
        "measured_step_s_by_round": [r["measured_step_s"] for r in rounds],
        "rounds": rounds,
        "settings": {k: v for k, v in asdict(config).items() if k != "schedules"},
    }


def bench_pipeline(config: PipelineBenchConfig) -> list[dict[str, Any]]:
    """Calibrate, measure and predict every schedule of ``config``: one JSON-ready row each."""
    (result, *_) = run_on_ranks(
        _rank_main, world_size=config.stages, args=(config,), timeout_s=config.timeout_s
    )
    costs = _costs(result["calibration"]["stages"], result["calibration"]["p2p_s"])
    return [_row(config, name, result["rounds"][name], costs) for name in config.schedules]


_USAGE_NOTE = (
    ". 'cores used' is the ranks' CPU seconds per step over the step time; 'run-queue wait' the "
    "seconds per step, summed over ranks, that runnable ranks waited for a core"
)


def contention_note(rows: Sequence[dict[str, Any]]) -> str:
    cpu = rows[0]["cpu"]
    if not cpu["oversubscribed"]:
        return (
            f"{cpu['processes']} single-thread processes, {cpu['usable_cores']} usable cores "
            f"(os.cpu_count() = {cpu['cpu_count']}): a core per stage if nothing else runs"
        ) + _USAGE_NOTE
    return (
        f"{cpu['processes']} single-thread processes share {cpu['usable_cores']} usable cores "
        f"(os.cpu_count() = {cpu['cpu_count']}): measured times are contended. 'predicted' is "
        "the simulator with a core per stage; 'core-bound' is max(predicted, work / cores)"
    ) + _USAGE_NOTE


COLUMNS = (
    "schedule", "step s", "tokens/s", "predicted s", "measured / predicted",
    "core-bound s", "measured / core-bound", "bubble (sim)", "cores used", "run-queue wait s",
)  # fmt: skip


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """The calibrated stage costs, then the schedules ([Note: one table per result] in
    benchmarks/tables.py)."""
    return [costs_table(result["rows"]), table(result["rows"])]


def table(rows: Sequence[dict[str, Any]]) -> ResultTable:
    first = rows[0]
    title = (
        f"tidal bench pipeline: p = {first['stages']} gloo ranks, m = {first['microbatches']}, "
        f"{first['tokens_per_step']} tokens per step"
    )
    cells = []
    for row in rows:
        tokens = row["tokens_per_s"]
        cells.append([
            row["schedule"], f"{row['measured_step_s']:.4f}",
            "-" if tokens is None else f"{tokens:,.0f}", f"{row['predicted_step_s']:.4f}",
            f"{row['measured_over_predicted']:.2f}", f"{row['core_bound_step_s']:.4f}",
            f"{row['measured_over_core_bound']:.2f}", f"{100 * row['bubble_fraction']:.1f}%",
            "-" if row["cores_used"] is None else f"{row['cores_used']:.2f}",
            f"{row['run_queue_wait_s_per_step']:.4f}",
        ])  # fmt: skip
    return ResultTable.of(title, COLUMNS, cells, note=contention_note(rows))


def costs_table(rows: Sequence[dict[str, Any]]) -> ResultTable:
    """The calibrated stage costs in milliseconds."""
    costs = rows[0]["costs"]
    title = f"calibrated stage costs, ms (p2p one-way {1e3 * costs['p2p_s']:.3f} ms)"
    cells = [
        [str(s), *(f"{1e3 * costs[k][s]:.2f}" for k in ("forward_s", "backward_s", "update_s"))]
        for s in range(len(costs["forward_s"]))
    ]
    return ResultTable.of(title, ("stage", "forward", "backward", "update"), cells)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Bars per schedule: measured, predicted and core-bound step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["schedule"] for r in rows]
    series = (
        ("measured", "measured_step_s"),
        ("predicted (core per stage)", "predicted_step_s"),
        ("core-bound: max(predicted, work / cores)", "core_bound_step_s"),
    )
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [k + (i - 1) * width for k in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width=width, label=label)
    ax.set_xticks(range(len(rows)), names)
    ax.set_ylabel("seconds per optimizer step")
    first = rows[0]
    ax.set_title(f"p={first['stages']}, m={first['microbatches']} on gloo", fontsize=10)
    cpu = first["cpu"]
    fig.suptitle(
        f"{cpu['processes']} single-thread processes on {cpu['usable_cores']} cores", fontsize=9
    )
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(top=1.35 * max(r[key] for r in rows for _, key in series))  # room for the legend
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# command line (wired by tidal.cli as ``tidal bench pipeline``)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PipelineBenchConfig()
    flags: list[tuple[str, str, type, str]] = [  # flag, config field, type, help
        ("--stages", "stages", int, "pipeline stages p, one gloo process each"),
        ("--microbatches", "microbatches", int, "microbatches m per step (default: m = p)"),
        ("--steps", "steps", int, "timed steps per schedule (>= 2)"),
        ("--warmup-steps", "warmup_steps", int, "untimed steps first"),
        ("--repeats", "repeats", int, "one-step programs timed for PipeMare's T(1)"),
        ("--rounds", "rounds", int, "interleaved rounds over the schedules; the fastest counts"),
        ("--reps", "reps", int, "repetitions of each calibration timing"),
        ("--layers", "num_layers", int, "GPT blocks, split evenly over the stages"),
        ("--d-model", "d_model", int, "GPT width"),
        ("--heads", "num_heads", int, "attention heads"),
        ("--seq-len", "seq_len", int, "tokens per row"),
        ("--vocab-size", "vocab_size", int, "random-token vocabulary"),
        ("--rows-per-microbatch", "rows_per_microbatch", int, "batch rows per microbatch"),
        ("--seed", "seed", int, "model init and batches"),
        ("--timeout-s", "timeout_s", float, "limit for the whole multi-process run"),
    ]
    for flag, field, kind, what in flags:
        default = getattr(d, field)
        shown = "" if default is None else f" ({default})"
        metavar = flag[2:].upper().replace("-", "_")
        parser.add_argument(
            flag, dest=field, metavar=metavar, type=kind, default=default, help=what + shown
        )
    parser.add_argument(
        "--schedules",
        default=",".join(d.schedules),
        metavar="A,B",
        help=f"schedules to time ({','.join(d.schedules)})",
    )
    parser.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="write the JSON and PNG here instead of benchmarks/results/",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG bar chart")


def config_from_args(args: argparse.Namespace) -> PipelineBenchConfig:
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    if not schedules:
        raise ConfigError("--schedules", f"expected a comma list, got {args.schedules!r}")
    names = [f.name for f in dataclasses.fields(PipelineBenchConfig) if f.name != "schedules"]
    return PipelineBenchConfig(schedules=schedules, **{n: getattr(args, n) for n in names})


def run(args: argparse.Namespace, console: Console) -> int:
    """``tidal bench pipeline``: measure, print the tables, write the JSON (and the PNG)."""
    from benchmarks.results import read_results, write_results
    from benchmarks.tables import show

    config = config_from_args(args)
    console.print(
        f"timing {', '.join(config.schedules)} on {config.stages} gloo ranks "
        f"(m = {config.num_microbatches}, {config.steps} steps after {config.warmup_steps} "
        "warm-up)..."
    )
    rows = bench_pipeline(config)
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("pipeline", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    if not args.no_plot:
        console.print(f"plot: {plot(rows, path.with_suffix('.png'))}")
    return 0
