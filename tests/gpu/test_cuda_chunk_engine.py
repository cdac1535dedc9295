"""The chunk engine on CUDA: the device tier is GPU memory, the host tier pinned CPU memory."""

from __future__ import annotations

import pytest
import torch

from tidal.engine import OptimizerConfig, ReferenceEngine, TrainingConfig
from tidal.engine.chunk_engine import ChunkEngine
from tidal.engine.config import MemoryConfig
from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt, preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _losses(engine, device: str) -> list[float]:
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(10):
        tokens = torch.randint(0, 256, (4, 65), generator=g).to(device)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("budget", [None, "200KiB"])
def test_cuda_chunk_engine_tracks_the_reference(budget: str | None) -> None:
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=2, decay_steps=10)
    training = TrainingConfig(device="cuda", steps=10)
    want = _losses(
        ReferenceEngine(build_gpt(preset("tiny")), optimizer=optimizer, training=training), "cuda"
    )
    engine = ChunkEngine(
        build_gpt(preset("tiny")),
        optimizer=optimizer,
        training=training,
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=128),
    )
    got = _losses(engine, "cuda")
    # The update runs on the CPU here and on the GPU in the reference: kernels differ slightly.
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)
    stats = engine.stats()
    assert engine.host_tier.pinned
    if budget is not None:
        assert stats["peak_device_bytes"] <= 200 * 1024 and stats["evictions"] > 0
