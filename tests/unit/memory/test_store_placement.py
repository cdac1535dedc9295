"""The store makes no placement decision of its own ([Note: one placement] in policy.py).

A store hooked to the tiny GPT at a tight budget records every move it makes; replaying its trace
through ``plan_moment`` from the same empty device must give the same moves in the same order,
moment by moment. A store that picked prefetches by a rule of its own (as it did before: a
chunk that did not fit was skipped and the next one tried, where the policy stops) fails this.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tidal.memory.hooks import install_hooks
from tidal.memory.layout import plan_layout, unique_parameters
from tidal.memory.policy import Move, choose_victims, plan_moment
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import make_tiers
from tidal.memory.trace import AccessTrace
from tidal.models import build_gpt, preset

CHUNK_ELEMENTS = 128


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None


def _store(budget_bytes: int | None, *, policy: str = "belady") -> tuple[nn.Module, ChunkStore]:
    model = build_gpt(preset("tiny"), seed=0)
    layout = plan_layout(unique_parameters(model), chunk_size=CHUNK_ELEMENTS)
    device, host = make_tiers(device="cpu", device_budget=budget_bytes, host_budget=None)
    store = ChunkStore(model, layout=layout, device_tier=device, host_tier=host, policy=policy)
    install_hooks(model, store, on_grad=_drop_grad)
    return model, store


def _iteration(model: nn.Module, store: ChunkStore) -> None:
    """One forward and backward as the chunk engine runs them, then the step's evictions."""
    store.begin_iteration()
    with store.meter.tracking():
        loss = model(*_batch())
    with warnings.catch_warnings():  # the embedding's inputs need no gradient: expected
        warnings.simplefilter("ignore", UserWarning)
        loss.backward()
    store.release_all()
    store.end_iteration()
    store.evict_unpinned()


def _replay(trace: AccessTrace, budget_bytes: int) -> list[tuple[int, Move]]:
    """The moves of one iteration by ``plan_moment`` from an empty device; no prefetch at the
    last moment, after which the step evicts everything."""
    resident: frozenset[int] = frozenset()
    moves = []
    for moment in trace.moments:
        depth = 1 if moment.index < len(trace) - 1 else 0
        planned = plan_moment(trace, moment.index, resident, device_budget_bytes=budget_bytes,
                              policy="belady", prefetch_depth=depth)  # fmt: skip
        for move in planned:
            moves.append((moment.index, move))
            on_device = move.kind != "evict"
            resident = resident | {move.chunk} if on_device else resident - {move.chunk}
    return moves


@pytest.fixture(scope="module")
def least_bytes() -> tuple[int, int]:
    """(the least budget of an iteration, the model's bytes), from an unlimited store."""
    model, store = _store(None)
    _iteration(model, store)
    assert store.trace is not None
    return store.trace.min_device_bytes(), store.model_bytes


@pytest.mark.parametrize("extra", [0, 8, 3], ids=["least", "an-eighth", "a-third"])
def test_the_store_moves_exactly_as_the_policy_replays_its_trace(least_bytes, extra) -> None:
    least, model_bytes = least_bytes
    budget = least + (model_bytes // extra if extra else 0)
    model, store = _store(budget)
    _iteration(model, store)  # the warm-up: no trace to follow yet
    _iteration(model, store)
    store.move_log = []
    _iteration(model, store)
    trace = store.trace
    assert trace is not None and store.num_traces == 1
    want = _replay(trace, budget)
    assert any(move.kind == "evict" for _, move in want)
    assert any(move.kind == "prefetch" for _, move in want)
    made = [(index, move) for index, move in store.move_log if index >= 0]  # not the step's
    assert made == want


def test_the_warm_up_evicts_the_least_recently_used_by_the_policy(least_bytes) -> None:
    least, model_bytes = least_bytes
    model, store = _store(least + model_bytes // 8)
    store.move_log = []
    _iteration(model, store)
    evictions = [move.chunk for i, move in store.move_log if move.kind == "evict" and i >= 0]
    assert evictions and not any(move.kind == "prefetch" for _, move in store.move_log)
    # With no trace, each eviction is the least recently used chunk on the device then; the
    # forward uses the chunks in order here, so the first victims are the first chunks used.
    assert evictions[0] == min(store.trace.moments[0].chunks)  # type: ignore[union-attr]


def test_victims_without_a_trace_are_the_least_recently_used() -> None:
    sizes = [4, 4, 8, 4]
    last_use = {0: 5, 1: 2, 2: 2, 3: 9}
    order = choose_victims([0, 1, 2, 3], 100, chunk_bytes=sizes, policy="belady",
                           last_use=last_use)  # fmt: skip
    assert order == (1, 2, 0, 3)  # oldest first, lower index on ties
    assert choose_victims([0, 1, 2, 3], 5, chunk_bytes=sizes, policy="lru",
                          last_use=last_use) == (1, 2)  # fmt: skip
    assert choose_victims([0, 1, 2, 3], 0, chunk_bytes=sizes, policy="lru") == ()


def test_pinned_chunks_are_never_victims() -> None:
    from tidal.memory.trace import Moment

    trace = AccessTrace(
        moments=tuple(Moment(i, frozenset({c}), 0, f"m{i}") for i, c in enumerate([0, 1, 2, 0])),
        chunk_bytes=(4, 4, 4),
    )
    # Room for two chunks: at moment 2 Belady would evict chunk 1 (never used again) or 0.
    moves = plan_moment(trace, 2, frozenset({0, 1}), device_budget_bytes=8, policy="belady",
                        prefetch_depth=0, pinned=frozenset({1}))  # fmt: skip
    assert moves == [Move(0, "evict"), Move(2, "fetch")]


def test_pinning_is_a_pure_choice_from_figures() -> None:
    from tidal.memory.pinning import pinned_indices
    from tidal.memory.trace import Moment

    uses = [{0}, {1}, {0, 2}, {0}]
    trace = AccessTrace(
        moments=tuple(Moment(i, frozenset(c), 2, f"m{i}") for i, c in enumerate(uses)),
        chunk_bytes=(4, 4, 4),
    )

    def choose(budget_bytes: int) -> frozenset[int]:
        return pinned_indices(trace, state_bytes=[12, 12, 12], step_buffer_bytes=lambda _: 4,
                              budget_bytes=budget_bytes)  # fmt: skip

    assert choose(100) == {0, 1, 2}  # room for every chunk and its state
    # Room for the busiest chunk (0, used three times) and its state beside any moment's
    # chunks, not for a second one.
    assert choose(2 + 8 + 4 + 12) == {0}
    assert choose(2 + 8) == frozenset()  # no room for any state


def test_a_recompute_that_stops_early_leaves_no_chunk_held() -> None:
    """Non-reentrant checkpoint stops recomputing a block once it has what the backward needs,
    by an exception inside the block's last module: that module's forward hook must still
    release its chunks. Before it did, the last module of every block stayed held to the end
    of the iteration, and each block's recompute needed more room than the one before."""
    from torch.distributed._composable import checkpoint

    model, store = _store(None)
    for block in model.blocks:  # type: ignore[index, union-attr]
        checkpoint(block)
    _iteration(model, store)
    trace = store.trace
    assert trace is not None
    assert trace.moments[-1].chunks == frozenset(), trace.moments[-1]
    # the first block's backward holds none of the last block's own chunks
    last = {store.slot_of[id(p)][0] for p in model.blocks[-1].parameters()}  # type: ignore[index, union-attr]
    first = {store.slot_of[id(p)][0] for p in model.blocks[0].parameters()}  # type: ignore[index, union-attr]
    only_last = last - first
    start = next(m.index for m in trace.moments if m.label.endswith("bwd:blocks.0.mlp.proj"))
    assert only_last and not any(m.chunks & only_last for m in trace.moments[start:])
