"""``tidal bench mpress --section measured``: MPress's savers trained on gloo ranks under a
per-rank budget, the largest GPT each strategy trains and its step.

[Note: what the bench measures]
A GPT family (the ``tiny`` preset's width, ``--measured-seq-len`` tokens, blocks added one at a
time) trains as a pipeline of ``--measured-ranks`` gloo processes (one thread each) under
``memory.device_budget = --measured-budget`` per rank, for each schedule (1F1B, PipeDream) and
each ``pipeline.memory`` (none, recompute, selective, host, peer, auto). "Trains" means what ``tidal train``
does with a budget ([Note: pipeline memory] in tidal/train/pipeline_memory.py): the check before
the first step passes, and the saved-tensor meter, with what a rank holds for others, stays
within the budget at every change for every step (synchronous schedules; an asynchronous one is
held to the check before its first step). The largest model is searched by bisection over the
block count (one step a trial); at the largest model recompute-only trains, each strategy that
trains it runs ``--measured-steps`` steps, and its step time is the run's tokens per step over
the tokens/s its summary reports. Every rank runs every trial in one launch, so all ranks
agree on what trained. ``zero3`` is no pipeline: the chunk engine on the same ranks under the
same per-rank budget, its chunks sharded across them and offloaded to the host as the budget
needs (each rank a quarter of the rows); the schedule does not apply to it (measured twice).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from tidal.config import ConfigError, parse_bytes
from tidal.memory.shortfall import DeviceBudgetTooSmall

__all__ = ["MEASURED", "add_measured_arguments", "bench_measured"]

MEASURED = ("none", "recompute", "selective", "host", "peer", "auto", "zero3")
SCHEDULES = ("1f1b", "pipedream")


def add_measured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measured-ranks", type=int, default=2, help="gloo ranks, one stage each")
    parser.add_argument("--measured-budget", default="8MiB", metavar="SIZE",
                        help="memory.device_budget per rank (8MiB)")  # fmt: skip
    parser.add_argument("--measured-seq-len", type=int, default=64)
    parser.add_argument("--measured-max-layers", type=int, default=32)
    parser.add_argument("--measured-steps", type=int, default=4)
    parser.add_argument("--measured-schedule", action="append", choices=SCHEDULES,
                        help="schedules to measure (all by default)")  # fmt: skip
    parser.add_argument("--measured-strategy", action="append", choices=MEASURED,
                        help="pipeline.memory values to measure (all by default)")  # fmt: skip


def _job(run_dir: Path, *, layers: int, schedule: str, memory: str, budget: str, seq_len: int,
         ranks: int, steps: int) -> dict[str, Any]:  # fmt: skip
    job = {
        "run_dir": str(run_dir),
        "model": {"preset": "tiny", "num_layers": layers, "seq_len": seq_len,
                  "tie_embeddings": False},
        "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
        "training": {"steps": steps, "batch_size": 8, "device": "cpu", "log_every": 1,
                     "val_every": 0},
        "optimizer": {"lr": 1e-3, "warmup_steps": 1, "decay_steps": steps},
        "checkpoint": {"every_steps": 0},
        "memory": {"device_budget": budget},
        "pipeline": {"stages": ranks, "microbatches": 4, "schedule": schedule, "memory": memory},
    }  # fmt: skip
    if memory == "zero3":  # no pipeline: the chunk engine, its chunks sharded over the ranks
        del job["pipeline"]
        job["engine"] = "chunk"
    return job


def _trains(root: Path, **job: Any) -> tuple[float | None, str]:
    """The step seconds if the job trains (None and the one-line reason if not)."""
    from tidal.train import Trainer

    run_dir = root / f"{job['schedule']}-{job['memory']}-{job['layers']}-{job['steps']}"
    try:  # one folder for every rank
        started = time.perf_counter()
        summary = Trainer(_job(run_dir, **job)).fit()
        total_s = time.perf_counter() - started
    except (ConfigError, DeviceBudgetTooSmall) as error:
        return None, str(error)
    tokens_per_step = 8 * job["seq_len"]
    rate = summary.get("tokens_per_s")
    return (tokens_per_step / rate if rate else total_s / job["steps"]), ""


def _worker(root: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    common = {"budget": args["budget"], "seq_len": args["seq_len"], "ranks": args["ranks"]}
    rows = []
    strategies = args["strategies"]
    for schedule in args["schedules"]:
        largest: dict[str, int] = {}
        why: dict[str, str] = {}
        for memory in strategies:
            low, high = 0, args["max_layers"] + 1  # low trains (or 0), high does not
            while high - low > 1:
                mid = (low + high) // 2
                step_s, reason = _trains(Path(root), layers=mid, schedule=schedule,
                                         memory=memory, steps=1, **common)  # fmt: skip
                low, high = (mid, high) if step_s is not None else (low, mid)
                why[memory] = why.get(memory, "") if step_s is not None else reason
            largest[memory] = low
        at = largest.get("recompute", max(largest.values()))
        for memory in strategies:
            step_s = None
            if at and largest[memory] >= at:
                step_s, _ = _trains(Path(root), layers=at, schedule=schedule, memory=memory,
                                    steps=args["steps"], **common)  # fmt: skip
            rows.append({"section": "measured", "schedule": schedule, "strategy": memory,
                         "largest_layers": largest[memory],
                         "vs_recompute": largest[memory] / at if at else None,
                         "step_s_at_recompute_largest": step_s,
                         "refused_above": why.get(memory, ""),
                         "budget_bytes": parse_bytes(args["budget"], key="--measured-budget"),
                         "ranks": args["ranks"]})  # fmt: skip
    return rows


def bench_measured(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tidal.testing import run_on_ranks

    given = {"budget": args.measured_budget, "seq_len": args.measured_seq_len,
             "ranks": args.measured_ranks, "max_layers": args.measured_max_layers,
             "steps": args.measured_steps,
             "schedules": args.measured_schedule or list(SCHEDULES),
             "strategies": args.measured_strategy or list(MEASURED)}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_on_ranks(_worker, world_size=args.measured_ranks, args=(root, given),
                                timeout_s=3600)  # fmt: skip
    rows: list[dict[str, Any]] = per_rank[0]
    for other in per_rank[1:]:  # every rank saw the same outcomes
        assert [r["largest_layers"] for r in other] == [r["largest_layers"] for r in rows]
    return rows
