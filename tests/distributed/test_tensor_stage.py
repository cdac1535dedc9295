"""[Note: tensor-parallel stages] on 2 gloo ranks: a stage split over ``tp = 2`` computes what
the unsplit stage computes (loss, every gradient gathered in the model's order), its squared
gradient norm is the one-process norm (a sum that counts replicated parameters on each rank
would not be), and a checkpoint's whole values go back into the shares.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tidal.models import build_gpt, preset
from tidal.models.spec import split_model
from tidal.parallel.stage_params import plain_grad_squares
from tidal.testing import run_on_ranks

TP = 2
TOL = 1e-5


def _gpt_stage() -> nn.Module:
    (stage,) = split_model(build_gpt(preset("tiny"), seed=3), [(0, 2)])
    return stage


def _llama_stage() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(3)
    (stage,) = split_model(transformers.LlamaForCausalLM(config), [(0, 2)])
    return stage


def _whole_grads(stage: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from tidal.parallel.tensor_stage import model_order

    out = {}
    for name, p in stage.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = model_order(stage, name, grad)
    return out


def _worker(kind: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tidal.parallel.tensor_stage import (
        model_order,
        rank_order,
        tensor_grad_squares,
        tensor_parallel_stage,
    )

    stage = _gpt_stage() if kind == "gpt" else _llama_stage()
    reference = copy.deepcopy(stage)
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    tensor_parallel_stage(stage, mesh)
    split = [n for n, p in stage.named_parameters() if isinstance(p, DTensor)
             and p.placements[0].is_shard()]  # fmt: skip
    assert split and len(split) < len(list(stage.parameters())), split
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (2, 16), generator=generator)
    targets = torch.randint(0, 256, (2, 16), generator=generator)
    loss, ref_loss = stage(idx, targets), reference(idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=TOL)
    loss.backward()
    ref_loss.backward()
    grads = _whole_grads(stage)
    for name, ref in reference.named_parameters():
        torch.testing.assert_close(grads[name], ref.grad, rtol=0, atol=TOL, msg=name)
    # the norm: split shares summed over tp, replicated parameters once
    squares = tensor_grad_squares(stage.named_parameters())
    ref_squares = plain_grad_squares(reference.named_parameters())
    torch.testing.assert_close(squares, ref_squares, rtol=1e-5, atol=0)
    everything = sum(
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).double().square().sum()
        for p in stage.parameters()
        if p.grad is not None
    )
    assert isinstance(everything, torch.Tensor)
    dist.all_reduce(everything)  # every rank's whole: replicated parameters counted t times
    assert float(everything) > 1.01 * float(ref_squares), (everything, ref_squares)
    # a checkpoint's whole values, in the model's order, and back into the shares
    for name, p in stage.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        whole = model_order(stage, name, value)
        torch.testing.assert_close(whole, reference.get_parameter(name).detach(), rtol=0, atol=0)
        torch.testing.assert_close(rank_order(stage, name, whole), value, rtol=0, atol=0)
    return {"split": len(split)}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_tp2_stage_equals_the_unsplit_stage(kind: str) -> None:
    if kind == "llama":
        pytest.importorskip("transformers")
    out = run_on_ranks(_worker, world_size=TP, args=(kind,), timeout_s=120)
    # qkv (or q, k, v), proj, fc (gate, up), proj (down): weights and the column biases
    assert out[0]["split"] == {"gpt": 2 * 6, "llama": 2 * 7}[kind], out


def _refused(block: nn.Module) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from tidal.config import ConfigError
    from tidal.parallel.tensor_stage import tensor_parallel_stage

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    stage = nn.Module()
    stage.layers = nn.ModuleList([block])
    with pytest.raises(ConfigError) as err:
        tensor_parallel_stage(stage, mesh)
    return str(err.value)


def _refusals() -> list[str]:
    from tidal.models.gpt import Block as GPTBlock
    from tidal.models.gpt import GPTConfig

    odd = GPTConfig(vocab_size=16, seq_len=8, num_layers=1, num_heads=3, d_model=48)
    return [_refused(nn.Sequential(nn.Linear(4, 4))), _refused(GPTBlock(odd))]


def test_what_the_transform_cannot_split_is_refused_in_one_line() -> None:
    unknown, odd_heads = run_on_ranks(_refusals, world_size=TP, timeout_s=120)[0]
    assert "not Sequential; set parallel.tp = 1" in unknown and "\n" not in unknown
    assert "attn.qkv has 3 heads, which 2 tensor-parallel ranks do not divide" in odd_heads
