"""The verbs that change a model in place and return what trains it; build_engine
(tidal/train/build.py) chooses among them from the job's config alone. A pipeline's stages are
built by :func:`tidal.runtime.build.pipeline`, above the transforms it drives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import LocalParts
from tidal.parallel.reference import ReferenceEngine
from tidal.parallel.sharded_parts import ShardedParts
from tidal.sharding.config import ShardingConfig

if TYPE_CHECKING:
    from tidal.planner import Plan

__all__ = ["apply_plan", "offload", "shard"]


def offload(model: nn.Module, *, optimizer: OptimizerConfig, training: TrainingConfig,
            memory: MemoryConfig, chunk: ChunkConfig, init: ParameterValues | None = None,
            ) -> ChunkEngine:  # fmt: skip
    """Move ``model``'s parameters into chunks that travel between the device and the host
    under ``memory``'s budgets (each parameter becomes a slot of a chunk; the modules get the
    store's hooks); returns the chunk engine that trains it on this process."""
    return ChunkEngine(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                       init=init, parts=LocalParts())  # fmt: skip


_ONE_PROCESS_ONLY = {
    "relayout": "sharded chunks stay where they are",
    "grads_in_params": "sharded gradients are reduced in fp32 buffers",
}


def shard(model: nn.Module, *, optimizer: OptimizerConfig, training: TrainingConfig,
          memory: MemoryConfig, chunk: ChunkConfig, sharding: ShardingConfig, group: Any = None,
          init: ParameterValues | None = None) -> ChunkEngine:  # fmt: skip
    """:func:`offload`, each chunk and its optimizer state sharded over ``group``'s ranks
    (default: the default process group; none initialised: a mesh of one, which the NVMe tier
    uses on one process). ``chunk.relayout`` and ``chunk.grads_in_params`` do not apply: set
    to true, they are refused."""
    for key, why in _ONE_PROCESS_ONLY.items():
        if getattr(chunk, key) is True:
            raise ConfigError(f"chunk.{key}", f"applies on one process only ({why}); drop the "
                              f"setting (unset, it is on wherever it applies) or set it to false")  # fmt: skip
    parts = ShardedParts(Collectives(group), sharding=sharding, memory=memory, optimizer=optimizer)
    return ChunkEngine(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                       init=init, parts=parts)  # fmt: skip


def apply_plan(model: nn.Module, plan: Plan, *, optimizer: OptimizerConfig,
               training: TrainingConfig, init: ParameterValues | None = None,
               seq_len: int | None = None,
               inputs: tuple[torch.Tensor, ...] | None = None) -> ReferenceEngine:  # fmt: skip
    """Shard ``model`` as ``plan`` says (DTensor on ``tp``, FSDP2 on ``dp``: [Note: plan runs]
    in plan_layout.py); returns the reference engine that trains it in that layout. ``inputs``:
    for a model of your own, a sample of its inputs (as ``tidal.planner.plan_for`` took)."""
    from tidal.parallel.plan_layout import PlanLayout  # DTensor and FSDP2: for plan runs only

    layout = PlanLayout(plan, seq_len=seq_len, batch_size=training.batch_size, inputs=inputs)
    return ReferenceEngine(model, optimizer=optimizer, training=training, init=init,
                           layout=layout)  # fmt: skip
