"""The reference engine: plain PyTorch over a torch optimizer, the model laid out by a part.

Every later engine (chunked offload, ZeRO, tensor/sequence parallel, pipelines) is tested against
this one on the same seeds, so it stays deliberately plain: ``torch.optim.AdamW`` (or ``Adam``,
``SGD``), autocast, global-norm clipping. The calling convention is DeepSpeed's, which users
already know::

    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()        # call after every micro-batch; steps the optimizer on the boundary

Micro-batches are counted as [Note: accumulation boundary] in accumulation.py says.

Where the model lives is its ``layout``, chosen once (the verbs in verbs.py): :class:`Replicas`
(by default) holds the whole model on every rank, plain data parallel: on each accumulation
boundary the gradients are averaged over the ranks before clipping, so every rank takes the
same optimizer step and the replicas stay identical. ``PlanLayout`` (plan_layout.py) shards it
as a plan of ``tidal plan`` says. The steps, schedule, clipping rule and checkpoint keys are
this engine's for both.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tidal.config import ConfigError, format_bytes
from tidal.distributed import rank, world_size
from tidal.distributed.device import memory_bytes, peak_memory_bytes, resolve_device
from tidal.memory.materialize import ParameterValues, materialize
from tidal.memory.tiers import TierKind, resolve_budget
from tidal.parallel.accumulation import StepCounter
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.flat_state import (
    flat_optimizer_state,
    index_names,
    model_layout,
    model_tensors,
    read_whole,
    unflatten_optimizer_state,
)
from tidal.parallel.lr import lr_schedule
from tidal.parallel.protocol import CheckpointTensors, LoadTensors, Phase, Phases

__all__ = ["ReferenceEngine", "Replicas", "TorchLayout", "TorchOptimizer", "autocast",
           "build_optimizer", "lr_schedule", "model_data_bytes"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class TorchOptimizer:
    """Your own torch optimizer and learning-rate schedule in place of ``[optimizer]``'s
    ([Note: your optimizer] in tidal/train/user_optim.py).

    Attributes:
        make: the model's parameters -> a ``torch.optim.Optimizer`` over them; ``None``:
            ``[optimizer]``'s, at its peak ``lr``.
        schedule: the optimizer -> a torch LR scheduler, stepped once after every optimizer
            step; its state is checkpointed. ``None``: the learning rates stay the
            optimizer's own.
    """

    make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None


def build_optimizer(model: nn.Module, config: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """``config.name``'s torch optimizer (AdamW, Adam or SGD) with weight decay where
    ``config.decays`` (by default on matrices only: biases, norms and gains are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    # torch's fused and foreach kernels take one tensor type per call: a tensor-parallel
    # stage's DTensors and its plain (replicated) parameters go in groups of their own
    for kind in dict.fromkeys(type(p) for p in params) or (nn.Parameter,):
        alike = [p for p in params if type(p) is kind]
        groups += [
            {"params": [p for p in alike if config.decays(p)], "weight_decay": config.weight_decay},
            {"params": [p for p in alike if not config.decays(p)], "weight_decay": 0.0},
        ]
    device_type = params[0].device.type if params else "cpu"
    fused = config.use_fused(device_type) and all(p.is_floating_point() for p in params)
    if config.name == "sgd":
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=config.momentum,
            dampening=config.dampening,
            nesterov=config.nesterov,
            fused=fused,
        )
    adam = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return adam(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=fused)


def model_data_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                     nbytes: Callable[[torch.Tensor], int] | None = None) -> dict[str, int]:  # fmt: skip
    """Bytes of ``model``'s parameters, their gradients and ``optimizer``'s state, each tensor
    once; ``nbytes``: what a tensor holds here (default: all of it)."""
    size = nbytes or (lambda t: t.numel() * t.element_size())
    params = {id(p): p for p in model.parameters()}.values()

    def total(tensors: Iterable[Any]) -> int:
        return sum(size(t) for t in tensors if isinstance(t, torch.Tensor))

    return {
        "params": total(params),
        "grads": total(p.grad for p in params),
        "optimizer_state": total(t for s in optimizer.state.values() for t in s.values()),
    }


def check_model_data_fits(weight_bytes: int, budget: int | None, *,
                          optimizer: OptimizerConfig) -> None:  # fmt: skip
    """Refuse, in one line naming the fix, model data (the fp32 weights of ``weight_bytes``,
    their gradients and ``optimizer``'s state, all kept on the device as plain replicas keep
    them) over the device ``budget`` (None: no budget)."""
    num_state = optimizer.state_tensors_per_param
    needed = weight_bytes * (2 + num_state)
    if budget is None or needed <= budget:
        return
    raise ConfigError(
        "memory.device_budget",
        f"the reference engine keeps all model data on the device: {needed:,} bytes "
        f"({format_bytes(needed)}: weights, grads and {optimizer.name} state of {num_state}x "
        f"the weights) but the budget is {budget:,} bytes ({format_bytes(budget)}); set "
        f'engine = "chunk" (--set engine=chunk), which keeps on the device only the chunks of '
        f"model data each moment needs, or raise the budget",
    )


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``precision`` (bf16, fp16) on ``device``; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class TorchLayout(Protocol):
    """Where a :class:`ReferenceEngine`'s model lives and what that changes: its placement,
    the optimizer's groups, what backward and clipping do across ranks, byte counts and the
    state's form. ``optimizer_by_name``: whether :meth:`state_dict`'s optimizer state is keyed
    by parameter name (else by torch's index)."""

    name: str
    optimizer_by_name: bool

    def place(self, model: nn.Module, *, device: torch.device, precision: str,
              init: ParameterValues | None) -> nn.Module: ...  # fmt: skip
    def build_optimizer(self, model: nn.Module, config: OptimizerConfig,
                        lr: float) -> torch.optim.Optimizer: ...  # fmt: skip
    def before_backward(self, model: nn.Module, *, boundary: bool) -> None: ...
    def after_backward(self, model: nn.Module, *, boundary: bool) -> None: ...
    def clip(self, model: nn.Module, max_norm: float) -> float: ...
    def nbytes(self, t: torch.Tensor) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...
    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None: ...  # fmt: skip


_FP32_BYTES = 4


class Replicas:
    """The whole model on every rank (one rank: just the model on the device); gradients
    averaged over the ranks on the boundary, through one all_reduce of a flat fp32 buffer."""

    name = "reference"
    optimizer_by_name = False

    def __init__(self, *, memory: MemoryConfig | None = None,
                 optimizer: OptimizerConfig | None = None) -> None:  # fmt: skip
        self.memory = memory or MemoryConfig()
        self.optimizer = optimizer or OptimizerConfig()
        self.world_size = world_size()  # read once: the group is set up before any engine

    def place(self, model: nn.Module, *, device: torch.device, precision: str,
              init: ParameterValues | None) -> nn.Module:  # fmt: skip
        self._check_device_budget(model, device)
        if init is not None:  # a model on the meta device: the whole of it on the device
            materialize(model, init, device)
        return model.to(device)

    def _check_device_budget(self, model: nn.Module, device: torch.device) -> None:
        budget = resolve_budget(self.memory.device_budget, kind=TierKind.DEVICE, device=device,
                                key="memory.device_budget")  # fmt: skip
        num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        check_model_data_fits(num_params * _FP32_BYTES, budget, optimizer=self.optimizer)

    def build_optimizer(self, model: nn.Module, config: OptimizerConfig,
                        lr: float) -> torch.optim.Optimizer:  # fmt: skip
        return build_optimizer(model, config, lr)

    def before_backward(self, model: nn.Module, *, boundary: bool) -> None:
        """Nothing: gradients accumulate in place."""

    def after_backward(self, model: nn.Module, *, boundary: bool) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if self.world_size == 1 or not boundary or not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip(self, model: nn.Module, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm(grads))

    def nbytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def stats(self) -> dict[str, Any]:
        return {}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:  # fmt: skip
        model.load_state_dict(state["model"])
        # torch's optimizer keeps the given tensors as its state; copy them so that an in-memory
        # state dict of another engine is never shared (both would update the same moments).
        optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


class ReferenceEngine:
    """Train ``model`` laid out as ``layout`` says (default: :class:`Replicas`): AdamW, Adam or
    SGD, warm-up + cosine, clipping and accumulation; or ``torch_optimizer``'s own optimizer
    and schedule (replicated layouts only: a plan's splits its groups by mesh)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        memory: MemoryConfig | None = None,
        init: ParameterValues | None = None,
        layout: TorchLayout | None = None,
        torch_optimizer: TorchOptimizer | None = None,
    ) -> None:
        self.layout = layout or Replicas(memory=memory, optimizer=optimizer)
        self.device = resolve_device(training.device)
        self.precision = training.precision
        if self.precision == "fp16" and self.device.type != "cuda":
            raise ConfigError(
                "training.precision",
                "fp16 needs CUDA (loss scaling is a CUDA feature); use 'bf16' or 'fp32' on a CPU",
            )
        # Read once: the group is set up before any engine is built.
        self.world_size, self.rank = world_size(), rank()
        self.model = self.layout.place(model, device=self.device, precision=self.precision,
                                       init=init)  # fmt: skip
        self.grad_clip_norm = training.grad_clip_norm
        self.schedule = lr_schedule(optimizer, training)
        self.scheduler: Any = None  # your torch LR scheduler
        self._own_lr = torch_optimizer is None  # else your optimizer's rates or scheduler's
        if torch_optimizer is None or torch_optimizer.make is None:
            lr = self.schedule.lr_at(0) if self._own_lr else optimizer.lr
            self.optimizer = self.layout.build_optimizer(self.model, optimizer, lr)
        else:
            assert isinstance(self.layout, Replicas), "a plan's layout builds its own optimizer"
            self.optimizer = torch_optimizer.make(self.model.parameters())
        if torch_optimizer is not None and torch_optimizer.schedule is not None:
            self.scheduler = torch_optimizer.schedule(self.optimizer)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
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
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- the training calls --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self.precision, self.device):
            return self.phases.track(lambda: self.model(*args, **kwargs))

    def backward(self, loss: torch.Tensor) -> None:
        """See [Note: accumulation boundary]."""
        boundary, accum = self.counter.is_boundary(), self.counter.grad_accum_steps
        self.layout.before_backward(self.model, boundary=boundary)
        scaled = loss / accum if accum > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self.phases.backward()
        self.layout.after_backward(self.model, boundary=boundary)

    def step(self) -> bool:
        """Count a micro-batch; on the boundary unscale, clip, update and zero the gradients.
        Returns whether it stepped."""
        if not self.counter.count_micro_batch():
            return False
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        self.last_grad_norm = self.layout.clip(self.model, self.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.zero_grad()
        self.counter.global_step += 1
        if self.scheduler is not None:
            self.scheduler.step()
        self._set_lr()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.phases.gradients_dropped()

    def _set_lr(self) -> None:
        if not self._own_lr:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.global_step)

    # -- figures -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Figures of the engine now: step, learning rate, model-data bytes, memory."""
        return {
            "engine": self.layout.name,
            "device": str(self.device),
            "world_size": self.world_size,
            "rank": self.rank,
            "precision": self.precision,
            "global_step": self.global_step,
            "lr": self.lr,
            "grad_norm": self.last_grad_norm,
            "model_data_bytes": self.model_data_bytes(),
            "memory_bytes": memory_bytes(self.device),
            "peak_memory_bytes": peak_memory_bytes(self.device),
            **self.layout.stats(),
        }

    def model_data_bytes(self) -> dict[str, int]:
        """Bytes of (this rank's shares of) the parameters, gradients and optimizer state, each
        counted once."""
        return model_data_bytes(self.model, self.optimizer, nbytes=self.layout.nbytes)

    # -- state ---------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in the single-device layout, detached copies (what every
        engine gives; a collective under a plan: every rank calls it)."""
        return self.layout.model_state_dict(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The layout's model and optimizer state, the counters, the loss scaler's (a
        collective under a plan: every rank calls it)."""
        state = {**self.layout.state_dict(self.model, self.optimizer), **self.counter.state()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            state["lr_scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.layout.load_state_dict(self.model, self.optimizer, state)
        self.counter.restore(state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and "lr_scheduler" in state:
            self.scheduler.load_state_dict(state["lr_scheduler"])
            # torch's schedulers compute from the groups' current rates, which loading the
            # scheduler leaves as they were built: set them to where the saved run was.
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(),
                                 strict=True):  # fmt: skip
                group["lr"] = lr
        self._set_lr()

    def checkpoint_state(self) -> CheckpointTensors:
        """Every tensor whole, written by rank 0 (the other ranks hold replicas, or helped
        gather); ``optim/`` keys by parameter name ([Note: checkpoint keys])."""
        state = self.state_dict()  # a collective under a plan: every rank calls it
        model_state, optimizer = state.pop("model"), state.pop("optimizer")
        meta = model_layout(self.model, {n: t.shape for n, t in model_state.items()})
        if self.rank != 0:
            return CheckpointTensors(tensors={}, extras={}, meta=meta)
        names = None if self.layout.optimizer_by_name else index_names(self.model, self.optimizer)
        tensors, steps = flat_optimizer_state(optimizer["state"], names)
        extras = {**state, "optimizer_steps": steps}
        if self.layout.optimizer_by_name:  # torch's loading by name needs the groups saved
            extras["param_groups"] = optimizer["param_groups"]
        tensors.update(model_tensors(model_state, meta))
        return CheckpointTensors(tensors=tensors, extras=extras, meta=meta)

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """Load what any engine's checkpoint holds, whole, into this layout."""
        model, flat = read_whole(load, meta)
        by_name = unflatten_optimizer_state(flat, extras["optimizer_steps"], meta["model_shapes"])
        if self.layout.optimizer_by_name:
            # none saved: not a plan's checkpoint, which the layout's loading refuses by name
            optimizer = {"state": by_name, "param_groups": extras.get("param_groups")}
        else:  # torch's own state dict: by index; the groups are this engine's
            index_of = {n: i for i, n in index_names(self.model, self.optimizer).items()}
            optimizer = {"state": {index_of[n]: v for n, v in by_name.items()},
                         "param_groups": self.optimizer.state_dict()["param_groups"]}  # fmt: skip
        rest = {k: v for k, v in extras.items() if k not in ("optimizer_steps", "param_groups")}
        self.load_state_dict({"model": model, "optimizer": optimizer, **rest})
