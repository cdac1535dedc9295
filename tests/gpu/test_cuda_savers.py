"""MPress's savers on CUDA: host swap through pinned memory and a side stream, and recompute,
give the gradients of the same stage without them, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from tidal.activations import Saver
from tidal.activations.runtime import SaverHandles, apply_savers
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
