"""The chunk engine: the reference engine's calling convention over chunked model data.

Parameters live in chunks that move between the device and the host tier under
``memory.device_budget`` (see tidal/memory). The training calls are the reference engine's::

    loss = engine(inputs, targets); engine.backward(loss); engine.step()

One class trains on one process and, sharded (ZeRO-3), on many: what differs comes from its
parts, chosen once (:class:`~tidal.parallel.local_parts.LocalParts`,
:class:`~tidal.parallel.sharded_parts.ShardedParts`; the verbs ``offload`` and ``shard`` in
verbs.py pick them), never from a subclass.

[Note: chunk engine iterations]
A forward starts an iteration of the chunk store (the unit its access trace describes) and the
backward that follows ends it; a forward under ``torch.no_grad()`` ends it at once (no backward
can follow), and any other forward without a backward is ended by the next forward. So with
gradient accumulation each micro-batch is one iteration, and evaluation records a trace of its
own instead of silently following the training one. Everything between the forward and the end
of the backward belongs to the iteration: a loss term computed from the parameters after the
forward returned (an L2 penalty) is a moment of it ([Note: parameter uses] in
tidal/memory/uses.py). The open iteration is the FORWARD phase ([Note: engine phases] in
protocol.py).

[Note: chunk engine construction]
The steps run in this order, each needing the ones before: tiers (whose budgets the ranks
agree on), the layout (aligned so chunks split into equal shards), the fp32 masters and the
store (each a pass over the parameters' values, the masters first: they are taken at full
precision before the store converts them), the minimum budget check, the optimizer over the
store, then the hooks and parameter uses, which call the optimizer and the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from tidal.config import ConfigError, format_bytes
from tidal.distributed.device import memory_bytes, peak_memory_bytes, resolve_device
from tidal.memory.config import ChunkConfig
from tidal.memory.hooks import OUTPUT_ONLY_HOOK_WARNING, install_hooks
from tidal.memory.layout import ChunkLayout, default_chunk_size, plan_layout, unique_parameters
from tidal.memory.materialize import ParameterValues, check_buffers, meta_parameters, values_of
from tidal.memory.optim_rules import make_rule
from tidal.memory.shortfall import chunk_size_advice
from tidal.memory.store import DeviceBudgetTooSmall
from tidal.memory.tiers import host_budget_named, make_tiers
from tidal.memory.uses import ParameterUses
from tidal.parallel.accumulation import StepCounter
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import LocalParts
from tidal.parallel.loss_scale import LossScale
from tidal.parallel.lr import lr_schedule
from tidal.parallel.parts import ChunkParts
from tidal.parallel.protocol import CheckpointTensors, LoadTensors, Phase, Phases
from tidal.parallel.reference import autocast

__all__ = ["ChunkEngine", "ChunkParts"]  # ChunkParts: tidal/parallel/parts.py

P = ParamSpec("P")
R = TypeVar("R")


def _host_shortfalls_named(
    method: Callable[Concatenate[ChunkEngine, P], R],
) -> Callable[Concatenate[ChunkEngine, P], R]:
    """``method`` with the host tier over its budget said as the user's error (one line)."""

    @functools.wraps(method)
    def named(self: ChunkEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._host_named():
            return method(self, *args, **kwargs)

    return named


class ChunkEngine:
    """Train ``model`` with its parameters in chunks under a device byte budget; ``parts``
    (default: one process) say where the chunks live ([Note: chunk engine construction])."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        memory: MemoryConfig,
        chunk: ChunkConfig,
        init: ParameterValues | None = None,
        parts: ChunkParts | None = None,
    ) -> None:
        self.parts: ChunkParts = parts if parts is not None else LocalParts()
        self.device = resolve_device(training.device)
        self.precision = training.precision
        self.model = model
        self._init = _check_init(model, init)
        # bf16/fp16: the model computes from parameter chunks of that dtype, under autocast (see
        # __call__); the optimizer updates fp32 master chunks. fp16 also scales the loss
        # (LossScale) so small gradients survive.
        param_dtype = _PARAM_DTYPES[training.precision]
        self.loss_scale = LossScale() if training.precision == "fp16" else None
        _move_buffers(model, self.device, param_dtype)
        self.device_tier, self.host_tier = make_tiers(
            device=self.device, device_budget=memory.device_budget, host_budget=memory.host_budget,
            non_model_budget=memory.non_model_budget,
        )  # fmt: skip
        self.parts.agree_budgets(self.device_tier, self.host_tier)
        self.layout = _layout(model, chunk, self.parts.world_size)
        # With a disk tier the host's room is planned ([Note: nvme placement] in swap.py).
        host_bytes = _model_data_bytes(self.layout, param_dtype, optimizer)
        self._host_named = functools.partial(
            host_budget_named, None if memory.nvme_dir is not None else host_bytes
        )
        with self._host_named():
            masters = self.parts.make_masters(self, param_dtype)
            self.store = self.parts.make_store(self, param_dtype, chunk)
        # No refusal here below that minimum: the first iteration measures what the whole
        # iteration needs and names it ([Note: the least budget] in tidal/memory/shortfall.py),
        # so one retry trains where a retry at the hungriest module's figure would fail again.
        self.min_budget_bytes, self.largest_module = self.parts.minimum_budget(self)
        with self._host_named():
            self.optimizer = self.parts.make_optimizer(self, optimizer, training, chunk, masters)
        self._hooks = install_hooks(model, self.store, on_grad=self.optimizer.collect)
        # [Note: parameter uses] in tidal/memory/uses.py: the parameter slot is the weights (so
        # in-place ops may run on it) only without fp32 masters and gathers; a chunk is brought in
        # between iterations only where no gather (which needs every rank) is involved.
        gathers = self.parts.gathers
        self.uses = ParameterUses(self.store, read=self.read_parameter, write=self.write_parameter,
                                  in_place=not gathers and self.optimizer.masters is None,
                                  fetch_between_iterations=not gathers)  # fmt: skip
        self._hooks += self.uses.adopt(model)
        self.schedule = lr_schedule(optimizer, training)
        self.grad_clip_norm = training.grad_clip_norm
        self.counter = StepCounter(grad_accum_steps=training.grad_accum_steps)
        self.last_grad_norm: float | None = None
        self.phases = Phases()

    @property
    def phase(self) -> Phase:
        return self.phases.now

    @property
    def global_step(self) -> int:
        return self.counter.global_step

    @property
    def rank(self) -> int:
        return self.parts.rank

    @property
    def world_size(self) -> int:
        return self.parts.world_size

    def values(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The parameters' values, one pass ([Note: deferred construction] in materialize.py)."""
        return self._init() if self._init is not None else values_of(self.model)

    def read_parameter(self, param: nn.Parameter) -> torch.Tensor:
        """A copy of ``param``'s weights at full precision (collective when sharded)."""
        return self.parts.read_parameter(self, param)

    def write_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write ``value`` to wherever ``param``'s weights live (every rank, when sharded)."""
        self.parts.write_parameter(self, param, value)

    def check_minimum_budget(self) -> None:
        """Every module's own chunks must fit at once (after a relayout, which checked it)."""
        budget, need = self.device_tier.budget_bytes, self.min_budget_bytes
        if budget is not None and need > budget:
            raise ConfigError(
                "memory.device_budget",
                f"{budget:,} bytes ({format_bytes(budget)}) is below the minimum of {need:,} "
                f"bytes ({format_bytes(need)}): module '{self.largest_module}' needs its chunks "
                f"on the device at once; raise the budget to at least that"
                f"{chunk_size_advice(self.store.chunks)}",
            )

    # -- the training calls --------------------------------------------------------------------

    @_host_shortfalls_named
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward; see [Note: chunk engine iterations]."""
        if self.phase is Phase.GRADS_IN_PARAMS:
            raise RuntimeError(
                "the model was called between backward() and step(): with "
                f"training.precision = {self.precision!r} and no gradient accumulation the "
                "gradients are kept in the parameters' own low-precision storage until step() "
                "copies the fp32 weights back (chunk.grads_in_params; [Note: gradients in "
                "parameter chunks] in tidal/memory/optim.py). Call step() before the next "
                "forward (or zero_grad() to drop the gradients); to sum the gradients of several "
                "backwards per step set training.grad_accum_steps to their number; to evaluate "
                "between backward and step set chunk.grads_in_params = false"
            )
        if self.phase is Phase.FORWARD:
            self.phases.forward_ended()
            self._end_iteration()
        self.store.begin_iteration()
        self.phases.forward()
        try:
            # bf16/fp16: the parameters are in that dtype already; autocast runs the ops it keeps
            # in fp32 (norms, softmax, losses) in fp32 as the reference engine does, and casts
            # floating inputs (a CNN's images) where they meet the weights.
            with self.store.meter.tracking(), autocast(self.precision, self.device):
                output = self.model(*args, **kwargs)
        except BaseException:
            self.phases.forward_ended()
            self.store.abandon_iteration()  # modules it left never ran their post hooks
            raise
        if not torch.is_grad_enabled():  # no backward can follow
            self.phases.forward_ended()
            self._end_iteration()
        return output

    @_host_shortfalls_named
    def backward(self, loss: torch.Tensor) -> None:
        accum = self.counter.grad_accum_steps
        scaled = loss / accum if accum > 1 else loss
        if self.loss_scale is not None:
            scaled = scaled * self.loss_scale.scale
        self.parts.before_backward(self)
        try:
            with _quiet_output_only_hooks():
                scaled.backward()
        except BaseException:
            if self.phase is Phase.FORWARD:
                self.phases.forward_ended()
            self.store.abandon_iteration()
            self._drop_window()
            raise
        self.store.release_all()
        self.parts.after_backward(self)
        self.phases.backward(grads_in_params=bool(self.store.grads_in_slots))
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Close the store's iteration. A budget the iteration did not fit in ([Note: the least
        budget] in tidal/memory/store.py) drops its gradients: no step may use them."""
        try:
            self.store.end_iteration()
        except DeviceBudgetTooSmall:
            self._drop_window()
            raise

    def _drop_window(self) -> None:
        """No step may use the gradients of a failed iteration: drop the accumulation window's."""
        self.zero_grad()
        self.counter.drop_window()

    @_host_shortfalls_named
    def step(self) -> bool:
        """Count a micro-batch; on the boundary clip, update and zero. Returns whether it stepped."""
        if not self.counter.count_micro_batch():
            return False
        self.store.release_all()
        self.parts.before_step(self)
        self.last_grad_norm = self.optimizer.step(
            lr=self.schedule.lr_at(self.global_step),
            max_grad_norm=self.grad_clip_norm,
            loss_scale=self.loss_scale.scale if self.loss_scale else 1.0,
        )
        self.phases.gradients_dropped()
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.after_step(overflow=self.last_grad_norm is None)
        # A step skipped for overflow still advances the schedule, as with torch's GradScaler.
        self.counter.global_step += 1
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.phases.gradients_dropped()

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.global_step)

    # -- figures -----------------------------------------------------------------------------

    def model_data_bytes(self) -> dict[str, int]:
        return {
            "params": self.store.model_bytes,
            "grads": self.optimizer.grad_bytes,
            "optimizer_state": self.optimizer.state_bytes,
        }

    def stats(self) -> dict[str, Any]:
        device, host = self.device_tier, self.host_tier
        stats = {
            "engine": "chunk",
            "device": str(self.device),
            "precision": self.precision,
            "global_step": self.global_step,
            "lr": self.lr,
            "grad_norm": self.last_grad_norm,
            "bytes_to_device": device.bytes_in,
            "bytes_to_host": device.bytes_out,
            "peak_device_bytes": device.peak_bytes,
            "peak_host_bytes": host.peak_bytes,
            "device_budget": device.budget_bytes,
            "host_budget": host.budget_bytes,
            "chunk_size": self.layout.chunk_size,
            "num_chunks": self.layout.num_chunks,
            # an oversize parameter's chunk holds it alone ([Note: oversize parameters])
            "largest_chunk_elements": max(spec.capacity for spec in self.layout.chunks),
            "chunk_padding_fraction": self.layout.waste_fraction,
            "evictions": self.store.num_evictions,
            "prefetches": self.store.num_prefetches,
            "pinned_chunks": len(self.store.pinned),
            "unpins": self.store.num_unpins,
            "loss_scale": self.loss_scale.scale if self.loss_scale else None,
            "skipped_steps": self.loss_scale.skipped_steps if self.loss_scale else 0,
            # [Note: the least budget]: over every iteration so far (the largest chunk before one)
            "min_device_bytes": self.store.least_budget_bytes or self.store.min_device_bytes(),
            "min_device_bytes_last_trace": self.store.min_device_bytes(),
            # the most non-model bytes (activations) any iteration so far held on the device
            "peak_non_model_bytes": self.store.peak_non_model_bytes,
            # ... and the last iteration recorded
            "non_model_bytes_last_trace": self.store.trace.peak_non_model_bytes
            if self.store.trace is not None
            else 0,
            # the most they went over memory.non_model_budget, outside the device budget
            "non_model_over_budget_bytes": getattr(self.store.meter, "over_cap_bytes", 0),
            "traces_recorded": self.store.num_traces,
            "grads_in_params": self.optimizer.grads_in_params,
            "model_data_bytes": self.model_data_bytes(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        return self.parts.stats(self, stats)

    # -- state ---------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (same keys as ``model.state_dict()``), fp32, read from the
        chunks (gathered, when sharded: then every rank must call it)."""
        return self.parts.model_state_dict(self)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.counter.state(),
        }
        if self.loss_scale is not None:
            state["loss_scale"] = dataclasses.asdict(self.loss_scale)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.phase is Phase.GRADS_IN_PARAMS:  # they would be overwritten: lost without a word
            raise RuntimeError(
                "load_state_dict between backward() and step(): the gradients live in the "
                "parameters' storage (chunk.grads_in_params); call step() or zero_grad() first"
            )
        self.parts.load_state_dict(self, state)
        self.restore_counters(state)

    def restore_counters(self, state: dict[str, Any]) -> None:
        """The step counters and the loss scale of a state dict (or checkpoint extras)."""
        self.counter.restore(state)
        if self.loss_scale is not None and "loss_scale" in state:
            self.loss_scale = LossScale(**state["loss_scale"])

    def checkpoint_state(self) -> CheckpointTensors:
        """The state as flat tensors for torch.distributed.checkpoint ([Note: checkpoint
        tensors] in tidal/sharding/state.py)."""
        return self.parts.checkpoint_state(self)

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """Load what :meth:`checkpoint_state` saved (at any world size) through ``load``."""
        self.parts.restore_checkpoint(self, load, extras, meta)


_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_data_bytes(layout: ChunkLayout, dtype: torch.dtype, optimizer: OptimizerConfig) -> int:
    """Every chunk's model data: its parameters in ``dtype``, and in fp32 its gradients, its
    master weights (unless ``dtype`` is fp32) and the optimizer's state."""
    fp32_copies = 1 + (dtype != torch.float32) + len(make_rule(optimizer).state_kinds)
    return sum(spec.capacity for spec in layout.chunks) * (dtype.itemsize + 4 * fp32_copies)


def _layout(model: nn.Module, chunk: ChunkConfig, world_size: int) -> ChunkLayout:
    """Capacities are multiples of the alignment, so an alignment that is a multiple of the
    world size makes every chunk split into equal shards. A size that is not one is rounded
    down: on N ranks a chunk never holds more than the size asked for, so no rank's least
    budget exceeds one process's."""
    align = math.lcm(chunk.align, world_size)
    params = unique_parameters(model)
    ceiling = {} if chunk.max_size is None else {"max_chunk_size": max(align, chunk.max_size)}
    size = chunk.size or default_chunk_size(params, align=align, **ceiling).chunk_size
    size = max(align, size // align * align) if world_size > 1 else size
    return plan_layout(params, chunk_size=size, align=align)


def _check_init(model: nn.Module, init: ParameterValues | None) -> ParameterValues | None:
    """A model on the meta device needs an init source, and its buffers materialized."""
    meta = meta_parameters(model)
    if meta and init is None:
        raise ValueError(
            f"{len(meta)} parameters are on the meta device ({', '.join(meta[:3])}): pass their "
            f"values as init= (tidal.initialize(model, config, init=...); for a model of the "
            f"models package: spec_for(config).init(model, seed)), or build the model on the CPU"
        )
    check_buffers(model)
    return init


def _move_buffers(model: nn.Module, device: torch.device, param_dtype: torch.dtype) -> None:
    """Buffers to the device; a norm layer's floating statistics (BatchNorm's running mean and
    variance) in the parameters' dtype, which its kernel needs them in (as ``model.to(dtype)``
    would make them). Other buffers keep their dtype (rotary frequencies stay fp32)."""
    for module in model.modules():
        is_norm = isinstance(module, nn.modules.batchnorm._NormBase)
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            dtype = param_dtype if is_norm and buffer.is_floating_point() else buffer.dtype
            module._buffers[name] = buffer.to(device, dtype)


@contextlib.contextmanager
def _quiet_output_only_hooks() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OUTPUT_ONLY_HOOK_WARNING, category=UserWarning)
        yield
