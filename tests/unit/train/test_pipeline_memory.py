"""``pipeline.memory`` ([Note: pipeline memory] in tidal/train/pipeline_memory.py): 'selective'
recomputes each block's attention part and keeps the rest, blocks without one refused in one
line; PipeDream's stashed versions planned onto peers and carried out."""

from __future__ import annotations

from typing import Any

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


def test_pipedream_lends_its_stashed_versions_where_they_do_not_fit_and_trains_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: stashes on a peer] in tidal/runtime/weights.py, planned and carried out: PipeDream
    updating after every microbatch on 4 stages, the first (3 blocks) keeps 3 stashed versions;
    under 3150 KiB a rank with peer swap only, the plan lends them striped over two later ranks
    and the pipeline trains bit for bit as without a budget, stage 0 keeping no stash."""
    import tidal.train.pipeline_memory as pipeline_memory
    from tidal.activations import TensorClass
    from tidal.pipeline.schedules import make_schedule
    from tidal.runtime.local import run_local
    from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode
    from tidal.train.links import Links as MeasuredLinks
    from tidal.train.pipeline_memory import MemoryProbe

    # a process without peers measures no peer link: these stand in for what ranks measure
    monkeypatch.setattr(pipeline_memory, "measure_links",
                        lambda device: MeasuredLinks(host_bytes_per_s=1e9, peer_bytes_per_s=1e9))  # fmt: skip
    config = GPTConfig(vocab_size=64, seq_len=4, num_layers=6, num_heads=2, d_model=64)
    ranges = [(0, 3), (3, 4), (4, 5), (5, 6)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(step))
        return tokens[:, :-1], tokens[:, 1:]

    job = load_job("tiny", overrides={
        "pipeline": {"stages": 4, "microbatches": 1, "schedule": "pipedream", "memory": "peer"},
        "training": {"device": "cpu", "batch_size": 1}, "memory": {"device_budget": "3150KiB"},
        "model": {"tie_embeddings": False}})  # fmt: skip

    def run(budget: bool) -> tuple[list[torch.Tensor], list[float], list[int], Any]:
        stages = split_gpt(build_gpt(config, seed=0), ranges)
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.STASH)) for s in stages]  # fmt: skip
        lending, memory = None, None
        if budget:
            probe = MemoryProbe(*batch(0), block_forward_s=lambda s, b: 1e-4)
            memory = plan_pipeline_memory(job, stages, mine=range(4), rank=0, world_size=4,
                                          device=torch.device("cpu"), probe=probe)  # fmt: skip
            memory.bind(dict(enumerate(weights)))
            lending = memory.lending
        stashed = [0]

        def lr(_: int) -> float:
            stashed[0] = max(stashed[0], weights[0].stashed_bytes)
            return 0.5

        result = run_local(make_schedule("pipedream", stages=4, microbatches=1, steps=8), stages,
                           weights, batch, lr, lending=lending)  # fmt: skip
        params = [p.detach().clone() for s in stages for p in s.parameters()]
        return params, list(result.losses), [stashed[0], *result.peak_held_bytes], memory

    params, losses, (stashed, *held), memory = run(True)
    plain_params, plain_losses, (plain_stashed, *_), _ = run(False)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    assert memory is not None and memory.plan is not None and memory.plan.fits
    version = next(k for k, item in enumerate(memory.plan.saved)
                   if item.stage == 0 and item.tensor_class is TensorClass.WEIGHTS)  # fmt: skip
    stripe = memory.plan.stripe(version)
    assert stripe is not None and len(stripe.lenders) == 2, memory.plan.choices[version]
    assert sorted(memory.stashes_lent) == [0] and memory.figures(0)["stashes_lent"] == [0]
    assert stashed == 0 < plain_stashed  # no stash on stage 0: its versions were away
    assert all(held[r] > 0 for r in stripe.lenders), held
