"""A plan for one device: its recomputation, with no process group, as the same run without it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tidal.models import GPTSpec, preset
from tidal.parallel.plan_apply import apply, make_mesh
from tidal.planner import ClusterSpec, Plan, PlannerConfig, Recompute, make_plan
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

DEMO = preset("demo")
JOB: dict[str, Any] = {
    "name": "one-device-plan",
    "model": {"preset": "demo"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {"steps": 3, "batch_size": 2, "device": "cpu", "log_every": 1, "val_every": 0},
    "checkpoint": {"every_steps": 0, "at_end": False},
    "metrics": {"peak_tflops": 1.0},
}


def _plan(budget_bytes: int) -> Plan:
    graph = GPTSpec(config=DEMO).graph(micro_batch=2)
    cluster = ClusterSpec(devices=1, devices_per_node=1, device_memory_bytes=budget_bytes)
    config = PlannerConfig(objective="time", pareto=(), baselines=(), pipelines=False)
    return make_plan(graph, cluster, config).plan


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_a_one_device_plan_recomputes_and_trains_as_without_it(tmp_path: Path) -> None:
    plan = _plan(60 * 2**20)  # below the 67 MiB demo needs at 2 rows without recomputation
    assert (plan.dp, plan.tp) == (1, 1) and plan.recompute == {"blocks.*": Recompute.FULL}
    runs = {}
    for name, with_plan in (("plan", plan), ("plain", None)):
        job = copy.deepcopy(JOB)
        job["run_dir"] = str(tmp_path / name)
        trainer = Trainer(job, plan=with_plan)
        calls: list[int] = []
        # the model a plan laid out is its stage's one layer; a plain stage holds the blocks
        (stage,) = trainer.engine.modules.values()
        block = stage.layers[0].blocks[0] if with_plan else stage.layers[0]
        block.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        trainer.fit()
        runs[name] = (_losses(tmp_path / name), len(calls))
    # full recomputation runs each block's forward again in the backward: once more a step
    # (the evaluation at the end runs the forward alike in both)
    assert runs["plan"][1] - runs["plain"][1] == JOB["training"]["steps"]
    assert runs["plan"][0] == runs["plain"][0]  # recomputed in fp32 on the CPU: bit for bit
    assert runs["plain"][0][-1] != runs["plain"][0][0]  # the weights moved


def test_only_a_plan_of_one_device_goes_without_a_mesh() -> None:
    plan = _plan(80 * 2**30)
    assert make_mesh(plan, "cpu") is None
    two = Plan.from_dict({**plan.to_dict(), "devices": 2, "mesh": {"dp": 2, "tp": 1}})
    model = GPTSpec(config=DEMO).build(device="meta")
    with pytest.raises(
        ValueError, match=r"a plan of dp 2 x tp 1 needs its mesh: make_mesh\(plan\)"
    ):
        apply(model, two, None)
