"""tidal: train PyTorch models larger than the accelerator, spread with minimal redundant memory.

The front door::

    import tidal
    engine = tidal.initialize(model, config)   # config: tidal.Config, a dict, or a TOML path
    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from tidal.config import ConfigError
from tidal.distributed import init_from_env
from tidal.distributed.device import resolve_device
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.protocol import Engine, Phase, TrainingEngine
from tidal.parallel.verbs import apply_plan, offload, shard
from tidal.train import JobConfig, ReferenceEngine, Trainer, load_job

__version__ = "0.1.0"

Config = JobConfig

__all__ = [
    "ChunkEngine",
    "Config",
    "ConfigError",
    "Engine",
    "Phase",
    "ReferenceEngine",
    "Trainer",
    "TrainingEngine",
    "__version__",
    "apply_plan",
    "initialize",
    "offload",
    "shard",
]


def initialize(
    model: nn.Module,
    config: JobConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    init: ParameterValues | None = None,
) -> TrainingEngine:
    """Wrap ``model`` in the engine its config names (``engine = "reference" | "chunk"``).

    The model is one stage of the train step every tidal run takes ([Note: one model on stages]
    in tidal/runtime/stage_engine.py). ``"reference"``: on the training device, replicated over
    the ranks (or sharded by FSDP2 with ``parallel.fsdp2``); ``"chunk"``: its parameters moved
    into chunks under ``memory.device_budget`` and ``memory.host_budget``.

    A model too large to build whole can be built on the meta device and its values given as
    ``init``: a function returning ``(name, value)`` pairs, one parameter at a time, which the
    chunks stream in (every rank keeps only its shards); for tidal's GPT
    presets, ``tidal.models.gpt_init(model, seed)``::

        model = build_gpt(preset("gpt2-xl"), device="meta")   # shapes only
        engine = tidal.initialize(model, config, init=gpt_init(model, seed=0))

    Under torchrun it joins the process group torchrun's variables describe (gloo on CPU, NCCL
    on CUDA with ``cuda:LOCAL_RANK``), unless the program made one already, which is used: the
    chunks are then sharded over the ranks (ZeRO-3) and plain replicas average their
    gradients. Each rank passes its own rows of the batch.
    """
    job = load_job(config)
    init_from_env(device=resolve_device(job.training.device), timeout_s=job.distributed.timeout_s)
    # [Note: one model on stages] in tidal/runtime/stage_engine.py
    return _stage_engine(model, job, init=init)


def _stage_engine(
    model: nn.Module, job: JobConfig, *, init: ParameterValues | None
) -> TrainingEngine:
    from tidal.config import require
    from tidal.distributed import world_size
    from tidal.memory.tiers import TierKind, resolve_budget
    from tidal.runtime.stage_engine import stage_engine
    from tidal.train.build import chunk_stage_config
    from tidal.train.job import check_nvme_dir

    check_nvme_dir(job, plan=False)
    parallel = job.parallel
    for key, size in (("parallel.pp", parallel.pp), ("parallel.tp", parallel.tp)):
        require(size == 1, key, f"{key.split('.')[1]} = {size} needs the stages and the schedule "
                "tidal builds for its own models: train with tidal.Trainer or tidal train, or set "
                f"{key} = 1")  # fmt: skip
    device = resolve_device(job.training.device)
    budget = resolve_budget(job.memory.device_budget, kind=TierKind.DEVICE, device=device,
                            key="memory.device_budget")  # fmt: skip
    return stage_engine(model, optimizer=job.optimizer, training=job.training,
                        dims=parallel.resolve(world_size()), fsdp2=parallel.fsdp2,
                        fsdp2_offload=parallel.fsdp2_offload,
                        chunks=chunk_stage_config(job, device), init=init,
                        device_budget=budget)  # fmt: skip
