"""The systems ``tidal bench dp`` compares, built on one rank of N, and the loop that times them.

Every rank of every system builds the same GPT (:func:`tidal.models.build_gpt`, same seed, in
full on the CPU; or each system's way of building one no rank holds whole: ``Case.deferred``), draws the same global batches from the job's :class:`BatchSampler` and trains on
its rows ``[r * B / N, (r + 1) * B / N)`` ([Note: global batch] in tidal/train/trainer.py), with
the same AdamW hyper-parameters, schedule and clipping, through one calling convention
(``loss = engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` after every micro-batch):

- ``tidal``: :func:`tidal.train.build.build_engine` with ``engine="chunk"``: the chunk engine on
  one rank, the sharded engine (ZeRO-3 over sharded chunks) on several;
- ``deepspeed-zero3-offload``: DeepSpeed ZeRO-3, parameters and optimizer state offloaded to the
  CPU, DeepSpeedCPUAdam (:func:`benchmarks.baselines.build_deepspeed`);
- ``fsdp2-cpu-offload``: ``fully_shard`` per block and on the root with ``CPUOffloadPolicy``,
  ``torch.optim.AdamW`` over the sharded (DTensor) parameters (:class:`Fsdp2Engine`).

[Note: peak RSS of a spawned rank]
Linux carries the peak resident set of the address space a process replaces with ``exec`` into
that process's ``ru_maxrss``, and ``spawn`` forks the parent before it execs Python. So a rank's
``ru_maxrss`` is at least what its parent held when it started the rank: the bench's own
process, which has imported torch. ``VmHWM`` (/proc/self/status) is the peak of the rank's own
address space only, so the bench reports it as the rank's peak and judges budgets by it; both
figures are in the results.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.baselines import (
    DEEPSPEED,
    build_deepspeed,
    build_deepspeed_deferred,
    deepspeed_missing_reason,
)
from tidal.data import BatchSampler, build_token_splits
from tidal.distributed import all_reduce_mean
from tidal.models import build_gpt, gpt_init
from tidal.models.gpt import GPT
from tidal.parallel.accumulation import StepCounter, rank_rows
from tidal.parallel.lr import WarmupCosine
from tidal.parallel.reference import build_optimizer
from tidal.train.build import build_engine
from tidal.train.job import JobConfig, find_recipe, load_job

__all__ = [
    "DEEPSPEED",
    "DP_SYSTEMS",
    "FSDP2",
    "TIDAL",
    "Case",
    "Fsdp2Engine",
    "init_fsdp2_shards",
    "missing_reason",
    "rss_figures",
    "run_case",
]

TIDAL = "tidal"
FSDP2 = "fsdp2-cpu-offload"
DP_SYSTEMS = (TIDAL, DEEPSPEED, FSDP2)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One (system, world size) configuration as every rank runs it.

    ``tidal_budget_bytes``: a per-rank host budget that tidal is told about (the scale section);
    the other systems have no such setting and are only measured against it. ``result_dir``:
    where each rank also writes its figures once it has them; see [Note: teardown failures] in
    dp.py. ``deferred``: no rank holds the whole model at any time: tidal builds it on the meta
    device and streams its values into the shards (:func:`tidal.models.gpt_init`); DeepSpeed
    constructs it inside ``deepspeed.zero.Init`` (:func:`benchmarks.baselines.
    build_deepspeed_deferred`); FSDP2 shards a meta model, then materialises and draws its
    shards (:class:`Fsdp2Engine`). Otherwise every rank builds the whole model on the CPU first.
    """

    system: str
    recipe: str
    overrides: tuple[str, ...]
    steps: int
    warmup_steps: int
    tidal_budget_bytes: int | None = None
    tidal_device_fraction: float = 0.1
    result_dir: str | None = None
    deferred: bool = False


def missing_reason(system: str) -> str | None:
    """Why ``system`` cannot run here, or None."""
    if system not in DP_SYSTEMS:
        raise ValueError(f"unknown system {system!r}; expected one of {DP_SYSTEMS}")
    return deepspeed_missing_reason() if system == DEEPSPEED else None


# -- memory figures ---------------------------------------------------------------------------


def rss_figures() -> dict[str, int]:
    """Current RSS, ``ru_maxrss`` and ``VmHWM`` of this process in bytes; see
    [Note: peak RSS of a spawned rank]."""
    page_bytes = resource.getpagesize()
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * page_bytes
    hwm_kib = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm_kib = int(line.split()[1])
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rss_bytes": current,
        "ru_maxrss_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024,
        "hwm_rss_bytes": hwm_kib * 1024,
    }


# -- FSDP2 ---------------------------------------------------------------------------------------


class Fsdp2Engine:
    """FSDP2 with CPU offload behind the reference engine's calling convention.

    ``model`` is whole on the CPU, or with ``init_seed`` on the meta device (a GPT): then it is
    sharded first, each rank allocates its shards (``model.to_empty(device="cpu")``) and
    :func:`init_fsdp2_shards` draws them, as torch's FSDP2 docs and torchtitan build a model
    too large for one rank.

    Mirrors :class:`tidal.parallel.reference.ReferenceEngine`: the loss is divided by the
    accumulation steps, and on the boundary the (already averaged, sharded) gradients are
    clipped, AdamW steps and the schedule sets the next learning rate.
    """

    def __init__(
        self, model: nn.Module, job: JobConfig, *, world_size: int, init_seed: int | None = None
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        training, opt = job.training, job.optimizer
        if training.precision == "fp16":
            raise ValueError("the FSDP2 baseline runs fp32 or bf16 only")
        mesh = init_device_mesh("cpu", (world_size,))
        # Pinning needs an accelerator; without one the parameters stay in pageable memory.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": offload}
        if training.precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, **kwargs)
        # The root holds the embeddings, the final norm and the (tied) head.
        fully_shard(model, **kwargs)
        if init_seed is not None:  # a meta model: its shards are allocated and drawn only now
            assert isinstance(model, GPT)
            if model.config.tie_embeddings:
                # to_empty gives the tied matrix two tensors under one FSDP2 parameter
                raise ValueError("the deferred FSDP2 baseline needs model.tie_embeddings=false")
            model.to_empty(device="cpu")
            init_fsdp2_shards(model, init_seed)
        self.model = model
        self.grad_accum_steps = training.grad_accum_steps
        self.grad_clip_norm = training.grad_clip_norm
        self.schedule = WarmupCosine(
            peak_lr=opt.lr,
            warmup_steps=opt.warmup_steps,
            decay_steps=opt.decay_steps or training.steps,
            min_lr_ratio=opt.min_lr_ratio,
        )
        self.optimizer = build_optimizer(model, opt, self.schedule.lr_at(0))
        self.counter = StepCounter(grad_accum_steps=training.grad_accum_steps)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
        scaled.backward()

    def step(self) -> bool:
        if not self.counter.count_micro_batch():
            return False
        if self.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.counter.global_step += 1
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.counter.global_step)
        return True


def init_fsdp2_shards(model: GPT, seed: int) -> None:
    """Initialise a ``fully_shard``-ed GPT in place on each rank's shards: GPT-2's rule per
    parameter (:meth:`GPT.init_rule`: a normal draw with its std, or its constant), the draws
    from a CPU generator seeded with ``seed`` and the rank.

    The distribution is tidal's, the values are not ``build_gpt(config, seed=seed)``'s: those
    are one draw over each whole parameter, which no rank holds here. DTensor's random ops
    draw a sharded parameter as if whole only on CUDA-like meshes: on a CPU mesh its RNG
    tracker is not used (the op warns of incomplete support) and each rank draws its local
    tensor from its default generator, the same stream on every rank after one seed. So the
    shards are drawn as local tensors here, from a generator per rank, so no two repeat.
    """
    from torch.distributed.tensor import DTensor

    generator = torch.Generator(device="cpu").manual_seed((seed << 16) + dist.get_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            is_random, value = model.init_rule(name)
            if is_random:
                local.normal_(0.0, value, generator=generator)
            else:
                local.fill_(value)


# -- one rank's run ------------------------------------------------------------------------------


def tidal_budget_overrides(
    budget_bytes: int, base_rss_bytes: int, device_fraction: float
) -> list[str]:
    """tidal's tiers under a per-rank host budget: ``device_fraction`` of it for gathered chunks
    and activations (the device tier is host memory too on a CPU), the rest, less what the
    process held before the model existed, for the host tier's shards and optimizer state."""
    device_bytes = max(1, int(budget_bytes * device_fraction))
    host_bytes = budget_bytes - device_bytes - base_rss_bytes
    if host_bytes <= 0:
        raise ValueError(
            f"the process holds {base_rss_bytes:,} bytes before the model exists; a budget of "
            f"{budget_bytes:,} leaves the host tier nothing"
        )
    return [f"memory.device_budget={device_bytes}", f"memory.host_budget={host_bytes}"]


def _model_and_engine(case: Case, job: JobConfig, world_size: int) -> tuple[nn.Module, Any]:
    """The GPT in ``case.system``'s engine: built whole on the CPU, or with ``case.deferred``
    as each system builds a model too large for one rank (see :class:`Case`)."""
    config, seed = job.model.resolve_gpt(), job.training.seed
    if case.deferred and case.system == DEEPSPEED:
        return build_deepspeed_deferred(config, job, seed=seed)
    if case.deferred:
        model = build_gpt(config, device="meta")
        if case.system == FSDP2:
            return model, Fsdp2Engine(model, job, world_size=world_size, init_seed=seed)
        return model, build_engine(model, job, init=gpt_init(model, seed))
    model = build_gpt(config, device="cpu", seed=seed)
    return model, _build(case.system, model, job, world_size)


def _num_params(model: nn.Module) -> int:
    """Parameters of ``model``, tied ones once; a DeepSpeed partitioned one by its whole size."""
    unique = {id(p): p for p in model.parameters()}
    return sum(getattr(p, "ds_numel", p.numel()) for p in unique.values())


def _build(system: str, model: nn.Module, job: JobConfig, world_size: int) -> Any:
    if system == TIDAL:
        return build_engine(model, job)
    if system == DEEPSPEED:
        return build_deepspeed(model, job, torch.device("cpu"))
    if system == FSDP2:
        return Fsdp2Engine(model, job, world_size=world_size)
    raise ValueError(f"unknown system {system!r}; expected one of {DP_SYSTEMS}")


_DISK_FIGURES = ("bytes_to_nvme", "bytes_from_nvme", "peak_nvme_bytes", "chunks_on_nvme",
                 "param_shards_on_nvme", "num_chunks", "peak_host_bytes", "host_budget",
                 "param_reads_ahead", "param_reads_on_demand")  # fmt: skip


def _disk_figures(engine: Any) -> dict[str, int]:
    stats = engine.stats() if hasattr(engine, "stats") else {}
    if "bytes_to_nvme" not in stats:
        return {}
    return {key: stats[key] for key in _DISK_FIGURES if key in stats}


def run_case(case: Case) -> dict[str, Any]:
    """Build ``case.system`` on this rank and train; the rank's figures (under
    :func:`tidal.testing.run_on_ranks`, which has set up the process group)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = rss_figures()
    job = load_job(find_recipe(case.recipe), list(case.overrides))
    budgets: list[str] = []
    if case.system == TIDAL and case.tidal_budget_bytes is not None:
        budgets = tidal_budget_overrides(
            case.tidal_budget_bytes, base["rss_bytes"], case.tidal_device_fraction
        )
        job = load_job(job, budgets)
    training = job.training
    rows = rank_rows(training.batch_size, rank=rank, world_size=world_size)
    model_config = job.model.resolve_gpt()
    torch.manual_seed(training.seed)
    model, engine = _model_and_engine(case, job, world_size)
    count = _num_params(model)
    built = rss_figures()
    splits = build_token_splits(job.data, vocab_size=model_config.vocab_size, seed=training.seed)
    batches = BatchSampler(
        splits.train, batch_size=training.batch_size, seq_len=model_config.seq_len,
        seed=training.seed,
    )  # fmt: skip
    step_s: list[float] = []
    losses: list[float] = []
    after_warmup: dict[str, int] = {}
    disk_before: dict[str, int] = {}
    for step in range(case.steps):
        if step == case.warmup_steps:
            after_warmup = rss_figures()
            disk_before = _disk_figures(engine)
        start = time.perf_counter()
        loss_sum = 0.0
        for _ in range(training.grad_accum_steps):
            inputs, targets = batches.next_batch()
            loss = engine(inputs[rows], targets[rows])
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach())
        # The loss of the global batch (every rank's slice is the same size); also a barrier.
        losses.append(all_reduce_mean(loss_sum / training.grad_accum_steps))
        step_s.append(time.perf_counter() - start)
    end = rss_figures()
    timed = step_s[case.warmup_steps :] or step_s
    figures = {
        "rank": rank,
        "num_params": count,
        "tokens_per_step": training.batch_size * model_config.seq_len * training.grad_accum_steps,
        "step_s": step_s,
        "median_step_s": statistics.median(timed),
        "losses": losses,
        "base_rss_bytes": base["rss_bytes"],
        "rss_after_build_bytes": built["rss_bytes"],
        "hwm_rss_after_build_bytes": built["hwm_rss_bytes"],
        "rss_after_warmup_bytes": (after_warmup or end)["rss_bytes"],
        "hwm_rss_bytes": end["hwm_rss_bytes"],
        "ru_maxrss_bytes": end["ru_maxrss_bytes"],
        "num_threads": torch.get_num_threads(),
        "tidal_budgets": budgets,
        "load_average_1m": os.getloadavg()[0],
    }
    disk_after = _disk_figures(engine)
    if disk_after:  # tidal with an NVMe tier: what crossed it in the timed steps, and where
        figures["disk"] = {
            **disk_after,
            "timed_bytes_to_nvme": disk_after["bytes_to_nvme"] - disk_before["bytes_to_nvme"],
            "timed_bytes_from_nvme": disk_after["bytes_from_nvme"] - disk_before["bytes_from_nvme"],
            "timed_steps": len(timed),
        }
    if case.result_dir is not None:
        path = Path(case.result_dir) / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(figures))
        path.with_suffix(".tmp").replace(path)  # whole or absent, never half written
    return figures
