"""``run_local``: every rank's program of a schedule in one process, against one-process training.

A tiny GPT is split into stages; one SGD step of the pipeline must give the parameters (hence
the gradients) and the loss of one step of the whole model on the whole batch.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tidal.config import ConfigError
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.pipeline.ir import Action, Kind, Schedule, parse_program
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import even_ranges, tied_parameters
from tidal.runtime.executor import (
    LocalTransport,
    MessageKey,
    PipelineDeadlock,
    UpdateRules,
)
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

ATOL = 1e-6
LR = 0.5


def tiny_gpt(*, tie: bool = False, layers: int = 4) -> torch.nn.Module:
    config = GPTConfig(
        vocab_size=64, seq_len=8, num_layers=layers, num_heads=2, d_model=16, tie_embeddings=tie
    )
    return build_gpt(config, seed=0)


def batch(step: int, rows: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (rows, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def stage_weights(stages, config: AsyncConfig | None = None) -> list[StageWeights]:
    config = config or AsyncConfig(weights=WeightMode.CURRENT)
    return [StageWeights(s, torch.optim.SGD(s.parameters(), lr=LR), config) for s in stages]


def reference_step(model, batch_fn, max_norm: float | None = None) -> float:
    idx, targets = batch_fn(0)
    loss = model(idx, targets)
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return float(loss.detach())


def assert_stages_match(model, stages) -> None:
    whole = dict(model.named_parameters())
    checked = 0
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(
                p, whole[stage.source_names[name]], atol=ATOL, rtol=0, msg=name
            )
            checked += 1
    assert checked >= len(whole)


def run_pipeline(name, ranks, m, *, virtual=1, tie=False, rows=4, max_norm=None):
    model = tiny_gpt(tie=tie)
    schedule = make_schedule(name, stages=ranks, microbatches=m, virtual=virtual)
    stages = split_gpt(copy.deepcopy(model), even_ranges(4, schedule.num_stages))
    rules = UpdateRules(max_grad_norm=max_norm, tied=tuple(tied_parameters(stages)))

    def batch_fn(step):
        return batch(step, rows=rows)

    result = run_local(schedule, stages, stage_weights(stages), batch_fn, lambda _: LR, rules=rules)
    ref_loss = reference_step(model, batch_fn, max_norm)
    return model, stages, result, ref_loss


@pytest.mark.parametrize(
    ("name", "ranks", "m", "virtual"),
    [
        ("gpipe", 1, 2, 1),
        ("gpipe", 2, 4, 1),
        ("gpipe", 4, 2, 1),  # m < p
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 3, 1),  # m < p
        ("interleaved", 2, 2, 2),
        ("interleaved", 1, 2, 4),  # four stages on one rank: hand-offs without messages
    ],
)
def test_sync_step_equals_whole_model(name, ranks, m, virtual):
    model, stages, result, ref_loss = run_pipeline(name, ranks, m, virtual=virtual)
    assert_stages_match(model, stages)
    assert result.losses == pytest.approx([ref_loss], abs=ATOL)
    assert set(result.delays.values()) == {0}  # a flushed step has no delay


def test_split_weight_gradient_actions():
    # 1F1B with every B split into B (input gradient) and a later W (weight gradient).
    model = tiny_gpt()
    base = make_schedule("1f1b", stages=2, microbatches=2)
    programs = []
    for program in base.programs:
        out, deferred = [], []
        for a in program:
            if a.kind is Kind.UPDATE:
                out += deferred
            out.append(a)
            if a.kind is Kind.BACKWARD:
                deferred.append(
                    Action(stage=a.stage, kind=Kind.WEIGHT_GRAD, microbatch=a.microbatch)
                )
        programs.append(tuple(out))
    schedule = dataclasses.replace(base, programs=tuple(programs))
    assert sum(a.kind is Kind.WEIGHT_GRAD for _, a in schedule.actions()) == 4
    stages = split_gpt(copy.deepcopy(model), even_ranges(4, 2))
    result = run_local(schedule, stages, stage_weights(stages), batch, lambda _: LR)
    ref_loss = reference_step(model, batch)
    assert_stages_match(model, stages)
    assert result.losses == pytest.approx([ref_loss], abs=ATOL)


def test_uneven_microbatches_tied_and_clipped():
    # 5 rows in 3 microbatches (2, 2, 1): the row-weighted mean is the whole batch's mean.
    model, stages, result, ref_loss = run_pipeline("1f1b", 2, 3, tie=True, rows=5, max_norm=0.05)
    assert tied_parameters(stages), "the tied embedding should span the first and last stage"
    assert_stages_match(model, stages)
    assert result.losses == pytest.approx([ref_loss], abs=ATOL)


def test_more_microbatches_than_rows_is_refused():
    with pytest.raises(ConfigError, match="microbatches"):
        run_pipeline("gpipe", 2, 5, rows=4)


def test_deadlocking_program_raises():
    stages = split_gpt(tiny_gpt(), even_ranges(4, 2))
    # Rank 0 waits for stage 1's gradient before it has sent stage 1 anything.
    programs = (tuple(parse_program("0B0 0F0 0U")), tuple(parse_program("1F0 1B0 1U")))
    schedule = Schedule(
        name="bad", num_ranks=2, num_stages=2, num_microbatches=1, programs=programs
    )
    with pytest.raises(PipelineDeadlock, match="no rank can move"):
        run_local(schedule, stages, stage_weights(stages), batch, lambda _: LR)


def test_async_delays_equal_the_simulator():
    model = tiny_gpt()
    schedule = make_schedule("pipemare", stages=4, microbatches=2, steps=3)
    stages = split_gpt(model, even_ranges(4, 4))
    result = run_local(schedule, stages, stage_weights(stages), batch, lambda _: 0.01)
    assert result.delays == simulate(schedule).delays
    assert max(result.stage_delays(0)) >= 1  # the first stage does see stale weights
    assert len(result.losses) == 3


@pytest.mark.parametrize(
    ("name", "ranks", "m", "config"),
    [
        ("pipemare", 2, 2, AsyncConfig(weights=WeightMode.CURRENT)),
        ("pipemare", 4, 2, AsyncConfig(weights=WeightMode.CURRENT)),  # m < p: the last waits
        ("pipemare", 2, 2, AsyncConfig(weights=WeightMode.CURRENT, correction=True)),
        ("pipedream", 2, 1, AsyncConfig(weights=WeightMode.STASH)),
    ],
)
def test_async_tied_copy_follows_its_owner_one_version_behind(name, ranks, m, config):
    # [Note: tied matrices without a flush]: the owner (the embedding, stage 0) takes the summed
    # gradient; at version v the head holds the owner's version v - 1 (0 while v <= 1), and
    # the copies are equal when the program ends.
    stages = split_gpt(tiny_gpt(tie=True), even_ranges(4, ranks))
    (((_, owner_name), (last, head_name)),) = tied = tuple(tied_parameters(stages))
    weights = [StageWeights(s, torch.optim.AdamW(s.parameters(), lr=0.05), config)
               for s in stages]  # fmt: skip
    owner_values = [dict(stages[0].named_parameters())[owner_name].detach().clone()]
    owner_step = weights[0].step

    def recording_step(**kwargs):
        lr = owner_step(**kwargs)
        owner_values.append(dict(stages[0].named_parameters())[owner_name].detach().clone())
        return lr

    weights[0].step = recording_step
    seen = []
    head = dict(stages[last].named_parameters())[head_name]
    stages[last].register_forward_pre_hook(
        lambda *_: seen.append((weights[last].version, head.detach().clone()))
    )
    schedule = make_schedule(name, stages=ranks, microbatches=m, steps=4)
    rules = UpdateRules(tied=tied, max_grad_norm=1.0)
    result = run_local(schedule, stages, weights, batch, lambda _: 0.05, rules=rules)
    assert len(owner_values) == 5 and len(seen) == 4 * m
    assert {v for v, _ in seen} == {0, 1, 2, 3}
    for version, value in seen:
        assert torch.equal(value, owner_values[max(version - 1, 0)]), version
    assert not torch.equal(owner_values[1], owner_values[0])
    assert torch.equal(head, owner_values[-1])
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_async_tied_owner_steps_on_the_sum_of_both_gradients():
    # One pipemare update (m = 1, one step): SGD's update of the owner is -lr times the sum of
    # the embedding's and the head's gradients, which one backward of the whole tied model gives.
    model = tiny_gpt(tie=True)
    stages = split_gpt(copy.deepcopy(model), even_ranges(4, 2))
    schedule = make_schedule("pipemare", stages=2, microbatches=1, steps=1)
    rules = UpdateRules(tied=tuple(tied_parameters(stages)))
    run_local(schedule, stages, stage_weights(stages), batch, lambda _: LR, rules=rules)
    reference_step(model, batch)
    assert_stages_match(model, stages)


def test_local_transport_keys():
    transport = LocalTransport()
    key = MessageKey(1, 0, 3)
    assert not transport.ready(key)
    transport.send(key, torch.ones(2))
    assert transport.ready(key) and len(transport) == 1
    assert torch.equal(transport.recv(key), torch.ones(2))
    assert key.direction.value == "backward"
    assert len(transport) == 0
