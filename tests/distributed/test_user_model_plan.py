"""Your own model under a plan ([Note: models without tokens] in tidal/planner/wiring.py): an
MLP whose linears split over a tensor axis of 2 and a small CNN over a data axis of 2 (ZeRO per
unit), each trained by ``tidal.Trainer(model, config, train_data=..., plan=plan_for(...))`` on 2
gloo ranks, log the reference engine's losses, resume exactly and export under their own
names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn.functional as F

import tidal
from tidal.cli.main import main
from tidal.planner import Plan, PlannerConfig, StrategyName, plan_for
from tidal.testing import run_on_ranks
from tidal.testing.your_models import cnn, images, mlp, regression, run_config
from tidal.train.metrics import read_metrics
from tidal.train.safetensors import read_safetensors

BATCH = 8
TOL = 1e-5


# model, data, loss, the tensor axis the plan is made for
CASES = {
    "mlp": (lambda: mlp(outputs=2), lambda: regression(BATCH, outputs=2), F.mse_loss, 2),
    "cnn": (lambda: cnn(batch_norm=False), lambda: images(BATCH), None, 1),
}


def _fit(run_dir: Path, case: str, steps: int, *, plan: Plan | None = None,
         resume: bool = False) -> dict:  # fmt: skip
    build, data, loss_fn, _ = CASES[case]
    config = run_config(run_dir, steps=steps, batch=BATCH)
    trainer = tidal.Trainer(build(), config, train_data=data(), val_data=data()[:2],
                            loss_fn=loss_fn, plan=plan)  # fmt: skip
    return trainer.fit(resume=resume)


def _plan(case: str) -> Plan:
    build, data, _, tp = CASES[case]
    rows = data()[0][0][: BATCH * tp // 2]  # one data-parallel rank's rows
    config = PlannerConfig(tp=tp, eps=1000, pareto=(), baselines=(), pipelines=False)
    return plan_for(build(), rows, devices=2, config=config)


def _on_ranks(root: str, case: str, plan: Plan) -> dict:
    summary = _fit(Path(root) / "plan", case, 6, plan=plan)
    _fit(Path(root) / "split", case, 4, plan=plan)
    _fit(Path(root) / "split", case, 6, plan=plan, resume=True)
    return summary


def _records(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_your_model_under_a_plan_equals_the_reference_engine(case: str, tmp_path: Path) -> None:
    plan = _plan(case)
    if case == "mlp":  # the linears split over the tensor axis
        assert plan.tp == 2 and plan.unit("0").strategy is StrategyName.COLWISE
    else:  # the data axis, every unit's state sharded by its ZeRO level
        assert plan.dp == 2 and any(u.zero > 0 for u in plan.units)
    _fit(tmp_path / "reference", case, 6)
    summaries = run_on_ranks(_on_ranks, world_size=2, args=(str(tmp_path), case, plan),
                             timeout_s=240)  # fmt: skip
    assert summaries[0]["engine"] == "plan" and summaries[0]["world_size"] == 2
    assert summaries[0]["mesh"] == f"dp {plan.dp} x tp {plan.tp}"
    got, want = _records(tmp_path / "plan"), _records(tmp_path / "reference")
    assert [r[0] for r in got] == [r[0] for r in want] and len(want) == 9  # 6 steps, 3 vals
    flat = [v for r in want for v in r[1:] if v is not None]
    assert [v for r in got for v in r[1:] if v is not None] == pytest.approx(flat, abs=TOL, rel=0)
    assert _records(tmp_path / "split") == got  # resumed at step 4, exactly
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "plan"), "--out", str(out), "--check"]) == 0
    model = CASES[case][0]()
    model.load_state_dict(read_safetensors(out / "model.safetensors"), strict=True)
