"""The wiring apply derives from a measured graph: tidal's GPT as its hand-written table once said,
Hugging Face LLaMA (GQA) and GPT-2 (Conv1D, fused qkv), and plans apply must refuse."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tidal.models import build_gpt, preset
from tidal.planner.check import check_plan
from tidal.planner.plan import Layout, Plan, Recompute, StrategyName
from tidal.planner.wiring import UnitSpec, derive_wiring, structure_graph
from tidal.testing.plans import Choices, hand_plan

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P
TINY = preset("tiny")


def _spec(module: str, segment: int | None, kind: str, role: str | None = None) -> UnitSpec:
    return UnitSpec(module=module, segment=segment, kind=kind, role=role or kind)


# tidal/planner/gpt_wiring.py's table at a9f0879, before the wiring was derived.
OLD_GPT_UNITS: dict[str, UnitSpec] = {
    "[0]": _spec("", 0, "elementwise", "positions"),
    "tok_embed": _spec("tok_embed", None, "embedding"),
    "pos_embed": _spec("pos_embed", None, "embedding"),
    "[1]": _spec("", 1, "elementwise"),
    "drop": _spec("drop", None, "elementwise", "dropout"),
    "blocks.*.ln_1": _spec("blocks.*.ln_1", None, "norm"),
    "blocks.*.attn.qkv": _spec("blocks.*.attn.qkv", None, "linear"),
    "blocks.*.attn[0]": _spec("blocks.*.attn", 0, "attention"),
    "blocks.*.attn.proj": _spec("blocks.*.attn.proj", None, "linear"),
    "blocks.*.attn.resid_drop": _spec("blocks.*.attn.resid_drop", None, "elementwise", "dropout"),
    "blocks.*[0]": _spec("blocks.*", 0, "elementwise"),
    "blocks.*.ln_2": _spec("blocks.*.ln_2", None, "norm"),
    "blocks.*.mlp.fc": _spec("blocks.*.mlp.fc", None, "linear"),
    "blocks.*.mlp[0]": _spec("blocks.*.mlp", 0, "elementwise"),
    "blocks.*.mlp.proj": _spec("blocks.*.mlp.proj", None, "linear"),
    "blocks.*.mlp.drop": _spec("blocks.*.mlp.drop", None, "elementwise", "dropout"),
    "blocks.*[1]": _spec("blocks.*", 1, "elementwise"),
    "ln_f": _spec("ln_f", None, "norm"),
    "lm_head": _spec("lm_head", None, "linear"),
    "[2]": _spec("", 2, "loss"),
}


def old_gpt_edges(num_layers: int) -> list[tuple[str, str, int]]:
    """gpt_wiring.gpt_edges at a9f0879."""
    n = num_layers
    chain = ["ln_1", "attn.qkv", "attn[0]", "attn.proj", "attn.resid_drop", "[0]", "ln_2"]
    chain += ["mlp.fc", "mlp[0]", "mlp.proj", "mlp.drop", "[1]"]
    block = [f"blocks.*{u}" if u.startswith("[") else f"blocks.*.{u}" for u in chain]
    first, add_0, add_1 = block[0], block[5], block[-1]
    edges = [("[0]", "pos_embed", 1), ("tok_embed", "[1]", 1), ("pos_embed", "[1]", 1)]
    edges += [("[1]", "drop", 1), ("drop", first, 1), ("drop", add_0, 1)]
    edges += [(a, b, n) for a, b in zip(block[:-1], block[1:], strict=True)] + [(add_0, add_1, n)]
    edges += [(add_1, first, n - 1), (add_1, add_0, n - 1), (add_1, "ln_f", 1)]
    edges += [("ln_f", "lm_head", 1), ("lm_head", "[2]", 1)]
    return [e for e in edges if e[2] > 0]


@pytest.mark.parametrize("num_layers", [2, 3])
def test_the_gpts_derived_wiring_is_the_old_table(num_layers: int) -> None:
    config = dataclasses.replace(TINY, num_layers=num_layers)  # dropout 0: units all the same
    wiring = derive_wiring(structure_graph(build_gpt(config, device="meta"), seq_len=16))
    assert wiring.units == OLD_GPT_UNITS
    assert set(wiring.edges) == set(old_gpt_edges(num_layers))
    # what the table's users had spelt out in code
    qkv = wiring.projections["blocks.*.attn.qkv"]
    assert (qkv.attention, qkv.parts) == ("blocks.*.attn[0]", (64, 64, 64))
    assert wiring.ties == {"lm_head": "tok_embed"} and not wiring.transposed
    if num_layers > 1:
        block = wiring.blocks["blocks.*"]
        assert block.heads == ("blocks.*.ln_1", "blocks.*[0]") and block.entry == "blocks.*[0]"
    # the attention core reads its fused projection's shape, which is never sequence-split
    assert set(wiring.hand_whole) == {"blocks.*.attn.qkv"}
    assert wiring.whole_in == {} and wiring.sequence_whole == {}
    assert wiring.inputs == {"tok_embed": (0,), "[2]": (1,)}  # ids, and the loss's targets


def _hf(kind: str, **overrides: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            use_cache=False, **overrides,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return cls(config)


def test_llama_wiring_from_its_graph() -> None:
    wiring = derive_wiring(structure_graph(_hf("llama"), seq_len=16))
    attn = "model.layers.*.self_attn[2]"
    assert wiring.units[attn].role == "attention" and wiring.attention[attn] == (4, 2, 16)
    parts = {n: p.parts for n, p in wiring.projections.items()}
    layer = "model.layers.*.self_attn."
    assert parts == {layer + "q_proj": (64,), layer + "k_proj": (32,), layer + "v_proj": (32,)}
    # positions: the ids' arange and the rotary tables, computed after the embedding
    assert {n for n, s in wiring.units.items() if s.role == "positions"} == {
        "model[0]",
        "model.rotary_emb",
    }
    # model's code counts positions from the embedding, the attention's code reshapes q, k, v
    # by its input's shape, the causal LM's code slices the final norm's output
    layer = "model.layers.*."
    assert set(wiring.hand_whole) == {
        "model.embed_tokens", layer + "input_layernorm", "model.norm",
        *(f"{layer}self_attn.{p}_proj" for p in "qkv"),
    }  # fmt: skip
    assert wiring.whole_in == {} and wiring.sequence_whole == {}
    block = wiring.blocks["model.layers.*"]
    assert block.entry == "model.layers.*[0]"  # the rotary tables are not the block's input
    assert block.heads == ("model.layers.*.input_layernorm", "model.layers.*[0]")
    assert wiring.units["model.layers.*.mlp.act_fn"].role == "elementwise"
    assert not wiring.ties and not wiring.transposed


def test_gpt2_wiring_from_its_graph() -> None:
    wiring = derive_wiring(structure_graph(_hf("gpt2"), seq_len=16))
    c_attn = "transformer.h.*.attn.c_attn"
    assert wiring.projections[c_attn].parts == (64, 64, 64)  # fused, split by its core
    assert {c_attn, "transformer.h.*.mlp.c_fc"} <= wiring.transposed  # Conv1D: [in, out]
    assert wiring.ties == {"lm_head": "transformer.wte"}
    assert wiring.units["transformer.h.*.attn.resid_dropout"].role == "dropout"
    # the ids' view reads the caller's tensor; the model's code counts positions from the
    # embedding, and reshapes the final norm's output with the caller's sequence length
    assert set(wiring.whole_in) == {"transformer[0]"}
    assert set(wiring.sequence_whole) == {"transformer[0]", "transformer[2]"}
    assert set(wiring.hand_whole) == {
        "transformer.wte", "transformer.drop", "transformer.ln_f", c_attn
    }  # fmt: skip


# -- plans apply refuses --------------------------------------------------------------------------


def _plan(model: nn.Module, choices: Choices, *, tp: int = 2, **fields: object) -> Plan:
    wiring = derive_wiring(structure_graph(model, seq_len=16))
    return hand_plan(wiring, choices, model="m", tp=tp, seq_len=16, **fields)


class _HeadInterleaved(nn.Module):
    """GPT-NeoX's layout: the fused projection's outputs are ``[q_h; k_h; v_h]`` per head, which
    a per-rank ``[q; k; v]`` reordering would scramble."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 4, 24).transpose(1, 2).split(8, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, 32))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.attn = _HeadInterleaved()
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(ids)))


def test_a_fused_projection_of_unknown_layout_is_refused_naming_it() -> None:
    with torch.device("meta"):
        model = _Toy()
    heads = {"attn.qkv": (S.COLWISE, R, HID), "attn[0]": (S.HEADS, HID, HID)}
    with pytest.raises(ValueError, match=r"unit 'attn\[0\]' is heads, but apply cannot split what "
                       r"'attn.qkv' feeds it by heads: its 96 outputs are neither q or k/v"):  # fmt: skip
        check_plan(model, _plan(model, heads))
    check_plan(model, _plan(model, {"attn.qkv": (S.COLWISE, R, HID)}))  # gathered: fine


@pytest.mark.parametrize(
    ("kind", "choices", "fields", "message"),
    [
        (
            "llama", {}, {"recompute": {"model.layers.*": Recompute.SELECTIVE}},
            r"attention core 'model\.layers\.\*\.self_attn\[2\]' is code inside "
            r"LlamaAttention\.forward, which apply cannot recompute on its own",
        ),
        (
            "gpt2", {"transformer[2]": (S.SEQUENCE, SEQ, SEQ)}, {},
            r"unit 'transformer\[2\]' is sequence S\(seq\)->S\(seq\), but its sequence must stay "
            r"whole: it reads 'transformer.wte', which is handed on whole: 'transformer''s code",
        ),
        (
            "gpt2", {"transformer.h.*.attn[0]": (S.HEADS, HID, HID)}, {},
            "the fused qkv splits only by heads",
        ),
        (
            "llama", {"model.layers.*.self_attn[2]": (S.HEADS, HID, HID)}, {"tp": 4},
            r"'model\.layers\.\*\.self_attn\[2\]' is heads on a tensor axis of 4 ranks, but its "
            r"2 key/value heads are not divisible by 4",
        ),
    ],
)  # fmt: skip
def test_hf_plans_apply_cannot_carry_out_are_refused(kind, choices, fields, message) -> None:
    model = _hf(kind)
    with pytest.raises(ValueError, match=message):
        check_plan(model, _plan(model, choices, **fields))
