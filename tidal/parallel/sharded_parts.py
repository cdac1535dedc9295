"""The chunk engine's parts over several ranks: ZeRO-3 data parallelism on sharded chunks.

Each rank keeps 1/N of every chunk ([Note: sharded chunks] in tidal/sharding/store.py) and of its
optimizer state, gathers chunks before use under the same device budget, trace, eviction and
prefetch as on one process, and reduce-scatters gradients ([Note: sharded gradients] in
tidal/sharding/grads.py). The calling convention is the chunk engine's; each rank passes its own
slice of the global batch. One process is a mesh of one (the NVMe tier runs there, its swapper
being the sharded optimizer's).

[Note: sharded iterations]
One training iteration per rank, with ``reshard_after_forward``: the forward gathers each chunk
(prefetching along the trace) and keeps what the budget allows; when the backward starts every
gathered chunk is dropped, so the backward gathers them again, and each chunk's gradient is
reduce-scattered as soon as it is complete. At the step the gathered copies are dropped (the
shards are about to change) and each rank updates its shards. Per step and rank that is the
ZeRO-3 volume, ``3 * model bytes * (N-1)/N`` with an unlimited budget ([Note: collective byte
counts] in tidal/distributed/collectives.py); a budget that forces evictions adds gathers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.nvme import NvmeTier
from tidal.memory.optim_rules import make_rule
from tidal.memory.tiers import Tier
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import checkpoint_meta, largest_module_bytes, persistent_buffers
from tidal.parallel.parts import PartsHost
from tidal.parallel.protocol import CheckpointTensors, LoadTensors
from tidal.sharding.config import ShardingConfig
from tidal.sharding.optim import ShardedOptimizer, make_master_shards
from tidal.sharding.state import sharded_tensors
from tidal.sharding.store import ShardedChunkStore
from tidal.sharding.swap import ShardReader, StateSwapper, nvme_staging_bytes, plan_nvme

__all__ = ["ShardedParts"]


class ShardedParts:
    """Chunks and optimizer state sharded over ``comm``'s ranks: the chunk engine's ``parts``
    (the ``ChunkParts`` protocol)."""

    gathers = True

    def __init__(self, comm: Collectives, *, sharding: ShardingConfig, memory: MemoryConfig,
                 optimizer: OptimizerConfig) -> None:  # fmt: skip
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.sharding = sharding
        self.memory = memory
        self.optimizer_config = optimizer
        self.nvme: NvmeTier | None = None
        self.swapper: StateSwapper | None = None  # which shards live on disk; see _plan_disk
        self.host_staging_bytes = 0  # host memory the disk's traffic streams through
        self._placed = False  # whether before_step placed the shards

    def agree_budgets(self, device_tier: Tier, host_tier: Tier) -> None:
        """[Note: ranks decide alike] in tidal/sharding/store.py: one budget for every rank."""
        for tier in (device_tier, host_tier):
            if tier.budget_bytes is not None and not self.comm.local:
                smallest = torch.tensor([tier.budget_bytes], dtype=torch.int64)
                dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.comm.group)
                tier.budget_bytes = int(smallest.item())

    def make_masters(self, engine: PartsHost, param_dtype: torch.dtype) -> Any:
        self.swapper = self._plan_disk(engine, param_dtype)
        if param_dtype == torch.float32:
            return None
        return make_master_shards(engine.model, engine.layout, rank=self.rank,
                                  world_size=self.world_size, host_tier=engine.host_tier,
                                  swapper=self.swapper, values=engine.values())  # fmt: skip

    def _plan_disk(self, engine: PartsHost, param_dtype: torch.dtype) -> StateSwapper | None:
        """Which chunk indices keep which shards on the NVMe tier (none without
        ``memory.nvme_dir``); see [Note: nvme placement] in tidal/sharding/swap.py."""
        if self.memory.nvme_dir is None:
            return None
        self.nvme = NvmeTier(self.memory.nvme_dir, budget_bytes=self.memory.nvme_budget)
        trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
        kinds = len(make_rule(self.optimizer_config).state_kinds)
        kinds += 1 if param_dtype != torch.float32 else 0  # the masters
        chunks = engine.layout.chunks
        numels = [spec.capacity // self.world_size for spec in chunks]
        is_trainable = [any(i.names[0] in trainable for i in spec.slots) for spec in chunks]
        state = [4 * kinds * n * t for n, t in zip(numels, is_trainable, strict=True)]
        params = [n * param_dtype.itemsize for n in numels]
        grads = [4 * n * t for n, t in zip(numels, is_trainable, strict=True)]
        read_ahead = self.memory.nvme_read_ahead
        plan = plan_nvme(state_bytes=state, param_bytes=params, grad_bytes=grads,
                         host_budget_bytes=engine.host_tier.budget_bytes, read_ahead=read_ahead,
                         state_fraction=self.memory.nvme_state_fraction)  # fmt: skip
        self.host_staging_bytes = nvme_staging_bytes(plan, state_bytes=state, param_bytes=params,
                                                     grad_bytes=grads, read_ahead=read_ahead)  # fmt: skip
        return StateSwapper(self.nvme, engine.host_tier, plan)

    def make_store(self, engine: PartsHost, dtype: torch.dtype, chunk: ChunkConfig) -> Any:
        reader = None
        if self.swapper is not None and self.swapper.plan.params:
            numels = [spec.capacity // self.world_size for spec in engine.layout.chunks]
            reader = ShardReader(self.swapper, numels=numels, dtype=dtype,
                                 depth=self.memory.nvme_read_ahead)  # fmt: skip
        store = ShardedChunkStore(
            engine.model, comm=self.comm, reader=reader,
            check_gathers=self.sharding.check_gathers, layout=engine.layout,
            device_tier=engine.device_tier, host_tier=engine.host_tier, dtype=dtype,
            policy=chunk.policy, prefetch=chunk.prefetch, values=engine.values(),
        )  # fmt: skip
        store.keep_trace_params = False  # only relayout reads them, and sharded chunks stay put
        return store

    def minimum_budget(self, engine: PartsHost) -> tuple[int, str]:
        """The hungriest module's chunks, plus, where some chunk is not fp32, one chunk's fp32
        gradient and its reduced shard: fp32 chunks take their gradients in place ([Note:
        gradients in gathered chunks] in tidal/sharding/grads.py)."""
        need, owner = largest_module_bytes(engine.model, engine.store)
        largest = max((c.spec.capacity for c in engine.store.chunks
                       if c.dtype != torch.float32), default=0)  # fmt: skip
        return need + 4 * largest + 4 * largest // self.world_size, owner

    def make_optimizer(self, engine: PartsHost, optimizer: OptimizerConfig,
                       training: TrainingConfig, chunk: ChunkConfig, masters: Any) -> Any:  # fmt: skip
        return ShardedOptimizer(
            engine.store,
            names={id(p): n for n, p in engine.model.named_parameters()},
            rule=make_rule(optimizer),
            weight_decay=optimizer.weight_decay,
            decays=optimizer.decays,
            fused=optimizer.use_fused(engine.device.type),
            masters=masters,
            max_pending=self.sharding.max_pending_reductions,
            swapper=self.swapper,
        )

    def read_parameter(self, engine: PartsHost, param: nn.Parameter) -> torch.Tensor:
        """``param``'s full weights, gathered: collective, every rank must call it (as every
        rank calls ``model.state_dict()``)."""
        index, slot = engine.store.slot_of[id(param)]
        engine.store.wait_for_copies()
        full = engine.optimizer.full_weights(index)
        return engine.store.chunks[index].view_in(full, slot).clone()

    def write_parameter(self, engine: PartsHost, param: nn.Parameter, value: torch.Tensor) -> None:  # fmt: skip
        """This rank's piece of ``value`` into its shards (and the gathered copy, if any); every
        rank writes the same value for the model to stay one."""
        index, slot = engine.store.slot_of[id(param)]
        engine.store.drop_read_ahead()  # stale once the shard changes
        engine.store.wait_for_copies()
        engine.optimizer.write_weights(index, slot, value)
        chunk = engine.store.chunks[index]
        if chunk.on_device:
            chunk.view(slot).copy_(value)

    # -- the iteration ([Note: sharded iterations]) ----------------------------------------------

    def before_backward(self, engine: PartsHost) -> None:
        if self.sharding.reshard_after_forward:
            engine.store.drop_gathered()

    def after_backward(self, engine: PartsHost) -> None:
        engine.optimizer.finish_backward()

    def before_step(self, engine: PartsHost) -> None:
        """Shards live on the device when there is no device budget (placed at the first
        step), else on the host; sharded chunks are never pinned, so never unplaced."""
        if not self._placed and engine.device_tier.budget_bytes is None:
            everything = frozenset(range(len(engine.store.chunks))) - engine.optimizer.on_disk
            engine.optimizer.place(everything, engine.device_tier)
        self._placed = True

    def stats(self, engine: PartsHost, stats: dict[str, Any]) -> dict[str, Any]:
        required = engine.optimizer.peak_required_transient_bytes
        stats.update(
            engine="chunk-sharded",
            rank=self.rank,
            world_size=self.world_size,
            reshard_after_forward=self.sharding.reshard_after_forward,
            # the largest moment plus the gradient buffers no chunk could do without
            # ([Note: gradients in gathered chunks] in tidal/sharding/grads.py)
            min_device_bytes=stats["min_device_bytes"] + required,
            peak_gradient_buffer_bytes=engine.optimizer.peak_transient_bytes,
            gradient_stashes=engine.optimizer.gradients.gathered.num_stashes,
            chunks_on_nvme=len(engine.optimizer.on_disk),
            param_shards_on_nvme=len(engine.store.on_disk),
            **self.comm.stats(),
        )
        if self.nvme is not None:
            nvme = self.nvme.stats()
            stats.update(bytes_to_nvme=nvme["in_bytes"], bytes_from_nvme=nvme["out_bytes"],
                         peak_nvme_bytes=nvme["peak_bytes"], nvme_budget=nvme["budget_bytes"],
                         host_staging_bytes=self.host_staging_bytes)  # fmt: skip
        if engine.store.reader is not None:
            reader = engine.store.reader
            stats.update(param_reads_ahead=reader.num_read_ahead,
                         param_reads_on_demand=reader.num_read_on_demand,
                         param_bytes_read_ahead=reader.ahead_bytes)  # fmt: skip
        return stats

    # -- state: full (gathered) tensors, so any world size can load them ------------------------

    def model_state_dict(self, engine: PartsHost) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank; collective (every rank must call it)."""
        engine.store.wait_for_copies()
        state: dict[str, torch.Tensor] = {}
        for index, spec in enumerate(engine.layout.chunks):
            full = engine.optimizer.full_weights(index)
            for slot, info in enumerate(spec.slots):
                value = engine.store.chunks[index].view_in(full, slot).clone()
                for name in info.names:
                    state[name] = value
        for name, buffer in persistent_buffers(engine.model):
            state[name] = buffer.detach().cpu().clone()
        return {k: state[k] for k in engine.model.state_dict(keep_vars=True)}

    def load_state_dict(self, engine: PartsHost, state: dict[str, Any]) -> None:
        self._before_load(engine)
        buffers = dict(persistent_buffers(engine.model))
        for name, value in state["model"].items():
            if name in buffers:
                buffers[name].copy_(value)
        engine.optimizer.load_full(state["model"], state["optimizer"])

    def _before_load(self, engine: PartsHost) -> None:
        engine.store.drop_gathered()  # stale once the shards change
        engine.store.drop_read_ahead()
        engine.store.wait_for_copies()

    # -- sharded checkpoints ([Note: checkpoint tensors] in tidal/sharding/state.py) ------------

    def checkpoint_state(self, engine: PartsHost) -> CheckpointTensors:
        """This rank's pieces (read from the NVMe tier as DCP writes them); the rest is the same
        on every rank."""
        from tidal.sharding.planners import PieceSavePlanner  # DCP: for checkpoints only

        engine.store.wait_for_copies()
        tensors = self._tensors(engine)
        extras: dict[str, Any] = {**engine.counter.state(),
                                  "optimizer_steps": engine.optimizer.step_counts()}  # fmt: skip
        if engine.loss_scale is not None:
            extras["loss_scale"] = dataclasses.asdict(engine.loss_scale)
        meta = checkpoint_meta(engine, tensors)
        meta["world_size"] = self.world_size
        return CheckpointTensors(tensors=tensors, extras=extras, meta=meta,
                                 planner=PieceSavePlanner(self.nvme))  # fmt: skip

    def restore_checkpoint(self, engine: PartsHost, load: LoadTensors, extras: dict[str, Any],
                           meta: dict[str, Any]) -> None:  # fmt: skip
        """Read this rank's pieces straight into its shards, in memory or on disk (any world
        size wrote them)."""
        from tidal.sharding.planners import PieceLoadPlanner  # DCP: for checkpoints only

        self._before_load(engine)
        saved = {key.split("/")[1] for key in meta["numels"] if key.startswith("optim/")}
        engine.optimizer.set_written(saved)
        load(self._tensors(engine), planner=PieceLoadPlanner(self.nvme))
        engine.optimizer.weights_loaded()
        engine.optimizer.set_step_counts(extras["optimizer_steps"])
        engine.restore_counters(extras)

    def _tensors(self, engine: PartsHost) -> dict[str, Any]:
        """The checkpoint's keys: this rank's pieces of the parameters and the optimizer state
        (written ones), and the buffers (the same on every rank)."""
        tensors: dict[str, Any] = {**sharded_tensors(engine.optimizer)}
        for name, buffer in persistent_buffers(engine.model):
            tensors[f"buffer/{name}"] = buffer.detach()
        return tensors
