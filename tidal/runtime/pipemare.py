"""PipeMare's per-stage weight handling: versions, delays, saved-tensor redirection, LR
rescheduling, discrepancy correction, and PipeDream / 2BW stashing baselines.

The runtime drives one :class:`StageWeights` per stage: it wraps the stage's forward of a
microbatch in ``weights.forward(mb)``, the stage's ``torch.autograd.backward(...)`` of that
microbatch in ``weights.backward(mb)``, and calls ``weights.step(lr=..., step=...)`` where the
schedule has an update (``U``) action. The pure math (:func:`delayed_sgd_stability_limit`; :func:`lr_scale` and :func:`correction_gamma`
come from :mod:`tidal.pipeline.async_config`; the stateful part from :mod:`tidal.runtime.weights`) is re-exported here.

[Note: weight delay tau]
The stage's *version* is the number of updates it has applied. A microbatch's forward records
the version it computed with (``version_at_forward``). Its gradient accumulates into ``.grad``
in its backward and is applied by the next ``step``, which updates the version current at that
moment, i.e. the version current at the backward. So

    tau(mb) = (version at the microbatch's backward) - (version its forward used),

measured when ``backward(mb)`` is entered and kept in ``StageWeights.delays``. A synchronous
schedule (no update between F and B) has tau = 0 everywhere; PipeMare in a 1F1B runtime has
about ceil((p - 1 - s) / N) on stage s; PipeDream's stashing has the same tau as PipeMare (the
gradient is just as stale, only consistent); 2BW has tau = 1 from the second batch on.

[Note: PipeMare rules]
- LR rescheduling (technique 1): alpha_{k,s} = alpha_k / max(tau_s, 1) ** (1 - min(k / T1, 1)):
  divide by the delay at step 0, the base schedule from step T1 on, geometric in between.
  T1 = 0 means no rescheduling effect. tau_s is the mean tau of the microbatches whose gradients
  the update applies (those whose backward ran since the previous update): a measured, per-update
  value instead of a formula, so warm-up steps (tau ramps up) and flushes are handled as they are.
- Discrepancy correction (technique 2): delta <- gamma * delta + (1 - gamma) * (w_new - w_old)
  after each update, gamma = D ** (1 / max(tau_s, 1)); a microbatch's backward uses
  w - tau(mb) * delta, pulling the backward weights towards the (older) forward weights.
  Cost: one weight-sized buffer per stage.

[Note: weight prediction]
tidal's alternative to discrepancy correction (``AsyncConfig.prediction``), in the spirit of
SpecTrain's and PipeNAG's look-ahead: instead of pulling the backward's weights back towards
the forward's, run the forward on the weights the backward will find ``tau_hat`` updates later,

    w_hat = w + u_next + (tau_hat - 1) * delta,

``tau_hat`` being the delay measured for the same slot (``mb - k * m``) of the latest step whose
backward has run (delays repeat every m microbatches in a steady schedule; a program's first
step has none), ``u_next`` the update the optimizer is about to make, computed by its own rule
from the part of the step's gradient already in ``.grad`` and its running mean gradient for the
rest ([Note: optimizer look-ahead] in lookahead.py; ``delta`` instead for optimizers it does not
know), and ``delta`` the same update EMA as correction's for the updates after it. The backward
runs on the live weights (``CURRENT``), which are ``w_hat`` up to the prediction's error: if
the prediction were exact, every stage would compute its gradient on the weights it is applied
to, as in synchronous training. Cost: the delta buffer, plus a transient copy of the stage's
weights during each forward (freed when it ends; ``held_weight_copies`` counts it meanwhile).
Not combinable with correction (they undo each other) or with stashing schedules (their forward
runs on a stashed version).
"""

from __future__ import annotations

import numpy as np

from tidal.pipeline.async_config import AsyncConfig, WeightMode, correction_gamma, lr_scale
from tidal.runtime.weights import StageWeights

__all__ = [
    "AsyncConfig",
    "StageWeights",
    "WeightMode",
    "correction_gamma",
    "delayed_sgd_stability_limit",
    "lr_scale",
]


def _spectral_radius(alpha_lambda: float, tau: int) -> float:
    # w_{k+1} = w_k - a * w_{k-tau} has characteristic polynomial z^{tau+1} - z^tau + a.
    coefficients = np.zeros(tau + 2)
    coefficients[0] = 1.0
    coefficients[1] -= 1.0
    coefficients[-1] += alpha_lambda  # the same coefficient as z^tau's when tau = 0
    return float(np.max(np.abs(np.roots(coefficients))))


def delayed_sgd_stability_limit(tau: int, *, tolerance: float = 1e-10) -> float:
    """The largest ``alpha * lambda`` for which delayed SGD on ``f = lambda w^2 / 2`` is stable.

    Found numerically by bisection on the roots of ``z^{tau+1} - z^tau + alpha * lambda`` (stable
    iff all lie inside the unit circle); it equals ``2 sin(pi / (2 (2 tau + 1)))``, so the usable
    step shrinks like ``pi / (2 tau + 1)``: the reason PipeMare divides the LR by the delay.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    stable, unstable = 0.0, 2.5  # alpha * lambda > 2 diverges for every tau
    while unstable - stable > tolerance:
        middle = 0.5 * (stable + unstable)
        if _spectral_radius(middle, tau) < 1.0:
            stable = middle
        else:
            unstable = middle
    return stable
