"""Plans for a model of your own, traced on a sample of its inputs ([Note: models without
tokens] in tidal/planner/wiring.py): linears keep their tensor-parallel splits, everything else
takes whole activations, and a plan made for other inputs is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.parallel.plan_layout import check_plan_fits
from tidal.planner import Layout, PlannerConfig, StrategyName, plan_for
from tidal.planner.cluster import ClusterSpec, Mesh
from tidal.planner.strategies import TrainingSpec, unit_options
from tidal.planner.wiring import structure_graph

CONFIG = PlannerConfig(tp=2, eps=1000, pareto=(), baselines=(), pipelines=False)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def test_a_model_traced_on_images_splits_only_its_linears() -> None:
    graph = structure_graph(_cnn(), inputs=(torch.randn(4, 1, 12, 12),))
    assert not graph.tokens and graph.micro_batch == 4
    spec = TrainingSpec(num_microbatches=1, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    cluster = ClusterSpec(devices=2, devices_per_node=2)
    options = unit_options(graph, Mesh(dp=1, tp=2), cluster, spec)
    for unit in graph.units:
        layouts = {c.in_layout for c in options[unit.name]} | {
            c.out_layout for c in options[unit.name]
        }
        assert Layout.SEQ not in layouts, unit.name
        if unit.kind != "linear":  # a convolution, a norm, a pooling: whole activations only
            assert layouts == {Layout.R}, (unit.name, unit.kind)
    linear = {c.strategy for u in graph.units if u.kind == "linear" for c in options[u.name]}
    assert {StrategyName.COLWISE, StrategyName.ROWWISE} <= linear


def test_a_plan_for_your_model_splits_its_linears_and_checks_against_it() -> None:
    model = _cnn()
    plan = plan_for(model, torch.randn(4, 1, 12, 12), devices=2, config=CONFIG)
    assert plan.tp == 2 and plan.micro_batch == 4
    split = [u for u in plan.units if u.strategy is not StrategyName.REPLICATE]
    assert split and all(u.kind == "linear" for u in split)
    graph = structure_graph(model, inputs=(torch.randn(4, 1, 12, 12),))
    check_plan_fits(plan, model, world_size=2, seq_len=graph.seq_len, graph=graph)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    other = structure_graph(mlp, inputs=(torch.randn(4, 16),))
    with pytest.raises(ConfigError, match=r"another model .*plan_for\(model, inputs, devices=2\)"):
        check_plan_fits(plan, mlp, world_size=2, seq_len=other.seq_len, graph=other)
