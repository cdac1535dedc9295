"""How one pipeline stage treats its weights under an asynchronous schedule (which weights a
backward uses, PipeMare's techniques, weight prediction), and PipeMare's two per-update factors;
the stage's stateful part is :class:`~tidal.runtime.weights.StageWeights`, and
:mod:`tidal.runtime.pipemare` re-exports both ([Note: PipeMare rules] there)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tidal.config import require

__all__ = ["AsyncConfig", "WeightMode", "correction_gamma", "lr_scale", "update_rate"]


class WeightMode(enum.StrEnum):
    """Which weights a microbatch's backward uses; see [Note: backward weights]."""

    CURRENT = "current"  # the stage's current weights (PipeMare, naive async, sync schedules)
    STASH = "stash"  # the exact weights its forward used (PipeDream: every version still needed)
    TWO_VERSIONS = "2bw"  # PipeDream-2BW: at most two versions live


@dataclass(kw_only=True, frozen=True, slots=True)
class AsyncConfig:
    """How one stage treats its weights under an asynchronous schedule.

    Attributes:
        weights: backward weights; see :class:`WeightMode`.
        lr_rescheduling: PipeMare technique 1 (divide the LR by the delay early on).
        lr_warmup_steps: T1, the step from which the base LR is used unchanged; 0 = no effect.
        correction: PipeMare technique 2 (backward on ``w - tau * delta``); ``CURRENT`` only.
        correction_decay: D in (0, 1); the velocity EMA factor is ``D ** (1 / tau)`` (for
            correction and prediction alike).
        prediction: weight prediction, tidal's alternative to correction: the forward runs on
            the weights it expects the backward to find, ``w + u_next + (tau_hat - 1) * delta``
            ([Note: weight prediction]); ``CURRENT`` only, and not with ``correction``.
        microbatches_per_update: m, for ``TWO_VERSIONS``: a forward of a microbatch with
            ``microbatch % m == 0`` starts a batch on the current version. 0 means the caller
            passes ``forward(mb, version=...)`` (the executor passes the schedule's versions).
            With ``prediction``, ``tau_hat`` of microbatch ``mb`` is the delay measured for
            the same slot ``mb - k * m`` of an earlier step, and ``done / m`` the share of the
            step's gradient known; 0 uses the last update's mean delay and no partial gradient.
    """

    weights: WeightMode = WeightMode.CURRENT
    lr_rescheduling: bool = False
    lr_warmup_steps: int = 0
    correction: bool = False
    correction_decay: float = 0.1
    prediction: bool = False
    microbatches_per_update: int = 0

    def __post_init__(self) -> None:
        modes = ", ".join(m.value for m in WeightMode)
        require(
            self.weights in set(WeightMode),
            "weights",
            f"must be one of {modes}, got {self.weights!r}",
        )
        # Accept the plain string from a config file or CLI; slots + frozen need object.__setattr__.
        object.__setattr__(self, "weights", WeightMode(self.weights))
        require(
            self.lr_warmup_steps >= 0,
            "lr_warmup_steps",
            f"must be >= 0 (0 disables the rescheduling effect), got {self.lr_warmup_steps}",
        )
        require(
            0.0 < self.correction_decay < 1.0,
            "correction_decay",
            f"must be in (0, 1), e.g. 0.1, got {self.correction_decay}",
        )
        require(
            not self.correction or self.weights is WeightMode.CURRENT,
            "correction",
            f"discrepancy correction needs weights='current' (got {self.weights.value!r}): "
            "stashing already gives the backward its forward's weights; drop one of the two",
        )
        require(
            not self.prediction or self.weights is WeightMode.CURRENT,
            "prediction",
            f"weight prediction needs weights='current' (got {self.weights.value!r}): the "
            "forward of a stashing schedule runs on its stashed version",
        )
        require(
            not (self.prediction and self.correction),
            "prediction",
            "choose one of prediction (forward on the weights the backward will see) and "
            "correction (backward on the weights the forward saw): together they undo each other",
        )
        require(
            self.microbatches_per_update >= 0,
            "microbatches_per_update",
            f"must be >= 0, got {self.microbatches_per_update}",
        )


def lr_scale(tau: float, step: int, warmup_steps: int) -> float:
    """PipeMare's LR multiplier ``1 / max(tau, 1) ** (1 - min(step / T1, 1))``; 1 when T1 = 0."""
    if warmup_steps <= 0:
        return 1.0
    exponent = 1.0 - min(step / warmup_steps, 1.0)
    return 1.0 / max(tau, 1.0) ** exponent


def update_rate(config: AsyncConfig, taus: list[int], lr: float, step: int) -> tuple[float, float]:
    """The rate one update of a stage applies and the delay it was chosen for: ``taus`` are the
    measured delays of the microbatches whose gradients it applies, their mean is the update's
    tau ([Note: PipeMare rules] in tidal/runtime/pipemare.py), and with LR rescheduling the
    base ``lr`` is divided as :func:`lr_scale` says. Every kind of stage parameters calls this,
    so the rule lives here once."""
    tau = sum(taus) / len(taus) if taus else 0.0
    if not config.lr_rescheduling:
        return lr, tau
    return lr * lr_scale(tau, step, config.lr_warmup_steps), tau


def correction_gamma(tau: float, decay: float) -> float:
    """The velocity EMA's factor ``D ** (1 / max(tau, 1))`` for discrepancy correction."""
    return decay ** (1.0 / max(tau, 1.0))
