"""The update a stage's optimizer is about to make, for weight prediction.

[Note: optimizer look-ahead]
Weight prediction ([Note: weight prediction] in pipemare.py) runs a microbatch's forward on the
weights its backward will find ``tau_hat`` updates later. The first of those updates is partly
known at the forward: the backward of ``done`` of the step's ``m`` microbatches has run, so
``.grad`` holds their share of the step's gradient (each microbatch's loss is scaled by its
share of the rows). The rest is estimated by the optimizer's running mean gradient (Adam's
``exp_avg``; SGD's ``(1 - momentum) * momentum_buffer``), counting microbatches as equal shares:

    g_est = grad_done + (1 - done / m) * mean_grad,

and the optimizer's own rule applied to ``g_est`` gives the update: Adam and AdamW (bias
correction, L2 or decoupled weight decay) and SGD (momentum, dampening, Nesterov, weight decay).
With every microbatch done, ``g_est`` is the step's gradient and the update is exactly the one
``step()`` applies. :func:`next_update` returns ``None`` for anything else (other optimizers,
``amsgrad``, ``maximize``), and the caller extrapolates with its update average instead.
The learning rate is the group's current one, i.e. the last update's: the next may differ by
one step of the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["next_update"]


def _adam_update(
    p: torch.Tensor, grad: torch.Tensor | None, state: dict, group: dict, fraction_done: float
) -> torch.Tensor:
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    w = p.detach()
    exp_avg = state.get("exp_avg")
    exp_avg_sq = state.get("exp_avg_sq")
    step = float(state["step"]) + 1.0 if "step" in state else 1.0
    g = torch.zeros_like(w) if grad is None else grad.detach().clone()
    if exp_avg is not None:
        g.add_(exp_avg, alpha=1.0 - fraction_done)
    decoupled = bool(group.get("decoupled_weight_decay", False))
    if weight_decay and not decoupled:
        g.add_(w, alpha=weight_decay)
    m_next = g.mul(1.0 - beta1) if exp_avg is None else exp_avg.mul(beta1).add_(g, alpha=1 - beta1)
    v_next = g.mul(g).mul_(1.0 - beta2)
    if exp_avg_sq is not None:
        v_next.add_(exp_avg_sq, alpha=beta2)
    denom = v_next.sqrt_().div_((1.0 - beta2**step) ** 0.5).add_(eps)
    update = m_next.div_(denom).mul_(-lr / (1.0 - beta1**step))
    if weight_decay and decoupled:
        update.add_(w, alpha=-lr * weight_decay)
    return update


def _sgd_update(
    p: torch.Tensor, grad: torch.Tensor | None, state: dict, group: dict, fraction_done: float
) -> torch.Tensor:
    lr, momentum = float(group["lr"]), float(group["momentum"])
    dampening, weight_decay = float(group["dampening"]), float(group["weight_decay"])
    w = p.detach()
    buf = state.get("momentum_buffer")
    g = torch.zeros_like(w) if grad is None else grad.detach().clone()
    if buf is not None and momentum and dampening < 1.0:
        # buf is about mean_grad * (1 - dampening) / (1 - momentum) in a steady state
        g.add_(buf, alpha=(1.0 - fraction_done) * (1.0 - momentum) / (1.0 - dampening))
    if weight_decay:
        g.add_(w, alpha=weight_decay)
    if not momentum:
        return g.mul_(-lr)
    buf_next = g.clone() if buf is None else buf.mul(momentum).add_(g, alpha=1.0 - dampening)
    direction = g.add_(buf_next, alpha=momentum) if group["nesterov"] else buf_next
    return direction.mul_(-lr)


def next_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    *,
    fraction_done: float,
) -> list[torch.Tensor] | None:
    """The update ``optimizer`` would apply to ``params`` next ([Note: optimizer look-ahead]).

    ``fraction_done`` is the share of the step's microbatches whose gradient is in ``.grad``.
    Returns one tensor per parameter (``w_next - w``), or ``None`` where the optimizer's rule is
    not known here.
    """
    if not 0.0 <= fraction_done <= 1.0:
        raise ValueError(f"fraction_done must be in [0, 1], got {fraction_done}")
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        rule = _adam_update
    elif isinstance(optimizer, torch.optim.SGD):
        rule = _sgd_update
    else:
        return None
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    updates = []
    for p in params:
        group = group_of.get(id(p))
        if group is None or group.get("maximize") or group.get("amsgrad"):
            return None
        updates.append(rule(p, p.grad, optimizer.state.get(p, {}), group, fraction_done))
    return updates
