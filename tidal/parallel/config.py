"""Configs the engines read: optimizer and schedule, the training step, memory budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tidal.config import ByteSize, require

if TYPE_CHECKING:
    import torch

__all__ = [
    "MemoryConfig",
    "OptimizerConfig",
    "TrainingConfig",
]

Precision = Literal["fp32", "bf16", "fp16"]


OptimizerName = Literal["adamw", "adam", "sgd"]


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW, Adam or SGD, with linear warm-up then cosine decay to ``min_lr_ratio * lr``.

    Weight decay applies to matrices only (biases, norms and gains are not decayed), or to
    every parameter as torch's optimizers do when given ``model.parameters()``
    (``weight_decay_on``): decoupled for AdamW, L2 (added to the gradient) for Adam and SGD,
    as in torch.

    Attributes:
        name: ``adamw``, ``adam`` or ``sgd`` (torch's algorithms, the same in every engine).
        lr: peak learning rate, reached after ``warmup_steps``.
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps``.
        decay_steps: the step at which the cosine reaches its floor; ``None`` means the run's
            ``training.steps``. Set it when a run is split in parts (train 10, resume to 20) so
            both parts follow one schedule.
        min_lr_ratio: floor of the cosine as a fraction of ``lr``.
        beta1, beta2, eps: Adam's and AdamW's moment decays and denominator term.
        weight_decay: see above.
        weight_decay_on: ``matrices`` (parameters of 2 or more dimensions) or ``all``.
        momentum: SGD's momentum factor; 0 is plain SGD, which keeps no optimizer state.
        nesterov: SGD with Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        dampening: SGD's dampening of the gradient added to the momentum buffer.
        fused: use the optimizer's fused kernel (on CPU and CUDA); ``None`` picks it when
            available, except for SGD with momentum (see :meth:`use_fused`).
    """

    name: OptimizerName = "adamw"
    lr: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    weight_decay_on: Literal["matrices", "all"] = "matrices"
    momentum: float = 0.9
    nesterov: bool = False
    dampening: float = 0.0
    fused: bool | None = None

    def decays(self, param: torch.Tensor) -> bool:
        """Whether weight decay applies to ``param`` (every engine asks here)."""
        return self.weight_decay_on == "all" or param.dim() >= 2

    def use_fused(self, device_type: str) -> bool:
        """``fused`` resolved for a device: ``None`` picks torch's fused kernel on CPU and CUDA,
        but not for SGD with momentum, whose fused kernel (torch 2.13) fails when only some
        parameters have a momentum buffer: one that got no gradient in the first steps (a
        layer ``layerdrop`` skipped) has none yet. Every engine resolves it here, so their
        arithmetic stays the same."""
        if self.fused is not None:
            return self.fused
        return device_type in ("cpu", "cuda") and not (self.name == "sgd" and self.momentum > 0)

    def __post_init__(self) -> None:
        require(
            self.name in ("adamw", "adam", "sgd"),
            "name",
            f"expected 'adamw', 'adam' or 'sgd', got {self.name!r}",
        )
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None:
            require(self.decay_steps >= 1, "decay_steps", f"must be >= 1, got {self.decay_steps}")
        require(
            0 <= self.min_lr_ratio <= 1,
            "min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, name, f"must be in [0, 1), got {value}")
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.weight_decay_on in ("matrices", "all"), "weight_decay_on",
                f"expected 'matrices' or 'all', got {self.weight_decay_on!r}")  # fmt: skip
        self._check_sgd()

    def _check_sgd(self) -> None:
        require(self.momentum >= 0, "momentum", f"must be >= 0, got {self.momentum}")
        require(0 <= self.dampening <= 1, "dampening", f"must be in [0, 1], got {self.dampening}")
        if self.nesterov:
            # torch.optim.SGD's own rule.
            require(
                self.momentum > 0 and self.dampening == 0,
                "nesterov",
                f"needs momentum > 0 and dampening 0, got momentum {self.momentum} and "
                f"dampening {self.dampening}",
            )
        if self.name != "sgd":
            # Set without name = "sgd" they would be ignored silently; momentum cannot be told
            # from its default, so it is only documented as SGD's.
            for key, default in (("nesterov", False), ("dampening", 0.0)):
                value = getattr(self, key)
                require(
                    value == default,
                    key,
                    f"applies to SGD only, but optimizer.name is {self.name!r}; set "
                    f"optimizer.name = 'sgd' or leave {key} at {default}",
                )

    @property
    def state_tensors_per_param(self) -> int:
        """Optimizer state tensors the size of each parameter: Adam's and AdamW's two moments,
        SGD's momentum buffer, none for plain SGD."""
        if self.name == "sgd":
            return 1 if self.momentum != 0 else 0
        return 2


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The training loop.

    Attributes:
        steps: optimizer steps to reach; a resumed run continues up to this step.
        batch_size: sequences per micro-batch.
        grad_accum_steps: micro-batches per optimizer step.
        grad_clip_norm: global L2 norm to clip gradients to; 0 turns clipping off.
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + gradient scaler, CUDA).
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``.
        seed: seeds the model's initial weights, the batches and torch's RNGs.
        log_every: steps between progress lines and metrics records.
        val_every: steps between validation passes; 0 turns validation off (one runs at the end).
        val_batches: batches per validation pass (always the same batches).
    """

    steps: int = 100
    batch_size: int = 8
    grad_accum_steps: int = 1
    grad_clip_norm: float = 1.0
    precision: Precision = "fp32"
    device: str = "auto"
    seed: int = 0
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 8

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "val_batches"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be >= 1, got {value}")
        require(self.val_every >= 0, "val_every", f"must be >= 0, got {self.val_every}")
        require(
            self.grad_clip_norm >= 0,
            "grad_clip_norm",
            f"must be >= 0 (0 turns clipping off), got {self.grad_clip_norm}",
        )
        require(
            self.device == "auto"
            or self.device == "cpu"
            or self.device == "cuda"
            or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
            "device",
            f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
        )


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    """Byte budgets per tier: sizes such as ``"512MiB"`` or ``"2GB"``, ``"auto"``, or unset.

    Attributes:
        device_budget: the most model data (weights, gradients, optimizer state) the run may keep
            on the training device. ``"auto"``: what the device has minus a documented reserve
            (see ``tidal.memory.tiers.resolve_budget``); unset: no limit. The reference engine
            keeps all model data on the device, so it refuses a model whose data exceeds it.
        host_budget: the same for host memory, where offloaded model data lives.
        nvme_dir: a directory on a fast disk for the third tier: the chunk engine keeps there
            the model data that does not fit ``host_budget``: first fp32 master and
            optimizer-state shards, streamed through host memory at each step, then, when the
            host cannot hold even the parameter and gradient shards, those too, read ahead of
            their gathers ([Note: nvme placement] in tidal/sharding/swap.py). Unset: no disk
            tier.
        nvme_budget: the most bytes the run may keep under ``nvme_dir``; unset: no limit.
        nvme_read_ahead: parameter shards on disk read ahead of the gathers that need them,
            along the trace; each holds one shard of host memory while it waits.
        non_model_budget: the most of ``device_budget`` set aside for activations and other
            non-model data: the chunks always get the rest, and non-model data above it goes
            over the budget instead of evicting them or failing the step (a plan's chunk stages
            set their predicted activations). Unset: the two share the budget, the chunks
            getting what the activations leave.
        nvme_state_fraction: keep this share of the optimizer's state (fp32 masters included)
            on NVMe, the last chunks first, to the nearest chunk, instead of what does not fit
            ``host_budget``: a plan's share ([Note: nvme placement] in tidal/sharding/swap.py).
            Unset: the host budget decides.
    """

    device_budget: ByteSize | Literal["auto"] | None = None
    host_budget: ByteSize | Literal["auto"] | None = None
    nvme_dir: str | None = None
    nvme_budget: ByteSize | None = None
    nvme_read_ahead: int = 2
    non_model_budget: ByteSize | None = None
    nvme_state_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.nvme_state_fraction is not None:
            require(self.nvme_dir is not None, "nvme_state_fraction",
                    "needs memory.nvme_dir (where)")  # fmt: skip
            require(0 <= self.nvme_state_fraction <= 1, "nvme_state_fraction",
                    f"must be in [0, 1], got {self.nvme_state_fraction}")  # fmt: skip
        if self.nvme_budget is not None:
            require(self.nvme_dir is not None, "nvme_budget", "needs memory.nvme_dir (where)")
        require(self.nvme_read_ahead >= 0, "nvme_read_ahead",
                f"must be >= 0, got {self.nvme_read_ahead}")  # fmt: skip
        require(self.non_model_budget is None or self.device_budget is not None,
                "non_model_budget", "is a share of memory.device_budget; set that too")  # fmt: skip
        for name in ("device_budget", "host_budget", "nvme_budget", "non_model_budget"):
            value = getattr(self, name)
            if isinstance(value, int):
                require(value > 0, name, f"must be > 0, got {value}")
