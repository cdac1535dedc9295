"""Fixtures of the planner's tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tidal.models import GPTConfig
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Mesh, PlannerConfig
from tidal.planner.graph import ModelGraph
from tidal.planner.search import _problem
from tidal.planner.strategies import valid_tensor_sizes

# what the pipeline search takes to build its options: each stage's meshes, each stage's ILP
SearchParts = tuple[Callable[[ClusterSpec], list[Mesh]], Callable[..., Any]]


@pytest.fixture(scope="module")
def graph() -> ModelGraph:
    """An 8-block GPT's measured graph: small enough to solve every pipeline option."""
    config = GPTConfig(vocab_size=512, seq_len=128, num_layers=8, num_heads=4, d_model=128,
                       dropout=0.1)  # fmt: skip
    return measure_gpt(config, micro_batch=1)


@pytest.fixture(scope="session")
def search_parts() -> Callable[[ModelGraph, PlannerConfig], SearchParts]:
    """The pipeline search's builders for ``graph``, as search.py makes them: every mesh of a
    stage's devices the model's tensor sizes allow, and each stage's ILP under ``config``."""

    def parts(graph: ModelGraph, config: PlannerConfig) -> SearchParts:
        def meshes(stage: ClusterSpec) -> list[Mesh]:
            sizes = valid_tensor_sizes(graph.units, stage.devices, stage.devices_per_node)
            return [Mesh(dp=stage.devices // t, tp=t) for t in sizes]

        def problem(g, mesh, stage, spec):  # noqa: ANN001, ANN202
            return _problem(g, mesh, stage, spec, config)

        return meshes, problem

    return parts
