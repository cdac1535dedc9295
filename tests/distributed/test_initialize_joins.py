"""``tidal.initialize`` in a program torchrun started joins the process group from torchrun's
variables (issue 17: it trained an unsharded copy per rank, silently) and shards over the ranks,
equal to one process on the whole batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tidal
from tidal.testing import run_on_ranks

WORLD = 2
STEPS = 3
CONFIG: dict[str, Any] = {
    "engine": "chunk",
    "training": {"device": "cpu", "steps": STEPS},
    "optimizer": {"lr": 1e-2, "warmup_steps": 0, "eps": 1e-6},
    "chunk": {"size": 256},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2)
    )


def _train(world: int) -> dict[str, Any]:
    """What a user's script does; under torchrun each rank takes its rows of the batch."""
    engine = tidal.initialize(_model(), CONFIG)
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    stats = engine.stats()
    return {
        "world_size": stats.get("world_size", 1),
        "collective_bytes": stats.get("bytes_all_gathered", 0)
        + stats.get("bytes_reduce_scattered", 0),
        "state": {k: v.clone() for k, v in engine.model.state_dict().items()},
    }  # fmt: skip


def _as_torchrun_started_it() -> dict[str, Any]:
    assert not dist.is_initialized()  # torchrun sets the variables; the program joins
    return _train(WORLD)


def test_initialize_joins_torchruns_group_and_shards() -> None:
    ranks = run_on_ranks(_as_torchrun_started_it, world_size=WORLD, backend=None, timeout_s=90)
    single = _train(1)
    for out in ranks:
        assert out["world_size"] == WORLD and out["collective_bytes"] > 0, out["world_size"]
        for name, value in single["state"].items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-5, atol=1e-6)
