"""``PipelineRuntime`` on 2 and 4 gloo ranks.

Synchronous schedules must equal one-process training of the whole model (1e-6) and
``torch.distributed.pipelining``'s schedules on the same stage modules; asynchronous ones must
equal ``run_local`` (the one-process delay simulator) bit for bit, with the simulator's tau.
One spawn per world size runs every case (start-up costs more than the cases); each rank
computes its references in its own process, so they use the same kernels and thread count.
Workers return what they measured and the tests assert on it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import even_ranges, tied_parameters
from tidal.runtime.distributed import PipelineRuntime, RuntimeConfig
from tidal.runtime.executor import UpdateRules
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode
from tidal.testing import run_on_ranks

LR = 0.5
ATOL = 1e-6
SEQ_BY_STEP = (8, 5, 7)  # variable sequence length across steps
ROWS_BY_STEP = (4, 5, 3)  # and uneven microbatches (m = 2) after step 0


def tiny_gpt(layers: int, *, tie: bool = False) -> nn.Module:
    config = GPTConfig(
        vocab_size=64, seq_len=8, num_layers=layers, num_heads=2, d_model=16, tie_embeddings=tie
    )
    return build_gpt(config, seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(
        0, 64, (ROWS_BY_STEP[step % 3], SEQ_BY_STEP[step % 3] + 1), generator=gen
    )
    return tokens[:, :-1], tokens[:, 1:]


def sgd_weights(stages, config: AsyncConfig | None = None, momentum: float = 0.0):
    config = config or AsyncConfig(weights=WeightMode.CURRENT)
    return [
        StageWeights(s, torch.optim.SGD(s.parameters(), lr=LR, momentum=momentum), config)
        for s in stages
    ]


def my_stages(stages: list[nn.Module], group: dist.ProcessGroup) -> list[nn.Module]:
    return stages[dist.get_rank(group) :: dist.get_world_size(group)]


def max_diff_to_model(model: nn.Module, stages: list[nn.Module]) -> float:
    whole = dict(model.named_parameters())
    diffs = [
        (p - whole[stage.source_names[n]]).abs().max().item()
        for stage in stages
        for n, p in stage.named_parameters()
    ]
    return max(diffs)


def max_diff(a: list[nn.Module], b: list[nn.Module]) -> float:
    pa = [p for m in a for p in m.parameters()]
    pb = [p for m in b for p in m.parameters()]
    assert len(pa) == len(pb)
    return max((x - y).abs().max().item() for x, y in zip(pa, pb, strict=True))


def all_equal(a: list[nn.Module], b: list[nn.Module]) -> bool:
    pa = [p for m in a for p in m.state_dict().values()]
    pb = [p for m in b for p in m.state_dict().values()]
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


# ---------------------------------------------------------------------------------------------
# synchronous: one step against the whole model and against torch.distributed.pipelining


class _Logits(nn.Module):
    """A stage returning logits instead of the loss, for torch's schedules (they apply loss_fn)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        h = s.embed(x) if s.embed is not None else x
        for layer in s.layers:
            h = layer(h)
        return h if s.head is None else s.head(h)


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def torch_step(
    name: str, stages: list[nn.Module], num_stages: int, m: int, group: dist.ProcessGroup
) -> None:
    """One SGD step of ``stages`` (this rank's) with torch's schedule of the same name."""
    from torch.distributed import pipelining as pp

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids = list(range(rank, num_stages, world))
    wrapped = [
        pp.PipelineStage(_Logits(st), s, num_stages, torch.device("cpu"), group=group)
        for s, st in zip(ids, stages, strict=True)
    ]
    if name == "interleaved":
        schedule = pp.ScheduleInterleaved1F1B(wrapped, m, loss_fn=_loss_fn)
    else:
        cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[name]
        schedule = cls(wrapped[0], m, loss_fn=_loss_fn)
    idx, targets = batch(0)
    args = (idx,) if 0 in ids else ()
    kwargs: dict[str, Any] = {"target": targets, "losses": []} if num_stages - 1 in ids else {}
    schedule.step(*args, **kwargs)
    with torch.no_grad():
        for st in stages:
            for p in st.parameters():
                p -= LR * p.grad


def _sync_case(name: str, m: int, virtual: int, group: dist.ProcessGroup) -> dict[str, Any]:
    world = dist.get_world_size(group)
    num_stages = world * virtual
    layers = max(4, num_stages)
    model = tiny_gpt(layers)
    ranges = even_ranges(layers, num_stages)
    ours = my_stages(split_gpt(copy.deepcopy(model), ranges), group)
    theirs = my_stages(split_gpt(copy.deepcopy(model), ranges), group)
    config = RuntimeConfig(schedule=name, microbatches=m, virtual_stages=virtual)
    runtime = PipelineRuntime(config, stages=ours, weights=sgd_weights(ours), group=group)
    (loss,) = runtime.train(1, batch, lambda _: LR)
    torch_step(name, theirs, num_stages, m, group)
    idx, targets = batch(0)
    ref_loss = model(idx, targets)
    ref_loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    # every stage but the last sends each microbatch's activation on, every stage but the first
    # its gradient back: the batch's rows x sequence x width in fp32 each way
    rows_bytes = idx.numel() * model.config.d_model * 4
    sends = sum((s < num_stages - 1) + (s > 0) for s in runtime.stage_ids)
    return {
        "bytes_sent": runtime.bytes_sent,
        "bytes_expected": sends * rows_bytes,
        "loss_diff": abs(loss - ref_loss.item()),
        "vs_model": max_diff_to_model(model, ours),
        "vs_torch": max_diff(ours, theirs),
        "torch_vs_model": max_diff_to_model(model, theirs),
    }


# ---------------------------------------------------------------------------------------------
# asynchronous: bit for bit against run_local, tau against the simulator

ASYNC_CASES = {
    "pipemare": ("pipemare", AsyncConfig(weights=WeightMode.CURRENT, lr_rescheduling=True)),
    "pipemare+correction": (
        "pipemare",
        AsyncConfig(weights=WeightMode.CURRENT, correction=True, lr_rescheduling=True),
    ),
    "pipemare+prediction": (
        "pipemare",
        AsyncConfig(prediction=True, microbatches_per_update=2, lr_rescheduling=True),
    ),
    "pipedream": ("pipedream", AsyncConfig(weights=WeightMode.STASH)),
    # [Note: tied matrices without a flush]: the head follows the embedding over the wire
    "pipemare+tied": ("pipemare", AsyncConfig(weights=WeightMode.CURRENT, lr_rescheduling=True)),
}


def _async_case(key: str, m: int, steps: int, group: dist.ProcessGroup) -> dict[str, Any]:
    name, async_config = ASYNC_CASES[key]
    world = dist.get_world_size(group)
    model = tiny_gpt(4, tie=key.endswith("+tied"))
    ranges = even_ranges(4, world)
    local = split_gpt(copy.deepcopy(model), ranges)
    tied = tuple(tied_parameters(local))
    assert bool(tied) == key.endswith("+tied")
    ours = my_stages(split_gpt(copy.deepcopy(model), ranges), group)

    def lr_fn(step: int) -> float:
        return 0.1 / (1 + step)

    max_norm = 0.05 if tied else None  # the owner's norm has the sum in it, the head's not
    config = RuntimeConfig(schedule=name, microbatches=m, max_grad_norm=max_norm)
    runtime = PipelineRuntime(config, stages=ours, group=group, tied=tied,
                              weights=sgd_weights(ours, async_config, momentum=0.9))  # fmt: skip
    losses = runtime.train(steps, batch, lr_fn)
    schedule = make_schedule(name, stages=world, microbatches=m, steps=steps)
    result = run_local(
        schedule,
        local,
        sgd_weights(local, async_config, momentum=0.9),
        batch,
        lr_fn,
        rules=UpdateRules(max_grad_norm=max_norm, tied=tied),
    )
    mine = set(range(dist.get_rank(group), world, world))
    simulated = {k: v for k, v in simulate(schedule).delays.items() if k[0] in mine}
    return {
        "params_equal": all_equal(ours, my_stages(local, group)),
        "losses_equal": losses == result.losses,
        "delays_equal_local": runtime.delays
        == {k: v for k, v in result.delays.items() if k[0] in mine},
        "delays_equal_simulated": runtime.delays == simulated,
        "max_delay": max(runtime.delays.values()),
        "lrs_equal": runtime.lrs == {k: v for k, v in result.lrs.items() if k[0] in mine},
    }


# ---------------------------------------------------------------------------------------------
# variable sequence length, tied weights, global clipping, checkpoint resume (1f1b, sync)

MAX_NORM = 0.05


def _resume_runtime(stages: list[nn.Module], group: dist.ProcessGroup) -> PipelineRuntime:
    config = RuntimeConfig(
        schedule="1f1b", microbatches=2, max_grad_norm=MAX_NORM, partition=((0, 2), (2, 4))
    )
    mine = my_stages(stages, group)
    return PipelineRuntime(
        config,
        stages=mine,
        weights=sgd_weights(mine, momentum=0.9),
        tied=tied_parameters(stages),
        group=group,
    )


def _clip_resume_case(folder: str, group: dist.ProcessGroup) -> dict[str, Any]:
    model = tiny_gpt(4, tie=True)
    ranges = even_ranges(4, 2)
    full = _resume_runtime(split_gpt(copy.deepcopy(model), ranges), group)
    losses = full.train(3, batch, lambda _: LR)

    first = _resume_runtime(split_gpt(copy.deepcopy(model), ranges), group)
    resumed_losses = first.train(1, batch, lambda _: LR)
    first.save(folder)
    second = _resume_runtime(split_gpt(copy.deepcopy(model), ranges), group)
    resumed_at = second.load(folder)
    resumed_losses += second.train(2, batch, lambda _: LR)

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_losses, clipped = [], 0
    for step in range(3):
        loss = model(*batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        clipped += int(norm > MAX_NORM)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    stages = list(full.modules.values())
    return {
        "vs_model": max_diff_to_model(model, stages),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "clipped_steps": clipped,
        "resumed_at": resumed_at,
        "resume_params_equal": all_equal(stages, list(second.modules.values())),
        "resume_losses_equal": losses == resumed_losses,
        "tied": bool(tied_parameters(split_gpt(copy.deepcopy(model), ranges))),
    }


def _lent_against_plain(group: dist.ProcessGroup, num_stages: int, config: RuntimeConfig,
                        lent: dict[int, dict[str, tuple[int, ...]]], *,
                        versions: dict[int, tuple[int, ...]] | None = None,
                        steps: int = 2) -> dict[str, Any]:  # fmt: skip
    """[Note: lending] over gloo: ``lent[s]``, per stage, each unit it lends and the ranks it
    lends to (several: a stripe, a quarter and three quarters when two); ``versions[s]``, the
    ranks a PipeDream stage's weight versions go to ([Note: stashes on a peer]). The same
    pipeline trained with and without lending, the most bytes this rank held for others and the
    most its stages kept stashed."""
    from tidal.activations import Saver, Stripe
    from tidal.activations.apply import apply_savers
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending

    versions = versions or {}
    stash = WeightMode.STASH if versions else WeightMode.CURRENT

    def stripe(ranks: tuple[int, ...]) -> Stripe:
        return Stripe(lenders=ranks, weights=(1.0, 3.0)[: len(ranks)])

    def run(lend: bool) -> tuple[list[nn.Module], list[float], int, int]:
        stages = split_gpt(tiny_gpt(4), even_ranges(4, num_stages))
        mine = my_stages(stages, group)
        weights = sgd_weights(mine, AsyncConfig(weights=stash))
        held: list[int] = []
        lending = None
        if lend:
            swaps = {}
            for s in set(lent) | set(versions):
                if s % dist.get_world_size(group) == dist.get_rank(group):
                    swaps[s] = PeerSwap()
                    units = lent.get(s, {})
                    apply_savers(stages[s], dict.fromkeys(units, Saver.PEER), peer=swaps[s],
                                 lenders={unit: stripe(r) for unit, r in units.items()})  # fmt: skip
                    if s in versions:
                        lend_version = functools.partial(swaps[s].lend, stripe=stripe(versions[s]))
                        weights[mine.index(stages[s])].lend_with(lend_version)
            lenders = {s: tuple(sorted({r for ranks in [*lent.get(s, {}).values(),
                                                        versions.get(s, ())] for r in ranks}))
                       for s in set(lent) | set(versions)}  # fmt: skip
            lending = Lending(lenders=lenders, swaps=swaps, on_hold=held.append)
        runtime = PipelineRuntime(config, stages=mine, weights=weights, group=group,
                                  lending=lending)  # fmt: skip
        stashed = [0]

        def lr(_: int) -> float:
            stashed[0] = max(stashed[0], *(w.stashed_bytes for w in weights))
            return LR

        losses = runtime.train(steps, batch, lr)
        return list(runtime.modules.values()), losses, max(held, default=0), stashed[0]

    lent_modules, lent_losses, held, stashed = run(True)
    plain, plain_losses, _, plain_stashed = run(False)
    return {"params_equal": all_equal(lent_modules, plain),
            "losses_equal": lent_losses == plain_losses, "peak_held_bytes": held,
            "stashed_bytes": stashed, "plain_stashed_bytes": plain_stashed}  # fmt: skip


def _stash_lending_case(group: dist.ProcessGroup) -> dict[str, Any]:
    """[Note: stashes on a peer] over gloo: PipeDream updating after every microbatch on 4
    ranks; stages 0-2 send their weight versions away (stage 0's striped over ranks 2 and 3, with
    its first block's attention), stages 1 and 2 to rank 3."""
    config = RuntimeConfig(schedule="pipedream", microbatches=1)
    return _lent_against_plain(group, 4, config, {0: {"layers.0.attn": (3,)}},
                               versions={0: (2, 3), 1: (3,), 2: (3,)}, steps=8)  # fmt: skip


def _stripe_case(group: dist.ProcessGroup) -> dict[str, Any]:
    """[Note: stripes] over gloo: stage 0 lends its first block's attention striped over ranks 1
    and 3 (a quarter, three quarters) and its MLP to rank 1, so rank 1's message carries shares
    of two bundles."""
    config = RuntimeConfig(schedule="1f1b", microbatches=4)
    return _lent_against_plain(group, 4, config,
                               {0: {"layers.0.attn": (1, 3), "layers.0.mlp": (1,)}})  # fmt: skip


def _virtual_lending_case(group: dist.ProcessGroup) -> dict[str, Any]:
    """With virtual stages: 2 ranks, 2 chunks; stage 0 lends its first block to rank 1, stage 1
    its attention back to rank 0 (held at stage 2), stage 2 its block to rank 1."""
    config = RuntimeConfig(schedule="interleaved", microbatches=4, virtual_stages=2)
    return _lent_against_plain(group, 4, config, {0: {"layers.0": (1,)},
                                                  1: {"layers.0.attn": (0,)},
                                                  2: {"layers.0": (1,)}})  # fmt: skip


def _earlier_lending_case(group: dist.ProcessGroup) -> dict[str, Any]:
    """An earlier lender: under 1F1B on 2 ranks the last stage lends its first block to rank 0."""
    config = RuntimeConfig(schedule="1f1b", microbatches=4)
    return _lent_against_plain(group, 2, config, {1: {"layers.0": (0,)}})


# ---------------------------------------------------------------------------------------------
# the spawn: 4 ranks run the 4-rank cases on the world and, at the same time, the 2-rank cases on
# the pairs {0, 1} and {2, 3} (so also on a pipeline group that is not the world)

SYNC_CASES = {
    2: [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)],
    4: [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)],  # gpipe with m < p
}
ASYNC_RUNS = {
    2: ["pipemare", "pipemare+correction", "pipedream", "pipemare+tied"],
    4: ["pipemare", "pipemare+prediction", "pipedream", "pipemare+tied"],  # tied: m < p
}


def _cases(world: int, group: dist.ProcessGroup, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m, v in SYNC_CASES[world]:
        out[f"sync/{name}"] = _sync_case(name, m, v, group)
    for key in ASYNC_RUNS[world]:
        out[f"async/{key}"] = _async_case(key, m=2, steps=3, group=group)
    if world == 2:
        out["clip_resume"] = _clip_resume_case(folder, group)
        out["virtual_lending"] = _virtual_lending_case(group)
        out["earlier_lending"] = _earlier_lending_case(group)
    else:
        out["stripes"] = _stripe_case(group)
        out["stash_lending"] = _stash_lending_case(group)
    return out


def _worker(folder: str) -> dict[int, dict[str, Any]]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = dist.get_rank() // 2
    return {
        4: _cases(4, dist.group.WORLD, folder),
        2: _cases(2, pairs[pair], f"{folder}/pair{pair}"),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    folder = str(tmp_path_factory.mktemp("pipeline-ckpt"))
    per_rank = run_on_ranks(_worker, world_size=4, args=(folder,), timeout_s=180)
    # results[world][rank in that world's group]: the pairs' ranks are 0, 1, 0, 1.
    return {world: [r[world] for r in per_rank] for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_sync_schedules_equal_one_process_and_torch(results, world):
    for rank_result in results[world]:
        for name, _, _ in SYNC_CASES[world]:
            r = rank_result[f"sync/{name}"]
            assert r["loss_diff"] < ATOL, (name, r)
            assert r["vs_model"] < ATOL, (name, r)
            assert r["vs_torch"] < ATOL, (name, r)
            assert r["torch_vs_model"] < ATOL, (name, r)
            assert r["bytes_sent"] == r["bytes_expected"] > 0, (name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_async_schedules_equal_run_local_bit_for_bit(results, world):
    for index, rank_result in enumerate(results[world]):
        rank = index % world
        for key in ASYNC_RUNS[world]:
            r = rank_result[f"async/{key}"]
            assert r["params_equal"] and r["losses_equal"] and r["lrs_equal"], (key, rank, r)
            assert r["delays_equal_local"] and r["delays_equal_simulated"], (key, rank, r)
            # Every stage but the last sees stale weights under 1F1B without a flush.
            assert (r["max_delay"] >= 1) == (rank < world - 1), (key, rank, r)


def test_variable_length_tied_clipping_and_resume(results):
    for r in (rank_result["clip_resume"] for rank_result in results[2]):
        assert r["tied"]
        assert r["clipped_steps"] >= 1  # the clip was active
        assert r["vs_model"] < ATOL and r["loss_diff"] < ATOL, r
        assert r["resumed_at"] == 1
        assert r["resume_params_equal"] and r["resume_losses_equal"], r


def test_stripes_lent_over_gloo_equal_the_plain_pipeline(results):
    """The runtime half of [Note: stripes] over real point-to-point messages: bit for bit, and
    both lenders of the stripe held bytes, the borrower none."""
    for rank, rank_result in enumerate(results[4]):
        r = rank_result["stripes"]
        assert r["params_equal"] and r["losses_equal"], (rank, r)
        assert (r["peak_held_bytes"] > 0) == (rank in (1, 3)), (rank, r)


def test_weight_versions_lent_over_gloo_train_as_the_plain_pipeline(results):
    """[Note: stashes on a peer] over real point-to-point messages: bit for bit; ranks 0-2 kept
    no stashed version (the plain run does on ranks 0 and 1), ranks 2 and 3 held them."""
    for rank, rank_result in enumerate(results[4]):
        r = rank_result["stash_lending"]
        assert r["params_equal"] and r["losses_equal"], (rank, r)
        if rank < 3:
            assert r["stashed_bytes"] == 0, (rank, r)
        if rank < 2:  # a stash seen at an update: there the plain run keeps two or more
            assert r["plain_stashed_bytes"] > 0, (rank, r)
        assert (r["peak_held_bytes"] > 0) == (rank in (2, 3)), (rank, r)


def test_lending_under_virtual_stages_over_gloo_equals_the_plain_pipeline(results):
    """[Note: lending] with 2 chunks on each pair of ranks: bit for bit, and each rank (a
    borrower and a lender at once) held bytes."""
    for rank, rank_result in enumerate(results[2]):
        r = rank_result["virtual_lending"]
        assert r["params_equal"] and r["losses_equal"], (rank, r)
        assert r["peak_held_bytes"] > 0, (rank, r)


def test_an_earlier_lender_over_gloo_equals_the_plain_pipeline(results):
    """[Note: lending]'s earlier lender over real point-to-point messages: bit for bit, rank 0
    (the lender) held bytes, rank 1 (the borrower) none."""
    for index, rank_result in enumerate(results[2]):
        r = rank_result["earlier_lending"]
        assert r["params_equal"] and r["losses_equal"], (index, r)
        assert (r["peak_held_bytes"] > 0) == (index % 2 == 0), (index, r)
