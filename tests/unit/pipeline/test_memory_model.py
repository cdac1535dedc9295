"""The per-rank memory model of the saver planner ([Note: savers on a schedule]) against what a
pipeline run holds: under each synchronous schedule, every stage's peak of saved activations,
counted by the saved-tensor meter while ``run_local`` trains, is within 10% of the model's
prediction (the schedule's in-flight microbatches times one microbatch's saved bytes)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tidal.activations import Links, TensorClass, keep_all
from tidal.memory.activations import SavedTensorMeter
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.pipeline.savers import BlockSaves, saved_tensors
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import even_ranges
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

CONFIG = GPTConfig(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, d_model=32)
RANKS, MICROBATCHES = 2, 4


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _metered(stage: nn.Module, weights: StageWeights | None = None) -> SavedTensorMeter:
    """A meter that counts what ``stage`` saves in each of its forwards (``weights``: a stashed
    version's storage is model data too)."""
    params = {p.untyped_storage()._cdata for p in stage.parameters()}
    meter = SavedTensorMeter(is_model_storage=lambda key: key in params or (
        weights is not None and weights.is_stashed(key)))  # fmt: skip
    open_: list[contextlib.AbstractContextManager[None]] = []

    def enter(*_: object) -> None:
        open_.append(meter.tracking())
        open_[-1].__enter__()

    def leave(*_: object) -> None:  # returns None: a forward hook's value replaces the output
        open_.pop().__exit__(None, None, None)

    stage.register_forward_pre_hook(enter)
    stage.register_forward_hook(leave, always_call=True)
    return meter


def _one_microbatch_bytes(stage: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    meter = _metered(stage)
    output = stage(inputs, targets) if stage.is_last else stage(inputs)
    held = meter.live_bytes()
    del output
    return held


@pytest.mark.parametrize(("name", "virtual", "mode"),
                         [("gpipe", 1, WeightMode.CURRENT), ("1f1b", 1, WeightMode.CURRENT),
                          ("interleaved", 2, WeightMode.CURRENT),
                          ("pipedream", 1, WeightMode.STASH), ("2bw", 1, WeightMode.TWO_VERSIONS),
                          ("pipemare", 1, WeightMode.CURRENT)])  # fmt: skip
def test_each_stages_measured_peak_is_the_models_within_10_percent(
    name: str, virtual: int, mode: WeightMode
) -> None:
    """Activations in flight and, under PipeDream and 2BW, the stashed weight versions."""
    steps = 3 if name in ("pipedream", "2bw", "pipemare") else 1
    schedule = make_schedule(name, stages=RANKS, microbatches=MICROBATCHES, virtual=virtual,
                             steps=steps)  # fmt: skip
    num_stages = schedule.num_stages
    sim = simulate(schedule)

    # One microbatch's saved bytes per stage, each stage fed what the one before gives.
    probe = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(CONFIG.num_layers, num_stages))
    rows = 8 // MICROBATCHES
    x, targets = _batch(0)
    x, targets = x[:rows], targets[:rows]
    per_microbatch = []
    for stage in probe:
        per_microbatch.append(_one_microbatch_bytes(stage, x, targets))
        if not stage.is_last:
            x = stage(x).detach().requires_grad_()

    blocks = [BlockSaves(stage=s, block=s, bytes_by_class={TensorClass.OTHER: n}, forward_s=1.0)
              for s, n in enumerate(per_microbatch)]  # fmt: skip
    weight_bytes = [sum(p.numel() * p.element_size() for p in stage.parameters())
                    for stage in probe]  # fmt: skip
    saved = saved_tensors(sim, blocks, weight_bytes=weight_bytes)
    links = Links(stage_rank=tuple(range(num_stages)), budget_bytes=(1 << 40,) * num_stages,
                  base_bytes=(0,) * num_stages, host_link=(0,) * num_stages,
                  host_bandwidth=(1e9,), host_budget_bytes=(None,),
                  peer_bandwidth=tuple((0.0,) * num_stages for _ in range(num_stages)))  # fmt: skip
    predicted = keep_all(saved, links).peak_bytes  # per stage (a stage per "rank" here)

    stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(CONFIG.num_layers, num_stages))
    weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.1),
                            AsyncConfig(weights=mode, microbatches_per_update=MICROBATCHES))
               for s in stages]  # fmt: skip
    meters = [_metered(stage, w) for stage, w in zip(stages, weights, strict=True)]
    measured = [0] * num_stages
    for s, stage in enumerate(stages):  # each forward's end: activations and versions held
        stage.register_forward_hook(
            lambda *_, s=s: measured.__setitem__(s, max(
                measured[s], meters[s].live_bytes() + weights[s].stashed_bytes)))  # fmt: skip
    run_local(schedule, stages, weights, _batch, lambda _: 0.1)
    measured = [max(m, meter.take_peak_bytes()) for m, meter in zip(measured, meters, strict=True)]
    assert sim.peak_activations[0] > sim.peak_activations[-1] or name == "gpipe"
    for s in range(num_stages):
        assert abs(measured[s] - predicted[s]) <= 0.1 * predicted[s], (name, s, measured, predicted)
