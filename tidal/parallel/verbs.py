"""The verbs that change a model in place and return the engine that trains it; build_engine
(tidal/train/build.py) chooses among them from the job's config alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.materialize import ParameterValues
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import LocalParts
from tidal.parallel.sharded_parts import ShardedParts
from tidal.sharding.config import ShardingConfig

if TYPE_CHECKING:
    from tidal.parallel.plan_engine import PlanEngine
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


def shard(model: nn.Module, *, optimizer: OptimizerConfig, training: TrainingConfig,
          memory: MemoryConfig, chunk: ChunkConfig, sharding: ShardingConfig, group: Any = None,
          init: ParameterValues | None = None) -> ChunkEngine:  # fmt: skip
    """:func:`offload`, each chunk and its optimizer state sharded over ``group``'s ranks
    (default: the default process group; none initialised: a mesh of one, which the NVMe tier
    uses on one process). ``chunk.relayout`` and ``chunk.grads_in_params`` do not apply."""
    parts = ShardedParts(Collectives(group), sharding=sharding, memory=memory, optimizer=optimizer)
    return ChunkEngine(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                       init=init, parts=parts)  # fmt: skip


def apply_plan(model: nn.Module, plan: Plan, *, optimizer: OptimizerConfig,
               training: TrainingConfig, init: ParameterValues | None = None,
               seq_len: int | None = None) -> PlanEngine:  # fmt: skip
    """Shard ``model`` as ``plan`` says (DTensor on ``tp``, FSDP2 on ``dp``: [Note: plan runs]
    in plan_engine.py); returns the plan engine that trains it."""
    from tidal.parallel.plan_engine import PlanEngine  # DTensor and FSDP2: for plan runs only

    return PlanEngine(model, plan=plan, optimizer=optimizer, training=training, init=init,
                      seq_len=seq_len)  # fmt: skip
