"""Fixtures of the planner's tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


@pytest.fixture(scope="session")
def matches_every_option() -> Callable[..., float]:
    """Asserts that a bounded pipeline search finds what solving every option finds: the same
    fastest step, and the same smallest plan at each time limit (``slowdowns`` times the
    fastest; inf: at any speed), within 1e-3. Returns the fastest step."""

    def check(search: Any, every: Sequence[Any], problem: Callable[..., Any], memory: float,
              slowdowns: Sequence[float] = (math.inf,)) -> float:  # fmt: skip
        for option in every:
            option.build(problem)
            option.solve_fastest(memory_limit=memory, solver_time_limit_s=60)
        fastest = min(o.fastest_s for o in every)
        assert math.isfinite(fastest) and search.fastest is not None
        assert search.fastest.fastest_s == pytest.approx(fastest, rel=1e-3)
        for slowdown in slowdowns:
            limit = slowdown * fastest
            plans = [o.smallest(memory_limit=memory, time_limit=limit, solver_time_limit_s=60)
                     for o in every]  # fmt: skip
            found = search.smallest(time_limit=limit)
            assert found is not None
            assert found.peak_memory_bytes == pytest.approx(
                min(p.peak_memory_bytes for p in plans if p is not None), rel=1e-3
            )
        return fastest

    return check
