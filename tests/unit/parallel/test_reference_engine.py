"""The reference engine against a hand-written torch loop, and its schedule, state and figures."""

from __future__ import annotations

import math

import pytest
import torch

import tidal
from tidal.config import ConfigError
from tidal.models import build_gpt, preset
from tidal.parallel.lr import WarmupCosine
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

TINY = preset("tiny")


def _batch(seed: int, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch_size, TINY.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _engine(**training: object) -> ReferenceEngine:
    opt = OptimizerConfig(lr=1e-3, warmup_steps=2, decay_steps=6, fused=False)
    return ReferenceEngine(
        build_gpt(TINY, seed=0), optimizer=opt, training=TrainingConfig(device="cpu", **training)
    )


def test_matches_a_plain_torch_loop() -> None:
    engine = _engine(grad_clip_norm=0.5)
    model = build_gpt(TINY, seed=0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=False,
    )
    schedule = WarmupCosine(peak_lr=1e-3, warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    for step in range(5):
        inputs, targets = _batch(step)
        loss = engine(inputs, targets)
        engine.backward(loss)
        assert engine.step()

        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        ref_loss = model(inputs, targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss, ref_loss)
    for (name, got), want in zip(engine.model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_accumulation_equals_one_large_batch() -> None:
    big = _engine(grad_accum_steps=1, batch_size=8)
    accum = _engine(grad_accum_steps=2, batch_size=4)
    for step in range(3):
        inputs, targets = _batch(step, batch_size=8)
        big.backward(big(inputs, targets))
        assert big.step()
        stepped = []
        for half in (slice(0, 4), slice(4, 8)):
            accum.backward(accum(inputs[half], targets[half]))
            stepped.append(accum.step())
        assert stepped == [False, True]
    assert accum.global_step == big.global_step == 3
    # Summation order differs, and Adam divides by sqrt(v), which magnifies rounding where a
    # gradient is near zero; 1e-5 is 1% of one step's largest change (lr 1e-3).
    for a, b in zip(big.model.parameters(), accum.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_warmup_cosine_shape() -> None:
    s = WarmupCosine(peak_lr=1.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == 1.0
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(100) == pytest.approx(0.1)
    decayed = [s.lr_at(i) for i in range(4, 15)]
    assert decayed == sorted(decayed, reverse=True)


def test_state_dict_round_trip_continues_identically() -> None:
    a = _engine()
    for step in range(3):
        a.backward(a(*_batch(step)))
        a.step()
    b = _engine()
    b.load_state_dict(a.state_dict())
    assert b.global_step == 3 and b.lr == a.lr
    for step in range(3, 5):
        la, lb = a(*_batch(step)), b(*_batch(step))
        assert torch.equal(la, lb)
        a.backward(la)
        b.backward(lb)
        a.step()
        b.step()
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_stats_count_model_data_exactly() -> None:
    engine = _engine()
    engine.backward(engine(*_batch(0)))
    engine.step()
    stats = engine.stats()
    num_params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    data = stats["model_data_bytes"]
    assert data["params"] == 4 * num_params
    assert data["grads"] == 0  # zeroed (set to None) after the step
    # Two fp32 moments per parameter plus one scalar step counter per parameter tensor.
    num_tensors = len({id(p) for p in engine.model.parameters()})
    assert data["optimizer_state"] == 8 * num_params + 4 * num_tensors
    assert stats["global_step"] == 1 and stats["grad_norm"] > 0
    assert stats["peak_memory_bytes"]["host"] > 0


def test_bf16_autocast_trains_and_fp16_on_cpu_is_refused() -> None:
    engine = _engine(precision="bf16")
    loss = engine(*_batch(0))
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    with pytest.raises(ConfigError, match="training.precision.*fp16 needs CUDA"):
        _engine(precision="fp16")


def test_device_budget_is_enforced() -> None:
    with pytest.raises(ConfigError, match="memory.device_budget"):
        tidal.initialize(build_gpt(TINY), {"memory": {"device_budget": "1MiB"}})
    engine = tidal.initialize(build_gpt(TINY), {"memory": {"device_budget": "4MiB"}})
    assert engine.stats()["engine"] == "reference"
    # "auto" is the machine's own memory minus a reserve: a tiny model fits.
    tidal.initialize(build_gpt(TINY), {"memory": {"device_budget": "auto"}})


def test_initialize_accepts_a_dict_config() -> None:
    engine = tidal.initialize(
        build_gpt(TINY), {"optimizer": {"lr": 5e-4}, "training": {"device": "cpu"}}
    )
    loss = engine(*_batch(0))
    engine.backward(loss)
    assert engine.step()
    assert engine.stats()["global_step"] == 1
    with pytest.raises(ConfigError, match="optimizer.lr"):
        tidal.initialize(build_gpt(TINY), {"optimizer": {"lr": -1}})


@pytest.mark.parametrize(
    ("name", "cls"),
    [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)],
)
def test_each_optimizer_decays_matrices_only(name: str, cls: type) -> None:
    engine = ReferenceEngine(
        build_gpt(TINY, seed=0),
        optimizer=OptimizerConfig(name=name, weight_decay=0.05),
        training=TrainingConfig(device="cpu"),
    )
    optimizer = engine.optimizer
    assert type(optimizer) is cls
    decay, rest = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in rest["params"])
    # Fused on a CPU, but not SGD with momentum: its fused kernel fails when only some
    # parameters have a momentum buffer (OptimizerConfig.use_fused).
    assert decay["fused"] == (name != "sgd")
    if name == "sgd":
        assert (decay["momentum"], decay["dampening"], decay["nesterov"]) == (0.9, 0.0, False)
    else:
        assert decay["decoupled_weight_decay"] == (name == "adamw")


@pytest.mark.parametrize(("momentum", "state_tensors"), [(0.9, 1), (0.0, 0)])
def test_sgd_state_is_counted_exactly(momentum: float, state_tensors: int) -> None:
    engine = ReferenceEngine(
        build_gpt(TINY, seed=0),
        optimizer=OptimizerConfig(name="sgd", momentum=momentum),
        training=TrainingConfig(device="cpu"),
    )
    engine.backward(engine(*_batch(0)))
    engine.step()
    num_params = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())
    assert engine.model_data_bytes()["optimizer_state"] == 4 * num_params * state_tensors


def test_device_budget_counts_each_optimizers_state() -> None:
    num_params = sum(p.numel() for p in {id(p): p for p in build_gpt(TINY).parameters()}.values())
    # Weights and gradients take 8 bytes per parameter; each state tensor 4 more.
    budget = {"memory": {"device_budget": 12 * num_params}}
    sgd = {"optimizer": {"name": "sgd"}}
    tidal.initialize(build_gpt(TINY), {**budget, **sgd})  # momentum: exactly 12 bytes
    for name in ("adamw", "adam"):
        with pytest.raises(ConfigError, match=f"{name} state of 2x the weights"):
            tidal.initialize(build_gpt(TINY), {**budget, "optimizer": {"name": name}})
    tight = {"memory": {"device_budget": 8 * num_params}}
    tidal.initialize(build_gpt(TINY), {**tight, "optimizer": {"name": "sgd", "momentum": 0}})
    with pytest.raises(ConfigError, match="memory.device_budget.*sgd state of 1x the weights"):
        tidal.initialize(build_gpt(TINY), {**tight, **sgd})
