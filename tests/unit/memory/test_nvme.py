"""The NVMe tier (files, budget, counters, cleanup) and the plan of what goes to disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tidal.config import ConfigError
from tidal.memory.nvme import NvmeTier
from tidal.memory.tiers import Tier, TierKind
from tidal.parallel.config import MemoryConfig
from tidal.sharding.swap import (
    GRAD_WRITES,
    STAGING_GROUPS,
    NvmePlan,
    ShardList,
    ShardReader,
    StateSwapper,
    nvme_staging_bytes,
    plan_nvme,
)


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
    dead = tmp_path / "tidal-999999999-abc"  # no such process
    dead.mkdir()
    (dead / "exp_avg-000001").write_bytes(b"x" * 10)
    alive = tmp_path / f"tidal-{os.getppid()}-xyz"
    alive.mkdir()
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    assert not dead.exists() and alive.exists()
    other = NvmeTier(tmp_path, budget_bytes=None)  # a second tier of this process
    assert other.directory != nvme.directory and nvme.directory.exists()
    other.close()
    assert nvme.directory.exists()
    nvme.close()


def _plan(budget: int | None, *, state: list[int], params: int = 10, read_ahead: int = 1):
    return plan_nvme(state_bytes=state, param_bytes=[params] * len(state),
                     grad_bytes=[params if b else 0 for b in state], host_budget_bytes=budget,
                     read_ahead=read_ahead)  # fmt: skip


def test_plan_puts_state_on_disk_first_keeping_what_fits() -> None:
    state = [100, 0, 100, 100, 100]  # index 1: a frozen chunk (no state, no gradient)
    shards = 5 * 10 + 4 * 10  # parameter and gradient shards, all in memory
    staging = STAGING_GROUPS * 100
    assert _plan(None, state=state) == NvmePlan()
    assert _plan(shards + staging + 250, state=state) == NvmePlan(state=frozenset({3, 4}))
    assert _plan(shards + staging, state=state) == NvmePlan(state=frozenset({0, 2, 3, 4}))


def test_a_share_of_the_state_goes_to_disk_to_the_nearest_index_whatever_the_budget() -> None:
    """``memory.nvme_state_fraction`` (a plan's ``h``): the last indices first, an index going
    when at least half of it is within the share; the host budget does not enter."""
    state = [100, 0, 100, 100, 100]
    for budget in (None, 10**9, 1):

        def plan(f: float, budget: int | None = budget) -> NvmePlan:
            return plan_nvme(state_bytes=state, param_bytes=[10] * 5, grad_bytes=[10] * 5,
                             host_budget_bytes=budget, read_ahead=1, state_fraction=f)  # fmt: skip

        assert plan(0.5) == NvmePlan(state=frozenset({3, 4}))
        assert plan(0.0) == NvmePlan() and plan(1.0) == NvmePlan(state=frozenset({0, 2, 3, 4}))
        assert plan(0.3).state == {4} and plan(0.4).state == {3, 4}  # 120 of 400: 100 nearest
    shards = {
        "state_bytes": state,
        "param_bytes": [10] * 5,
        "grad_bytes": [10] * 5,
        "read_ahead": 1,
    }
    assert nvme_staging_bytes(NvmePlan(state=frozenset({3, 4})), **shards) == STAGING_GROUPS * 100
    assert nvme_staging_bytes(NvmePlan(), **shards) == 0
    everything = NvmePlan(state=frozenset({0, 2, 3, 4}), params=frozenset({4}))
    assert (
        nvme_staging_bytes(everything, **shards) == STAGING_GROUPS * 120 + 2 * 10 + GRAD_WRITES * 10
    )
    with pytest.raises(ConfigError, match="nvme_state_fraction.*nvme_dir"):
        MemoryConfig(nvme_state_fraction=0.5)
    with pytest.raises(ConfigError, match=r"nvme_state_fraction.*\[0, 1\]"):
        MemoryConfig(nvme_state_fraction=1.5, nvme_dir="/tmp")


def test_plan_moves_parameter_and_gradient_shards_when_state_is_not_enough() -> None:
    # 20 chunks, AdamW-like: state twice the parameter shard; index 1 frozen (no state, no grad).
    state = [200] * 20
    state[1] = 0
    shards = 20 * 100 + 19 * 100  # parameter and gradient shards, all in memory
    staging = STAGING_GROUPS * 400 + (1 + 1) * 100 + GRAD_WRITES * 100
    assert _plan(shards + STAGING_GROUPS * 200, state=state, params=100).params == frozenset()
    # Just short of that: every state on disk is not enough, so the largest (parameter +
    # gradient) indices move too, lowest index first among equals, until the rest fits.
    plan = _plan(shards + STAGING_GROUPS * 200 - 1, state=state, params=100)
    assert plan.state == set(range(20)) - {1}
    assert plan.params == {0, 2, 3, 4, 5, 6}  # 1,200 bytes: shards + staging - 1,200 fits
    assert _plan(staging + 100, state=state, params=100).params == set(range(20)) - {1}
    assert _plan(staging, state=state, params=100).params == set(range(20))
    with pytest.raises(ConfigError, match="memory.host_budget.*at least"):
        _plan(staging - 1, state=state, params=100)
    # Reading further ahead costs a parameter shard of staging each.
    with pytest.raises(ConfigError, match="nvme_read_ahead"):
        _plan(staging, state=state, params=100, read_ahead=2)


def test_stream_hands_each_index_in_memory_and_writes_changes_back(tmp_path: Path) -> None:
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    shards: list[torch.Tensor | None] = []
    for i in range(4):
        shards.append(host.allocate(8, torch.float32).fill_(i))
    swapper = StateSwapper(nvme, host, NvmePlan(state=frozenset({1, 2, 3})))
    lists = [ShardList("exp_avg", shards, torch.float32, frozenset({1, 2, 3}))]
    for i in (1, 2, 3):
        swapper.offload(lists[0], i)
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


def test_stream_reads_and_writes_only_what_each_list_asks(tmp_path: Path) -> None:
    """Gradients are read and not written back; bf16 weights are written and not read."""
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    grads: list[torch.Tensor | None] = [host.allocate(4, torch.float32).fill_(3.0)]
    weights: list[torch.Tensor | None] = [host.allocate(4, torch.bfloat16).fill_(1.0)]
    swapper = StateSwapper(nvme, host, NvmePlan(params=frozenset({0})))
    lists = [ShardList("grad", grads, torch.float32, frozenset({0}), write=False),
             ShardList("param", weights, torch.bfloat16, frozenset({0}), read=False)]  # fmt: skip
    for shards in lists:
        swapper.offload(shards, 0)
    before = nvme.stats()
    for _ in swapper.stream(lists, {0: 4}):
        assert torch.equal(grads[0], torch.full((4,), 3.0))
        weights[0].copy_(grads[0] * 2)  # type: ignore[union-attr]
        grads[0].zero_()  # type: ignore[union-attr]
    after = nvme.stats()
    assert after["out_bytes"] - before["out_bytes"] == 16  # the gradient only
    assert after["in_bytes"] - before["in_bytes"] == 8  # the bf16 weights only
    with swapper.one(lists, 0, 4):
        assert torch.equal(grads[0], torch.full((4,), 3.0))  # what the step did to it is gone
        assert torch.equal(weights[0], torch.full((4,), 6.0, dtype=torch.bfloat16))
    nvme.close()


def test_ranges_of_a_file_read_and_write_in_place(tmp_path: Path) -> None:
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    nvme.write("a", torch.arange(10, dtype=torch.float32)).result()
    piece = torch.empty(3)
    nvme.read("a", piece, offset_bytes=4 * 5).result()
    assert piece.tolist() == [5.0, 6.0, 7.0]
    nvme.write("a", torch.full((2,), -1.0), offset_bytes=4 * 8).result()
    whole = torch.empty(10)
    nvme.read("a", whole).result()
    assert whole.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1]
    assert nvme.stats()["held_bytes"] == 40  # a range changes no file size
    with pytest.raises(AssertionError):
        nvme.read("a", torch.empty(3), offset_bytes=4 * 8)  # past the end
    nvme.close()


def test_reader_reads_ahead_within_its_depth_and_on_demand_beyond(tmp_path: Path) -> None:
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    nvme = NvmeTier(tmp_path, budget_bytes=None)
    shards: list[torch.Tensor | None] = [host.allocate(4, torch.float32).fill_(i) for i in range(4)]
    swapper = StateSwapper(nvme, host, NvmePlan(params=frozenset(range(4))))
    for i in range(4):
        swapper.offload(ShardList("param", shards, torch.float32, frozenset(range(4))), i)
    reader = ShardReader(swapper, numels=[4] * 4, dtype=torch.float32, depth=2)
    for i in range(4):
        reader.request(i)  # the third and fourth find the reader full
    assert reader.full and reader.has_ahead(1) and not reader.has_ahead(2)
    assert host.held_bytes == 2 * 16
    for i in (1, 3, 0):
        staging = reader.take(i)
        assert torch.equal(staging, torch.full((4,), float(i)))
        reader.release(staging)
    assert (reader.num_read_ahead, reader.num_read_on_demand) == (2, 1)
    reader.request(2)
    reader.drop()
    assert host.held_bytes == 0 and not reader.has_ahead(2)
    nvme.close()


def test_one_process_with_a_disk_tier_matches_the_reference(tmp_path: Path) -> None:
    """``memory.nvme_dir`` on one process runs the sharded chunk engine on a mesh of one (one
    shard per chunk)."""
    import tidal
    from tidal.models import build_gpt, preset
    from tidal.parallel.sharded_parts import ShardedParts

    def job(**memory: object) -> dict:
        return {"engine": "chunk", "chunk": {"size": 128}, "memory": memory,
                "training": {"device": "cpu"}, "optimizer": {"lr": 3e-3, "warmup_steps": 2}}  # fmt: skip

    reference = tidal.initialize(build_gpt(preset("tiny"), seed=0), {"training": {"device": "cpu"},
                                 "optimizer": {"lr": 3e-3, "warmup_steps": 2}})  # fmt: skip
    disk = tidal.initialize(build_gpt(preset("tiny"), seed=0),
                            job(host_budget=1_500_000, nvme_dir=str(tmp_path)))  # fmt: skip
    assert isinstance(disk.chunks.parts, ShardedParts) and disk.chunks.world_size == 1
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
