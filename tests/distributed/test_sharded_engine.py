"""ZeRO-3 over sharded chunks on 2 gloo ranks against the one-process reference engine.

Each rank trains on its half of the same global batches; the reported loss is the mean over the
ranks, which is the global batch's loss. One spawn of 2 ranks runs every case (start-up costs
more than the cases), and each test checks its own case's results.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt, gpt_init, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.parallel.verbs import shard
from tidal.sharding.config import ShardingConfig
from tidal.testing import run_on_ranks
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

WORLD = 2
STEPS = 6  # past the 5 warm-up steps, into the decay
RTOL = 1e-5  # the bound on the losses
TINY = preset("tiny")
TINY_CHUNK = 128  # elements: dozens of chunks, so gathers, evictions and reductions interleave


def _optimizer(**kw: Any) -> OptimizerConfig:
    return OptimizerConfig(lr=3e-3, warmup_steps=5, decay_steps=STEPS, **kw)


def _batches(
    num: int = STEPS, *, batch: int = 4, seq_len: int = 64
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    for _ in range(num):
        tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _model(frozen: bool = False) -> nn.Module:
    model = build_gpt(TINY, seed=0)
    if frozen:  # a frozen embedding and first block, as in fine-tuning
        for name, param in model.named_parameters():
            if name.startswith(("tok_emb", "blocks.0.")):
                param.requires_grad_(False)
    return model


# -- what each rank runs ---------------------------------------------------------------------------


def _sharded_run(case: dict[str, Any], budget: int | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    init = None
    if case.get("deferred"):  # built on the meta device, values streamed into the shards
        model = build_gpt(TINY, device="meta")
        init = gpt_init(model, seed=0)
    else:
        model = _model(case.get("frozen", False))
    engine = shard(
        model,
        init=init,
        optimizer=_optimizer(**case.get("optimizer", {})),
        training=TrainingConfig(device="cpu", **case.get("training", {})),
        memory=MemoryConfig(device_budget=budget, **_disk(case)),
        chunk=ChunkConfig(size=case.get("size", TINY_CHUNK)),
        sharding=ShardingConfig(**case.get("sharding", {})),
    )
    losses, per_step, min_bytes = [], [], 0
    accum = engine.counter.grad_accum_steps
    batches = list(_batches(STEPS * accum, seq_len=case.get("seq_len", 64)))
    for step in range(STEPS):
        before = engine.stats()
        total = torch.zeros(())
        for inputs, targets in batches[step * accum : (step + 1) * accum]:
            rows = inputs.shape[0] // world
            mine = slice(rank * rows, (rank + 1) * rows)
            loss = engine(inputs[mine], targets[mine])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / world / accum)
        after = engine.stats()
        per_step.append({k: after[k] - before[k]
                         for k in ("bytes_all_gathered", "bytes_reduce_scattered")})  # fmt: skip
        min_bytes = max(min_bytes, after["min_device_bytes"])
    stats = engine.stats()
    stats["min_device_bytes"] = min_bytes
    capacity = [(c.spec.capacity, c.num_bytes, c.index in engine.optimizer.trainable)
                for c in engine.store.chunks]  # fmt: skip
    plan = engine.parts.swapper.plan if engine.parts.swapper is not None else None
    return {
        "plan": (sorted(plan.state), sorted(plan.params)) if plan is not None else None,
        "losses": losses,
        "per_step": per_step,
        "stats": stats,
        "state": engine.model_state_dict(),
        "chunks": capacity,
        "padding": engine.layout.waste_fraction,
    }


def _disk(case: dict[str, Any]) -> dict[str, Any]:
    """A host budget that keeps a few chunks' optimizer state in memory, the rest on disk; or
    (``"params"``) one so small that most parameter and gradient shards go to disk too."""
    if not case.get("nvme"):
        return {}
    return {
        "host_budget": _host_budget(case),
        "nvme_dir": tempfile.gettempdir() + "/tidal-test-nvme",
    }


def _all_cases(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in cases.items():
        results[name] = _sharded_run(case, None)
        if case.get("minimum"):  # again at the measured minimum budget
            minimum = results[name]["stats"]["min_device_bytes"]
            results[name + "@minimum"] = _sharded_run(case, minimum)
            results[name + "@minimum"]["budget"] = minimum
    return results


CASES: dict[str, dict[str, Any]] = {
    "fp32": {"minimum": True},
    "searched": {"size": None},
    "keep-gathered": {"sharding": {"reshard_after_forward": False}},
    "sgd-accum-clip": {
        "optimizer": {"name": "sgd", "momentum": 0.9, "nesterov": True},
        "training": {"grad_accum_steps": 2, "grad_clip_norm": 0.05},
        "minimum": True,
    },
    "frozen": {"frozen": True},
    "bf16": {"training": {"precision": "bf16"}},
    # The host holds the parameter and gradient shards (483 KB per rank), three chunks of
    # staging and a few chunks' optimizer state; the rest of the state streams through disk.
    "nvme": {"nvme": True, "minimum": True},
    "nvme-bf16": {"nvme": True, "training": {"precision": "bf16"}},
    # Host memory for little more than staging: parameter and gradient shards on disk too.
    "nvme-params": {"nvme": "params", "minimum": True},
    "nvme-params-bf16": {"nvme": "params", "training": {"precision": "bf16"}},
    "deferred-nvme-params": {"nvme": "params", "deferred": True},
    "nvme-params-sgd-accum-clip": {
        "nvme": "params",
        "host_budget": 500_000,  # SGD's state is half of AdamW's: less staging, more in memory
        "optimizer": {"name": "sgd", "momentum": 0.9, "nesterov": True},
        "training": {"grad_accum_steps": 2, "grad_clip_norm": 0.05},
    },
    # Short sequences: activations small beside the model data, so the minimum device budget
    # is below what a rank keeps of the model (offloading and sharding compose).
    "short": {"seq_len": 8, "minimum": True},
}
NVME_HOST_BUDGET = 700_000
CASES_READ_AHEAD = 2  # memory.nvme_read_ahead's default
NVME_PARAMS_HOST_BUDGET = 600_000  # staging is 544 KB per rank (the 64 KB embedding chunk's)


def _host_budget(case: dict[str, Any]) -> int:
    if case["nvme"] != "params":
        return NVME_HOST_BUDGET
    return case.get("host_budget", NVME_PARAMS_HOST_BUDGET)


@pytest.fixture(scope="module")
def sharded() -> dict[str, list[dict[str, Any]]]:
    """Per case, every rank's results."""
    by_rank = run_on_ranks(_all_cases, world_size=WORLD, args=(CASES,), timeout_s=300)
    return {name: [ranks[name] for ranks in by_rank] for name in by_rank[0]}


# -- the one-process references ------------------------------------------------------------------


def _one_process(case: dict[str, Any], engine_kind: str = "reference") -> tuple[list[float], dict]:
    training = TrainingConfig(device="cpu", **case.get("training", {}))
    model = _model(case.get("frozen", False))
    if engine_kind == "reference":
        engine: Any = ReferenceEngine(model, optimizer=_optimizer(**case.get("optimizer", {})),
                                      training=training)  # fmt: skip
    else:
        engine = ChunkEngine(model, optimizer=_optimizer(**case.get("optimizer", {})),
                             training=training, memory=MemoryConfig(),
                             chunk=ChunkConfig(size=TINY_CHUNK))  # fmt: skip
    accum = training.grad_accum_steps
    batches = list(_batches(STEPS * accum, seq_len=case.get("seq_len", 64)))
    losses = []
    for step in range(STEPS):
        total = 0.0
        for inputs, targets in batches[step * accum : (step + 1) * accum]:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / accum)
    state = engine.model_state_dict() if engine_kind == "chunk" else engine.model.state_dict()
    return losses, {k: v.detach().float() for k, v in state.items()}


def _assert_losses_close(got: list[float], want: list[float], rtol: float = RTOL) -> None:
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= rtol * abs(b), (step, a, b)


def _assert_params_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


# -- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "fp32@minimum", "searched", "keep-gathered", "frozen",
                                  "sgd-accum-clip", "sgd-accum-clip@minimum", "nvme",
                                  "nvme@minimum", "short@minimum", "nvme-params",
                                  "nvme-params@minimum", "nvme-params-sgd-accum-clip",
                                  "deferred-nvme-params"])  # fmt: skip
def test_matches_the_one_process_reference(sharded: dict[str, Any], name: str) -> None:
    want_losses, want_state = _one_process(CASES[name.split("@")[0]])
    got = sharded[name]
    for rank_result in got:
        _assert_losses_close(rank_result["losses"], want_losses)
        # Adam divides by the root of tiny second moments: summation-order differences in the
        # gradients show as ~1e-6 in a few weights after 10 steps.
        _assert_params_close(rank_result["state"], want_state, atol=2e-5)


def test_bf16_matches_the_one_process_chunk_engine(sharded: dict[str, Any]) -> None:
    want_losses, want_state = _one_process(CASES["bf16"], engine_kind="chunk")
    for rank_result in sharded["bf16"]:
        # Same bf16 parameter chunks and fp32 masters; the sum over ranks of fp32 gradients is
        # the only difference, rounded to bf16 in the weights the next forward uses.
        _assert_losses_close(rank_result["losses"], want_losses, rtol=1e-4)
        # Adam moves a weight with a near-zero gradient by about lr whatever its sign, so
        # single elements may differ by a few steps' lr. The one-process chunk engine is itself
        # 5e-3 (relative, whole model) from the bf16 reference engine after these 10 steps.
        got = rank_result["state"]
        diff = sum(float((got[k] - want_state[k]).square().sum()) for k in want_state)
        norm = sum(float(v.square().sum()) for v in want_state.values())
        assert (diff / norm) ** 0.5 < 1e-2


def test_minimum_budget_is_respected_and_evicts(sharded: dict[str, Any]) -> None:
    for name in ("fp32@minimum", "sgd-accum-clip@minimum", "nvme@minimum", "nvme-params@minimum"):
        for rank_result in sharded[name]:
            stats = rank_result["stats"]
            assert stats["device_budget"] == rank_result["budget"]
            assert stats["peak_device_bytes"] <= rank_result["budget"]
            unlimited = sharded[name.split("@")[0]][0]["stats"]
            assert unlimited["peak_device_bytes"] > rank_result["budget"]


# -- collective volume -----------------------------------------------------------------------------


def _model_bytes(
    result: dict[str, Any], *, trainable_only: bool = False, fp32: bool = False
) -> int:
    return sum(4 * capacity if fp32 else num_bytes
               for capacity, num_bytes, trainable in result["chunks"]
               if trainable or not trainable_only)  # fmt: skip


@pytest.mark.parametrize(("name", "gathers"), [("fp32", 2), ("keep-gathered", 1), ("frozen", 2)])
def test_collective_bytes_equal_zero3_theory(
    sharded: dict[str, Any], name: str, gathers: int
) -> None:
    """Per step and rank: the parameters gathered for the forward and again for the backward
    (once when kept), the trainable ones' fp32 gradients reduce-scattered, each ``(N-1)/N``."""
    for rank_result in sharded[name]:
        share = (WORLD - 1) / WORLD
        params = _model_bytes(rank_result)
        grads = _model_bytes(rank_result, trainable_only=True, fp32=True)
        for step in rank_result["per_step"]:
            assert step["bytes_all_gathered"] == gathers * params * share
            assert step["bytes_reduce_scattered"] == grads * share
    fp32 = sharded["fp32"][0]
    # "about 3 x model-parameter bytes x (N-1)/N": the chunks hold the parameters plus padding
    param_bytes = 4 * sum(p.numel() for p in _model().parameters())  # tied ones once
    total = sum(fp32["per_step"][0].values())
    assert 3 * param_bytes * share <= total <= 3 * param_bytes * share / (1 - fp32["padding"])


def test_bf16_gathers_half_the_bytes(sharded: dict[str, Any]) -> None:
    bf16, fp32 = sharded["bf16"][0]["per_step"][0], sharded["fp32"][0]["per_step"][0]
    assert bf16["bytes_all_gathered"] * 2 == fp32["bytes_all_gathered"]
    assert bf16["bytes_reduce_scattered"] == fp32["bytes_reduce_scattered"]  # fp32 reductions


def test_each_rank_holds_half_the_model_data(sharded: dict[str, Any]) -> None:
    one = sharded["fp32"][0]["stats"]["model_data_bytes"]
    assert one["params"] * WORLD == _model_bytes(sharded["fp32"][0])
    num_tensors = len(list(_model().parameters()))  # one step counter each, as torch keeps
    assert one["optimizer_state"] == 2 * one["params"] + 4 * num_tensors


# -- the NVMe tier ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nvme", "nvme@minimum", "nvme-bf16"])
def test_optimizer_state_streams_through_disk(sharded: dict[str, Any], name: str) -> None:
    for rank_result in sharded[name]:
        stats = rank_result["stats"]
        assert 0 < stats["chunks_on_nvme"] < stats["num_chunks"]
        on_disk = stats["peak_nvme_bytes"]
        assert on_disk > 0
        # Written once at the start and after every step, read once per step.
        assert stats["bytes_from_nvme"] == STEPS * on_disk
        assert stats["bytes_to_nvme"] == (STEPS + 1) * on_disk
        assert stats["peak_host_bytes"] <= NVME_HOST_BUDGET


def test_disk_changes_nothing_but_where_state_lives(sharded: dict[str, Any]) -> None:
    for with_disk, without in (("nvme", "fp32"), ("nvme-bf16", "bf16"), ("nvme-params", "fp32"),
                               ("nvme-params@minimum", "fp32"), ("nvme-params-bf16", "bf16"),
                               ("nvme-params-sgd-accum-clip", "sgd-accum-clip"),
                               ("deferred-nvme-params", "fp32")):  # fmt: skip
        for a, b in zip(sharded[with_disk], sharded[without], strict=True):
            assert a["losses"] == b["losses"], with_disk
            for key, value in b["state"].items():
                assert torch.equal(a["state"][key], value), (with_disk, key)


@pytest.mark.parametrize("name", ["nvme-params", "nvme-params-bf16", "nvme-params-sgd-accum-clip"])
def test_parameter_and_gradient_shards_stream_through_disk(
    sharded: dict[str, Any], name: str
) -> None:
    """Per step, a parameter shard on disk is read for the forward's gather, again for the
    backward's, and (fp32, where it is the weights) by the update, then written; a gradient
    shard is written once per micro-batch (read back to add to when accumulating) and read by
    the update; optimizer state is read and written once."""
    accum = CASES[name].get("training", {}).get("grad_accum_steps", 1)
    for rank_result in sharded[name]:
        stats, (state_on_disk, params_on_disk) = rank_result["stats"], rank_result["plan"]
        assert state_on_disk == list(range(stats["num_chunks"]))  # every chunk's state
        assert 0 < len(params_on_disk) < stats["num_chunks"]
        assert stats["param_shards_on_nvme"] == len(params_on_disk)
        shard_numel = {
            i: capacity // WORLD for i, (capacity, _, _) in enumerate(rank_result["chunks"])
        }
        param_itemsize = 2 if "bf16" in name else 4
        params = sum(shard_numel[i] * param_itemsize for i in params_on_disk)
        grads = sum(shard_numel[i] * 4 for i in params_on_disk)
        kinds = {"sgd": 1}.get(CASES[name].get("optimizer", {}).get("name"), 2)
        kinds += "bf16" in name  # the masters
        state = sum(shard_numel[i] * 4 * kinds for i in state_on_disk)
        weights_read = params if param_itemsize == 4 else 0
        gathers = accum + 1
        per_step_reads = gathers * params + weights_read + (accum - 1) * grads + grads + state
        per_step_writes = params + accum * grads + state
        # The last step started reading what the next forward would gather first.
        pending = stats["param_bytes_read_ahead"]
        assert 0 < pending <= CASES_READ_AHEAD * max(shard_numel.values()) * param_itemsize
        assert stats["bytes_from_nvme"] == STEPS * per_step_reads + pending
        assert stats["bytes_to_nvme"] == params + state + STEPS * per_step_writes  # + the start
        reads = stats["param_reads_ahead"] + stats["param_reads_on_demand"]
        taken = STEPS * gathers * len(params_on_disk)
        assert taken < reads <= taken + CASES_READ_AHEAD
        assert stats["param_reads_ahead"] > stats["param_reads_on_demand"]
        assert stats["peak_host_bytes"] <= _host_budget(CASES[name])


def test_device_budget_below_the_ranks_share_of_the_model(sharded: dict[str, Any]) -> None:
    for rank_result in sharded["short@minimum"]:
        stats = rank_result["stats"]
        share_bytes = sum(stats["model_data_bytes"].values())  # params, grads, optimizer state
        assert stats["peak_device_bytes"] <= rank_result["budget"] < share_bytes
