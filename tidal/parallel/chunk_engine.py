"""The chunk engine: the reference engine's calling convention over chunked model data.

Parameters live in chunks that move between the device and the host tier under
``memory.device_budget`` (see tidal/memory). The training calls are the reference engine's::

    loss = engine(inputs, targets); engine.backward(loss); engine.step()

[Note: chunk engine iterations]
A forward starts an iteration of the chunk store (the unit its access trace describes) and the
backward that follows ends it; a forward under ``torch.no_grad()`` ends it at once (no backward
can follow), and any other forward without a backward is ended by the next forward. So with
gradient accumulation each micro-batch is one iteration, and evaluation records a trace of its
own instead of silently following the training one. Everything between the forward and the end
of the backward belongs to the iteration: a loss term computed from the parameters after the
forward returned (an L2 penalty) is a moment of it ([Note: parameter uses] in
tidal/memory/uses.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tidal.config import ConfigError, format_bytes
from tidal.distributed.device import memory_bytes, peak_memory_bytes, resolve_device
from tidal.memory.config import ChunkConfig
from tidal.memory.hooks import OUTPUT_ONLY_HOOK_WARNING, install_hooks
from tidal.memory.layout import ChunkLayout, default_chunk_size, plan_layout, unique_parameters
from tidal.memory.materialize import ParameterValues, check_buffers, meta_parameters, values_of
from tidal.memory.optim import ChunkOptimizer, make_master_chunks
from tidal.memory.optim_rules import make_rule
from tidal.memory.pinning import choose_pinned
from tidal.memory.relayout import relayout
from tidal.memory.store import ChunkStore, DeviceBudgetTooSmall
from tidal.memory.tiers import Tier, make_tiers
from tidal.memory.uses import ParameterUses
from tidal.parallel.accumulation import AccumulationCounter
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.loss_scale import LossScale
from tidal.parallel.lr import WarmupCosine
from tidal.parallel.protocol import CheckpointTensors, LoadTensors
from tidal.sharding.state import model_key, optim_key

__all__ = ["ChunkEngine"]


class ChunkEngine(AccumulationCounter):
    """Train ``model`` with its parameters in chunks under a device byte budget."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        memory: MemoryConfig,
        chunk: ChunkConfig,
        init: ParameterValues | None = None,
    ) -> None:
        self.device = resolve_device(training.device)
        self.precision = training.precision
        self.model = model
        self._init = _check_init(model, init)
        _move_buffers(model, self.device, _PARAM_DTYPES[training.precision])
        self.device_tier, self.host_tier = self._make_tiers(memory)
        self.layout = self._plan_layout(model, chunk)
        # bf16/fp16: the model computes from parameter chunks of that dtype, under autocast (see
        # _autocast); the optimizer updates fp32 master chunks, taken from the full-precision
        # weights before the store converts them. fp16 also scales the loss (LossScale) so small
        # gradients survive.
        param_dtype = _PARAM_DTYPES[training.precision]
        self.loss_scale = LossScale() if training.precision == "fp16" else None
        masters = self._make_masters(model, param_dtype)
        self.store = self._make_store(model, param_dtype, chunk)
        self.min_budget_bytes, self._largest_module = self._minimum_budget()
        self._check_minimum_budget()
        self.optimizer = self._make_optimizer(model, optimizer, training, chunk, masters)
        self._hooks = install_hooks(model, self.store, on_grad=self.optimizer.collect)
        self.uses = self._make_uses()
        self._hooks += self.uses.adopt(model)
        self.store.on_unpin = self._unplace_optimizer
        self.schedule = WarmupCosine(
            peak_lr=optimizer.lr,
            warmup_steps=optimizer.warmup_steps,
            decay_steps=optimizer.decay_steps or training.steps,
            min_lr_ratio=optimizer.min_lr_ratio,
        )
        self.grad_accum_steps = training.grad_accum_steps
        self.grad_clip_norm = training.grad_clip_norm
        self.global_step = 0
        self.micro_step = 0
        self.last_grad_norm: float | None = None
        self._in_iteration = False
        self._placed = False
        self._relayout_pending = chunk.relayout  # see _relayout
        self.store.keep_trace_params = chunk.relayout

    # -- construction steps (the sharded engine replaces some) ------------------------------------

    def _make_tiers(self, memory: MemoryConfig) -> tuple[Tier, Tier]:
        return make_tiers(
            device=self.device, device_budget=memory.device_budget, host_budget=memory.host_budget
        )

    def _plan_layout(self, model: nn.Module, chunk: ChunkConfig) -> ChunkLayout:
        return _layout(model, chunk)

    def _values(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The parameters' values, one pass ([Note: deferred construction] in materialize.py)."""
        return self._init() if self._init is not None else values_of(self.model)

    def _make_masters(self, model: nn.Module, param_dtype: torch.dtype) -> Any:
        if param_dtype == torch.float32:
            return None
        return make_master_chunks(model, self.layout, self.host_tier, self._values())

    def _make_store(
        self, model: nn.Module, param_dtype: torch.dtype, chunk: ChunkConfig
    ) -> ChunkStore:
        return ChunkStore(
            model,
            layout=self.layout,
            device_tier=self.device_tier,
            host_tier=self.host_tier,
            dtype=param_dtype,
            policy=chunk.policy,
            prefetch=chunk.prefetch,
            values=self._values(),
        )

    def _minimum_budget(self) -> tuple[int, str]:
        return _largest_module_bytes(self.model, self.store)

    def _make_optimizer(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        chunk: ChunkConfig,
        masters: Any,
    ) -> Any:
        names = {id(p): n for n, p in model.named_parameters()}
        return ChunkOptimizer(
            self.store,
            names=names,
            rule=make_rule(optimizer),
            weight_decay=optimizer.weight_decay,
            fused=optimizer.use_fused(self.device.type),
            masters=masters,
            # [Note: gradients in parameter chunks] in tidal/memory/optim.py
            grads_in_params=(
                chunk.grads_in_params and masters is not None and training.grad_accum_steps == 1
            ),
        )

    def _make_uses(self) -> ParameterUses:
        """[Note: parameter uses] in tidal/memory/uses.py: the parameter slot is the weights
        (so in-place ops may run on it) only without fp32 masters."""
        return ParameterUses(
            self.store,
            read=self.read_parameter,
            write=self.write_parameter,
            in_place=self.optimizer.masters is None,
            fetch_between_iterations=True,
        )

    def read_parameter(self, param: nn.Parameter) -> torch.Tensor:
        """A copy of ``param``'s weights at full precision (its fp32 master where it has one)."""
        self.store.wait_for_copies()
        return self.optimizer.weight(param).detach().to(torch.float32, copy=True)

    def write_parameter(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write ``value`` to wherever ``param``'s weights live: its slot (on either tier) and
        its fp32 master; both are what the next forward and step read."""
        if id(param) in self.store.grads_in_slots:  # it would be overwritten: lost without a word
            raise RuntimeError(
                f"writing {self.store.names_of([param])[0]} between backward() and step(): the "
                "gradients live in the parameters' storage (chunk.grads_in_params); call step() "
                "or zero_grad() first"
            )
        index, slot = self.store.slot_of[id(param)]
        self.store.wait_for_copies()  # no queued copy may land on what is written here
        self.optimizer.weight(param).copy_(value)
        self.store.chunks[index].view(slot).copy_(value)

    def _check_minimum_budget(self) -> None:
        """Every module's own chunks must fit at once; else fail before training."""
        budget, need = self.device_tier.budget_bytes, self.min_budget_bytes
        if budget is not None and need > budget:
            raise ConfigError(
                "memory.device_budget",
                f"{budget:,} bytes ({format_bytes(budget)}) is below the minimum of {need:,} "
                f"bytes ({format_bytes(need)}): module '{self._largest_module}' needs its chunks "
                f"on the device at once; raise the budget to at least that, or lower chunk.size",
            )

    def _relayout(self) -> None:
        """Re-pack the chunks in first-use order, once, at the first step with a trace and no
        iteration open; see [Note: relayout] in tidal/memory/relayout.py."""
        if not self._relayout_pending or self.store.trace is None or self._in_iteration:
            return
        self._relayout_pending = False
        done = relayout(self.model, self.store, self.optimizer)
        self.store.keep_trace_params = False  # relayout's translation was their only reader
        if done is None:
            return
        self.layout = self.store.layout
        self.min_budget_bytes, self._largest_module = _largest_module_bytes(self.model, self.store)
        self._check_minimum_budget()  # relayout checked it would fit: this only asserts it

    def _unplace_optimizer(self) -> None:
        """The store gave up its pinned chunks: state to the host, choose again at the step."""
        self.optimizer.place_on_host()
        self._placed = False

    def _place_optimizer(self) -> None:
        """Pin the chunks whose optimizer state fits the margin; see [Note: optimizer placement]
        in tidal/memory/pinning.py."""
        pinned = choose_pinned(self.store, self.optimizer, self.device_tier.budget_bytes)
        if pinned is None:
            return  # no trace yet: decide at the next step
        self.store.pin(pinned)
        self.optimizer.place_on_device(pinned)
        self._placed = True

    # -- the training calls --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward; see [Note: chunk engine iterations]."""
        if self.store.grads_in_slots:
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
        if self._in_iteration:
            self._end_iteration()
        self.store.begin_iteration()
        self._in_iteration = True
        try:
            with self.store.meter.tracking(), self._autocast():
                output = self.model(*args, **kwargs)
        except BaseException:
            self._in_iteration = False
            self.store.abandon_iteration()  # modules it left never ran their post hooks
            raise
        if not torch.is_grad_enabled():  # no backward can follow
            self._end_iteration()
        return output

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16/fp16: the parameters are in that dtype already; autocast runs the ops it keeps
        in fp32 (norms, softmax, losses) in fp32 as the reference engine does, and casts
        floating inputs (a CNN's images) where they meet the weights."""
        dtype = _PARAM_DTYPES[self.precision]
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
        if self.loss_scale is not None:
            scaled = scaled * self.loss_scale.scale
        self._before_backward()
        try:
            with _quiet_output_only_hooks():
                scaled.backward()
        except BaseException:
            self._in_iteration = False
            self.store.abandon_iteration()
            self._drop_window()
            raise
        self.store.release_all()
        self._after_backward()
        self._end_iteration()

    def _end_iteration(self) -> None:
        """Close the store's iteration. A budget the iteration did not fit in ([Note: the least
        budget] in tidal/memory/store.py) drops its gradients: no step may use them."""
        self._in_iteration = False
        try:
            self.store.end_iteration()
        except DeviceBudgetTooSmall:
            self._drop_window()
            raise

    def _drop_window(self) -> None:
        """No step may use the gradients of a failed iteration: drop the accumulation window's."""
        self.zero_grad()
        self.micro_step -= self.micro_step % self.grad_accum_steps

    @property
    def min_device_bytes(self) -> int:
        """The least device budget every iteration so far ran in ([Note: the least budget])."""
        return self.store.least_budget_bytes

    @property
    def peak_non_model_bytes(self) -> int:
        """The most non-model bytes (activations) any iteration so far held on the device."""
        return self.store.peak_non_model_bytes

    def _before_backward(self) -> None:
        """Nothing here; the sharded engine drops the forward's gathered chunks."""

    def _after_backward(self) -> None:
        """Nothing here; the sharded engine waits for its gradient reductions."""

    def step(self) -> bool:
        """Count a micro-batch; on the boundary clip, update and zero. Returns whether it stepped."""
        if not self._count_micro_batch():
            return False
        self.store.release_all()
        if not self._placed:
            self._relayout()
            self._place_optimizer()
        self.last_grad_norm = self.optimizer.step(
            lr=self.schedule.lr_at(self.global_step),
            max_grad_norm=self.grad_clip_norm,
            loss_scale=self.loss_scale.scale if self.loss_scale else 1.0,
        )
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.after_step(overflow=self.last_grad_norm is None)
        # A step skipped for overflow still advances the schedule, as with torch's GradScaler.
        self.global_step += 1
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

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
        return {
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
            "chunk_padding_fraction": self.layout.waste_fraction,
            "evictions": self.store.num_evictions,
            "prefetches": self.store.num_prefetches,
            "pinned_chunks": len(self.store.pinned),
            "unpins": self.store.num_unpins,
            "loss_scale": self.loss_scale.scale if self.loss_scale else None,
            "skipped_steps": self.loss_scale.skipped_steps if self.loss_scale else 0,
            # [Note: the least budget]: over every iteration so far (the largest chunk before one)
            "min_device_bytes": self.min_device_bytes or self.store.min_device_bytes(),
            "min_device_bytes_last_trace": self.store.min_device_bytes(),
            "peak_non_model_bytes": self.peak_non_model_bytes,
            "traces_recorded": self.store.num_traces,
            "grads_in_params": self.optimizer.grads_in_params,
            "model_data_bytes": self.model_data_bytes(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }

    # -- state ---------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (same keys as ``model.state_dict()``), read from the chunks."""
        self.store.wait_for_copies()
        state = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            # fp32 throughout, frozen parameters included (they have no fp32 master to read).
            state[name] = self.optimizer.weight(param).detach().to(torch.float32, copy=True)
        for name, buffer in _persistent_buffers(self.model):
            state[name] = buffer.detach().clone()
        return {k: state[k] for k in self.model.state_dict(keep_vars=True)}

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step,
            "micro_step": self.micro_step,
        }
        if self.loss_scale is not None:
            state["loss_scale"] = dataclasses.asdict(self.loss_scale)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.store.grads_in_slots:  # they would be overwritten: lost without a word
            raise RuntimeError(
                "load_state_dict between backward() and step(): the gradients live in the "
                "parameters' storage (chunk.grads_in_params); call step() or zero_grad() first"
            )
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(_persistent_buffers(self.model))
        for name, value in state["model"].items():
            if name in params:
                self.write_parameter(params[name], value)
            else:
                buffers[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_counters(state)

    def _restore_counters(self, state: dict[str, Any]) -> None:
        """The step counters and the loss scale of a state dict (or checkpoint extras)."""
        self.global_step = int(state["global_step"])
        self.micro_step = int(state["micro_step"])
        if self.loss_scale is not None and "loss_scale" in state:
            self.loss_scale = LossScale(**state["loss_scale"])

    # -- sharded checkpoints ([Note: checkpoint tensors] in tidal/sharding/state.py) ------------

    def checkpoint_state(self) -> CheckpointTensors:
        """The state as flat per-parameter tensors for torch.distributed.checkpoint."""
        state = self.state_dict()
        canonical = {info.names[0] for spec in self.layout.chunks for info in spec.slots}
        tensors: dict[str, Any] = {}
        for name, value in state["model"].items():
            if name in canonical or name not in dict(self.model.named_parameters()):
                tensors[_state_key(self, name)] = value.reshape(-1)
        steps = {}
        for name, saved in state["optimizer"].items():
            for key, value in saved.items():
                if key == "step":
                    steps[name] = float(value)
                else:
                    tensors[optim_key(name, key)] = value.reshape(-1)
        extras = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        extras["optimizer_steps"] = steps
        return CheckpointTensors(
            tensors=tensors, extras=extras, meta=self._checkpoint_meta(tensors)
        )

    def _checkpoint_meta(self, tensors: dict[str, Any]) -> dict[str, Any]:
        model_state = self.model.state_dict(keep_vars=True)
        return {
            "numels": {key: int(t.size(0)) for key, t in tensors.items()},
            "model_keys": {name: _state_key(self, name) for name in model_state},
            "model_shapes": {name: list(t.shape) for name, t in model_state.items()},
        }

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """Load what :meth:`checkpoint_state` saved (at any world size) through ``load``."""
        targets = {key: torch.empty(numel) for key, numel in meta["numels"].items()}
        load(targets)
        shapes = meta["model_shapes"]
        model = {name: targets[key].view(shapes[name])
                 for name, key in meta["model_keys"].items()}  # fmt: skip
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in targets.items():
            if key.startswith("optim/"):
                name, state_name = key[len("optim/") :].rsplit("/", 1)
                optimizer.setdefault(name, {})[state_name] = value.view(shapes[name])
        for name, step in extras["optimizer_steps"].items():
            optimizer.setdefault(name, {})["step"] = torch.tensor(step)
        rest = {k: v for k, v in extras.items() if k != "optimizer_steps"}
        self.load_state_dict({"model": model, "optimizer": optimizer, **rest})


def _state_key(engine: ChunkEngine, name: str) -> str:
    """The checkpoint key of a state-dict name: tied parameters share their first name's."""
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    if name not in params:
        return f"buffer/{name}"
    index, slot = engine.store.slot_of[id(params[name])]
    return model_key(engine.layout.chunks[index].slots[slot].names[0])


_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _largest_module_bytes(model: nn.Module, store: ChunkStore) -> tuple[int, str]:
    """The bytes of chunks the hungriest module needs at once, and its name.

    A module runs inside its ancestors' forward and backward, whose own chunks stay in use
    (COMPUTE) meanwhile, so a module needs its chunks and those of every ancestor that owns
    parameters.
    """
    need, owner = 0, ""

    def visit(module: nn.Module, name: str, held: frozenset[int]) -> None:
        nonlocal need, owner
        held = held | store.chunks_of(module.parameters(recurse=False))
        num_bytes = sum(store.chunks[i].num_bytes for i in held)
        if num_bytes > need:
            need, owner = num_bytes, name or "<root>"
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, held)

    visit(model, "", frozenset())
    return need, owner


def _layout(model: nn.Module, chunk: ChunkConfig) -> ChunkLayout:
    params = unique_parameters(model)
    size = chunk.size or default_chunk_size(params, align=chunk.align).chunk_size
    return plan_layout(params, chunk_size=size, align=chunk.align)


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


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


@contextlib.contextmanager
def _quiet_output_only_hooks() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=OUTPUT_ONLY_HOOK_WARNING, category=UserWarning)
        yield
