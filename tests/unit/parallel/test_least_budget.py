"""``min_device_bytes`` is the least budget a run trains in, and less fails before any update.

[Note: the least budget] in tidal/memory/store.py. Before release moments the trace charged the
loss's activations to ``fwd:lm_head`` together with its chunk, so a budget a few percent under
the reported minimum got through forward and backward and then failed inside ``step()`` with a
raw ValueError; the minimum covered the last iteration only, and the error named what one
moment needed, so following it climbed a few hundred bytes per try.
"""

from __future__ import annotations

import pytest
import torch

from tidal.config import ConfigError
from tidal.memory.config import ChunkConfig
from tidal.memory.store import DeviceBudgetTooSmall
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.train import OptimizerConfig, TrainingConfig

TINY = preset("tiny")


def _batches(lengths: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 256, (4, n + 1), generator=g) for n in lengths]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _engine(budget: int | None, size: int | None) -> ChunkEngine:
    return ChunkEngine(
        build_gpt(TINY, seed=0),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=size),
    )


def _train(engine: ChunkEngine, batches) -> None:
    for inputs, targets in batches:
        engine.backward(engine(inputs, targets))
        engine.step()


def _least(lengths: tuple[int, ...], size: int | None) -> tuple[int, list[int]]:
    """The run's minimum, and each iteration's own, from an unlimited run."""
    probe = _engine(None, size)
    each = []
    for batch in _batches(lengths):
        _train(probe, [batch])
        each.append(probe.stats()["min_device_bytes_last_trace"])
    return probe.stats()["min_device_bytes"], each


@pytest.mark.parametrize("size", [None, 1024], ids=["searched", "small-chunks"])
@pytest.mark.parametrize("lengths", [(64, 64, 64), (64, 16, 32)], ids=["fixed", "varying"])
def test_the_minimum_trains_and_less_fails_before_any_update(lengths, size) -> None:
    minimum, each = _least(lengths, size)
    assert minimum == max(each)  # over every iteration, not the last one's
    if len(set(lengths)) > 1:
        assert each[-1] < minimum
    engine = _engine(minimum, size)
    _train(engine, _batches(lengths) * 2)
    assert engine.stats()["peak_device_bytes"] <= minimum
    assert engine.stats()["min_device_bytes"] == minimum

    short = int(minimum * 0.97)
    engine = _engine(short, size)
    before = engine.model_state_dict()
    inputs, targets = _batches(lengths)[0]
    with pytest.raises(DeviceBudgetTooSmall) as err:
        engine.backward(engine(inputs, targets))  # the forward and backward run, measured
    assert f"at least {minimum:,} bytes" in str(err.value)  # the figure that works
    assert engine.global_step == 0 and engine.counter.micro_step == 0
    after = engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.device_tier.held_bytes <= short


def test_a_longer_iteration_later_fails_in_itself_and_names_its_need() -> None:
    short_minimum, _ = _least((16,), 1024)
    minimum, (first, second) = _least((16, 64), 1024)
    assert first == short_minimum < second == minimum
    engine = _engine(short_minimum, 1024)
    (a, b), (c, d) = _batches((16, 64))
    _train(engine, [(a, b)])
    after_one = engine.model_state_dict()
    with pytest.raises(DeviceBudgetTooSmall) as err:
        engine.backward(engine(c, d))
    assert f"at least {second:,} bytes" in str(err.value)
    assert engine.global_step == 1
    state = engine.model_state_dict()
    assert all(torch.equal(state[k], after_one[k]) for k in state)  # no update from it
    retry = _engine(second, 1024)
    _train(retry, _batches((16, 64)))  # following the error works at once


def test_an_evaluation_forward_ends_its_iteration() -> None:
    """Under ``torch.no_grad()`` no backward can follow: the iteration (and its trace, and a
    budget error if it had one) ends with the forward, not at the next call."""
    engine = _engine(None, None)
    _train(engine, _batches((64,)))
    traces = engine.stats()["traces_recorded"]
    inputs, targets = _batches((32,))[0]
    with torch.no_grad():
        engine(inputs, targets)
    assert engine.stats()["traces_recorded"] == traces + 1
    assert not engine.store.model_running


def test_a_budget_error_says_to_what_to_lower_chunk_size() -> None:
    """It said "or lower chunk.size", not to what, nor whether that could help at all."""
    engine = _engine(4096, None)  # the searched size: a few chunks of several parameters
    with pytest.raises(DeviceBudgetTooSmall) as err:
        _train(engine, _batches((16,)))
    size = engine.layout.chunk_size
    largest = max(
        info.numel for spec in engine.layout.chunks if not spec.is_oversize for info in spec.slots
    )
    assert f"lower chunk.size from {size:,} elements toward {largest:,}" in str(err.value)
    assert largest < size

    one_each = _engine(4096, 64)  # every parameter has a chunk of its own: nothing to gain
    with pytest.raises(DeviceBudgetTooSmall) as err:
        _train(one_each, _batches((16,)))
    assert "chunk.size" not in str(err.value)


def test_a_ceiling_on_the_size_search_lowers_what_a_moment_holds() -> None:
    """``chunk.max_size`` bounds the searched size: smaller chunks, fewer bytes a moment holds;
    with ``chunk.size`` it is refused."""
    searched = _engine(None, None)
    ceiling = searched.layout.chunk_size // 2
    bounded = ChunkEngine(build_gpt(TINY, seed=0),
                          optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
                          training=TrainingConfig(device="cpu"), memory=MemoryConfig(),
                          chunk=ChunkConfig(max_size=ceiling))  # fmt: skip
    assert bounded.layout.chunk_size <= ceiling < searched.layout.chunk_size
    for engine in (searched, bounded):
        _train(engine, _batches((64,)))
    held = [max(map(t.bytes_of, (m.chunks for m in t.moments)))
            for t in (searched.store.trace, bounded.store.trace)]  # fmt: skip
    assert held[1] < held[0], held  # the most chunk bytes a moment holds
    with pytest.raises(ConfigError, match="max_size"):
        ChunkConfig(size=1024, max_size=2048)
