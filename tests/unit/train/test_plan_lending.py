"""What a plan run lends ([Note: lending in plan runs] in tidal/train/plan_lending.py): whole
blocks and one class of the next, nearest the plan's continuous lent bytes."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.models import preset
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Plan, PlannerConfig, Recompute, make_plan
from tidal.train.plan_lending import LentParts, lent_parts

FP32 = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


@pytest.fixture(scope="module")
def plan() -> Plan:
    """A 4-block tiny GPT over pp 2 x dp 2 (two blocks a stage), nothing lent yet."""
    model = dataclasses.replace(preset("tiny"), num_layers=4, dropout=0.0)
    config = PlannerConfig(pp=2, tp=1, pareto=(), baselines=(), recompute=(Recompute.NONE,),
                           objective="time", **FP32)  # fmt: skip
    return make_plan(measure_gpt(model, micro_batch=1), ClusterSpec(devices=4), config).plan


def _lending(plan: Plan, lent: float, mode: Recompute = Recompute.NONE) -> Plan:
    layout = plan.pipeline
    assert layout is not None
    first = layout.stages["first"]
    first = dataclasses.replace(first, memory=dataclasses.replace(first.memory, lent=lent),
                                recompute=dict.fromkeys(first.recompute, mode))  # fmt: skip
    stages = {**layout.stages, "first": first}
    return dataclasses.replace(plan, pipeline=dataclasses.replace(layout, stages=stages))


def _sizes(plan: Plan) -> tuple[float, dict[str, float]]:
    """One block's saved bytes, and each class child's, as the plan counts them."""
    units = [u for u in plan.stage_plan(0).units if "*" in u.module]
    block = sum(u.memory.activations for u in units)
    child = {c: sum(u.memory.activations for u in units if f"{u.module}.".startswith(f"blocks.*.{c}."))
             for c in ("attn", "mlp")}  # fmt: skip
    return block, child


def test_the_nearest_blocks_and_class_lend(plan: Plan) -> None:
    block, child = _sizes(plan)
    assert 0 < child["attn"] < child["mlp"] < block
    assert lent_parts(plan, 0) == LentParts()  # nothing lent
    cases = {
        0.01 * block: LentParts(0, "attn", child["attn"]),  # at least a class
        child["mlp"]: LentParts(0, "mlp", child["mlp"]),
        block + child["attn"]: LentParts(1, "attn", block + child["attn"]),
        0.98 * block: LentParts(1, None, block),
        10 * block: LentParts(2, None, 2 * block),  # at most every block
    }
    for lent, want in cases.items():
        got = lent_parts(_lending(plan, lent), 0)
        assert got == want, (lent, got)
        assert lent_parts(_lending(plan, lent), 1) == LentParts()  # the mirror lends nothing
    assert LentParts(1, "attn").modules() == ["layers.0", "layers.1.attn"]


def test_a_recomputed_attention_core_is_not_lent(plan: Plan) -> None:
    """Checkpoint's saved-tensor hooks inside an attention would nest inside the lending's."""
    block, child = _sizes(plan)
    got = lent_parts(_lending(plan, child["attn"], Recompute.SELECTIVE), 0)
    assert got.child != "attn" and got.modules(), got
