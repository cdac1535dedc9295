"""``tidal bench plan-check --ranks 4``: the plans the search makes for a small GPT on 4 devices,
each trained on 4 gloo ranks, every rank's measured figures beside the plan's prediction.

[Note: the CPU cluster, calibrated once]
The cost model needs a device's speed and its links'. Here the "devices" are the gloo ranks
sharing this machine's cores, so the figures are measured once per bench run, on all the ranks
at once (as they will train): a fp32 matmul's FLOP/s, an element-wise op's bytes per second,
and an all-reduce's latency and ring bandwidth over the ranks, each the median over the ranks.
The cluster spec takes them at efficiency 1 (they are achieved figures, not peaks), the host
link at the element-wise rate (host and device are one memory here) and each rank's device
memory as its share of the machine's. The JSON records the calibration; the step-time ratio is
the cost model's error against these measured figures, not against a GPU's.

What each rank measures: the model data its stages hold after the run, as the runtime meters it
(``model_data_bytes``: parameters, AdamW's state; the gradients are freed by then), what its
blocks swapped to the host, and the growth of its resident memory over the run (the process's
peak RSS less its RSS before the model was built: allocator caches, gloo buffers and the
interpreter's own growth are in it, so it bounds the plan's device figure from above rather
than equals it). The step time is rank 0's median steady step (a synchronous step is the
slowest rank's). Offloading plans run (on a CPU host and device are one memory, so they check
the path and the bytes each side is metered for, not a transfer): all of the model data on the
host (FSDP2's CPU offload, and again in tidal's chunks under the plan's budgets, whose store
meters its device's peak, activations included up to the plan's share for them, beside the
plan's device figure, and how far the activations went over that share), half of the
optimizer updated on the host, all of it on NVMe (files under a temporary folder of this
machine's disk), and all of the model data on the host in chunks with half of the optimizer's
state on NVMe (the disk's share set beside the plan's). For the FSDP2 runs of the optimizer on
the host the host's share of
AdamW's state, in host memory and on the disk together, is set beside the plan's: with ``f``
of the optimizer on the host the rank's state is ``S = optimizer / (1 - f)`` (or ``nvme / h``
with all of it there), of which the host holds ``f S``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["CASES", "bench_plan_check_ranks", "calibrate", "tables"]

# case -> the search's settings (PlannerConfig fields) on the calibrated 4-device cluster
CASES: dict[str, dict[str, Any]] = {
    "pp2 x dp2": {"pp": 2, "tp": 1},
    "pp2 x tp2, host swap": {"pp": 2, "tp": 2, "recompute": ("swap",)},
    "dp4": {"pp": 1, "tp": 1},
    "pp2 x dp2, model data on the host": {
        "pp": 2,
        "tp": 1,
        "offload": (1.0,),
        "offload_params": (1.0,),
        "model_data": "fsdp2",
    },  # fmt: skip
    # the same search with --model-data auto: in tidal's chunks under the plan's budgets
    # ([Note: chunk stages in plans] in tidal/planner/model_data.py)
    "pp2 x dp2, model data on the host in chunks": {
        "pp": 2,
        "tp": 1,
        "offload": (1.0,),
        "offload_params": (1.0,),
        "model_data": "auto",
    },  # fmt: skip
    # all of it on the host and half of the optimizer's state on NVMe, in chunks: the disk's
    # share is the plan's ([Note: nvme placement] in tidal/sharding/swap.py)
    "dp4 in chunks, half the state on NVMe": {
        "pp": 1,
        "tp": 1,
        "offload": (1.0,),
        "offload_params": (1.0,),
        "offload_nvme": (0.5,),
        "model_data": "chunks",
    },  # fmt: skip
    "pp2 x dp2, half the optimizer on the host": {
        "pp": 2,
        "tp": 1,
        "offload": (0.5,),
        "model_data": "fsdp2",
    },  # fmt: skip
    "dp4, optimizer on NVMe": {
        "pp": 1,
        "tp": 1,
        "offload": (1.0,),
        "offload_nvme": (1.0,),
        "model_data": "fsdp2",
    },  # fmt: skip
}
FP32: dict[str, Any] = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}  # fp32 AdamW


def calibrate(world_size: int) -> dict[str, float]:
    """The figures of [Note: the CPU cluster, calibrated once], measured on ``world_size``
    ranks at once."""
    from tidal.testing import run_on_ranks

    ranks = run_on_ranks(_calibrate_rank, world_size=world_size, timeout_s=300)
    return {key: statistics.median(r[key] for r in ranks) for key in ranks[0]}


def _calibrate_rank() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    a = torch.randn(512, 512)

    def timed(fn: Any, repeats: int) -> float:
        fn()  # warm up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    # about a second each: four ranks share two cores, and the scheduler's slices are coarse
    matmul_s = timed(lambda: a @ a, 100)
    x = torch.randn(4 * 2**20)
    add_s = timed(lambda: x + x, 100)
    world = dist.get_world_size()
    big, small = torch.zeros(2**20), torch.zeros(1)
    reduce_s = timed(lambda: dist.all_reduce(big), 20)
    latency_s = timed(lambda: dist.all_reduce(small), 100)
    ring = 2 * (world - 1) / world
    alpha = latency_s / (2 * (world - 1))
    return {
        "flops": 2 * 512**3 / matmul_s,
        "bytes_per_s": 3 * x.numel() * 4 / add_s,
        "link_bytes_per_s": ring * big.numel() * 4 / max(reduce_s - 2 * (world - 1) * alpha, 1e-9),
        "link_latency_s": alpha,
    }


def _cluster(figures: dict[str, float], world_size: int) -> Any:
    from tidal.planner import ClusterSpec

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ClusterSpec(
        devices=world_size, devices_per_node=world_size,
        device_memory_bytes=memory // world_size // 2,  # half: the host's side holds the rest
        peak_flops=figures["flops"], flops_efficiency=1.0,
        memory_bandwidth=figures["bytes_per_s"], bandwidth_efficiency=1.0,
        intra_node_bandwidth=figures["link_bytes_per_s"],
        inter_node_bandwidth=figures["link_bytes_per_s"],
        intra_node_latency_s=figures["link_latency_s"],
        inter_node_latency_s=figures["link_latency_s"],
        host_link_bandwidth=figures["bytes_per_s"], host_memory_per_node_bytes=memory // 2,
        nvme_bytes_per_node=memory,  # a disk the size of memory: only the NVMe case reads it
    )  # fmt: skip


def _plan(model: Any, cluster: Any, settings: dict[str, Any], micro_batch: int) -> Any:
    import torch

    from tidal.models.gpt import measure_gpt
    from tidal.planner import PlannerConfig, Recompute, make_plan

    settings = dict(settings)
    if "recompute" in settings:
        settings["recompute"] = tuple(Recompute(m) for m in settings["recompute"])
    config = PlannerConfig(pareto=(), baselines=(), pipelines=settings.get("pp", 1) > 1,
                           **FP32, **settings)  # fmt: skip
    # traced in fp32, as the ranks train: the activations' bytes are the run's
    graph = measure_gpt(model, micro_batch=micro_batch, dtype=torch.float32)
    return make_plan(graph, cluster, config).plan


def bench_plan_check_ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per case and rank (one per case for a plan that does not run yet)."""
    from tidal.models import preset
    from tidal.planner.check import not_run
    from tidal.testing import run_on_ranks

    world, chosen = args.ranks, _chosen(args.cases)  # a bad name before the calibration
    model = dataclasses.replace(preset(args.model), dropout=0.0)
    figures = calibrate(world)
    cluster = _cluster(figures, world)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tidal-plan-check-ranks-") as folder:
        for case, settings in chosen.items():
            plan = _plan(model, cluster, settings, args.micro_batch)
            base = {"case": case, "model": args.model, "calibration": figures,
                    "plan": plan.mesh_name, "recompute": _modes(plan),
                    "offload": [o.to_dict() for o in plan.offloads()],
                    "predicted_step_s": plan.step_time_s}  # fmt: skip
            gaps = not_run(plan)
            if gaps:
                memory = plan.rank_memory(0)
                rows.append({**base, "ran": False, "why": gaps[0].why,
                             "predicted_host_bytes": memory.host,
                             "predicted_nvme_bytes": memory.nvme,
                             "predicted_device_bytes": memory.total})  # fmt: skip
                continue
            job = _job(args, Path(folder) / case.replace(" ", "-").replace(",", ""), plan)
            ranks = run_on_ranks(_train_rank, world_size=world, args=(job, plan.to_dict()),
                                 timeout_s=args.timeout_s)  # fmt: skip
            step_s = ranks[0]["step_s"]
            for rank, measured in enumerate(ranks):
                pp_rank = rank // (plan.dp * plan.tp)
                memory, offload = plan.rank_memory(pp_rank), plan.rank_offload(pp_rank)
                data = measured["model_data"]
                held = data["params"] + data["optimizer_state"]
                # all of it on the host: every unit ZeRO-3, its shard, gradient and state there
                # (a swap's host bytes are activations, not model data; the optimizer's share on
                # the host is set apart below)
                kept = FP32["param_bytes"] + FP32["optimizer_bytes"]
                host = memory.host * kept / sum(FP32.values()) if offload.params else 0.0
                predicted = memory.params + memory.optimizer + host
                host_optimizer = measured["host_optimizer"]
                if host_optimizer is not None:  # the host's share of the state (module note)
                    host_optimizer = host_optimizer["state"] + host_optimizer["nvme"]
                rows.append({**base, "ran": True, "rank": rank, "pp_rank": pp_rank,
                             "kind": None if plan.pipeline is None
                             else plan.pipeline.rank_kind(pp_rank),
                             "predicted_memory": memory.to_dict(),
                             "predicted_model_data_bytes": predicted,
                             "measured_model_data": data, "measured_model_data_bytes": held,
                             "model_data_measured_over_predicted": held / predicted,
                             "predicted_host_optimizer_bytes": _host_state(offload, memory),
                             "measured_host_optimizer_bytes": host_optimizer,
                             "measured_nvme_bytes": (measured["host_optimizer"] or {}).get(
                                 "nvme", measured["chunk_nvme_bytes"] or 0),
                             "predicted_nvme_bytes": memory.nvme,
                             "predicted_device_bytes": memory.total,
                             "chunks": plan.rank_chunks(pp_rank) is not None,
                             "measured_device_bytes": measured["chunk_peak_device_bytes"],
                             "activations_over_bytes": measured["activations_over_bytes"],
                             "rss_growth_bytes": measured["rss_growth_bytes"],
                             "host_swap_bytes": measured["host_swap_bytes"],
                             "measured_step_s": step_s,
                             "step_measured_over_predicted": step_s / plan.step_time_s,
                             "final_loss": measured["final_loss"]})  # fmt: skip
    return rows


def _chosen(names: str | None) -> dict[str, dict[str, Any]]:
    """The cases ``--cases`` names (``;`` between them), all without it."""
    if names is None:
        return CASES
    wanted = [name.strip() for name in names.split(";") if name.strip()]
    unknown = [name for name in wanted if name not in CASES]
    if unknown or not wanted:
        from tidal.config import ConfigError

        raise ConfigError("--cases", f"{'; '.join(unknown) or 'none given'} is not a case; the "
                          f"cases are {'; '.join(CASES)}")  # fmt: skip
    return {name: CASES[name] for name in wanted}


def _host_state(offload: Any, memory: Any) -> float | None:
    """The host's share of the rank's optimizer state, ``f S`` (module note); None where the
    host updates none of it or FSDP2 holds it all."""
    f, h = offload.optimizer, offload.nvme
    if not f or offload.params:
        return None
    whole = memory.optimizer / (1 - f) if f < 1 else memory.nvme / h if h else None
    return None if whole is None else f * whole


def _modes(plan: Any) -> dict[str, int]:
    kinds = [plan] if plan.pipeline is None else list(plan.pipeline.stages.values())
    modes: dict[str, int] = {}
    for kind in kinds:
        for mode in kind.recompute.values():
            modes[str(mode)] = modes.get(str(mode), 0) + 1
    return modes


def _job(args: argparse.Namespace, run_dir: Path, plan: Any) -> dict[str, Any]:
    rows = plan.micro_batch * plan.dp * (plan.num_microbatches if plan.pipeline else 1)
    accumulate = 1 if plan.pipeline else plan.num_microbatches
    return {
        "name": "plan-check-ranks", "run_dir": str(run_dir), "engine": "reference",
        "model": {"preset": args.model, "dropout": 0.0},
        "data": {"source": "synthetic", "synthetic_num_tokens": 200_000},
        "training": {"steps": args.steps, "batch_size": rows, "grad_accum_steps": accumulate,
                     "device": "cpu", "log_every": 1, "val_every": 0, "val_batches": 1},
        "optimizer": {"lr": 1e-3, "warmup_steps": 1},
        "checkpoint": {"every_steps": 0, "at_end": False},
        # the NVMe tier's files, in a folder of this machine's disk (the plan's disk)
        "memory": {"nvme_dir": str(run_dir / "nvme")} if any(o.nvme for o in plan.offloads())
        else {},
        "metrics": {"peak_tflops": 1.0},
        "warmup_steps": args.warmup_steps,
    }  # fmt: skip


def _train_rank(job: dict[str, Any], plan_data: dict[str, Any]) -> dict[str, Any]:
    from tidal.planner.plan import Plan
    from tidal.train import Trainer
    from tidal.train.metrics import read_metrics

    job = dict(job)
    warmup = job.pop("warmup_steps")
    before = _rss_bytes()
    trainer = Trainer(job, plan=Plan.from_dict(plan_data))
    summary = trainer.fit()
    figures = trainer.part.summary_figures()
    steady = [r["step_s"] for r in read_metrics(trainer.run_dir)
              if r["kind"] == "train" and r["step"] > warmup]  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "step_s": statistics.median(steady) if steady else None,
        "model_data": figures["model_data_bytes"],
        "host_swap_bytes": figures.get("host_swap_bytes", 0),
        "host_optimizer": figures.get("host_optimizer_bytes"),
        # a chunk store meters its device's bytes, the activations included up to the plan's
        # share for them, and how far they went over it (None: FSDP2's stages)
        **_chunk_figures(figures["pipeline"]["chunk_stages"].values()),
        "rss_growth_bytes": peak - before,
        "final_loss": summary["final_loss"],
    }


def _chunk_figures(stages: Any) -> dict[str, int | None]:
    stages = list(stages)
    return {
        # a rank of v model chunks runs v stores: their peaks summed bound the rank's from above
        "chunk_peak_device_bytes": sum(c["peak_device_bytes"] for c in stages) if stages else None,
        "activations_over_bytes": max(
            (c["non_model_over_budget_bytes"] for c in stages), default=None
        ),  # fmt: skip
        "chunk_nvme_bytes": sum(c.get("peak_nvme_bytes", 0) for c in stages) if stages else None,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tables(result: dict[str, Any], args: argparse.Namespace) -> list[Any]:
    """Each case's ranks, prediction beside measurement ([Note: one table per result] in
    benchmarks/tables.py)."""
    from benchmarks.tables import ResultTable
    from tidal.config import format_bytes

    columns = ("plan", "rank", "kind", "model data predicted", "metered", "ratio",
               "host optimizer predicted", "metered (NVMe)", "device predicted",
               "chunk stores' peaks, summed (+ activations over)", "RSS growth",
               "host swap", "step s predicted", "step s measured", "ratio")  # fmt: skip
    cells = []
    for r in result["rows"]:
        if not r["ran"]:
            cells.append([f"{r['case']} ({r['plan']})", "-", "-", "-", "-", "-", "-", "-",
                          format_bytes(int(r["predicted_device_bytes"])), "-", "-", "-",
                          f"{r['predicted_step_s']:.3g}", "priced, not run", "-"])  # fmt: skip
            continue
        cells.append([
            f"{r['case']} ({r['plan']})", str(r["rank"]), r["kind"] or "-",
            format_bytes(int(r["predicted_model_data_bytes"])),
            format_bytes(int(r["measured_model_data_bytes"])),
            f"{r['model_data_measured_over_predicted']:.2f}",
            *_host_cells(r, format_bytes),
            format_bytes(int(r["predicted_device_bytes"])),
            _chunk_cell(r, format_bytes),
            format_bytes(int(r["rss_growth_bytes"])), format_bytes(int(r["host_swap_bytes"])),
            f"{r['predicted_step_s']:.3g}", f"{r['measured_step_s']:.3g}",
            f"{r['step_measured_over_predicted']:.2f}",
        ])  # fmt: skip
    calibration = result["rows"][0]["calibration"] if result["rows"] else {}
    title = ("tidal bench plan-check --ranks: plans for a small GPT on 4 gloo ranks, each rank's "
             "figures beside the plan's (cluster calibrated on this machine: "
             + ", ".join(f"{k} {v:.3g}" for k, v in calibration.items()) + ")")  # fmt: skip
    return [ResultTable.of(title, columns, cells)]


def _chunk_cell(row: dict[str, Any], format_bytes: Any) -> str:
    """A chunk store's metered peak, and (+) how far its activations went over their share."""
    if row.get("measured_device_bytes") is None:
        return "-"
    over = row.get("activations_over_bytes") or 0
    extra = f" (+{format_bytes(int(over))})" if over else ""
    return format_bytes(int(row["measured_device_bytes"])) + extra


def _host_cells(row: dict[str, Any], format_bytes: Any) -> list[str]:
    """The host's share of AdamW's state, predicted and metered (of it, on NVMe)."""
    predicted, metered = row.get("predicted_host_optimizer_bytes"), row.get(
        "measured_host_optimizer_bytes")  # fmt: skip
    if row.get("chunks") and row.get("predicted_nvme_bytes"):  # the chunks' disk share alone
        return [f"NVMe {format_bytes(int(row['predicted_nvme_bytes']))}",
                f"({format_bytes(int(row['measured_nvme_bytes']))})"]  # fmt: skip
    if predicted is None or metered is None:
        return ["-", "-"]
    return [
        format_bytes(int(predicted)),
        f"{format_bytes(int(metered))} ({format_bytes(int(row['measured_nvme_bytes']))})",
    ]
