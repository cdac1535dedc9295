"""Model specs: one interface to tidal's GPT and Hugging Face decoders ([Note: model specs])."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import tidal
from tidal.config import ConfigError
from tidal.memory.materialize import materialize
from tidal.models import GPTConfig, GPTSpec, HFModelConfig, HFSpec, ModelConfig, spec_for
from tidal.planner.wiring import ModelWiring

VOCAB, SEQ, LAYERS = 48, 8, 3


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
    ).save_pretrained(folder / "llama")  # fmt: skip
    transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=LAYERS, n_head=2, n_positions=2 * SEQ,
    ).save_pretrained(folder / "gpt2")  # fmt: skip
    return {kind: folder / kind / "config.json" for kind in ("llama", "gpt2")}


def _spec(kind: str, hf_configs: dict[str, Path] | None = None):
    if kind == "gpt":
        config = GPTConfig(
            vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS, num_heads=2, d_model=16
        )
        return spec_for(config)
    return spec_for(HFModelConfig.load(hf_configs[kind], seq_len=SEQ, key="hf_config"))


@pytest.fixture(params=["gpt", "llama", "gpt2"])
def spec(request: pytest.FixtureRequest, hf_configs: dict[str, Path]):
    return _spec(request.param, hf_configs)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(spec, model: nn.Module, idx_BT: torch.Tensor) -> torch.Tensor:
    """The whole model's loss in the stages' convention ([Note: loss convention] in
    tidal/pipeline/split.py): targets already shifted, -100 after the last token."""
    targets = torch.cat([idx_BT[:, 1:], torch.full((idx_BT.shape[0], 1), -100)], dim=1)
    if spec.computes_loss:
        return model(idx_BT, targets)
    logits_BTV = model(idx_BT).logits
    return nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), targets.flatten())


def test_spec_for_chooses_the_family(hf_configs: dict[str, Path]) -> None:
    assert isinstance(spec_for(ModelConfig()), GPTSpec)
    assert spec_for(ModelConfig()).computes_loss
    hf = spec_for(ModelConfig(hf_config=str(hf_configs["llama"]), seq_len=SEQ))
    assert isinstance(hf, HFSpec) and not hf.computes_loss
    assert hf.config.num_layers == LAYERS


def test_meta_build_plus_init_is_the_cpu_build_of_the_same_seed(spec) -> None:
    whole = spec.build(device="cpu", seed=3)
    meta = spec.build(device="meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, spec.init(meta, 3), torch.device("cpu"))
    ours, theirs = meta.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    other = spec.build(device="cpu", seed=4)
    assert any(
        not torch.equal(p, q) for p, q in zip(whole.parameters(), other.parameters(), strict=True)
    )


def test_two_stages_compose_to_the_whole_models_loss(spec) -> None:
    model = spec.build(device="cpu", seed=2).eval()  # GPT-2's config has dropout
    idx = _tokens()
    expected = _loss(spec, model, idx)
    targets = torch.cat([idx[:, 1:], torch.full((idx.shape[0], 1), -100)], dim=1)
    first, last = spec.split(model, [(0, 1), (1, LAYERS)])
    assert (first.block_range, last.block_range) == ((0, 1), (1, LAYERS))
    loss = last(first(idx), targets)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)


def test_export_adapter_round_trips_names(spec) -> None:
    model = spec.build(device="cpu", seed=0)
    adapter = spec.export_adapter(model)
    state = model.state_dict()
    exported = adapter.to_export(state)
    back = adapter.from_export(exported)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    if isinstance(spec, GPTSpec):  # tidal's names, every tied name kept
        assert adapter.format == "tidal-gpt" and exported.keys() == state.keys()
        assert GPTConfig(**adapter.config) == spec.config
    else:  # Hugging Face's file: a tied weight once, under its first name
        assert adapter.format == "hf" and adapter.config["model_type"] == spec.config.model_type
        tied = spec.config.model_type == "gpt2"
        assert ("lm_head.weight" not in exported) == tied
        if tied:
            with pytest.raises(ConfigError, match="transformer.wte.weight"):
                adapter.from_export({k: v for k, v in exported.items() if "wte" not in k})


def test_figures_and_planner_views(spec) -> None:
    model = spec.build()
    count = spec.num_params(model)
    assert count == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert spec.flops_per_token(model) >= 6 * LAYERS * 16 * 16
    wiring = spec.wiring(model)
    assert isinstance(wiring, ModelWiring) and list(wiring.blocks.values())[0].count == LAYERS
    graph = spec.graph(micro_batch=1, dtype=torch.float32)
    assert graph.seq_len == SEQ and LAYERS in graph.blocks.values()
    profiles = spec.profile(model, micro_batch=1, seq_len=SEQ)
    assert [p.name for p in profiles] == ["embed", *(f"blocks.{i}" for i in range(LAYERS)), "head"]


# [Note: model specs]: the layers below train/ take what a model gives them as values.
_BELOW_TRAIN = ("planner", "pipeline", "parallel", "memory", "sharding", "distributed", "config")


def _imports_models(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == "tidal.models" or n.startswith("tidal.models.") for n in names):
            return True
    return False


def test_no_layer_below_train_imports_models() -> None:
    root = Path(tidal.__file__).parent
    offenders = [
        str(path.relative_to(root))
        for layer in _BELOW_TRAIN
        for path in sorted((root / layer).rglob("*.py"))
        if _imports_models(path)
    ]
    assert offenders == []
