"""Fixtures of the planner's tests."""

from __future__ import annotations

import pytest

from tidal.models import GPTConfig
from tidal.models.gpt import measure_gpt
from tidal.planner.graph import ModelGraph


@pytest.fixture(scope="module")
def graph() -> ModelGraph:
    """An 8-block GPT's measured graph: small enough to solve every pipeline option."""
    config = GPTConfig(vocab_size=512, seq_len=128, num_layers=8, num_heads=4, d_model=128,
                       dropout=0.1)  # fmt: skip
    return measure_gpt(config, micro_batch=1)
