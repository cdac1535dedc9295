"""The systems ``tidal bench offload`` compares, and the one training loop that times them all.

Every system trains the same GPT (:func:`tidal.models.build_gpt`, same seed) on the same batches
(the job's :class:`BatchSampler`, same seed) with the same AdamW hyper-parameters, schedule and
clipping, through the calling convention they share (``loss = engine(x, y)``,
``engine.backward(loss)``, ``engine.step()``):

- ``pytorch``: tidal's reference engine (plain PyTorch, ``torch.optim.AdamW``);
- ``tidal-chunk``: the chunk engine;
- ``deepspeed``: DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to the CPU and
  DeepSpeedCPUAdam, gloo: one process here; ``tidal bench dp`` builds it on each of N ranks
  (:func:`build_deepspeed`). DeepSpeed is an optional extra (``pip install -e .[baselines]``)
  and is imported only here, inside the function that builds it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal.data import BatchSampler, build_token_splits
from tidal.distributed.device import resolve_device
from tidal.models import build_gpt
from tidal.models.gpt import GPT, GPTConfig
from tidal.parallel.lr import WarmupCosine
from tidal.testing import free_port
from tidal.train.build import build_engine
from tidal.train.job import JobConfig

__all__ = [
    "DEEPSPEED",
    "PYTORCH",
    "SYSTEMS",
    "TIDAL_CHUNK",
    "Run",
    "build_deepspeed",
    "build_deepspeed_deferred",
    "build_run",
    "deepspeed_config",
    "deepspeed_missing_reason",
    "train_steps",
]

PYTORCH = "pytorch"
TIDAL_CHUNK = "tidal-chunk"
DEEPSPEED = "deepspeed-zero3-offload"
SYSTEMS = (PYTORCH, TIDAL_CHUNK, DEEPSPEED)


@dataclass
class Run:
    """A system ready to train: its engine, batches, and what a step consumes."""

    system: str
    engine: Any
    batches: BatchSampler
    device: torch.device
    num_params: int
    tokens_per_step: int
    micro_batches: int


def deepspeed_missing_reason() -> str | None:
    """Why the DeepSpeed baseline cannot run here, or None when it is importable."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed; install it with: pip install -e .[baselines]"
    return None


def build_run(system: str, job: JobConfig) -> Run:
    """The model, batches and engine of ``system`` for ``job`` (its engine setting is ignored)."""
    training = job.training
    model_config = job.model.resolve_gpt()
    torch.manual_seed(training.seed)
    model = build_gpt(model_config, device="cpu", seed=training.seed)
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    device = resolve_device(training.device)
    if system == DEEPSPEED:
        engine = build_deepspeed(model, job, device)
    elif system in (PYTORCH, TIDAL_CHUNK):
        engine_name = "reference" if system == PYTORCH else "chunk"
        engine = build_engine(model, _with_engine(job, engine_name))
    else:
        raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")
    splits = build_token_splits(job.data, vocab_size=model_config.vocab_size, seed=training.seed)
    batches = BatchSampler(
        splits.train,
        batch_size=training.batch_size,
        seq_len=model_config.seq_len,
        seed=training.seed,
    )
    return Run(
        system=system,
        engine=engine,
        batches=batches,
        device=device,
        num_params=num_params,
        tokens_per_step=training.batch_size * model_config.seq_len * training.grad_accum_steps,
        micro_batches=training.grad_accum_steps,
    )


def _with_engine(job: JobConfig, engine: str) -> JobConfig:
    from tidal.train.job import load_job

    return job if job.engine == engine else load_job(job, [f"engine={engine}"])


def train_steps(run: Run, steps: int) -> tuple[list[float], list[float]]:
    """Train ``steps`` optimizer steps; returns each step's wall seconds and loss.

    A step is timed from fetching its first batch to reading its loss back, which waits for
    the device, as ``tidal train`` times it.
    """
    step_s: list[float] = []
    losses: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        loss_sum = 0.0
        for _ in range(run.micro_batches):
            inputs, targets = run.batches.next_batch()
            loss = run.engine(inputs.to(run.device), targets.to(run.device))
            run.engine.backward(loss)
            run.engine.step()
            loss_sum += float(loss.detach())
        step_s.append(time.perf_counter() - start)
        losses.append(loss_sum / run.micro_batches)
    return step_s, losses


# -- DeepSpeed -----------------------------------------------------------------------------------


def deepspeed_config(job: JobConfig, *, world_size: int = 1) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer state offloaded to the CPU, as the job trains;
    ``training.batch_size`` is the global micro-batch, split equally over ``world_size`` ranks."""
    training = job.training
    if training.precision == "fp16":
        raise ValueError(
            "the DeepSpeed baseline runs fp32 or bf16 only (fp16 needs DeepSpeed's loss scaler, "
            "which tidal's fp16 path does not mirror)"
        )
    if training.batch_size % world_size:
        raise ValueError(
            f"training.batch_size {training.batch_size} does not split over {world_size} ranks"
        )
    return {
        "train_micro_batch_size_per_gpu": training.batch_size // world_size,
        "gradient_accumulation_steps": training.grad_accum_steps,
        "gradient_clipping": training.grad_clip_norm,
        "bf16": {"enabled": training.precision == "bf16"},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The reference engine's rule: matrices decay; biases, norms and gains do not. A parameter
    ``deepspeed.zero.Init`` partitioned is empty here; its ``ds_shape`` is the whole one."""
    params = [p for p in model.parameters() if p.requires_grad]

    def is_matrix(p: nn.Parameter) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    return [
        {"params": [p for p in params if is_matrix(p)], "weight_decay": weight_decay},
        {"params": [p for p in params if not is_matrix(p)], "weight_decay": 0.0},
    ]


def _join_deepspeed(device: torch.device) -> int:
    """DeepSpeed's process group (gloo) on the initialised group's ranks, else alone; the world
    size."""
    reason = deepspeed_missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if device.type == "cpu":
        # Without it DeepSpeed probes for accelerators and warns that it fell back to the CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    world_size = 1
    if torch.distributed.is_initialized():  # DeepSpeed adopts the group the caller set up
        world_size = torch.distributed.get_world_size()
    else:
        # One process is the whole world: the bench runs each case in a fresh process.
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # ZeRO-3 calls collectives that torch marks deprecated, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    deepspeed.init_distributed(dist_backend="gloo")
    return world_size


def build_deepspeed(model: nn.Module, job: JobConfig, device: torch.device) -> Any:
    """DeepSpeed's engine for ``model`` (built whole): on the initialised process group's ranks,
    else alone."""
    world_size = _join_deepspeed(device)
    return _deepspeed_engine(model, job, deepspeed_config(job, world_size=world_size))


def build_deepspeed_deferred(config: GPTConfig, job: JobConfig, *, seed: int) -> tuple[GPT, Any]:
    """A GPT no rank holds whole, in DeepSpeed's engine, on the initialised group's ranks.

    DeepSpeed's way for a model too large for one rank: construct it inside
    ``deepspeed.zero.Init(config_dict_or_path=..., remote_device="cpu")``, which partitions each
    submodule's parameters over the ranks as soon as its ``__init__`` returns (so at most one
    submodule's are ever whole), then set the values one parameter at a time inside
    ``deepspeed.zero.GatheredParameters(param, modifier_rank=0)``, which gathers it, and on
    leaving broadcasts rank 0's values and partitions it again. The values are exactly
    ``build_gpt(config, seed=seed)``'s: every rank draws each whole parameter in
    ``named_parameters()`` order from one generator, as [Note: deterministic init] in
    tidal/models/gpt.py does.
    """
    world_size = _join_deepspeed(torch.device("cpu"))
    import deepspeed

    ds_config = deepspeed_config(job, world_size=world_size)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device="cpu", enabled=True):
        model = GPT(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                is_random, value = model.init_rule(name)
                if is_random:
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                    param.copy_(noise.mul_(value))
                else:
                    param.fill_(value)
    return model, _deepspeed_engine(model, job, ds_config)


def _deepspeed_engine(model: nn.Module, job: JobConfig, ds_config: dict[str, Any]) -> Any:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = job.optimizer
    optimizer = DeepSpeedCPUAdam(
        _decay_groups(model, opt.weight_decay),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        adamw_mode=True,
    )
    schedule = WarmupCosine(
        peak_lr=opt.lr,
        warmup_steps=opt.warmup_steps,
        decay_steps=opt.decay_steps or job.training.steps,
        min_lr_ratio=opt.min_lr_ratio,
    )

    def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: schedule.lr_at(step) / opt.lr
        )

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine
