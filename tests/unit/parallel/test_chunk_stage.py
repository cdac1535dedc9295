"""Chunk stages (tidal/parallel/chunk_stage.py) in ``run_local`` against plain stages.

A tiny GPT with tied embeddings is split into 2 and 4 stages; the same stages run once with
:class:`StageWeights` and torch's AdamW and once with their parameters in chunks under device
budgets that force evictions (each stage at the least budget its own unlimited run measured).
Three clipped steps must give the same losses and parameters (1e-5) for gpipe, 1f1b and
interleaved, and no stage may go over its budget.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.config import ChunkConfig
from tidal.memory.store import DeviceBudgetTooSmall
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.parallel.chunk_stage import ChunkStageConfig, ChunkStageParams, require_synchronous
from tidal.parallel.config import MemoryConfig, OptimizerConfig
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import even_ranges, tied_parameters
from tidal.runtime.executor import UpdateRules
from tidal.runtime.local import LocalResult, run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode
from tidal.runtime.precision import LossScaler

ATOL = 1e-5
STEPS = 3
MAX_NORM = 0.5  # below the tiny GPT's gradient norm: every step clips
OPTIMIZER = OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1)
CHUNK = ChunkConfig(size=256, align=16)  # about ten chunks a stage


def lr_at(step: int) -> float:
    return 1e-2 * (1.0 + step) / STEPS  # a rate per step: step() must take the one it is given


def tiny_gpt() -> nn.Module:
    config = GPTConfig(
        vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16, tie_embeddings=True
    )
    return build_gpt(config, seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (4, 9), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def adamw(stage: nn.Module) -> torch.optim.Optimizer:
    """torch's AdamW with the chunk optimizer's groups (decay on matrices only)."""
    params = list(stage.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIMIZER.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=OPTIMIZER.lr, betas=(OPTIMIZER.beta1, OPTIMIZER.beta2),
                             eps=OPTIMIZER.eps, fused=True)  # fmt: skip


def run(
    name: str, ranks: int, m: int, virtual: int, weights_of, scaler: LossScaler | None = None
) -> tuple[list[nn.Module], list, LocalResult]:
    schedule = make_schedule(name, stages=ranks, microbatches=m, virtual=virtual, steps=STEPS)
    stages = split_gpt(tiny_gpt(), even_ranges(4, schedule.num_stages))
    rules = UpdateRules(max_grad_norm=MAX_NORM, tied=tuple(tied_parameters(stages)))
    assert rules.tied, "the tied embedding should span the first and last stage"
    weights = [weights_of(s, stage) for s, stage in enumerate(stages)]
    result = run_local(schedule, stages, weights, batch, lr_at, rules=rules, scaler=scaler)
    return stages, weights, result


def plain(_index: int, stage: nn.Module) -> StageWeights:
    return StageWeights(stage, adamw(stage), AsyncConfig(weights=WeightMode.CURRENT))


def chunked(budgets: list[int | None] | None = None):
    def make(index: int, stage: nn.Module) -> ChunkStageParams:
        budget = None if budgets is None else budgets[index]
        config = ChunkStageConfig(optimizer=OPTIMIZER, memory=MemoryConfig(device_budget=budget),
                                  chunk=CHUNK)  # fmt: skip
        return ChunkStageParams(stage, config)

    return make


CASES = [
    ("gpipe", 2, 4, 1),
    ("1f1b", 2, 4, 1),
    ("1f1b", 4, 3, 1),
    ("interleaved", 2, 2, 2),
]


@pytest.mark.parametrize(("name", "ranks", "m", "virtual"), CASES)
def test_chunk_stages_equal_plain_stages_under_tight_budgets(name, ranks, m, virtual):
    stages, _, want = run(name, ranks, m, virtual, plain)
    _, probes, _ = run(name, ranks, m, virtual, chunked())
    least = [w.stats()["min_device_bytes"] for w in probes]  # [Note: the least budget]
    budgets = [int(b) for b in least]
    _, weights, got = run(name, ranks, m, virtual, chunked(budgets))

    assert got.losses == pytest.approx(want.losses, abs=ATOL)
    assert len(set(got.losses)) == STEPS  # the steps changed the weights
    initial = split_gpt(tiny_gpt(), even_ranges(4, len(stages)))
    for s, (ref, w) in enumerate(zip(stages, weights, strict=True)):
        values = w.model_state_dict()
        start = dict(initial[s].named_parameters())
        for pname, p in ref.named_parameters():
            torch.testing.assert_close(values[pname], p.detach(), atol=ATOL, rtol=0, msg=pname)
            assert not torch.equal(values[pname], start[pname].detach()), pname
        stats = w.stats()
        assert stats["evictions"] > 0, (s, stats)
        assert stats["peak_device_bytes"] <= budgets[s], (s, stats["peak_device_bytes"])
        assert w.version == STEPS
        # a step repeats the same moments: the first step's trace is followed throughout
        assert stats["traces_recorded"] == 1, (s, stats["traces_recorded"])
    # the budget is tight: the stages' whole model data would not fit
    assert any(
        budgets[s] < sum(w.stats()["model_data_bytes"].values()) for s, w in enumerate(weights)
    )


def test_a_budget_below_the_step_names_its_least():
    _, probes, _ = run("gpipe", 2, 4, 1, chunked())
    least = probes[0].stats()["min_device_bytes"]
    # the step is measured over the budget and its figure named: the same as the probe's
    with pytest.raises(DeviceBudgetTooSmall, match=f"needs at least {least:,} bytes"):
        run("gpipe", 2, 4, 1, chunked([least // 2, None]))


def test_a_non_model_budget_keeps_the_chunks_room_when_activations_grow():
    """``memory.non_model_budget`` ([Note: non-model memory] in tidal/memory/activations.py):
    one byte below the least budget the step fails; with half the activations' peak set aside
    for them, the chunks keep the rest, the activations above it go over the budget (and are
    reported), and the step runs as plain stages do."""
    _, _, want = run("1f1b", 2, 4, 1, plain)
    _, probes, _ = run("1f1b", 2, 4, 1, chunked())
    least = [int(w.stats()["min_device_bytes"]) for w in probes]
    peaks = [int(w.stats()["peak_non_model_bytes"]) for w in probes]
    budgets = [b - 1 for b in least]
    with pytest.raises(DeviceBudgetTooSmall):
        run("1f1b", 2, 4, 1, chunked(budgets))

    def capped(index: int, stage: nn.Module) -> ChunkStageParams:
        memory = MemoryConfig(device_budget=budgets[index], non_model_budget=peaks[index] // 2)
        return ChunkStageParams(stage, ChunkStageConfig(optimizer=OPTIMIZER, memory=memory,
                                                        chunk=CHUNK))  # fmt: skip

    _, weights, got = run("1f1b", 2, 4, 1, capped)
    assert got.losses == pytest.approx(want.losses, abs=ATOL)
    for s, w in enumerate(weights):
        stats = w.stats()
        assert stats["non_model_over_budget_bytes"] == peaks[s] - peaks[s] // 2, (s, stats)
        assert stats["peak_device_bytes"] <= budgets[s] and stats["evictions"] > 0, (s, stats)


def test_forward_refuses_another_version():
    stage = split_gpt(tiny_gpt(), even_ranges(4, 2))[0]
    weights = chunked()(0, stage)
    with pytest.raises(ValueError, match="synchronous schedule"), weights.forward(0, version=1):
        pass
    with weights.forward(0, version=0):
        stage(batch(0)[0])
    assert weights.version == 0


def test_asynchronous_schedules_are_refused():
    schedule = make_schedule("pipedream", stages=2, microbatches=2, steps=3)
    with pytest.raises(ConfigError, match="pipedream keeps older weight versions"):
        require_synchronous(schedule)
    require_synchronous(make_schedule("pipemare", stages=2, microbatches=2, steps=3))
    require_synchronous(make_schedule("1f1b", stages=2, microbatches=4))
    stages = split_gpt(tiny_gpt(), even_ranges(4, 2))
    weights = [chunked()(s, stage) for s, stage in enumerate(stages)]
    with pytest.raises(RuntimeError, match="in flight at the step.s end"):
        run_local(schedule, stages, weights, batch, lr_at)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_stages_follow_fp32_under_a_budget(precision):
    # bf16/fp16 parameter chunks with fp32 masters, the forward under autocast: close to fp32,
    # not equal, and the gradients of every microbatch summed in fp32 gradient chunks; fp16's
    # loss scale is the pipeline's (the one update: prepare_update unscales before the step)
    def make(precision: str):
        def stage_params(_index: int, stage: nn.Module) -> ChunkStageParams:
            config = ChunkStageConfig(optimizer=OPTIMIZER, chunk=CHUNK, precision=precision,
                                      memory=MemoryConfig(device_budget=60_000))  # fmt: skip
            return ChunkStageParams(stage, config)

        return stage_params

    scaler = LossScaler(precision)
    _, fp32, want = run("1f1b", 2, 4, 1, make("fp32"))
    _, low, got = run("1f1b", 2, 4, 1, make(precision), scaler=scaler)
    assert got.losses == pytest.approx(want.losses, abs=1e-2)
    assert got.losses != want.losses
    assert scaler.scale == (2.0**16 if precision == "fp16" else 1.0) / 2**scaler.skipped_steps
    for a, b in zip(fp32, low, strict=True):
        assert b.store.chunks[0].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        assert not b.optimizer.grads_in_params
        assert b.stats()["evictions"] > 0
        assert b.stats()["peak_device_bytes"] <= 60_000
        values, ref = b.model_state_dict(), a.model_state_dict()
        assert max((values[k] - ref[k]).abs().max().item() for k in ref) < 0.05


# [Note: PipeMare on chunk stages]: LR rescheduling on, T1 past the run so every update divides
PIPEMARE = AsyncConfig(weights=WeightMode.CURRENT, lr_rescheduling=True, lr_warmup_steps=8)


def run_pipemare(name: str, ranks: int, m: int, weights_of, *,
                 tie: bool = False) -> tuple[list, LocalResult]:  # fmt: skip
    schedule = make_schedule(name, stages=ranks, microbatches=m, steps=STEPS)
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16,
                       tie_embeddings=tie)  # fmt: skip
    stages = split_gpt(build_gpt(config, seed=0), even_ranges(4, schedule.num_stages))
    weights = [weights_of(s, stage) for s, stage in enumerate(stages)]
    tied = tuple(tied_parameters(stages))
    assert bool(tied) == tie
    rules = UpdateRules(max_grad_norm=MAX_NORM, tied=tied)
    return weights, run_local(schedule, stages, weights, batch, lr_at, rules=rules)


@pytest.mark.parametrize(("name", "ranks", "m", "tie"), [
    ("pipemare", 2, 2, False), ("pipemare", 4, 2, False), ("pipemarew", 2, 4, False),
    ("pipemare", 2, 2, True),  # the head follows the embedding: [Note: tied matrices ...]
])  # fmt: skip
def test_pipemare_on_chunk_stages_equals_plain_pipemare_bit_for_bit(name, ranks, m, tie):
    """Updates with microbatches in flight, under budgets that evict: the backward unpacks the
    chunks' current weights, as plain stages' redirection gives them, and each update's rate is
    rescheduled by the same measured delays. A tied head's chunk is moved by its zero gradient
    and then written with the embedding's value, which plain stages never step."""

    def plain(_index: int, stage: nn.Module) -> StageWeights:
        return StageWeights(stage, adamw(stage), PIPEMARE)

    def chunk_stages(budgets: list[int] | None):
        def make(index: int, stage: nn.Module) -> ChunkStageParams:
            budget = None if budgets is None else budgets[index]
            config = ChunkStageConfig(optimizer=OPTIMIZER, chunk=CHUNK,
                                      memory=MemoryConfig(device_budget=budget))  # fmt: skip
            return ChunkStageParams(stage, config, weights=PIPEMARE)

        return make

    reference, want = run_pipemare(name, ranks, m, plain, tie=tie)
    probes, _ = run_pipemare(name, ranks, m, chunk_stages(None), tie=tie)
    budgets = [int(w.stats()["min_device_bytes"]) for w in probes]
    weights, got = run_pipemare(name, ranks, m, chunk_stages(budgets), tie=tie)

    assert got.losses == want.losses and got.lrs == want.lrs and got.delays == want.delays
    simulated = simulate(make_schedule(name, stages=ranks, microbatches=m, steps=STEPS)).delay
    assert tuple(max(got.stage_delays(s)) for s in range(ranks)) == tuple(simulated)
    assert max(simulated) >= 1  # the first stage really ran on stale weights
    if max(simulated) > 1:  # an update's mean delay above 1 divides its rate
        assert any(lr < lr_at(step) for (_, step), lr in got.lrs.items()), got.lrs
    for s, (ref, w) in enumerate(zip(reference, weights, strict=True)):
        values = w.model_state_dict()
        for pname, p in ref.module.named_parameters():
            assert torch.equal(values[pname], p.detach()), (s, pname)
        stats = w.stats()
        assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= budgets[s], (s, stats)
        assert w.version == STEPS and w.delays == {mb: tau for (st, mb), tau in got.delays.items()
                                                   if st == s}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "says"),
    [({"correction": True}, "pipeline.correction"), ({"prediction": True}, "pipeline.prediction"),
     ({"weights": WeightMode.STASH}, "keeps older weight versions")],
)  # fmt: skip
def test_pipemare_on_chunk_stages_refuses_what_needs_a_second_copy(change, says):
    stage = split_gpt(tiny_gpt(), even_ranges(4, 2))[0]
    config = ChunkStageConfig(optimizer=OPTIMIZER, chunk=CHUNK)
    weights = dataclasses.replace(PIPEMARE, **change)
    with pytest.raises(ConfigError, match=says):
        ChunkStageParams(stage, config, weights=weights)


def test_a_stage_of_the_whole_model_keeps_its_bf16_gradients_in_the_parameter_slots():
    """[Note: gradients in parameter slots]: one stage, one backward a step, one process: the
    chunk engine's saving (no fp32 gradient chunks), the same training within bf16's rounding;
    with two backwards a step the slots cannot sum them, so the fp32 chunks stay, and asking
    for the slots there is refused in one line."""
    config = ChunkStageConfig(optimizer=OPTIMIZER, chunk=CHUNK, precision="bf16",
                              memory=MemoryConfig(device_budget=120_000))  # fmt: skip

    def train(whole_model: bool, microbatches: int = 1) -> tuple[ChunkStageParams, LocalResult]:
        stages = split_gpt(tiny_gpt(), [(0, 4)])
        held = ChunkStageParams(stages[0], config, microbatches_per_step=microbatches,
                                whole_model=whole_model)  # fmt: skip
        schedule = make_schedule("1f1b", stages=1, microbatches=microbatches, steps=STEPS)
        rules = UpdateRules(max_grad_norm=MAX_NORM)
        return held, run_local(schedule, stages, [held], batch, lr_at, rules=rules)

    slots, got = train(whole_model=True)
    chunks, want = train(whole_model=False)
    assert slots.optimizer.grads_in_params and slots.optimizer.grad_bytes == 0
    assert not chunks.optimizer.grads_in_params and chunks.optimizer.grad_bytes > 0
    assert got.losses == pytest.approx(want.losses, abs=1e-2)
    assert slots.stats()["peak_device_bytes"] <= 120_000 and slots.stats()["evictions"] > 0
    accumulating, _ = train(whole_model=True, microbatches=2)
    assert not accumulating.optimizer.grads_in_params
    stage = split_gpt(tiny_gpt(), [(0, 4)])[0]
    asked = dataclasses.replace(config, chunk=dataclasses.replace(CHUNK, grads_in_params=True))
    with pytest.raises(ConfigError, match="chunk.grads_in_params: .*one backward a step"):
        ChunkStageParams(stage, asked, microbatches_per_step=2, whole_model=True)
