"""Your own model under a plan ([Note: models without tokens] in tidal/planner/wiring.py): an
MLP whose linears split over a tensor axis of 2 and a small CNN over a data axis of 2 (ZeRO per
unit), each trained by ``tidal.Trainer(model, config, train_data=..., plan=plan_for(...))`` on 2
gloo ranks, log the reference engine's losses, resume exactly and export under their own
names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tidal
from tidal.cli.main import main
from tidal.planner import Plan, PlannerConfig, StrategyName, plan_for
from tidal.testing import run_on_ranks
from tidal.train.metrics import read_metrics
from tidal.train.safetensors import read_safetensors

BATCH = 8
TOL = 1e-5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))  # fmt: skip


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )  # fmt: skip


def _regression() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, 16, generator=g) for _ in range(5)]
    return [(x, x[:, :2] * 2) for x in xs]


def _images() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(BATCH, 1, 12, 12, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(4)]  # fmt: skip


# model, data, loss, the tensor axis the plan is made for
CASES = {"mlp": (_mlp, _regression, F.mse_loss, 2), "cnn": (_cnn, _images, None, 1)}


def _fit(run_dir: Path, case: str, steps: int, *, plan: Plan | None = None,
         resume: bool = False) -> dict:  # fmt: skip
    build, data, loss_fn, _ = CASES[case]
    config: dict[str, Any] = {
        "run_dir": str(run_dir),
        "training": {"steps": steps, "batch_size": BATCH, "val_every": 2, "log_every": 1,
                     "device": "cpu"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1, "decay_steps": 6},
        "checkpoint": {"every_steps": 2},
    }  # fmt: skip
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
