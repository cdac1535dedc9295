"""GPT model: presets and configs, parameter/FLOP counts, init determinism, and learning."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tidal.config.configurable import ConfigError, from_dict
from tidal.models import (
    GPT,
    PRESETS,
    GPTConfig,
    ModelConfig,
    build_gpt,
    closed_form_num_params,
    num_params,
    preset,
    training_flops_per_token,
)

TINY = preset("tiny")


def _batch(
    config: GPTConfig, batch: int = 4, seq_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens split into inputs and next-token targets."""
    generator = torch.Generator().manual_seed(0)
    length = (seq_len or config.seq_len) + 1
    tokens = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------------------------
# counting


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_closed_form_matches_built_model(name: str) -> None:
    config = PRESETS[name]
    assert num_params(build_gpt(config, device="meta")) == closed_form_num_params(config)


@pytest.mark.parametrize(
    "overrides",
    [{"tie_embeddings": False}, {"bias": False}, {"d_ff": 100}, {"bias": False, "d_ff": 36}],
)
def test_closed_form_matches_variants(overrides: dict[str, object]) -> None:
    config = dataclasses.replace(TINY, **overrides)
    assert num_params(build_gpt(config, device="meta")) == closed_form_num_params(config)


def test_gpt2_small_count_matches_hugging_face(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    hf_count = sum(p.numel() for p in {id(p): p for p in hf_model.parameters()}.values())
    config = preset("gpt2-small")
    assert closed_form_num_params(config) == 124_439_808 == hf_count

    untied = dataclasses.replace(config, tie_embeddings=False)
    assert closed_form_num_params(untied) - closed_form_num_params(config) == 50257 * 768


def test_num_params_counts_tied_matrix_once() -> None:
    tied = build_gpt(TINY, device="meta")
    untied = build_gpt(dataclasses.replace(TINY, tie_embeddings=False), device="meta")
    assert num_params(untied) - num_params(tied) == TINY.vocab_size * TINY.d_model


def test_training_flops_per_token_gpt2_small() -> None:
    d, layers, vocab, seq = 768, 12, 50257, 1024
    block = 12 * d * d + 13 * d  # 7_087_872
    n_matmul = layers * block + vocab * d  # 85_054_464 + 38_597_376
    expected = 6 * n_matmul + 12 * layers * seq * d
    assert expected == 855_157_248
    assert training_flops_per_token(preset("gpt2-small")) == expected


# ---------------------------------------------------------------------------------------------
# build and init


def test_build_is_deterministic_per_seed() -> None:
    a = build_gpt(TINY, seed=1).state_dict()
    b = build_gpt(TINY, seed=1).state_dict()
    c = build_gpt(TINY, seed=2).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_embed.weight"], c["tok_embed.weight"])
    assert not torch.equal(a["blocks.1.mlp.proj.weight"], c["blocks.1.mlp.proj.weight"])


def test_build_ties_embeddings_after_materialising() -> None:
    model = build_gpt(TINY)
    assert model.lm_head.weight is model.tok_embed.weight
    assert model.lm_head.weight.device.type == "cpu"
    untied = build_gpt(dataclasses.replace(TINY, tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.tok_embed.weight.data_ptr()


def test_init_scheme() -> None:
    model = build_gpt(dataclasses.replace(TINY, d_model=128, num_layers=8))
    block = model.blocks[3]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.all(block.mlp.fc.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)


def test_init_loss_is_near_uniform() -> None:
    model = build_gpt(TINY)
    idx_BT, targets_BT = _batch(TINY)
    with torch.no_grad():
        loss = model(idx_BT, targets_BT)
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.5


# ---------------------------------------------------------------------------------------------
# forward


def test_forward_shapes_and_length_check() -> None:
    model = build_gpt(TINY)
    idx_BT, _ = _batch(TINY, batch=2)
    assert model(idx_BT[:, :10]).shape == (2, 10, TINY.vocab_size)
    too_long = torch.zeros(1, TINY.seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len"):
        model(too_long)


def test_attention_is_causal() -> None:
    model = build_gpt(TINY).eval()
    idx_BT, _ = _batch(TINY, batch=2)
    t = 20
    changed_BT = idx_BT.clone()
    changed_BT[:, t] = (changed_BT[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(idx_BT), model(changed_BT)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t], after[:, t])


def test_adamw_fits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = build_gpt(TINY)
    idx_BT, targets_BT = _batch(TINY, batch=2, seq_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = model(idx_BT, targets_BT).item()
    for _ in range(30):
        loss = model(idx_BT, targets_BT)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < start / 2


# ---------------------------------------------------------------------------------------------
# configs


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ConfigError, match="tiny") as info:
        preset("gpt5")
    assert info.value.key == "preset"
    with pytest.raises(ConfigError, match="gpt2-small"):
        ModelConfig(preset="nope")


def test_heads_must_divide_d_model() -> None:
    with pytest.raises(ConfigError) as info:
        GPTConfig(vocab_size=10, seq_len=8, num_layers=1, num_heads=3, d_model=64)
    assert "num_heads" in info.value.key or "d_model" in info.value.key
    assert "64" in info.value.message and "3" in info.value.message
    with pytest.raises(ConfigError) as info:
        ModelConfig(preset="tiny", num_heads=5)
    assert info.value.key == "num_heads"


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", 0), ("vocab_size", -1), ("d_ff", 0), ("dropout", 1.0)]
)
def test_invalid_values_name_their_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(TINY, **{field: value})
    assert info.value.key == field


def test_model_config_resolves_overrides() -> None:
    assert ModelConfig(preset="tiny", num_layers=3).resolve().num_layers == 3
    assert ModelConfig().resolve() == TINY
    resolved = ModelConfig(preset="gpt2-small", tie_embeddings=False, dropout=0.1).resolve()
    assert resolved == dataclasses.replace(preset("gpt2-small"), tie_embeddings=False, dropout=0.1)


def test_model_config_from_dict_prefixes_key() -> None:
    config = from_dict(ModelConfig, {"preset": "demo", "d_ff": "512"}, path="model")
    assert config.resolve().ffn_dim == 512
    with pytest.raises(ConfigError) as info:
        from_dict(ModelConfig, {"d_model": "62"}, path="model")
    assert info.value.key == "model.num_heads"


def test_ffn_dim_defaults_to_four_d_model() -> None:
    assert TINY.ffn_dim == 4 * TINY.d_model
    assert isinstance(build_gpt(TINY, device="meta"), GPT)


def test_logits_match_hugging_face_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same weights in HF's GPT-2 give the same logits: pins pre-LN order, tanh GELU, tying."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=TINY.vocab_size,
        n_positions=TINY.seq_len,
        n_embd=TINY.d_model,
        n_layer=TINY.num_layers,
        n_head=TINY.num_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    model = build_gpt(TINY).eval()
    # Larger weights than the init's, so activations reach where tanh-GELU and erf-GELU differ.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    # HF's GPT-2 stores its linear layers as Conv1D, whose weight is the transpose of nn.Linear's.
    renames = {"tok_embed": "wte", "pos_embed": "wpe", "blocks": "h", "qkv": "c_attn"}
    renames |= {"attn.proj": "attn.c_proj", "fc": "c_fc", "mlp.proj": "mlp.c_proj"}
    hf_state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        hf_name = "transformer." + name
        for ours, theirs in renames.items():
            hf_name = hf_name.replace(ours, theirs)
        transpose = tensor.ndim == 2 and ".h." in hf_name
        hf_state[hf_name] = tensor.t() if transpose else tensor
    loaded = hf_model.load_state_dict(hf_state, strict=False)
    assert not loaded.unexpected_keys
    assert set(loaded.missing_keys) <= {"lm_head.weight"}  # tied to wte
    hf_model.tie_weights()
    idx_BT, _ = _batch(TINY, batch=2)
    with torch.no_grad():
        expected = hf_model(idx_BT).logits
        actual = model(idx_BT)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)
