"""``tidal.parallel.plan_apply`` on 2 gloo ranks against single-device training of the tiny GPT.

Every case trains 3 AdamW steps from one seed on the same batches (a data-parallel rank on its
half of each); the losses and the gathered, un-permuted parameters must match a single-device
run in this process. One spawn of 2 ranks runs every case (start-up costs more than the cases),
and each test checks its own cases' results.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from tidal.models import build_gpt, preset
from tidal.models.gpt import measure_gpt
from tidal.parallel.plan_apply import apply, check_plan, full_state_dict, make_mesh
from tidal.planner import ClusterSpec, PlannerConfig
from tidal.planner import make_plan as make_tidal_plan
from tidal.planner.plan import Layout, Plan, Recompute, StrategyName
from tidal.planner.wiring import derive_wiring, structure_graph
from tidal.testing import run_on_ranks
from tidal.testing.plans import Choices, hand_plan

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P
WORLD = 2
STEPS = 3
TOL = 1e-5  # the bound on losses and parameters
TINY = preset("tiny")  # dropout 0.0: runs are deterministic, so they can match exactly
# The GPT's units and edges as apply derives them (test_plan_wiring.py checks them against the
# table they were once written in).
WIRING = derive_wiring(structure_graph(build_gpt(TINY, device="meta"), seq_len=TINY.seq_len))
GPT_UNITS = WIRING.units


# Megatron's tensor parallelism: column- then row-parallel pairs, everything else replicated.
MEGATRON: Choices = {
    "tok_embed": (S.VOCAB, R, P),
    "blocks.*.attn.qkv": (S.COLWISE, R, HID),
    "blocks.*.attn[0]": (S.HEADS, HID, HID),
    "blocks.*.attn.proj": (S.ROWWISE, HID, P),
    "blocks.*.mlp.fc": (S.COLWISE, R, HID),
    "blocks.*.mlp[0]": (S.HIDDEN, HID, HID),
    "blocks.*.mlp.proj": (S.ROWWISE, HID, P),
    "lm_head": (S.COLWISE, R, HID),
    "[2]": (S.HIDDEN, HID, HID),  # vocabulary-parallel loss
}
# ... plus sequence parallelism: the token-wise units between the pairs split the sequence.
SEQUENCE_PARALLEL: Choices = {
    **{name: (S.SEQUENCE, SEQ, SEQ) for name in GPT_UNITS},
    **MEGATRON,
    "blocks.*.attn.qkv": (S.COLWISE, SEQ, HID),
    "blocks.*.mlp.fc": (S.COLWISE, SEQ, HID),
    "lm_head": (S.COLWISE, SEQ, HID),
}
# The same, but the colwise units take whole inputs: their consumers' hooks gather them, and
# nothing keeps the saved inputs sharded ([Note: colwise inputs kept sharded]).
GATHER_BEFORE_COLWISE: Choices = {
    **SEQUENCE_PARALLEL,
    **{n: (S.COLWISE, R, HID) for n in ("blocks.*.attn.qkv", "blocks.*.mlp.fc", "lm_head")},
}
COLWISE_ON_SEQUENCE = 2 * TINY.num_layers + 1  # qkv and fc per block, and lm_head
# Tokens split everywhere but in the colwise/rowwise pairs, the loss taken on split targets.
SEQUENCE_EVERYWHERE: Choices = {
    **SEQUENCE_PARALLEL,
    "tok_embed": (S.SEQUENCE, SEQ, SEQ),
    "lm_head": (S.SEQUENCE, SEQ, SEQ),
    "[2]": (S.SEQUENCE, SEQ, SEQ),
}
# As the planner chose for gpt2-small on 4 devices: attention replicated, the rest split by
# tokens. The first block's input is whole but its residual add takes S(seq): ln_1 detours.
REPLICATED_ATTENTION: Choices = {
    name: (S.SEQUENCE, SEQ, SEQ)
    for name in GPT_UNITS
    if name.startswith(("blocks.*[", "blocks.*.ln_2", "blocks.*.mlp", "ln_f", "lm_head", "[2]"))
}


def make_plan(
    choices: Choices,
    *,
    dp: int = 1,
    tp: int = 2,
    zero: int = 0,
    zeros: dict[str, int] | None = None,
    recompute: Recompute = Recompute.NONE,
) -> Plan:
    return hand_plan(
        WIRING, choices, model="tiny", dp=dp, tp=tp, micro_batch=4 // dp, seq_len=TINY.seq_len,
        zero=zero, zeros=zeros, recompute={"blocks.*": recompute}, edges=list(WIRING.edges),
    )  # fmt: skip


CASES: dict[str, Plan] = {
    "megatron": make_plan(MEGATRON),
    "megatron, selective recompute": make_plan(MEGATRON, recompute=Recompute.SELECTIVE),
    "sequence parallel": make_plan(SEQUENCE_PARALLEL),
    "sequence parallel, full recompute": make_plan(SEQUENCE_PARALLEL, recompute=Recompute.FULL),
    "gather before colwise": make_plan(GATHER_BEFORE_COLWISE),
    "sequence everywhere": make_plan(SEQUENCE_EVERYWHERE),
    "replicated attention": make_plan(REPLICATED_ATTENTION),
    # the first block is handed R and entered in S(seq): recomputation must not convert twice
    "replicated attention, full recompute": make_plan(
        REPLICATED_ATTENTION, recompute=Recompute.FULL
    ),
    "zero-3": make_plan({}, dp=2, tp=1, zero=3),
    # units of a block at different levels get FSDP groups of their own; ZeRO-0 is all-reduced
    "mixed zero, full recompute": make_plan(
        {},
        dp=2,
        tp=1,
        zero=3,
        zeros={"blocks.*.ln_1": 0, "blocks.*.attn.qkv": 2, "tok_embed": 1, "lm_head": 1, "ln_f": 0},
        recompute=Recompute.FULL,
    ),
}
TENSOR_CASES = [name for name, plan in CASES.items() if plan.tp > 1] + ["planner, tp 2"]
DATA_CASES = [name for name, plan in CASES.items() if plan.dp > 1] + ["planner, dp 2"]


def _planner_cases() -> dict[str, Plan]:
    """What ``tidal plan`` makes for the tiny GPT on 2 devices: whatever it picks must run."""
    graph = measure_gpt(TINY)
    config = {"objective": "memory", "pareto": (), "baselines": ()}
    return {
        f"planner, {axis} 2": make_tidal_plan(
            graph,
            ClusterSpec(devices=2),
            PlannerConfig(pipelines=False, tp=2 if axis == "tp" else 1, **config),
        ).plan
        for axis in ("tp", "dp")
    }


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (4, TINY.seq_len + 1)
    tokens = [torch.randint(0, TINY.vocab_size, shape, generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # Adam divides by |grad| + eps: near-zero gradients differing by rounding (sums taken in
    # another order across ranks) would step by up to lr apart with the default eps of 1e-8.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


# -- what each rank runs ---------------------------------------------------------------------------


def _run_case(plan: Plan) -> dict[str, Any]:
    mesh = make_mesh(plan, "cpu")
    model = apply(build_gpt(TINY, seed=0), plan, mesh)
    optimizer = _optimizer(model)
    dp_rank = mesh["dp"].get_local_rank()
    losses, comms = [], {}
    for step, (x, y) in enumerate(_batches()):
        x, y = x.chunk(plan.dp)[dp_rank], y.chunk(plan.dp)[dp_rank]
        with CommDebugMode() as comm:
            loss = model(x, y)
            forward = dict(comm.get_comm_counts())
            loss.backward()
        if step == 0:
            comms = {str(op): n - forward.get(op, 0) for op, n in comm.get_comm_counts().items()}
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh.get_group("dp"))  # the global batch's mean
        losses.append(loss.item() / plan.dp)
    with torch.no_grad():  # logits, without targets: whole, whatever the loss's layout
        logits = model(_batches()[0][0])
    state = full_state_dict(model, plan)
    mine = dist.get_rank() == 0
    return {
        "losses": losses,
        "backward_comms": comms,
        "state": state if mine else None,
        "logits": logits if mine else None,
    }


def _run_cases(cases: dict[str, Plan]) -> dict[str, dict[str, Any]]:
    # CommDebugMode's module tracker warns about hooks on outputs; nothing to act on here.
    warnings.filterwarnings("ignore", category=UserWarning)
    return {name: _run_case(plan) for name, plan in cases.items()}


# -- the tests -----------------------------------------------------------------------------------------


def _single_device() -> dict[str, Any]:
    model = build_gpt(TINY, seed=0)
    optimizer = _optimizer(model)
    losses = []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        logits = model(_batches()[0][0])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "logits": logits}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    cases = {**CASES, **_planner_cases()}
    return run_on_ranks(_run_cases, world_size=WORLD, args=(cases,), timeout_s=240)[0]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _single_device()


def _assert_matches(result: dict[str, Any], reference: dict[str, Any]) -> None:
    ref_losses, ref_state = reference["losses"], reference["state"]
    assert result["losses"] == pytest.approx(ref_losses, abs=TOL, rel=0)
    torch.testing.assert_close(result["logits"], reference["logits"], atol=TOL, rtol=0)
    assert ref_losses[-1] != pytest.approx(ref_losses[0], abs=1e-3), "training must move"
    state = result["state"]
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_tensor_parallel_plan_matches_single_device(case: str, results: dict, reference) -> None:
    _assert_matches(results[case], reference)


@pytest.mark.parametrize("case", DATA_CASES)
def test_fsdp_plan_matches_single_device(case: str, results: dict, reference) -> None:
    _assert_matches(results[case], reference)


def test_colwise_sequence_inputs_are_saved_sharded_and_gathered_again(results: dict) -> None:
    kept = results["sequence parallel"]["backward_comms"]
    whole = results["gather before colwise"]["backward_comms"]
    gathers = "c10d_functional.all_gather_into_tensor"
    assert kept[gathers] - whole[gathers] == COLWISE_ON_SEQUENCE


def test_units_and_edges_are_the_planners() -> None:
    graph = measure_gpt(dataclasses.replace(TINY, dropout=0.1))  # p = 0 drops dropout units
    assert {(u.name, u.module, u.segment, u.kind) for u in graph.units} == {
        (name, s.module, s.segment, s.kind) for name, s in GPT_UNITS.items()
    }
    assert {(e.src, e.dst, e.count) for e in graph.edges} == set(WIRING.edges)


def test_a_detour_into_a_block_warns() -> None:
    with pytest.warns(UserWarning, match=r"first block, blocks\.\*\.ln_1 takes R .* S\(seq\) -> R"):
        check_plan(build_gpt(TINY, device="meta"), CASES["replicated attention"])


def test_a_plan_without_dropout_units_is_accepted() -> None:
    plan = make_plan(SEQUENCE_PARALLEL)
    plan.units = [u for u in plan.units if not u.name.endswith(("drop", "resid_drop"))]
    check_plan(build_gpt(TINY, device="meta"), plan)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: setattr(p, "tp", 3), r"blocks\.\*\.attn\[0\]'.* 4 heads are not divisible by 3"),
        (
            lambda p: p.units.append(dataclasses.replace(p.units[0], name="blocks.*.attn.rope")),
            r"units tidal's GPT does not have \('blocks\.\*\.attn\.rope'\)",
        ),
        (
            lambda p: _set(p, "blocks.*.attn[0]", S.REPLICATE, R, R),
            "fused qkv splits only by heads",
        ),
        (lambda p: _set(p, "blocks.*.ln_1", S.HIDDEN, HID, HID), "which a norm cannot do"),
        (
            lambda p: _set(p, "blocks.*[0]", S.SEQUENCE, SEQ, SEQ),
            r"'blocks\.\*\[1\]' takes R but 'blocks\.\*\[0\]' gives S\(seq\)",
        ),
        (lambda p: _set(p, "lm_head", S.REPLICATE, R, R), "share one weight"),
        (lambda p: p.units.pop(), r"no choice for units '\[2\]'"),
    ],
)
def test_bad_plans_raise_with_the_reason(change: Any, message: str) -> None:
    plan = make_plan(MEGATRON)
    change(plan)
    with pytest.raises(ValueError, match=message):
        check_plan(build_gpt(TINY, device="meta"), plan)


def _set(plan: Plan, name: str, strategy: StrategyName, in_layout: Layout, out: Layout) -> None:
    unit = plan.unit(name)
    unit.strategy, unit.in_layout, unit.out_layout = strategy, in_layout, out
