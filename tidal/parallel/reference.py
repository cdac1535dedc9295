"""The reference engine: plain PyTorch, the whole model on one device.

Every later engine (chunked offload, ZeRO, tensor/sequence parallel, pipelines) is tested against
this one on the same seeds, so it stays deliberately plain: ``torch.optim.AdamW`` (or ``Adam``,
``SGD``), autocast, ``clip_grad_norm_``. The calling convention is DeepSpeed's, which users already know::

    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()        # call after every micro-batch; steps the optimizer on the boundary

Micro-batches are counted as [Note: accumulation boundary] in accumulation.py says.

In a process group of more than one rank the engine is plain data parallel: every rank holds the
whole model, and on each accumulation boundary the gradients are averaged over the ranks before
clipping, so every rank takes the same optimizer step and the replicas stay identical.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tidal.config import ConfigError, format_bytes
from tidal.distributed import rank, world_size
from tidal.distributed.device import memory_bytes, peak_memory_bytes, resolve_device
from tidal.memory.materialize import ParameterValues, materialize
from tidal.memory.tiers import TierKind, resolve_budget
from tidal.parallel.accumulation import AccumulationCounter
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.lr import lr_schedule
from tidal.parallel.protocol import Phase, Phases

__all__ = [
    "ReferenceEngine", "autocast", "build_optimizer", "lr_schedule", "model_data_bytes", "set_lr",
    "step_optimizer", "torch_engine_stats",
]  # fmt: skip


def build_optimizer(model: nn.Module, config: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """``config.name``'s torch optimizer with weight decay on matrices only (biases, norms and
    gains are not decayed): AdamW, Adam or SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
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


_FP32_BYTES = 4


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``precision`` (bf16, fp16) on ``device``; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def step_optimizer(
    optimizer: torch.optim.Optimizer, scaler: Any, clip: Callable[[], float]
) -> float:
    """One update on the accumulation boundary: unscale, ``clip`` (which returns the gradient
    norm), step and zero the gradients; returns the norm."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def model_data_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, nbytes: Callable[[torch.Tensor], int]
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, each counted once, each tensor
    counted as ``nbytes`` says (a rank's share of a sharded one)."""
    params = {id(p): p for p in model.parameters()}.values()

    def total(tensors: Iterable[Any]) -> int:
        return sum(nbytes(t) for t in tensors if isinstance(t, torch.Tensor))

    return {
        "params": total(params),
        "grads": total(p.grad for p in params),
        "optimizer_state": total(t for s in optimizer.state.values() for t in s.values()),
    }


def torch_engine_stats(engine: Any, name: str) -> dict[str, Any]:
    """The figures of an engine over a torch optimizer (the reference and plan engines)."""
    return {
        "engine": name,
        "device": str(engine.device),
        "world_size": engine.world_size,
        "rank": engine.rank,
        "precision": engine.precision,
        "global_step": engine.global_step,
        "lr": engine.lr,
        "grad_norm": engine.last_grad_norm,
        "model_data_bytes": engine.model_data_bytes(),
        "memory_bytes": memory_bytes(engine.device),
        "peak_memory_bytes": peak_memory_bytes(engine.device),
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_device_budget(
    model: nn.Module, memory: MemoryConfig, optimizer: OptimizerConfig, device: torch.device
) -> None:
    budget = resolve_budget(
        memory.device_budget, kind=TierKind.DEVICE, device=device, key="memory.device_budget"
    )
    if budget is None:
        return
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # Weights, gradients and the optimizer's state tensors, each the size of the fp32 weights.
    num_state = optimizer.state_tensors_per_param
    needed = num_params * _FP32_BYTES * (2 + num_state)
    if needed > budget:
        raise ConfigError(
            "memory.device_budget",
            f"the reference engine keeps all model data on the device: {num_params:,} params "
            f"need {needed:,} bytes ({format_bytes(needed)}: weights, grads and {optimizer.name} "
            f"state of {num_state}x the weights) but the budget is {budget:,} bytes "
            f"({format_bytes(budget)}); raise the budget or pick a smaller model.preset",
        )


class ReferenceEngine(AccumulationCounter):
    """Train ``model`` on one device: AdamW, Adam or SGD, warm-up + cosine, clipping and
    accumulation."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        memory: MemoryConfig | None = None,
        init: ParameterValues | None = None,
    ) -> None:
        self.device = resolve_device(training.device)
        _check_device_budget(model, memory or MemoryConfig(), optimizer, self.device)
        if init is not None:  # a model on the meta device: the whole of it on the device
            materialize(model, init, self.device)
        self.precision = training.precision
        if self.precision == "fp16" and self.device.type != "cuda":
            raise ConfigError(
                "training.precision",
                "fp16 needs CUDA (loss scaling is a CUDA feature); use 'bf16' or 'fp32' on a CPU",
            )
        self.model = model.to(self.device)
        self.grad_accum_steps = training.grad_accum_steps
        self.grad_clip_norm = training.grad_clip_norm
        self.schedule = lr_schedule(optimizer, training)
        self.optimizer = build_optimizer(self.model, optimizer, self.schedule.lr_at(0))
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.global_step = 0
        self.micro_step = 0
        self.last_grad_norm: float | None = None
        self.phases = Phases()
        # Read once: the group is set up before any engine is built.
        self.world_size = world_size()
        self.rank = rank()

    @property
    def phase(self) -> Phase:
        return self.phases.now

    # -- the training calls --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autocast(self.precision, self.device):
            return self.phases.track(lambda: self.model(*args, **kwargs))

    def backward(self, loss: torch.Tensor) -> None:
        """See [Note: accumulation boundary]."""
        scaled = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self.phases.backward()
        if self.world_size > 1 and self.is_accumulation_boundary():
            self._average_gradients()

    def step(self) -> bool:
        """Count a micro-batch; on the boundary step the optimizer. Returns whether it stepped."""
        if not self._count_micro_batch():
            return False
        self.last_grad_norm = step_optimizer(self.optimizer, self.scaler, self._clip_gradients)
        self.phases.gradients_dropped()
        self.global_step += 1
        set_lr(self.optimizer, self.schedule.lr_at(self.global_step))
        return True

    def zero_grad(self) -> None:
        """Drop the gradients (``step`` already does after each update; this is for symmetry)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.phases.gradients_dropped()

    def _average_gradients(self) -> None:
        """The mean gradient over the ranks, through one all_reduce of a flat fp32 buffer."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip_gradients(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        if self.grad_clip_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        return float(norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- figures -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Figures of the engine now: step, learning rate, model-data bytes, memory per tier."""
        return torch_engine_stats(self, "reference")

    def model_data_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state, each counted once."""
        return model_data_bytes(self.model, self.optimizer, _nbytes)

    # -- state ---------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict, detached copies (what the chunk engines give too)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step,
            "micro_step": self.micro_step,
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        # torch's optimizer keeps the given tensors as its state; copy them so that an in-memory
        # state dict of another engine is never shared (both would update the same moments).
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.global_step = int(state["global_step"])
        self.micro_step = int(state["micro_step"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        set_lr(self.optimizer, self.schedule.lr_at(self.global_step))
