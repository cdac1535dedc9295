"""Layouts with frozen parameters: trainable and frozen ones never share a chunk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.memory.layout import (
    ChunkLayout,
    ParamRef,
    plan_layout,
    search_chunk_size,
    unique_parameters,
)
from tidal.models import build_gpt, preset


def _refs(specs: list[tuple[int, bool]]) -> list[ParamRef]:
    """``(numel, requires_grad)`` per parameter, named p0, p1, ..."""
    return [
        ParamRef(names=(f"p{i}",), shape=(n,), numel=n, requires_grad=g)
        for i, (n, g) in enumerate(specs)
    ]


def _placements(layout: ChunkLayout) -> dict[str, tuple[int, int]]:
    return {
        slot.names[0]: (chunk.index, slot.offset) for chunk in layout.chunks for slot in chunk.slots
    }


def test_each_group_packs_next_fit_in_its_own_chunks() -> None:
    # t: trainable, f: frozen.   t30   f50    t20   f70    t60
    refs = _refs([(30, True), (50, False), (20, True), (70, False), (60, True)])
    layout = plan_layout(refs, chunk_size=100, align=8)
    assert _placements(layout) == {
        "p0": (0, 0),  # opens trainable chunk 0
        "p1": (1, 0),  # opens frozen chunk 1: chunk 0 stays open for the trainable group
        "p2": (0, 32),  # back into chunk 0
        "p3": (2, 0),  # 56 + 70 > 100: a new frozen chunk
        "p4": (3, 0),  # 56 + 60 > 100: a new trainable chunk
    }
    assert [c.used for c in layout.chunks] == [50, 50, 70, 60]
    layout.validate()


def test_an_oversize_parameter_closes_only_its_own_groups_chunk() -> None:
    refs = _refs([(30, True), (40, False), (250, True), (20, True), (20, False)])
    layout = plan_layout(refs, chunk_size=100, align=8)
    assert _placements(layout) == {
        "p0": (0, 0),
        "p1": (1, 0),
        "p2": (2, 0),  # oversize: chunk 0 (trainable) is closed ...
        "p3": (3, 0),
        "p4": (1, 40),  # ... but the frozen chunk 1 is still open
    }
    assert layout.chunks[2].is_oversize and layout.chunks[2].capacity == 256
    layout.validate()


def test_nothing_frozen_or_everything_frozen_is_the_one_group_layout() -> None:
    numels = [30, 50, 20, 70, 10, 25, 100, 250]
    trainable = plan_layout(_refs([(n, True) for n in numels]), chunk_size=100, align=8)
    frozen = plan_layout(_refs([(n, False) for n in numels]), chunk_size=100, align=8)
    assert trainable == frozen
    assert [(c.index, s.offset) for c in trainable.chunks for s in c.slots] == [
        (0, 0), (0, 32), (1, 0), (1, 24), (2, 0), (2, 16), (3, 0), (4, 0),
    ]  # fmt: skip


def test_a_partly_frozen_gpt_has_pure_chunks() -> None:
    model = build_gpt(preset("tiny"), device="meta")
    model.pos_embed.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    refs = unique_parameters(model)
    layout = plan_layout(refs, chunk_size=4096)
    layout.validate()
    requires_grad = {r.names[0]: r.requires_grad for r in refs}
    kinds = [{requires_grad[s.names[0]] for s in c.slots} for c in layout.chunks]
    assert all(len(k) == 1 for k in kinds)
    assert {True} in kinds and {False} in kinds


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 300), st.booleans()), max_size=40),
    chunk_size=st.integers(min_value=1, max_value=200),
    align=st.sampled_from([1, 8, 64]),
)
def test_frozen_layout_invariants(
    specs: list[tuple[int, bool]], chunk_size: int, align: int
) -> None:
    refs = _refs(specs)
    layout = plan_layout(refs, chunk_size=chunk_size, align=align)
    layout.validate()
    group_of = {r.names[0]: r.requires_grad for r in refs}
    first_param = []
    for chunk in layout.chunks:
        assert len({group_of[s.names[0]] for s in chunk.slots}) == 1, chunk
        first_param.append(int(chunk.slots[0].names[0][1:]))
    # Chunk indices follow the first use of each chunk's first parameter ...
    assert first_param == sorted(first_param)
    # ... and within a group, chunks are consecutive segments of the given order.
    for group in (True, False):
        in_chunk_order = [
            s.names[0] for c in layout.chunks for s in c.slots if group_of[s.names[0]] is group
        ]
        assert in_chunk_order == [r.names[0] for r in refs if r.requires_grad is group]
    # The search packs exactly as plan_layout does, groups included.
    choice = search_chunk_size(
        refs, min_chunk_size=chunk_size, max_chunk_size=chunk_size + 30, step=7, align=align
    )
    chosen = plan_layout(refs, chunk_size=choice.chunk_size, align=align)
    assert (choice.num_chunks, choice.padding) == (chosen.num_chunks, chosen.padding)
