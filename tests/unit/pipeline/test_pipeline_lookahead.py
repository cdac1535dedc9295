"""next_update: the optimizer's next update, exact when the whole step's gradient is known."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tidal.runtime.lookahead import next_update

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.2),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _accumulate(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(3, 5)).square().mean().backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_whole_step_known_gives_exactly_the_step(name: str) -> None:
    model = _model()
    params = list(model.parameters())
    optimizer = OPTIMIZERS[name](params)
    for step in range(4):  # the first step has no optimizer state yet; later ones do
        _accumulate(model, step)
        predicted = next_update(optimizer, params, fraction_done=1.0)
        assert predicted is not None
        before = [p.detach().clone() for p in params]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for p, w, u in zip(params, before, predicted, strict=True):
            torch.testing.assert_close(w + u, p.detach(), atol=1e-7, rtol=1e-6)
            assert u.abs().max() > 0  # the check above compares a real update


def test_unknown_part_of_the_step_is_the_running_mean_gradient() -> None:
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    _accumulate(model, 0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _accumulate(model, 1)  # one microbatch of four done
    buffers = [optimizer.state[p]["momentum_buffer"].clone() for p in params]
    grads = [p.grad.clone() for p in params]
    predicted = next_update(optimizer, params, fraction_done=0.25)
    assert predicted is not None
    for u, buf, g in zip(predicted, buffers, grads, strict=True):
        g_est = g + 0.75 * (1 - 0.9) * buf
        torch.testing.assert_close(u, -0.1 * (0.9 * buf + g_est), atol=1e-7, rtol=1e-6)
    # Nothing done yet: the momentum's own estimate alone.
    optimizer.zero_grad(set_to_none=True)
    predicted = next_update(optimizer, params, fraction_done=0.0)
    assert predicted is not None
    for u, buf in zip(predicted, buffers, strict=True):
        torch.testing.assert_close(u, -0.1 * (0.9 * buf + 0.1 * buf), atol=1e-7, rtol=1e-6)


def test_unknown_rules_return_none_and_bad_fraction_raises() -> None:
    params = list(_model().parameters())
    assert next_update(torch.optim.RMSprop(params), params, fraction_done=1.0) is None
    assert next_update(torch.optim.Adam(params, amsgrad=True), params, fraction_done=1.0) is None
    assert next_update(torch.optim.SGD(params, lr=0.1, maximize=True), params,
                       fraction_done=1.0) is None  # fmt: skip
    with pytest.raises(ValueError, match="fraction_done"):
        next_update(torch.optim.SGD(params, lr=0.1), params, fraction_done=1.5)
