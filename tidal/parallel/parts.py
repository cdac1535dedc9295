"""The seam between the chunk engine and its parts: what differs between one process and ZeRO-3
(:class:`ChunkParts`, implemented by LocalParts and ShardedParts), and what the parts read of the
engine they serve (:class:`PartsHost`). Both are protocols here, so the engine imports its parts
and the parts never import the engine ([Note: chunk engine construction] in chunk_engine.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.memory.layout import ChunkLayout
from tidal.memory.tiers import Tier
from tidal.parallel.accumulation import StepCounter
from tidal.parallel.config import OptimizerConfig, TrainingConfig
from tidal.parallel.loss_scale import LossScale
from tidal.parallel.protocol import CheckpointTensors, LoadTensors, Phase

__all__ = ["ChunkParts", "PartsHost"]


class PartsHost(Protocol):
    """The chunk engine as its parts see it: what it has built so far (the steps' order is in
    [Note: chunk engine construction]) and the calls the parts make back."""

    model: nn.Module
    device: torch.device
    layout: ChunkLayout
    device_tier: Tier
    host_tier: Tier
    store: Any  # a ChunkStore, or the sharded one: the parts made it
    optimizer: Any  # a ChunkOptimizer, or the sharded one: the parts made it
    loss_scale: LossScale | None
    min_budget_bytes: int
    largest_module: str
    counter: StepCounter

    @property
    def phase(self) -> Phase: ...
    def values(self) -> Iterable[tuple[str, torch.Tensor]]: ...
    def write_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None: ...
    def check_minimum_budget(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def restore_counters(self, state: dict[str, Any]) -> None: ...


class ChunkParts(Protocol):
    """What differs between the chunk engine on one process and sharded over ranks; see
    [Note: chunk engine construction] for when the ``make_`` steps run."""

    rank: int
    world_size: int
    gathers: bool  # whether a chunk on the device is a gathered copy of shards

    def agree_budgets(self, device_tier: Tier, host_tier: Tier) -> None: ...
    def make_masters(self, engine: PartsHost, param_dtype: torch.dtype) -> Any: ...
    def make_store(self, engine: PartsHost, dtype: torch.dtype, chunk: ChunkConfig) -> Any: ...
    def minimum_budget(self, engine: PartsHost) -> tuple[int, str]: ...
    def make_optimizer(self, engine: PartsHost, optimizer: OptimizerConfig,
                       training: TrainingConfig, chunk: ChunkConfig, masters: Any) -> Any: ...  # fmt: skip
    def read_parameter(self, engine: PartsHost, param: nn.Parameter) -> torch.Tensor: ...
    def write_parameter(self, engine: PartsHost, param: nn.Parameter, value: torch.Tensor) -> None: ...  # fmt: skip
    def before_backward(self, engine: PartsHost) -> None: ...
    def after_backward(self, engine: PartsHost) -> None: ...
    def before_step(self, engine: PartsHost) -> None: ...
    def stats(self, engine: PartsHost, stats: dict[str, Any]) -> dict[str, Any]: ...
    def model_state_dict(self, engine: PartsHost) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, engine: PartsHost, state: dict[str, Any]) -> None: ...
    def checkpoint_state(self, engine: PartsHost) -> CheckpointTensors: ...
    def restore_checkpoint(self, engine: PartsHost, load: LoadTensors, extras: dict[str, Any],
                           meta: dict[str, Any]) -> None: ...  # fmt: skip
