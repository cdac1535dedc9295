"""The chunk engine over several ranks: ZeRO-3 data parallelism on sharded chunks.

Each rank keeps 1/N of every chunk ([Note: sharded chunks] in tidal/sharding/store.py) and of its
optimizer state, gathers chunks before use under the same device budget, trace, eviction and
prefetch as on one process, and reduce-scatters gradients ([Note: sharded gradients] in
tidal/sharding/grads.py). The calling convention is the chunk engine's; each rank passes its own
slice of the global batch.

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
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.layout import ChunkLayout, default_chunk_size, plan_layout, unique_parameters
from tidal.memory.materialize import ParameterValues
from tidal.memory.nvme import NvmeTier
from tidal.memory.optim_rules import make_rule
from tidal.memory.tiers import Tier
from tidal.memory.uses import ParameterUses
from tidal.parallel.chunk_engine import ChunkEngine, _largest_module_bytes, _persistent_buffers
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.protocol import CheckpointTensors, LoadTensors
from tidal.sharding.config import ShardingConfig
from tidal.sharding.disk_checkpoint import DiskLoadPlanner, DiskSavePlanner
from tidal.sharding.optim import ShardedOptimizer, make_master_shards
from tidal.sharding.state import sharded_tensors
from tidal.sharding.store import ShardedChunkStore
from tidal.sharding.swap import ShardReader, StateSwapper, plan_nvme

__all__ = ["ShardedEngine"]


class ShardedEngine(ChunkEngine):
    """:class:`ChunkEngine` with chunks and optimizer state sharded over the default group."""

    store: ShardedChunkStore
    optimizer: ShardedOptimizer  # type: ignore[assignment]

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        memory: MemoryConfig,
        chunk: ChunkConfig,
        sharding: ShardingConfig,
        group: Any = None,
        init: ParameterValues | None = None,
    ) -> None:
        self.comm = Collectives(group)
        self.sharding = sharding
        self.memory = memory
        self.optimizer_config = optimizer
        self.nvme: NvmeTier | None = None
        self.swapper: StateSwapper | None = None
        # Relayout would re-shard every chunk and its state after the first step; gradients in
        # parameter chunks would reduce bf16 sums. Neither is supported sharded (yet).
        chunk = dataclasses.replace(chunk, relayout=False, grads_in_params=False)
        super().__init__(model, optimizer=optimizer, training=training, memory=memory, chunk=chunk,
                         init=init)  # fmt: skip
        self.store.on_unpin = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    # -- construction ------------------------------------------------------------------------------

    def _make_tiers(self, memory: MemoryConfig) -> tuple[Tier, Tier]:
        device_tier, host_tier = super()._make_tiers(memory)
        # [Note: ranks decide alike] in tidal/sharding/store.py: one budget for every rank.
        for tier in (device_tier, host_tier):
            if tier.budget_bytes is not None and not self.comm.local:
                smallest = torch.tensor([tier.budget_bytes], dtype=torch.int64)
                dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.comm.group)
                tier.budget_bytes = int(smallest.item())
        return device_tier, host_tier

    def _plan_layout(self, model: nn.Module, chunk: ChunkConfig) -> ChunkLayout:
        # Capacities are multiples of the alignment, so an alignment that is a multiple of the
        # world size makes every chunk split into equal shards.
        align = math.lcm(chunk.align, self.comm.world_size)
        params = unique_parameters(model)
        size = chunk.size or default_chunk_size(params, align=align).chunk_size
        return plan_layout(params, chunk_size=-(-size // align) * align, align=align)

    def _make_masters(self, model: nn.Module, param_dtype: torch.dtype) -> Any:
        self.swapper = self._plan_disk(model, param_dtype)
        if param_dtype == torch.float32:
            return None
        return make_master_shards(model, self.layout, rank=self.rank, world_size=self.world_size,
                                  host_tier=self.host_tier, swapper=self.swapper,
                                  values=self._values())  # fmt: skip

    def _plan_disk(self, model: nn.Module, param_dtype: torch.dtype) -> StateSwapper | None:
        """Which chunk indices keep which shards on the NVMe tier (none without
        ``memory.nvme_dir``); see [Note: nvme placement] in tidal/sharding/swap.py."""
        if self.memory.nvme_dir is None:
            return None
        self.nvme = NvmeTier(self.memory.nvme_dir, budget_bytes=self.memory.nvme_budget)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        kinds = len(make_rule(self.optimizer_config).state_kinds)
        kinds += 1 if param_dtype != torch.float32 else 0  # the masters
        numels = [spec.capacity // self.world_size for spec in self.layout.chunks]
        is_trainable = [any(i.names[0] in trainable for i in spec.slots)
                        for spec in self.layout.chunks]  # fmt: skip
        plan = plan_nvme(
            state_bytes=[4 * kinds * n * t for n, t in zip(numels, is_trainable, strict=True)],
            param_bytes=[n * param_dtype.itemsize for n in numels],
            grad_bytes=[4 * n * t for n, t in zip(numels, is_trainable, strict=True)],
            host_budget_bytes=self.host_tier.budget_bytes,
            read_ahead=self.memory.nvme_read_ahead,
        )
        return StateSwapper(self.nvme, self.host_tier, plan)

    def _make_store(
        self, model: nn.Module, param_dtype: torch.dtype, chunk: ChunkConfig
    ) -> ShardedChunkStore:
        reader = None
        if self.swapper is not None and self.swapper.plan.params:
            numels = [spec.capacity // self.world_size for spec in self.layout.chunks]
            reader = ShardReader(self.swapper, numels=numels, dtype=param_dtype,
                                 depth=self.memory.nvme_read_ahead)  # fmt: skip
        return ShardedChunkStore(
            model,
            comm=self.comm,
            reader=reader,
            check_gathers=self.sharding.check_gathers,
            layout=self.layout,
            device_tier=self.device_tier,
            host_tier=self.host_tier,
            dtype=param_dtype,
            policy=chunk.policy,
            prefetch=chunk.prefetch,
            values=self._values(),
        )

    def _minimum_budget(self) -> tuple[int, str]:
        need, owner = _largest_module_bytes(self.model, self.store)
        return need + self._gradient_buffer_bytes(), owner

    def _gradient_buffer_bytes(self) -> int:
        """One chunk's fp32 gradient and its reduced shard: the least a backward needs besides
        the module's chunks."""
        largest = max((c.spec.capacity for c in self.store.chunks), default=0)
        return 4 * largest + 4 * largest // self.world_size

    def _make_optimizer(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        chunk: ChunkConfig,
        masters: Any,
    ) -> ShardedOptimizer:
        return ShardedOptimizer(
            self.store,
            names={id(p): n for n, p in model.named_parameters()},
            rule=make_rule(optimizer),
            weight_decay=optimizer.weight_decay,
            fused=optimizer.use_fused(self.device.type),
            masters=masters,
            max_pending=self.sharding.max_pending_reductions,
            swapper=self.swapper,
        )

    def _make_uses(self) -> ParameterUses:
        """[Note: parameter uses] in tidal/memory/uses.py: the gathered copy is never the
        weights, and a chunk not gathered is not brought in between iterations (a gather needs
        every rank)."""
        return ParameterUses(
            self.store,
            read=self.read_parameter,
            write=self.write_parameter,
            in_place=False,
            fetch_between_iterations=False,
        )

    def read_parameter(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s full weights, gathered: collective, every rank must call it (as every
        rank calls ``model.state_dict()``)."""
        index, slot = self.store.slot_of[id(param)]
        self.store.wait_for_copies()
        full = self.optimizer.full_weights(index)
        return self.store.chunks[index].view_in(full, slot).clone()

    def write_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """This rank's piece of ``value`` into its shards (and the gathered copy, if any); every
        rank writes the same value for the model to stay one."""
        index, slot = self.store.slot_of[id(param)]
        self.store.drop_read_ahead()  # stale once the shard changes
        self.store.wait_for_copies()
        self.optimizer.write_weights(index, slot, value)
        chunk = self.store.chunks[index]
        if chunk.on_device:
            chunk.view(slot).copy_(value)

    # -- the iteration ([Note: sharded iterations]) ----------------------------------------------

    def _before_backward(self) -> None:
        if self.sharding.reshard_after_forward:
            self.store.drop_gathered()

    def _after_backward(self) -> None:
        self.optimizer.finish_backward()

    def _place_optimizer(self) -> None:
        """Shards live on the device when there is no device budget, else on the host."""
        if self.device_tier.budget_bytes is None:
            everything = frozenset(range(len(self.store.chunks))) - self.optimizer.on_disk
            self.optimizer.place(everything, self.device_tier)
        self._placed = True

    def _unplace_optimizer(self) -> None:
        raise AssertionError("sharded chunks are never pinned")

    # -- figures -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        transient = self.optimizer.peak_transient_bytes
        stats.update(
            engine="chunk-sharded",
            rank=self.rank,
            world_size=self.world_size,
            reshard_after_forward=self.sharding.reshard_after_forward,
            # the largest moment plus the gradient buffers the backward held at once
            min_device_bytes=stats["min_device_bytes"] + transient,
            peak_gradient_buffer_bytes=transient,
            chunks_on_nvme=len(self.optimizer.on_disk),
            param_shards_on_nvme=len(self.store.on_disk),
            **self.comm.stats(),
        )
        if self.nvme is not None:
            nvme = self.nvme.stats()
            stats.update(bytes_to_nvme=nvme["in_bytes"], bytes_from_nvme=nvme["out_bytes"],
                         peak_nvme_bytes=nvme["peak_bytes"], nvme_budget=nvme["budget_bytes"])  # fmt: skip
        if self.store.reader is not None:
            reader = self.store.reader
            stats.update(param_reads_ahead=reader.num_read_ahead,
                         param_reads_on_demand=reader.num_read_on_demand,
                         param_bytes_read_ahead=reader.ahead_bytes)  # fmt: skip
        return stats

    # -- state: full (gathered) tensors, so any world size can load them ------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank; collective (every rank must call it)."""
        self.store.wait_for_copies()
        state: dict[str, torch.Tensor] = {}
        for index, spec in enumerate(self.layout.chunks):
            full = self.optimizer.full_weights(index)
            for slot, info in enumerate(spec.slots):
                value = self.store.chunks[index].view_in(full, slot).clone()
                for name in info.names:
                    state[name] = value
        for name, buffer in _persistent_buffers(self.model):
            state[name] = buffer.detach().cpu().clone()
        return {k: state[k] for k in self.model.state_dict(keep_vars=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._before_load()
        buffers = dict(_persistent_buffers(self.model))
        for name, value in state["model"].items():
            if name in buffers:
                buffers[name].copy_(value)
        self.optimizer.load_full(state["model"], state["optimizer"])
        self._restore_counters(state)

    def _before_load(self) -> None:
        self.store.drop_gathered()  # stale once the shards change
        self.store.drop_read_ahead()
        self.store.wait_for_copies()

    # -- sharded checkpoints ([Note: checkpoint tensors] in tidal/sharding/state.py) ------------

    def checkpoint_state(self) -> CheckpointTensors:
        """This rank's pieces as ShardedTensors (pieces on disk are read as DCP writes them);
        the rest is the same on every rank."""
        self.store.wait_for_copies()
        tensors, on_disk = sharded_tensors(self.optimizer)
        for name, buffer in _persistent_buffers(self.model):
            tensors[f"buffer/{name}"] = buffer.detach()
        extras: dict[str, Any] = {"global_step": self.global_step, "micro_step": self.micro_step,
                                  "optimizer_steps": self.optimizer.step_counts()}  # fmt: skip
        if self.loss_scale is not None:
            extras["loss_scale"] = dataclasses.asdict(self.loss_scale)
        meta = self._checkpoint_meta(tensors)
        meta["numels"] = {key: int(t.size(0)) for key, t in tensors.items()}
        meta["world_size"] = self.world_size
        planner = None
        if on_disk:
            assert self.nvme is not None
            planner = DiskSavePlanner(self.nvme, on_disk)
        return CheckpointTensors(tensors=tensors, extras=extras, meta=meta, planner=planner)

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """Read this rank's pieces straight into its shards, in memory or on disk (any world
        size wrote them)."""
        self._before_load()
        saved = {key.split("/")[1] for key in meta["numels"] if key.startswith("optim/")}
        self.optimizer.set_written(saved)
        targets, on_disk = sharded_tensors(self.optimizer)
        for name, buffer in _persistent_buffers(self.model):
            targets[f"buffer/{name}"] = buffer.detach()
        if on_disk:
            assert self.nvme is not None
            load(targets, planner=DiskLoadPlanner(self.nvme, on_disk))
        else:
            load(targets)
        self.optimizer.weights_loaded()
        self.optimizer.set_step_counts(extras["optimizer_steps"])
        self._restore_counters(extras)
