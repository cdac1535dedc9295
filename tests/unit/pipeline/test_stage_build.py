"""Stages built from the meta device ([Note: stages from the meta device] in
tidal/pipeline/stage_init.py): a rank's stages equal, bit for bit, those split from the model
built whole with the same seed; the others stay on the meta device."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.models import GPTConfig, HFModelConfig, build_stages, spec_for
from tidal.pipeline.savers import measure_units
from tidal.pipeline.sequential import check_sequential, sequential_parts, sequential_values
from tidal.pipeline.split import PipelineStage, split_parts
from tidal.pipeline.stage_init import materialize_stages

VOCAB, SEQ, LAYERS, SEED = 48, 8, 3, 7
RANGES = [(0, 1), (1, 2), (2, 3), (3, 3)]  # a head-only last stage
CPU = torch.device("cpu")
# each stage alone, and the first with the last: a tied embedding lives in both
HELD = [[0], [1], [2], [3], [0, 3]]


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


def _spec(kind: str, hf_configs: dict[str, Path]):
    if kind.startswith("gpt-"):
        config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS, num_heads=2,
                           d_model=16, tie_embeddings=kind == "gpt-tied")  # fmt: skip
        return spec_for(config)
    return spec_for(HFModelConfig.load(hf_configs[kind], seq_len=SEQ, key="hf_config"))


def _assert_held_equal(stages: list[PipelineStage], whole: list[PipelineStage], mine: list[int]):
    for s, (stage, reference) in enumerate(zip(stages, whole, strict=True)):
        built, expected = stage.state_dict(), reference.state_dict()
        assert built.keys() == expected.keys()
        for name, tensor in built.items():
            if s in mine:
                assert torch.equal(tensor, expected[name]), f"stage {s}: {name}"
            elif name in dict(stage.named_parameters()):
                assert tensor.is_meta, f"stage {s} is not held, yet {name} has storage"


@pytest.mark.parametrize("kind", ["gpt-tied", "gpt-untied", "llama", "gpt2"])
@pytest.mark.parametrize("mine", HELD, ids=str)
def test_held_stages_equal_the_whole_models(kind: str, mine: list[int], hf_configs) -> None:
    spec = _spec(kind, hf_configs)
    whole = spec.split(spec.build(device=CPU, seed=SEED), RANGES)
    stages = build_stages(spec, spec.build(device="meta"), RANGES, mine=mine, device=CPU,
                          seed=SEED)  # fmt: skip
    _assert_held_equal(stages, whole, mine)


def test_tied_embedding_gets_one_value_in_both_stages() -> None:
    spec = _spec("gpt-tied", {})
    stages = build_stages(spec, spec.build(device="meta"), RANGES, mine=[0, 3], device=CPU,
                          seed=SEED)  # fmt: skip
    first, last = stages[0].embed.tok.weight, stages[3].head.lm_head.weight
    assert first is not last  # one copy per stage ([Note: tied embeddings across stages])
    assert torch.equal(first, last)


def test_one_stage_keeps_the_tie() -> None:
    spec = _spec("gpt-tied", {})
    (stage,) = build_stages(spec, spec.build(device="meta"), [(0, LAYERS)], mine=[0], device=CPU,
                            seed=SEED)  # fmt: skip
    assert stage.embed.tok.weight is stage.head.lm_head.weight
    assert not stage.embed.tok.weight.is_meta


def test_the_source_is_read_no_further_than_the_last_held_parameter() -> None:
    spec = _spec("gpt-untied", {})
    model = spec.build(device="meta")
    stages = spec.split(model, RANGES)
    drawn: list[str] = []

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in spec.init(model, SEED)():
            drawn.append(name)
            yield name, value

    materialize_stages(stages, [1], counted, CPU)
    last_held = [name for name, _ in model.named_parameters() if name.startswith("blocks.1.")][-1]
    assert drawn[-1] == last_held


def test_a_source_missing_a_held_value_is_refused() -> None:
    spec = _spec("gpt-untied", {})
    model = spec.build(device="meta")
    stages = spec.split(model, RANGES)

    def some() -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, v) for n, v in spec.init(model, SEED)() if n != "blocks.1.ln_1.weight")

    with pytest.raises(ValueError, match=r"no value for blocks\.1\.ln_1\.weight"):
        materialize_stages(stages, [1], some, CPU)


# ---------------------------------------------------------------------------------------------
# your own nn.Sequential


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8),
                         nn.Linear(8, 3))  # fmt: skip


def _mse(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, targets)


@pytest.mark.parametrize("mine", [[0], [1], [2], [0, 2]], ids=str)
def test_meta_sequential_stages_equal_the_model_built_for_real(mine: list[int]) -> None:
    ranges = [(0, 2), (2, 4), (4, 5)]
    torch.manual_seed(SEED)
    real = _mlp()
    whole = split_parts(real, sequential_parts(real, _mse), ranges)
    with torch.device("meta"):
        model = _mlp()
    check_sequential(model, num_stages=len(ranges))
    stages = split_parts(model, sequential_parts(model, _mse), ranges)
    before = torch.get_rng_state()
    materialize_stages(stages, mine, sequential_values(model, SEED), CPU)
    assert torch.equal(torch.get_rng_state(), before)  # training's draws do not move
    _assert_held_equal(stages, whole, mine)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_a_meta_module_without_reset_parameters_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Scale())
    with pytest.raises(ConfigError, match=r"1 \(_Scale\) has no reset_parameters"):
        check_sequential(model, num_stages=2)


def test_a_model_partly_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        head = nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="wholly on the meta device"):
        check_sequential(nn.Sequential(nn.Linear(3, 3), head), num_stages=2)


# ---------------------------------------------------------------------------------------------
# the memory plan measures every stage


def test_other_ranks_stages_measure_what_they_would_held() -> None:
    spec = _spec("gpt-untied", {})
    whole = spec.split(spec.build(device=CPU, seed=SEED), RANGES)
    stages = build_stages(spec, spec.build(device="meta"), RANGES, mine=[1], device=CPU, seed=SEED)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    expected = measure_units(whole, tokens, tokens, lambda s, b: 1.0)
    measured = measure_units(stages, tokens, tokens, lambda s, b: 1.0)
    assert [(u.path, u.num_bytes) for u in measured] == [(u.path, u.num_bytes) for u in expected]
    assert stages[0].embed.tok.weight.is_meta  # measured on a stand-in, left as it was
