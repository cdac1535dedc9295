"""``tidal.parallel.plan_apply`` on Hugging Face LLaMA (GQA) and GPT-2 on 2 gloo ranks, against
single-device training of the same model.

Every case trains 3 AdamW steps from one seed on the same batches (a data-parallel rank on its
half of each), the loss taken outside the model on its logits; the losses, the final logits and
the gathered, un-permuted parameters must match a single-device run in this process within
1e-5. Hand-made Megatron-style plans (with and without sequence parallelism) pin the wirings
this file is about (separate q/k/v with GQA; GPT-2's fused, transposed c_attn); the planner's
own plans on each mesh must run too. One spawn of 2 ranks runs every case.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tidal.models.hf import HFModelConfig, build_hf
from tidal.parallel.plan_apply import apply, full_state_dict, make_mesh
from tidal.planner import ClusterSpec, PlannerConfig, Recompute, make_plan, measure
from tidal.planner.plan import Layout, Plan, StrategyName
from tidal.planner.wiring import derive_wiring, example_inputs, structure_graph
from tidal.testing import run_on_ranks
from tidal.testing.plans import Choices, hand_plan

transformers = pytest.importorskip("transformers")

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P
WORLD = 2
STEPS = 3
SEQ_LEN = 16
BATCH = 4
TOL = 1e-5

CONFIGS = {
    "llama": transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ),
    "gpt2": transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
}  # fmt: skip

_LAYER = "model.layers.*"
LLAMA_MEGATRON: Choices = {
    "model.embed_tokens": (S.VOCAB, R, P),
    **{f"{_LAYER}.self_attn.{p}_proj": (S.COLWISE, R, HID) for p in "qkv"},
    f"{_LAYER}.self_attn[2]": (S.HEADS, HID, HID),
    f"{_LAYER}.self_attn.o_proj": (S.ROWWISE, HID, P),
    f"{_LAYER}.mlp.gate_proj": (S.COLWISE, R, HID),
    f"{_LAYER}.mlp.up_proj": (S.COLWISE, R, HID),
    f"{_LAYER}.mlp.act_fn": (S.HIDDEN, HID, HID),
    f"{_LAYER}.mlp[0]": (S.HIDDEN, HID, HID),
    f"{_LAYER}.mlp.down_proj": (S.ROWWISE, HID, P),
    "lm_head": (S.COLWISE, R, HID),  # the logits gathered for the caller
}
# ... with the token-wise units between the pairs splitting the sequence: the embedding hands
# its output whole (positions are counted from it) and each block's entry splits it.
LLAMA_SEQUENCE: Choices = {
    **{
        name: (S.SEQUENCE, SEQ, SEQ)
        for name in (
            f"{_LAYER}.input_layernorm", f"{_LAYER}[0]", f"{_LAYER}.post_attention_layernorm",
            f"{_LAYER}[1]", "model.norm",
        )
    },
    **LLAMA_MEGATRON,
    **{f"{_LAYER}.self_attn.{p}_proj": (S.COLWISE, SEQ, HID) for p in "qkv"},
    f"{_LAYER}.mlp.gate_proj": (S.COLWISE, SEQ, HID),
    f"{_LAYER}.mlp.up_proj": (S.COLWISE, SEQ, HID),
    "lm_head": (S.SEQUENCE, SEQ, SEQ),
}  # fmt: skip
_BLOCK = "transformer.h.*"
GPT2_MEGATRON: Choices = {
    "transformer.wte": (S.VOCAB, R, P),
    f"{_BLOCK}.attn.c_attn": (S.COLWISE, R, HID),
    f"{_BLOCK}.attn[0]": (S.HEADS, HID, HID),
    f"{_BLOCK}.attn.c_proj": (S.ROWWISE, HID, P),
    f"{_BLOCK}.mlp.c_fc": (S.COLWISE, R, HID),
    f"{_BLOCK}.mlp.act": (S.HIDDEN, HID, HID),
    f"{_BLOCK}.mlp.c_proj": (S.ROWWISE, HID, P),
    "lm_head": (S.COLWISE, R, HID),  # tied to wte: rows split alike
}
GPT2_SEQUENCE: Choices = {
    **{
        name: (S.SEQUENCE, SEQ, SEQ)
        for name in (f"{_BLOCK}.ln_1", f"{_BLOCK}[0]", f"{_BLOCK}.ln_2", f"{_BLOCK}[1]",
                     "transformer.ln_f")
    },
    **GPT2_MEGATRON,
    f"{_BLOCK}.attn.c_attn": (S.COLWISE, SEQ, HID),
    f"{_BLOCK}.mlp.c_fc": (S.COLWISE, SEQ, HID),
    "lm_head": (S.COLWISE, SEQ, HID),
}  # fmt: skip


def _config_file(root: Path, family: str) -> Path:
    folder = root / family
    CONFIGS[family].save_pretrained(folder)
    return folder / "config.json"


def _model_config(path: Path) -> HFModelConfig:
    return HFModelConfig.load(path, seq_len=SEQ_LEN, key="model.hf_config")


def _hand_made(path: Path, choices: Choices) -> Plan:
    wiring = derive_wiring(structure_graph(build_hf(_model_config(path)), seq_len=SEQ_LEN))
    return hand_plan(
        wiring, choices, model=path.parent.name, tp=WORLD, micro_batch=BATCH, seq_len=SEQ_LEN
    )


def _planned(path: Path, *, tp: int) -> Plan:
    """What `tidal plan` makes for the model on 2 devices (a large eps lets it shard)."""
    meta = build_hf(_model_config(path)).to(torch.bfloat16)
    graph = measure(meta, example_inputs(meta, micro_batch=BATCH // (WORLD // tp), seq_len=SEQ_LEN))
    config = PlannerConfig(
        pipelines=False,
        tp=tp,
        eps=1000.0,
        pareto=(),
        baselines=(),
        recompute=(Recompute.NONE, Recompute.FULL),
    )
    return make_plan(graph, ClusterSpec(devices=WORLD), config).plan


def _cases(root: Path) -> dict[str, tuple[Path, Plan]]:
    llama, gpt2 = _config_file(root, "llama"), _config_file(root, "gpt2")
    cases = {
        "llama, megatron": (llama, _hand_made(llama, LLAMA_MEGATRON)),
        "llama, sequence parallel": (llama, _hand_made(llama, LLAMA_SEQUENCE)),
        "gpt2, megatron": (gpt2, _hand_made(gpt2, GPT2_MEGATRON)),
        "gpt2, sequence parallel": (gpt2, _hand_made(gpt2, GPT2_SEQUENCE)),
    }
    for family, path in (("llama", llama), ("gpt2", gpt2)):
        for axis, tp in (("tp", 2), ("dp", 1)):
            cases[f"{family}, planner {axis} 2"] = (path, _planned(path, tp=tp))
    # what each planner case is there for: a planner that changes its choices should not go
    # unnoticed
    for family in ("llama", "gpt2"):
        tp_plan = cases[f"{family}, planner tp 2"][1]
        assert any(u.strategy is S.HEADS for u in tp_plan.units), family
        assert {u.zero for u in cases[f"{family}, planner dp 2"][1].units} - {0}, family
    return cases


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())


def _train(model: torch.nn.Module, rows: slice | None = None) -> tuple[list[torch.Tensor], Any]:
    # Adam divides by |grad| + eps: see test_plan_apply.py's _optimizer.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for x, y in _batches():
        loss = _loss(model, x[rows], y[rows]) if rows else _loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    with torch.no_grad():
        logits = model(_batches()[0][0]).logits
    return losses, logits


# -- what each rank runs ---------------------------------------------------------------------------


def _run_case(path: Path, plan: Plan) -> dict[str, Any]:
    mesh = make_mesh(plan, "cpu")
    model = apply(build_hf(_model_config(path), device="cpu", seed=0), plan, mesh)
    share = BATCH // plan.dp
    dp_rank = mesh["dp"].get_local_rank()
    losses, logits = _train(model, slice(dp_rank * share, (dp_rank + 1) * share))
    for loss in losses:
        dist.all_reduce(loss, group=mesh.get_group("dp"))  # the global batch's mean
    state = full_state_dict(model, plan)
    mine = dist.get_rank() == 0
    return {
        "losses": [loss.item() / plan.dp for loss in losses],
        "state": state if mine else None,
        "logits": logits if mine else None,
    }


def _run_cases(cases: dict[str, tuple[Path, Plan]]) -> dict[str, dict[str, Any]]:
    warnings.filterwarnings("ignore", category=UserWarning)  # detours, FSDP's notes
    return {name: _run_case(path, plan) for name, (path, plan) in cases.items()}


# -- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases = _cases(tmp_path_factory.mktemp("hf"))
    ranks = run_on_ranks(_run_cases, world_size=WORLD, args=(cases,), timeout_s=300)
    references = {}
    for family in ("llama", "gpt2"):
        path = next(path for name, (path, _) in cases.items() if name.startswith(family))
        model = build_hf(_model_config(path), device="cpu", seed=0)
        model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        losses, logits = _train(model)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        references[family] = {"losses": [x.item() for x in losses], "logits": logits,
                              "state": state, "initial": model_state}  # fmt: skip
    return {"ranks": ranks[0], "references": references}


CASE_NAMES = [
    f"{family}, {case}"
    for family in ("llama", "gpt2")
    for case in ("megatron", "sequence parallel", "planner tp 2", "planner dp 2")
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_hf_plan_trains_as_one_device_does(case: str, results: dict[str, Any]) -> None:
    got, want = results["ranks"][case], results["references"][case.split(",")[0]]
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL, rel=0)
    assert want["losses"][-1] != pytest.approx(want["losses"][0], abs=1e-3), "training must move"
    torch.testing.assert_close(got["logits"], want["logits"], atol=TOL, rtol=0)
    assert got["state"].keys() == want["state"].keys()
    moved = 0
    for name, value in want["state"].items():
        torch.testing.assert_close(got["state"][name], value, atol=TOL, rtol=0, msg=name)
        moved += not torch.equal(value, want["initial"][name])
    assert moved > len(want["state"]) // 2, "most parameters must have trained"
