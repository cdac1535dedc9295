"""The NVMe tier (files, budget, counters, cleanup) and the plan of what goes to disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tidal.config import ConfigError
from tidal.memory.nvme import NvmeTier
from tidal.memory.tiers import Tier, TierKind
from tidal.sharding.swap import STAGING_GROUPS, StateSwapper, plan_nvme


def test_round_trip_counts_bytes_and_rewrites_in_place(tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    data = torch.randn(10_000)
    nvme.write("a", data).result()
    out = torch.empty_like(data)
    nvme.read("a", out).result()
    assert torch.equal(out, data)
    nvme.write("a", data * 2).result()  # the same file, rewritten
    nvme.read("a", out).result()
    assert torch.equal(out, data * 2)
    assert nvme.stats() == {"held_bytes": data.nbytes, "peak_bytes": data.nbytes,
                            "in_bytes": 2 * data.nbytes, "out_bytes": 2 * data.nbytes,
                            "budget_bytes": None}  # fmt: skip
    files = list(nvme.directory.iterdir())
    assert [f.stat().st_size for f in files] == [data.nbytes]
    nvme.close()
    assert not nvme.directory.exists()


def test_budget_refuses_a_file_that_does_not_fit(tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path, budget_bytes=1000)
    nvme.write("a", torch.zeros(200)).result()  # 800 bytes
    with pytest.raises(ConfigError, match="memory.nvme_budget"):
        nvme.write("b", torch.zeros(100))
    nvme.close()


def test_folders_of_dead_runs_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "tidal-999999999"  # no such process
    dead.mkdir()
    (dead / "exp_avg-000001").write_bytes(b"x" * 10)
    alive = tmp_path / f"tidal-{os.getppid()}"
    alive.mkdir()
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    assert not dead.exists() and alive.exists()
    nvme.close()


def test_plan_keeps_what_fits_and_refuses_an_impossible_budget() -> None:
    groups = [100, 0, 100, 100, 100]
    staging = STAGING_GROUPS * 100
    assert plan_nvme(group_bytes=groups, fixed_host_bytes=50, host_budget_bytes=None,
                     has_nvme=True) == frozenset()  # fmt: skip
    assert plan_nvme(group_bytes=groups, fixed_host_bytes=50, host_budget_bytes=50 + staging + 250,
                     has_nvme=True) == {3, 4}  # fmt: skip
    assert plan_nvme(group_bytes=groups, fixed_host_bytes=50, host_budget_bytes=50 + staging,
                     has_nvme=True) == {0, 2, 3, 4}  # fmt: skip
    with pytest.raises(ConfigError, match="memory.host_budget"):
        plan_nvme(group_bytes=groups, fixed_host_bytes=50, host_budget_bytes=staging,
                  has_nvme=True)  # fmt: skip


def test_stream_hands_each_index_in_memory_and_writes_changes_back(tmp_path: Path) -> None:
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    shards: list[torch.Tensor | None] = []
    for i in range(4):
        shards.append(host.allocate(8, torch.float32).fill_(i))
    swapper = StateSwapper(nvme, host, frozenset({1, 2, 3}))
    lists = [("exp_avg", shards)]
    for i in (1, 2, 3):
        swapper.offload(lists, i)
    assert shards[1] is None and host.held_bytes == 32
    seen = []
    for index in swapper.stream(lists, {i: 8 for i in (1, 2, 3)}):
        shard = shards[index]
        assert shard is not None and torch.equal(shard, torch.full((8,), float(index)))
        assert host.held_bytes <= 32 + STAGING_GROUPS * 32
        shard.add_(10)
        seen.append(index)
    assert seen == [1, 2, 3] and all(shards[i] is None for i in seen)
    assert host.held_bytes == 32
    with swapper.one(lists, 2, 8):
        assert torch.equal(shards[2], torch.full((8,), 12.0))
    nvme.close()


def test_one_process_with_a_disk_tier_matches_the_reference(tmp_path: Path) -> None:
    """``memory.nvme_dir`` on one process runs the sharded engine with one shard per chunk."""
    import tidal
    from tidal.engine.sharded_engine import ShardedEngine
    from tidal.models import build_gpt, preset

    def job(**memory: object) -> dict:
        return {"engine": "chunk", "chunk": {"size": 128}, "memory": memory,
                "training": {"device": "cpu"}, "optimizer": {"lr": 3e-3, "warmup_steps": 2}}  # fmt: skip

    reference = tidal.initialize(build_gpt(preset("tiny"), seed=0), {"training": {"device": "cpu"},
                                 "optimizer": {"lr": 3e-3, "warmup_steps": 2}})  # fmt: skip
    disk = tidal.initialize(build_gpt(preset("tiny"), seed=0),
                            job(host_budget=1_500_000, nvme_dir=str(tmp_path)))  # fmt: skip
    assert isinstance(disk, ShardedEngine)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        losses = []
        for engine in (reference, disk):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0]
    stats = disk.stats()
    assert stats["chunks_on_nvme"] > 0 and stats["bytes_from_nvme"] == 4 * stats["peak_nvme_bytes"]
    assert stats["bytes_all_gathered"] == 0  # one rank: nothing crosses a network
