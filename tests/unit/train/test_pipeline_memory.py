"""``pipeline.memory = 'selective'`` ([Note: pipeline memory] in tidal/train/pipeline_memory.py):
each block's attention part is recomputed and the rest kept; blocks without one are refused in
one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.models.gpt import GPTConfig, build_gpt, split_gpt
from tidal.pipeline.split import PipelineStage
from tidal.train.job import JobConfig, load_job
from tidal.train.pipeline_memory import plan_pipeline_memory


def _job(memory: str) -> JobConfig:
    return load_job("tiny", overrides={"pipeline": {"stages": 2, "memory": memory},
                                       "training": {"device": "cpu"}})  # fmt: skip


def test_selective_recomputes_each_blocks_attention_part_and_keeps_the_rest() -> None:
    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, d_model=32)
    stages = split_gpt(build_gpt(config, seed=0), [(0, 2), (2, 4)])
    memory = plan_pipeline_memory(_job("selective"), stages, mine=[0, 1], rank=0, world_size=2,
                                  device=torch.device("cpu"), probe=None)  # fmt: skip
    recomputed = sorted(path for h in memory.handles for path in h.recomputed)
    assert recomputed == ["layers.0.attn", "layers.0.attn", "layers.1.attn", "layers.1.attn"]
    assert all(not h.swapped for h in memory.handles)
    whole = plan_pipeline_memory(_job("recompute"), stages, mine=[0], rank=0, world_size=2,
                                 device=torch.device("cpu"), probe=None)  # fmt: skip
    assert sorted(p for h in whole.handles for p in h.recomputed) == ["layers.0", "layers.1"]


def test_selective_on_blocks_without_an_attention_part_is_one_line() -> None:
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)]
    stage = PipelineStage(stage_index=0, num_stages=1, embed=None, layers=blocks, head=None)
    with pytest.raises(ConfigError, match=r"'selective' recomputes each block's attention part"
                                          r".*stage 0's blocks have none; use 'recompute'"):  # fmt: skip
        plan_pipeline_memory(_job("selective"), [stage], mine=[0], rank=0, world_size=1,
                             device=torch.device("cpu"), probe=None)  # fmt: skip
