"""StageWeights: saved-tensor redirection, delays, PipeMare's two techniques, stashing baselines."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.models.gpt import Block, GPTConfig
from tidal.runtime.pipemare import (
    AsyncConfig,
    StageWeights,
    WeightMode,
    correction_gamma,
    delayed_sgd_stability_limit,
    lr_scale,
)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


# ---------------------------------------------------------------------------------------------
# synchronous: bit for bit


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def _case(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(1)
    if name == "linear":
        return nn.Linear(5, 3), [torch.randn(2, 5) for _ in range(2)]
    if name == "layernorm":
        return nn.Sequential(nn.LayerNorm(5), nn.ReLU()), [torch.randn(2, 5) for _ in range(2)]
    if name == "embedding":
        return _Embed(), [torch.randint(0, 10, (2, 3)) for _ in range(2)]
    config = GPTConfig(vocab_size=11, seq_len=4, num_layers=1, num_heads=2, d_model=8)
    return Block(config), [torch.randn(2, 4, 8) for _ in range(2)]


@pytest.mark.parametrize("name", ["linear", "layernorm", "embedding", "gpt_block"])
def test_hooks_change_no_bit_without_updates(name: str) -> None:
    module, inputs = _case(name)
    reference = copy.deepcopy(module)
    for x in inputs:
        (reference(x) ** 2).sum().backward()
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), AsyncConfig())
    outputs = []
    for mb, x in enumerate(inputs):  # both forwards in flight before either backward
        with weights.forward(mb):
            outputs.append(module(x))
    for mb, y in enumerate(outputs):
        with weights.backward(mb):
            torch.autograd.backward((y**2).sum())
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert weights.delays == {0: 0, 1: 0}
    assert weights.held_weight_copies() == 0


# ---------------------------------------------------------------------------------------------
# an in-place update between F and B


def _update_with_other_microbatch(
    weights: StageWeights, module: nn.Module, mb: int, x: torch.Tensor, step: int
) -> None:
    with weights.forward(mb):
        y = module(x)
    with weights.backward(mb):
        y.sum().backward()
    weights.step(lr=0.1, step=step)


def _hand_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    forward_weights: list[torch.Tensor],
    backward_w2: torch.Tensor,
) -> list[torch.Tensor]:
    """Two-layer tanh MLP: activations from the forward's weights, dh through backward W2."""
    w1, b1, w2, _ = forward_weights
    h = torch.tanh(x @ w1.T + b1)
    dh = dy @ backward_w2
    dz = dh * (1 - h * h)
    return [dz.T @ x, dz.sum(0), dy.T @ h, dy.sum(0)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_inplace_step_between_f_and_b_uses_current_weights(optimizer: str) -> None:
    module = _mlp()
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    }[optimizer]
    weights = StageWeights(module, make(module.parameters()), AsyncConfig())
    x, dy = torch.randn(3, 4), torch.randn(3, 3)
    old = [p.detach().clone() for p in module.parameters()]
    identities = [id(p) for p in module.parameters()]
    with weights.forward(0):
        y = module(x)
    for k in range(2):
        _update_with_other_microbatch(weights, module, 10 + k, torch.randn(3, 4), k)
    assert weights.delay(0) == 2
    with weights.backward(0):
        y.backward(dy)
    current_w2 = module[2].weight.detach()
    assert not torch.equal(current_w2, old[2])
    expected = _hand_grads(x, dy, old, current_w2)
    for p, e in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=0)
    assert [id(p) for p in module.parameters()] == identities
    assert weights.delays[0] == 2 and weights.version == 2


def test_plain_autograd_refuses_the_same_inplace_step() -> None:
    module = _mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    y = module(torch.randn(3, 4))
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.sum().backward()


def test_correction_backward_uses_w_minus_tau_delta() -> None:
    module = _mlp()
    config = AsyncConfig(correction=True, correction_decay=0.5)
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    assert weights.held_weight_copies() == 1  # delta
    x, dy = torch.randn(3, 4), torch.randn(3, 3)
    snapshots = [[p.detach().clone() for p in module.parameters()]]
    with weights.forward(0):
        y = module(x)
    for k in range(2):
        _update_with_other_microbatch(weights, module, 10 + k, torch.randn(3, 4), k)
        snapshots.append([p.detach().clone() for p in module.parameters()])
    # Each update applied one tau = 0 microbatch, so gamma = D ** (1 / max(0, 1)) = D.
    gamma = 0.5
    delta_w2 = torch.zeros_like(module[2].weight)
    for k in range(2):
        delta_w2 = gamma * delta_w2 + (1 - gamma) * (snapshots[k + 1][2] - snapshots[k][2])
    assert weights.state_dict()["delta"][2].allclose(delta_w2, atol=1e-7)
    with weights.backward(0):
        assert weights.delays[0] == 2
        y.backward(dy)
    backward_w2 = snapshots[2][2] - 2 * delta_w2
    expected = _hand_grads(x, dy, snapshots[0], backward_w2)
    for p, e in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=0)
    # The uncorrected backward differs, so the check above could fail.
    uncorrected = _hand_grads(x, dy, snapshots[0], snapshots[2][2])
    assert not torch.allclose(uncorrected[0], expected[0], atol=1e-6)
    assert weights.held_weight_copies() == 1  # the corrected weights were freed


def test_prediction_forward_runs_on_the_next_update_plus_delta() -> None:
    module = _mlp()
    config = AsyncConfig(prediction=True, correction_decay=0.5, microbatches_per_update=1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    weights = StageWeights(module, optimizer, config)
    x, dy = torch.randn(3, 4), torch.randn(3, 3)
    snapshots = [[p.detach().clone() for p in module.parameters()]]
    with weights.forward(0):  # a program's first step: no delay yet, the live weights
        y0 = module(x)
    for k in range(2):
        _update_with_other_microbatch(weights, module, 10 + k, torch.randn(3, 4), k)
        snapshots.append([p.detach().clone() for p in module.parameters()])
    with weights.backward(0):
        y0.backward(dy)  # its gradient waits in .grad for the next update
    assert weights.delays[0] == 2
    gamma = 0.5  # each update applied one tau = 0 microbatch: D ** (1 / max(0, 1))
    delta = [torch.zeros_like(w) for w in snapshots[0]]
    for k in range(2):
        delta = [gamma * d + (1 - gamma) * (b - a) for d, a, b in
                 zip(delta, snapshots[k], snapshots[k + 1], strict=True)]  # fmt: skip
    # Microbatch 1 is in microbatch 0's slot one update later (m = 1): tau_hat = 2. The first of
    # those two updates is the one microbatch 0's gradient is about to make, the second delta.
    assert weights.expected_delay(1) == 2.0
    with weights.forward(1):
        y1 = module(x)
        assert weights.held_weight_copies() == 2  # delta + the transient predicted weights
    for p, w in zip(module.parameters(), snapshots[2], strict=True):
        assert torch.equal(p.detach(), w)  # the live weights are back, bit for bit
    assert weights.held_weight_copies() == 1  # only delta
    weights.step(lr=0.1, step=2)  # the update the forward anticipated
    after = [p.detach().clone() for p in module.parameters()]
    predicted = [w + d for w, d in zip(after, delta, strict=True)]
    names = [n for n, _ in module.named_parameters()]
    expected_y = torch.func.functional_call(module, dict(zip(names, predicted, strict=True)), (x,))
    torch.testing.assert_close(y1, expected_y, atol=1e-6, rtol=0)
    live_y = torch.func.functional_call(module, dict(zip(names, snapshots[2], strict=True)), (x,))
    assert not torch.allclose(y1, live_y, atol=1e-4)  # a forward on the live weights differs
    _update_with_other_microbatch(weights, module, 12, torch.randn(3, 4), 3)
    with weights.backward(1):  # backward on the live weights, two updates after the forward
        y1.backward(dy)
    expected = _hand_grads(x, dy, predicted, module[2].weight.detach())
    for p, e in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=0)


def test_stash_backward_uses_the_forwards_weights() -> None:
    module = _mlp()
    reference = copy.deepcopy(module)
    config = AsyncConfig(weights=WeightMode.STASH)
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    x = torch.randn(3, 4)
    with weights.forward(0):
        y = module(x)
    _update_with_other_microbatch(weights, module, 1, torch.randn(3, 4), 0)
    assert weights.held_weight_copies() == 1
    with weights.backward(0):
        y.sum().backward()
    reference(x).sum().backward()  # F and B both at the forward's weights
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert weights.delays[0] == 1
    assert weights.held_weight_copies() == 0  # released with the last microbatch using it


# ---------------------------------------------------------------------------------------------
# memory: weight copies held, by StageWeights and by autograd


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@contextmanager
def _saved_storage_registry() -> Iterator[list[weakref.ref[_Box]]]:
    """Boxes every saved tensor autograd hands to this (outer) hook; live boxes = kept alive."""
    boxes: list[weakref.ref[_Box]] = []

    def pack(t: torch.Tensor) -> _Box:
        box = _Box(t.detach())
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        yield boxes


def _old_weight_storages(tensors: list[torch.Tensor], weight: torch.Tensor) -> int:
    """Distinct weight-sized storages among ``tensors`` other than the live weight's."""
    live = weight.untyped_storage().data_ptr()
    nbytes = weight.untyped_storage().nbytes()
    return len(
        {
            t.untyped_storage().data_ptr()
            for t in tensors
            if t.untyped_storage().nbytes() == nbytes and t.untyped_storage().data_ptr() != live
        }
    )


def _graph_saved_tensors(root: torch.autograd.graph.Node) -> list[torch.Tensor]:
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                if isinstance(value, torch.Tensor):
                    found.append(value)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


_NUM_IN_FLIGHT = 4


def _stage_input() -> torch.Tensor:
    # A middle stage's input needs a gradient, so the first layer saves its weight too.
    return torch.randn(2, 11, requires_grad=True)


def _wide_mlp() -> nn.Sequential:
    torch.manual_seed(0)  # weight 7 x 11 = 308 bytes: no activation of batch 2 has that size
    return nn.Sequential(nn.Linear(11, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("mode", ["current", "correction", "stash", "naive"])
def test_weight_copies_with_microbatches_in_flight(mode: str) -> None:
    module = _wide_mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    config = {
        "current": AsyncConfig(),
        "correction": AsyncConfig(correction=True),
        "stash": AsyncConfig(weights=WeightMode.STASH),
    }.get(mode)
    weights = None if config is None else StageWeights(module, optimizer, config)
    outputs = []
    with _saved_storage_registry() as boxes:
        for mb in range(_NUM_IN_FLIGHT):  # microbatch mb runs its forward at version mb
            if weights is None:
                outputs.append(module(_stage_input()))
                module(_stage_input()).sum().backward()
                if mb < _NUM_IN_FLIGHT - 1:
                    for p in module.parameters():  # out of place: the old tensor lives on
                        p.data = p.data - 0.1 * p.grad
                        p.grad = None
                continue
            with weights.forward(mb):
                outputs.append(module(_stage_input()))
            if mb < _NUM_IN_FLIGHT - 1:
                _update_with_other_microbatch(weights, module, 100 + mb, _stage_input(), mb)
    weight = module[0].weight
    kept_by_autograd = _old_weight_storages([b().t for b in boxes if b() is not None], weight)
    in_graph = _old_weight_storages(
        [t for y in outputs for t in _graph_saved_tensors(y.grad_fn)], weight
    )
    old_versions = _NUM_IN_FLIGHT - 1  # forwards at versions 0..3, the live one is 3
    if weights is None:
        assert kept_by_autograd == old_versions
        return
    assert kept_by_autograd == 0  # the outer hook never saw a weight: tokens instead
    expected = {"current": 0, "correction": 1, "stash": old_versions}[mode]
    assert weights.held_weight_copies() == expected
    if mode != "correction":  # unpacking outside a backward would build corrected copies
        assert in_graph == (old_versions if mode == "stash" else 0)
    for mb, y in enumerate(outputs):
        with weights.backward(mb):
            y.sum().backward()
    assert weights.held_weight_copies() == (1 if mode == "correction" else 0)
    assert [weights.delays[mb] for mb in range(_NUM_IN_FLIGHT)] == [3, 2, 1, 0]


_FIRST_STAGE = "F0 F1 B0 F2 B1 U F3 B2 F4 B3 U F5 B4 B5 U"  # two microbatches in flight
_LAST_STAGE = "F0 B0 F1 B1 U F2 B2 F3 B3 U F4 B4 F5 B5 U"  # one in flight


@pytest.mark.parametrize(
    ("program", "expected_delays"),
    [(_FIRST_STAGE, [0, 0, 1, 1, 1, 1]), (_LAST_STAGE, [0, 0, 0, 0, 0, 0])],
)
def test_two_versions_batch_version_and_one_copy(program: str, expected_delays: list[int]) -> None:
    module = _mlp()
    reference = copy.deepcopy(module)
    config = AsyncConfig(weights=WeightMode.TWO_VERSIONS, microbatches_per_update=2)
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    inputs = [torch.randn(3, 4) for _ in range(6)]
    outputs: dict[int, torch.Tensor] = {}
    forward_weights: dict[int, list[torch.Tensor]] = {}
    max_copies = 0
    for action in program.split():
        if action == "U":
            # The update applies this batch's gradients, each taken at its forward's weights.
            for mb in [mb for mb in forward_weights if weights.delays.get(mb) is not None]:
                for p, w in zip(reference.parameters(), forward_weights.pop(mb), strict=True):
                    p.data = w.clone()
                reference(inputs[mb]).sum().backward()
            for p, q in zip(module.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
                q.grad = None
            weights.step(lr=0.1, step=weights.version)
        elif action[0] == "F":
            mb = int(action[1:])
            with weights.forward(mb):
                outputs[mb] = module(inputs[mb])
                forward_weights[mb] = [p.detach().clone() for p in module.parameters()]
        else:
            mb = int(action[1:])
            with weights.backward(mb):
                outputs[mb].sum().backward()
        max_copies = max(max_copies, weights.held_weight_copies())
    assert [weights.delays[mb] for mb in range(6)] == expected_delays
    assert max_copies == 1  # one stashed version besides the live one, never two


# ---------------------------------------------------------------------------------------------
# PipeMare's learning-rate rule, gamma and the stability limit


def test_lr_scale_values() -> None:
    t1, tau = 10, 4
    assert lr_scale(tau, 0, t1) == pytest.approx(1 / 4)
    assert lr_scale(tau, t1 // 2, t1) == pytest.approx(1 / 2)
    assert lr_scale(tau, t1, t1) == 1.0
    assert lr_scale(tau, 2 * t1, t1) == 1.0
    assert lr_scale(tau, 0, 0) == 1.0  # T1 = 0: no effect
    assert lr_scale(0, 0, t1) == 1.0  # tau is floored at 1
    assert correction_gamma(4, 0.1) == pytest.approx(0.1**0.25)
    assert correction_gamma(0, 0.1) == pytest.approx(0.1)


def test_step_reschedules_with_the_mean_delay() -> None:
    module = _mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    config = AsyncConfig(lr_rescheduling=True, lr_warmup_steps=10)
    weights = StageWeights(module, optimizer, config)
    x = torch.randn(3, 4)
    outputs = []
    for mb in range(3):
        with weights.forward(mb):
            outputs.append(module(x))
    assert weights.step(lr=0.3, step=0) == pytest.approx(0.3)  # no gradient: tau 0
    assert weights.step(lr=0.3, step=0) == pytest.approx(0.3)
    for mb in (0, 1):  # tau 2 each
        with weights.backward(mb):
            outputs[mb].sum().backward()
    assert weights.step(lr=0.3, step=0) == pytest.approx(0.3 / 2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3 / 2)
    with weights.backward(2):  # tau 3 at step T1 / 2: 1 / sqrt(3)
        outputs[2].sum().backward()
    assert weights.step(lr=0.3, step=5) == pytest.approx(0.3 / math.sqrt(3))


@pytest.mark.parametrize("tau", [0, 1, 2, 4, 8])
def test_delayed_sgd_stability_limit(tau: int) -> None:
    limit = delayed_sgd_stability_limit(tau)
    assert limit == pytest.approx(2 * math.sin(math.pi / (2 * (2 * tau + 1))), abs=1e-6)
    for factor, stable in ((0.9, True), (1.1, False)):  # the iteration itself agrees
        history = [1.0] * (tau + 1)
        for _ in range(3000):
            history.append(history[-1] - factor * limit * history[-1 - tau])
        assert (abs(history[-1]) < 1e-3) is stable


# ---------------------------------------------------------------------------------------------
# config, checks, checkpoints


def test_config_validation() -> None:
    assert AsyncConfig(weights="stash").weights is WeightMode.STASH  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="correction"):
        AsyncConfig(weights=WeightMode.STASH, correction=True)
    with pytest.raises(ConfigError, match="correction_decay"):
        AsyncConfig(correction_decay=1.0)
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        AsyncConfig(lr_warmup_steps=-1)
    with pytest.raises(ConfigError, match="weights"):
        AsyncConfig(weights="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prediction"):
        AsyncConfig(prediction=True, correction=True)
    with pytest.raises(ConfigError, match="prediction"):
        AsyncConfig(weights=WeightMode.STASH, prediction=True)


def test_inplace_change_of_a_saved_activation_still_raises() -> None:
    module = _mlp()
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), AsyncConfig())
    with weights.forward(0):
        h = torch.tanh(module[0](torch.randn(3, 4)))  # tanh saves its output
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="inplace operation"), weights.backward(0):
        h.sum().backward()


def test_autocast_casts_are_reported_as_unredirected() -> None:
    module = nn.Linear(4, 3)
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), AsyncConfig())
    with (
        pytest.warns(UserWarning, match="cannot be redirected"),
        weights.forward(0),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        module(torch.randn(2, 4, requires_grad=True))  # saves the bf16 copy of the weight
    assert weights.num_unredirected_saves >= 1


def test_state_dict_round_trip() -> None:
    module = _mlp()
    config = AsyncConfig(correction=True)
    weights = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    with weights.forward(0):
        module(torch.randn(3, 4))
    _update_with_other_microbatch(weights, module, 1, torch.randn(3, 4), 0)
    weights.last_delay = 1.5  # what a prediction without a measured slot falls back to
    state = weights.state_dict()
    restored = StageWeights(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    restored.load_state_dict(state)
    assert restored.version == 1 and restored.delays == {1: 0} and restored.last_delay == 1.5
    assert restored.delay(0) == 1
    for a, b in zip(restored.state_dict()["delta"], state["delta"], strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert state["delta"][0].abs().sum() > 0
    with pytest.raises(ValueError, match="correction"):
        StageWeights(
            module, torch.optim.SGD(module.parameters(), lr=0.1), AsyncConfig()
        ).load_state_dict(state)
