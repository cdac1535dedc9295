"""The update rules of the chunk optimizer: AdamW, Adam and SGD (with or without momentum).

A rule says which state chunks it needs per trainable chunk index (:attr:`UpdateRule.state_kinds`)
and applies torch's own functional update over slot views, with the flags the matching
``torch.optim`` class passes to it, so the chunk engine's arithmetic is the reference engine's
element for element. Weight decay is the caller's, per parameter group: decoupled for AdamW, L2
(added to the gradient) for Adam and SGD, as in torch.

[Note: lazy optimizer state]
torch's SGD has no momentum buffer before its first step and then starts it from the first
(weight-decayed) gradient, not from zeros; the fused kernel even branches on whether every
buffer is missing. A rule with ``lazy_state`` is therefore given ``None`` for a parameter whose
state was never written, and the functional update creates the buffer in the list it was given;
the chunk optimizer copies it into the state chunk afterwards. Adam's state starts as zeros and a
step count of 0, which the chunks hold from the start, so Adam is not lazy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from tidal.memory.chunk import ChunkKind

__all__ = [
    "STATE_KEYS",
    "AdamRule",
    "OptimizerEntry",
    "OptimizerSettings",
    "SgdRule",
    "UpdateRule",
    "by_device",
    "clip_coefficient",
    "clip_factor",
    "state_value",
    "total_norm_of",
    "make_rule",
]

# The key each state kind has in torch's optimizer state, used by the chunk optimizer's
# state_dict so a checkpoint reads like torch's per-parameter state.
STATE_KEYS: dict[ChunkKind, str] = {
    ChunkKind.EXP_AVG: "exp_avg",
    ChunkKind.EXP_AVG_SQ: "exp_avg_sq",
    ChunkKind.MOMENTUM: "momentum_buffer",
}

StateLists = Sequence[list[torch.Tensor | None]]


class UpdateRule(Protocol):
    """One optimizer algorithm over lists of slot views; see the module doc."""

    @property
    def state_kinds(self) -> tuple[ChunkKind, ...]:
        """One fp32 chunk of each kind per trainable chunk index."""
        ...

    @property
    def counts_steps(self) -> bool:
        """Whether each parameter keeps a step counter (a float32 scalar, as torch's Adam)."""
        ...

    @property
    def lazy_state(self) -> bool:
        """See [Note: lazy optimizer state]."""
        ...

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: StateLists,
        steps: list[torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        fused: bool,
    ) -> None:
        """Update ``params`` in place; ``states`` has one list per kind, aligned with params."""
        ...


@dataclass(frozen=True, slots=True)
class AdamRule:
    """Adam, or AdamW with ``decoupled_weight_decay``: torch's functional ``adam``."""

    beta1: float
    beta2: float
    eps: float
    decoupled_weight_decay: bool

    state_kinds: ClassVar[tuple[ChunkKind, ...]] = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
    counts_steps: ClassVar[bool] = True
    lazy_state: ClassVar[bool] = False

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: StateLists,
        steps: list[torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        fused: bool,
    ) -> None:
        exp_avgs, exp_avg_sqs = states
        adam(
            params,
            grads,
            _present(exp_avgs),
            _present(exp_avg_sqs),
            [],
            steps,
            fused=fused,
            decoupled_weight_decay=self.decoupled_weight_decay,
            amsgrad=False,
            beta1=self.beta1,
            beta2=self.beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=self.eps,
            maximize=False,
        )


@dataclass(frozen=True, slots=True)
class SgdRule:
    """SGD, with heavy-ball or Nesterov momentum when ``momentum > 0``: torch's ``sgd``."""

    momentum: float
    dampening: float
    nesterov: bool

    counts_steps: ClassVar[bool] = False
    lazy_state: ClassVar[bool] = True

    @property
    def state_kinds(self) -> tuple[ChunkKind, ...]:
        return (ChunkKind.MOMENTUM,) if self.momentum != 0 else ()

    def apply(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: StateLists,
        steps: list[torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        fused: bool,
    ) -> None:
        # Plain SGD gets an empty buffer list, as torch.optim.SGD passes it.
        buffers = states[0] if states else []
        sgd(
            params,
            grads,
            buffers,
            fused=fused,
            weight_decay=weight_decay,
            momentum=self.momentum,
            lr=lr,
            dampening=self.dampening,
            nesterov=self.nesterov,
            maximize=False,
        )


def _present(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    assert all(t is not None for t in tensors), "Adam's state is never lazy"
    return [t for t in tensors if t is not None]


class OptimizerSettings(Protocol):
    """The fields of the engine's ``OptimizerConfig`` a rule is made from."""

    @property
    def name(self) -> str: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def dampening(self) -> float: ...
    @property
    def nesterov(self) -> bool: ...


def make_rule(settings: OptimizerSettings) -> UpdateRule:
    """The rule for ``settings.name``: ``adamw``, ``adam`` or ``sgd``."""
    if settings.name in ("adamw", "adam"):
        return AdamRule(
            beta1=settings.beta1,
            beta2=settings.beta2,
            eps=settings.eps,
            decoupled_weight_decay=settings.name == "adamw",
        )
    if settings.name == "sgd":
        return SgdRule(
            momentum=settings.momentum, dampening=settings.dampening, nesterov=settings.nesterov
        )
    raise ValueError(f"no update rule called {settings.name!r}; expected adamw, adam or sgd")


@dataclass(frozen=True, slots=True)
class OptimizerEntry:
    """One trainable parameter as a chunk optimizer sees it: where it lives, whether it decays."""

    name: str
    param: nn.Parameter
    chunk: int
    slot: int
    decay: bool


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``clip_grad_norm_`` scales gradients by, capped at 1: torch's formula, so that
    every engine and stage clips bit for bit as the reference does. The one definition of it."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_coefficient(
    norm: torch.Tensor, max_grad_norm: float, loss_scale: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unscaled norm, and what to multiply the gradients by (None: nothing)."""
    if loss_scale != 1.0:
        norm = norm / loss_scale
    coefficient: torch.Tensor | float | None = None
    if max_grad_norm > 0:
        coefficient = clip_factor(norm, max_grad_norm)
    if loss_scale != 1.0:  # unscaling folded into the same multiply
        coefficient = (1.0 if coefficient is None else coefficient) / loss_scale
    return norm, None if coefficient is None else torch.as_tensor(coefficient)


def by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """``tensors`` grouped by device, in order of first appearance."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def total_norm_of(norms: list[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` from the tensors' own norms (all fp32): grouped by
    device in order of first appearance, as it groups them, so the sum runs in its order."""
    if not norms:
        return torch.tensor(0.0)
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for value in norms:
        groups.setdefault(value.device, []).append(value)
    first = norms[0].device
    return torch.linalg.vector_norm(
        torch.stack([value.to(first) for group in groups.values() for value in group]), 2.0
    )


def state_value(saved: dict[str, Any], key: str, name: str) -> torch.Tensor:
    """``saved[key]`` of parameter ``name``'s saved optimizer state, or a KeyError naming both."""
    if key not in saved:
        raise KeyError(f"the optimizer state has no {key!r} for {name}")
    return saved[key]
