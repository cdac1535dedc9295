"""MPress's savers on CUDA: host swap through pinned memory and a side stream, and recompute,
give the gradients of the same stage without them, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tidal.activations import Saver
from tidal.activations.apply import SaverHandles, apply_savers
from tidal.memory.tiers import Tier, make_tiers
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stage_and_saved(saver: Saver) -> tuple[torch.nn.Module, torch.nn.Module, Tier,
                                             SaverHandles, torch.Tensor]:  # fmt: skip
    """A 4-block GPT stage, a copy of it with ``saver`` on every block, its host tier, the
    savers' handles and a batch of tokens."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, num_heads=4, d_model=128,
                       dropout=0.0)  # fmt: skip
    (stage,) = split_gpt(build_gpt(config, device="cuda"), [(0, 4)])
    saved = copy.deepcopy(stage)
    _, host = make_tiers(device=torch.device("cuda"), device_budget=None, host_budget="64MiB")
    handles = apply_savers(saved, {f"layers.{k}": saver for k in range(4)}, host=host)
    return stage, saved, host, handles, torch.randint(0, 256, (4, 64), device="cuda")


@pytest.mark.parametrize("saver", [Saver.HOST, Saver.RECOMPUTE])
def test_a_saver_on_cuda_gives_the_same_gradients_bit_for_bit(saver: Saver) -> None:
    """Host swap fetches ahead ([Note: host swap prefetch]): each block's backward starts the
    copy back of the block its backward reads next, and every copy fetched ahead is read."""
    stage, saved, host, handles, tokens = _stage_and_saved(saver)
    for model in (stage, saved):
        for _ in range(3):  # microbatches in flight at once, as 1F1B's first stage holds them
            losses = [model(tokens, tokens) for _ in range(3)]
            for loss in losses:
                loss.backward()
    torch.cuda.synchronize()
    for (name, a), b in zip(stage.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    if saver is Saver.HOST:
        swap = handles.host
        assert swap is not None and swap.tensors_out > 0
        assert swap.tensors_back == swap.tensors_out
        assert host.pinned and host.held_bytes == 0  # every buffer given back
        # per round: blocks 2, 1, 0 of each microbatch and block 3 of the second and the third
        assert swap.groups_fetched == 3 * (3 * 3 + 2)
        assert swap.storages_fetched > 0 and swap.storages_unread == 0


def test_stripes_lent_between_stages_on_one_gpu_train_bit_for_bit() -> None:
    """[Note: stripes] on CUDA: four 1F1B stages in one process (run_local's in-process messages:
    the machine has one GPU, so no NCCL); stage 0 lends its first block's attention striped
    over ranks 1 and 3 (a quarter and three quarters) and its MLP to rank 1, so rank 1's
    message carries shares of two bundles. The losses and parameters equal the same pipeline
    without lending, bit for bit, and both lenders held bytes."""
    from tidal.activations import Stripe
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending
    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.split import even_ranges
    from tidal.runtime.local import run_local
    from tidal.runtime.pipemare import AsyncConfig, StageWeights

    config = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, num_heads=4, d_model=128,
                       dropout=0.0)  # fmt: skip

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 256, (4, 65), generator=generator).cuda()
        return tokens[:, :-1], tokens[:, 1:]

    def run(lend: bool) -> tuple[list[torch.Tensor], list[float], Any]:
        stages = split_gpt(build_gpt(config, seed=0, device="cuda"), even_ranges(4, 4))
        lending, swap = None, PeerSwap()
        if lend:
            apply_savers(stages[0], {"layers.0.attn": Saver.PEER, "layers.0.mlp": Saver.PEER},
                         peer=swap, lenders={"layers.0.attn": Stripe(lenders=(1, 3),
                                                                     weights=(1.0, 3.0)),
                                             "layers.0.mlp": Stripe(lenders=(1,), weights=(1.0,))})  # fmt: skip
            lending = Lending(lenders={0: (1, 3)}, swaps={0: swap})
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5), AsyncConfig())
                   for s in stages]  # fmt: skip
        schedule = make_schedule("1f1b", stages=4, microbatches=4, steps=2)
        result = run_local(schedule, stages, weights, batch, lambda _: 0.5, lending=lending)
        torch.cuda.synchronize()
        return (
            [p.detach().clone() for s in stages for p in s.parameters()],
            list(result.losses),
            (result, swap),
        )

    params, losses, (result, swap) = run(True)
    plain_params, plain_losses, _ = run(False)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    assert swap.storages_lent > 0 and swap.bytes_lent > 0
    assert result.peak_held_bytes[1] > 0 and result.peak_held_bytes[3] > 0
    assert result.peak_held_bytes[0] == 0


def test_weight_versions_lent_between_stages_on_one_gpu_train_bit_for_bit() -> None:
    """[Note: stashes on a peer] on CUDA: PipeDream updating after every microbatch, four stages
    in one process; stages 0-2 send their weight versions away (stage 0's striped over ranks 2
    and 3). The losses and parameters equal the pipeline that stashes them, bit for bit, and no
    borrowing stage kept a stash."""
    import functools

    from tidal.activations import Stripe
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending
    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.split import even_ranges
    from tidal.runtime.local import run_local
    from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

    config = GPTConfig(vocab_size=256, seq_len=64, num_layers=4, num_heads=4, d_model=128,
                       dropout=0.0)  # fmt: skip
    lenders = {0: (2, 3), 1: (3,), 2: (3,)}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 256, (4, 65), generator=generator).cuda()
        return tokens[:, :-1], tokens[:, 1:]

    def run(lend: bool) -> tuple[list[torch.Tensor], list[float], int]:
        stages = split_gpt(build_gpt(config, seed=0, device="cuda"), even_ranges(4, 4))
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.STASH)) for s in stages]  # fmt: skip
        lending = None
        if lend:
            swaps = {s: PeerSwap() for s in lenders}
            for s, ranks in lenders.items():
                stripe = Stripe(lenders=ranks, weights=(1.0, 3.0)[: len(ranks)])
                weights[s].lend_with(functools.partial(swaps[s].lend, stripe=stripe))
            lending = Lending(lenders=lenders, swaps=swaps)
        stashed = [0]

        def lr(_: int) -> float:
            stashed[0] = max(stashed[0], *(w.stashed_bytes for w in weights[:3]))
            return 0.5

        schedule = make_schedule("pipedream", stages=4, microbatches=1, steps=8)
        result = run_local(schedule, stages, weights, batch, lr, lending=lending)
        torch.cuda.synchronize()
        params = [p.detach().clone() for s in stages for p in s.parameters()]
        return params, list(result.losses), stashed[0]

    params, losses, stashed = run(True)
    plain_params, plain_losses, plain_stashed = run(False)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    assert stashed == 0 < plain_stashed
