"""Stage modules: composed stages compute the whole model's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.models import split_model
from tidal.models.gpt import GPTConfig, build_gpt, split_gpt
from tidal.pipeline.split import (
    PipelineStage,
    even_ranges,
    tied_parameters,
    validate_block_ranges,
)

VOCAB, SEQ, LAYERS = 48, 8, 3
RANGES = [
    [(0, 3)],
    [(0, 1), (1, 3)],
    [(0, 2), (2, 3), (3, 3)],  # a head-only last stage
    [(0, 0), (0, 1), (1, 3), (3, 3)],  # an embedding-only first stage too
]


def _gpt(tie: bool) -> nn.Module:
    config = GPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS, num_heads=2, d_model=16,
        tie_embeddings=tie,
    )  # fmt: skip
    return build_gpt(config, seed=3)


def _tokens(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _run_pipeline(
    stages: list[PipelineStage], idx_BT: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    """Forward and backward stage by stage, passing one detached tensor across each boundary
    (as a runtime does); returns the loss."""
    inputs, outputs = [], []
    x = idx_BT
    for stage in stages:
        if not stage.is_first:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x, targets_BT) if stage.is_last else stage(x)
        outputs.append(x)
    loss = outputs[-1]
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        outputs[s].backward(inputs[s + 1].grad)
    return loss.detach()


def _assert_same_grads(model: nn.Module, stages: list[PipelineStage]) -> None:
    model_params = dict(model.named_parameters())
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, f"stage {stage.stage_index} {name} got no gradient"
            source = stage.source_names[name]
            # The tied copies' gradients add up to the model's (see tied_parameters).
            grads[source] = grads[source] + p.grad if source in grads else p.grad.clone()
    assert set(grads) == set(model_params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, model_params[name].grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("ranges", RANGES, ids=lambda r: f"{len(r)}stages")
def test_gpt_stages_give_the_whole_models_loss_and_gradients(tie: bool, ranges: list) -> None:
    model = _gpt(tie)
    idx, targets = _tokens()
    expected = model(idx, targets)
    expected.backward()
    stages = split_gpt(model, ranges)
    assert [s.block_range for s in stages] == [tuple(r) for r in ranges]
    assert [s.is_first for s in stages] == [True] + [False] * (len(ranges) - 1)
    assert [s.is_last for s in stages] == [False] * (len(ranges) - 1) + [True]
    loss = _run_pipeline(stages, idx, targets)
    assert abs(loss.item() - expected.item()) <= 1e-6
    _assert_same_grads(model, stages)


def test_a_tie_is_one_parameter_in_one_stage_and_a_reported_pair_across_stages() -> None:
    model = _gpt(tie=True)
    (only,) = split_gpt(model, [(0, LAYERS)])
    assert only.embed.tok.weight is only.head.lm_head.weight
    assert tied_parameters([only]) == []
    stages = split_gpt(model, [(0, 1), (1, LAYERS)])
    pairs = tied_parameters(stages)
    assert pairs == [((0, "embed.tok.weight"), (1, "head.lm_head.weight"))]
    (s0, n0), (s1, n1) = pairs[0]
    a, b = stages[s0].get_parameter(n0), stages[s1].get_parameter(n1)
    assert a is not b and torch.equal(a, b)
    assert tied_parameters(split_gpt(_gpt(tie=False), [(0, 1), (1, LAYERS)])) == []


def test_stages_own_copies_independent_of_the_model_and_of_each_other() -> None:
    model = _gpt(tie=True)
    stages = split_gpt(model, [(0, 2), (2, LAYERS)])
    before = model.tok_embed.weight.detach().clone()
    with torch.no_grad():
        stages[0].embed.tok.weight.add_(1.0)
        stages[1].layers[0].ln_1.weight.mul_(2.0)
    assert torch.equal(model.tok_embed.weight, before)
    assert torch.equal(stages[1].head.lm_head.weight, before)
    assert torch.equal(model.blocks[2].ln_1.weight, torch.ones(16))


def test_last_stage_without_targets_is_refused() -> None:
    (stage,) = split_gpt(_gpt(tie=True), [(0, LAYERS)])
    with pytest.raises(ValueError, match="needs targets_BT"):
        stage(_tokens()[0])


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ([(0, 1), (2, 3)], "must start at block 1"),
        ([(0, 1), (1, 1), (1, 3)], "stage 1 would hold nothing"),
        ([(0, 1), (1, 2)], "must end at 3"),
        ([(0, 2), (2, 1)], "not end"),
        ([], "at least one stage"),
    ],
)
def test_invalid_block_ranges_name_the_problem(ranges: list, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate_block_ranges(ranges, LAYERS)
    with pytest.raises(ConfigError, match=match):
        split_gpt(_gpt(tie=False), ranges)


@pytest.mark.parametrize(("num_blocks", "num_stages"), [(1, 1), (5, 2), (7, 3), (12, 5), (4, 4)])
def test_even_ranges_are_contiguous_and_balanced(num_blocks: int, num_stages: int) -> None:
    ranges = even_ranges(num_blocks, num_stages)
    validate_block_ranges(ranges, num_blocks)
    sizes = [end - start for start, end in ranges]
    assert len(ranges) == num_stages and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)


def test_even_ranges_refuses_more_stages_than_blocks() -> None:
    with pytest.raises(ConfigError, match="at most 3 stages"):
        even_ranges(3, 4)


def test_an_unsupported_model_names_the_supported_kinds() -> None:
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*GPT2LMHeadModel"):
        split_model(nn.Sequential(nn.Linear(2, 2)), [(0, 1)])


# ---------------------------------------------------------------------------------------------
# Hugging Face decoders


def _hf_model(kind: str, attn: str = "sdpa") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
            bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation=attn,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=2 * SEQ,
        bos_token_id=0, eos_token_id=1, attn_implementation=attn,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("ranges", [RANGES[1], RANGES[3]], ids=lambda r: f"{len(r)}stages")
def test_hf_stages_match_the_models_logits_loss_and_gradients(kind: str, ranges: list) -> None:
    model = _hf_model(kind)
    idx, _ = _tokens()
    logits_BTV = model(idx).logits
    # The stage convention: targets already shifted, -100 (ignored) after the last token.
    targets = torch.cat([idx[:, 1:], torch.full((idx.shape[0], 1), -100)], dim=1)
    expected = nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), targets.flatten())
    hf_loss = model(idx, labels=idx).loss
    assert abs(expected.item() - hf_loss.item()) <= 1e-6  # the same convention as HF's own loss
    hf_loss.backward()
    stages = split_model(model, ranges)
    loss = _run_pipeline(stages, idx, targets)
    assert abs(loss.item() - hf_loss.item()) <= 1e-6
    _assert_same_grads(model, stages)
    assert (tied_parameters(stages) != []) == (kind == "gpt2")  # GPT-2 ties wte and lm_head


def test_hf_model_without_sdpa_is_refused() -> None:
    with pytest.raises(ConfigError, match="attn_implementation='sdpa'"):
        split_model(_hf_model("llama", attn="eager"), [(0, LAYERS)])
