"""The reference engine on CUDA: mixed precision trains and agrees with the CPU run."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.models import build_gpt, preset
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _losses(device: str, precision: str, steps: int = 8) -> list[float]:
    config = preset("tiny")
    engine = ReferenceEngine(
        build_gpt(config, seed=0),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
        training=TrainingConfig(device=device, precision=precision, steps=steps),
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device)
    losses = []
    for _ in range(steps):
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_training_tracks_the_cpu_fp32_run(precision: str) -> None:
    cpu = _losses("cpu", "fp32")
    cuda = _losses("cuda", precision)
    assert all(math.isfinite(x) for x in cuda)
    assert cuda[-1] < cuda[0] - 0.5
    # Same seeds and batches: the curves agree to within mixed-precision noise.
    tolerance = 0.02 if precision == "fp32" else 0.15
    for a, b in zip(cpu, cuda, strict=True):
        assert abs(a - b) < tolerance, (cpu, cuda)


def test_cuda_memory_figures_have_a_device_tier() -> None:
    engine = ReferenceEngine(
        build_gpt(preset("tiny"), seed=0),
        optimizer=OptimizerConfig(),
        training=TrainingConfig(device="cuda"),
    )
    stats = engine.stats()
    assert stats["memory_bytes"]["device"] > 0
    assert stats["peak_memory_bytes"]["device"] >= stats["memory_bytes"]["device"]
