"""Hugging Face decoders named by a recipe: ``[model] hf_config``, built offline and seeded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.config import ConfigError
from tidal.memory.materialize import materialize
from tidal.models import ModelConfig, spec_for
from tidal.models.hf import HFModelConfig
from tidal.train.job import load_job

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(folder)  # fmt: skip
    return folder / "config.json"


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_seed_gives_one_model_built_whole_or_streamed(llama: Path) -> None:
    config = ModelConfig(hf_config=str(llama), seq_len=32).resolve()
    assert isinstance(config, HFModelConfig) and (config.num_heads, config.num_kv_heads) == (4, 2)
    spec = spec_for(config)
    whole = _state(spec.build(device="cpu", seed=3))
    again = _state(spec.build(device="cpu", seed=3))
    other = _state(spec.build(device="cpu", seed=4))
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    assert not torch.equal(whole["lm_head.weight"], other["lm_head.weight"])
    meta = spec.build()  # parameters on the meta device, rotary tables computed
    assert all(p.is_meta for p in meta.parameters())
    assert not any(b.is_meta for b in meta.buffers())
    materialize(meta, spec.init(meta, 3), torch.device("cpu"))
    streamed = _state(meta)
    assert all(torch.equal(whole[k], streamed[k]) for k in whole)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    built = spec.build(device="cpu", seed=3)
    torch.testing.assert_close(meta(ids).logits, built(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.num_layers=3"], "model.num_layers: shapes tidal's GPT presets"),
        (["model.seq_len=none"], "model.seq_len: a Hugging Face model (hf_config) needs"),
        (["model.seq_len=65"], "model.seq_len: 65 is longer than the 64 positions"),
        (["model.hf_config=/nowhere/config.json"], "model.hf_config: no Hugging Face config at"),
    ],
)
def test_a_bad_hf_model_section_names_the_key(llama: Path, overrides, message: str) -> None:
    base = [f"model.hf_config={llama}", "model.seq_len=32"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job({}, [*base, *overrides])


def test_another_family_is_refused_naming_the_ones_supported(tmp_path: Path) -> None:
    transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1).save_pretrained(
        tmp_path
    )
    with pytest.raises(ConfigError, match="model.hf_config: .* is a 'bert' model; tidal plans"):
        load_job({}, [f"model.hf_config={tmp_path}", "model.seq_len=16"])


def test_export_refuses_a_hugging_face_run(tmp_path: Path, llama: Path) -> None:
    from tidal.train.export import run_model_config

    (tmp_path / "config.json").write_text(f'{{"model": {{"hf_config": "{llama}", "seq_len": 32}}}}')
    with pytest.raises(ConfigError, match="trained a Hugging Face model"):
        run_model_config(tmp_path)
