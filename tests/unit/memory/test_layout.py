"""Chunk layout planning: unique parameters, next-fit packing, validation, chunk-size search."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tidal.memory.layout import (
    ChunkLayout,
    ParamRef,
    default_chunk_size,
    plan_layout,
    search_chunk_size,
    unique_parameters,
)
from tidal.models import build_gpt, num_params, preset


def _refs(numels: list[int]) -> list[ParamRef]:
    return [ParamRef(names=(f"p{i}",), shape=(n,), numel=n) for i, n in enumerate(numels)]


def _placements(layout: ChunkLayout) -> list[tuple[int, int]]:
    """``(chunk index, offset)`` of every slot, in chunk order then offset order."""
    return [(chunk.index, slot.offset) for chunk in layout.chunks for slot in chunk.slots]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 3)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


# ---------------------------------------------------------------------------------------------
# unique_parameters


def test_tied_parameter_appears_once_with_all_names() -> None:
    model = _Tied()
    model.mid.bias.requires_grad_(False)
    refs = unique_parameters(model)
    assert [r.names for r in refs] == [
        ("embed.weight", "head.weight"),
        ("mid.weight",),
        ("mid.bias",),
    ]
    assert [(r.shape, r.numel, r.requires_grad) for r in refs] == [
        ((10, 4), 40, True),
        ((3, 4), 12, True),
        ((3,), 3, False),
    ]


def test_construction_order_is_kept_and_meta_models_work() -> None:
    model = nn.Sequential()
    model.add_module("zeta", nn.Linear(2, 2))
    model.add_module("alpha", nn.LayerNorm(2))
    assert [r.names[0] for r in unique_parameters(model)] == [
        "zeta.weight",
        "zeta.bias",
        "alpha.weight",
        "alpha.bias",
    ]
    gpt = build_gpt(preset("tiny"), device="meta")
    refs = unique_parameters(gpt)
    assert [r.names[0] for r in refs] == [name for name, _ in gpt.named_parameters()]
    assert refs[0].names == ("tok_embed.weight", "lm_head.weight")
    assert sum(r.numel for r in refs) == num_params(gpt)


def test_param_ref_rejects_inconsistent_numel() -> None:
    with pytest.raises(ValueError, match="numel"):
        ParamRef(names=("w",), shape=(2, 3), numel=5)
    with pytest.raises(ValueError, match="name"):
        ParamRef(names=(), shape=(2,), numel=2)


# ---------------------------------------------------------------------------------------------
# plan_layout


def test_next_fit_packing_with_known_offsets() -> None:
    layout = plan_layout(_refs([30, 50, 20, 70, 10, 25, 100]), chunk_size=100, align=8)
    # p4 (10) would fit chunk 0's tail (88..98) under first-fit; next-fit never reopens it.
    assert _placements(layout) == [(0, 0), (0, 32), (1, 0), (1, 24), (2, 0), (2, 16), (3, 0)]
    assert [c.capacity for c in layout.chunks] == [100] * 4
    assert not any(c.is_oversize for c in layout.chunks)  # p6 fills chunk 3 exactly
    assert [c.used for c in layout.chunks] == [80, 90, 35, 100]
    assert layout.total_used == 305
    assert layout.padding == 400 - 305
    assert layout.waste_fraction == pytest.approx(95 / 400)
    layout.validate()


@pytest.mark.parametrize(
    ("align", "offsets"), [(64, [0, 64, 128, 256]), (1, [0, 1, 2, 67]), (3, [0, 3, 6, 72])]
)
def test_offsets_are_aligned(align: int, offsets: list[int]) -> None:
    layout = plan_layout(_refs([1, 1, 65, 1]), chunk_size=1000, align=align)
    assert [slot.offset for slot in layout.chunks[0].slots] == offsets


def test_oversize_parameter_gets_its_own_chunk_in_first_use_position() -> None:
    layout = plan_layout(_refs([30, 250, 40, 50]), chunk_size=100, align=8)
    assert _placements(layout) == [(0, 0), (1, 0), (2, 0), (2, 40)]
    oversize = layout.chunks[1]
    assert oversize.is_oversize and oversize.capacity == 256 and oversize.padding == 6
    assert layout.chunks[0].padding == 70  # closed by the oversize parameter, never reopened
    assert [c.is_oversize for c in layout.chunks] == [False, True, False]
    leading = plan_layout(_refs([250, 30]), chunk_size=100, align=8)
    assert [(c.is_oversize, c.capacity) for c in leading.chunks] == [(True, 256), (False, 100)]
    leading.validate()
    layout.validate()


@pytest.mark.parametrize(("chunk_size", "align"), [(0, 64), (100, 0), (-5, 1)])
def test_plan_rejects_non_positive_sizes(chunk_size: int, align: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_layout(_refs([1]), chunk_size=chunk_size, align=align)


def test_locate_by_alias_and_helpful_key_error() -> None:
    layout = plan_layout(unique_parameters(_Tied()), chunk_size=64, align=4)
    index, slot = layout.locate("head.weight")
    assert (index, slot) == layout.locate("embed.weight")
    assert slot.names == ("embed.weight", "head.weight") and slot.offset == 0
    assert layout.locate("mid.bias")[1].offset == 52  # after embed (40) and mid.weight (12 -> 52)
    with pytest.raises(KeyError, match=r"'mid\.wieght'.*did you mean 'mid\.weight'"):
        layout.locate("mid.wieght")


def test_json_round_trip() -> None:
    refs = unique_parameters(build_gpt(preset("tiny"), device="meta"))
    layout = plan_layout(refs, chunk_size=10_000, align=64)
    assert layout.chunks[0].is_oversize  # the 256 x 64 embedding
    restored = ChunkLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert restored == layout
    assert restored.locate("lm_head.weight") == layout.locate("tok_embed.weight")


def _shift_second_slot(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][0]["slots"][1]["offset"] -= 64


def _misalign(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][0]["slots"][1]["offset"] += 1


def _push_past_capacity(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][1]["slots"][-1]["offset"] += 64 * 100


def _duplicate_name(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][1]["slots"][0]["names"] = ["p0"]


def _grow_capacity(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][0]["capacity"] += 64


def _unmark_oversize(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][2]["is_oversize"] = False


def _renumber(chunk_data: dict[str, Any]) -> None:
    chunk_data["chunks"][1]["index"] = 5


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_shift_second_slot, "overlaps"),
        (_misalign, "not a multiple of 64"),
        (_push_past_capacity, "past the capacity"),
        (_duplicate_name, r"\['p0'\] already placed"),
        (_grow_capacity, "!= chunk_size"),
        (_unmark_oversize, "capacity 2048 != chunk_size"),
        (_renumber, "has index 5"),
    ],
)
def test_validate_catches_corrupted_layouts(
    corrupt: Callable[[dict[str, Any]], None], message: str
) -> None:
    layout = plan_layout(_refs([100, 100, 900, 10, 2000]), chunk_size=1024, align=64)
    data = json.loads(json.dumps(layout.to_dict()))
    ChunkLayout.from_dict(data)  # intact: loads
    corrupt(data)
    with pytest.raises(ValueError, match=message):
        ChunkLayout.from_dict(data)


# ---------------------------------------------------------------------------------------------
# chunk-size search


def _brute_force(refs: list[ParamRef], candidates: list[int], align: int) -> ChunkLayout:
    """The least-padding layout over ``candidates``, larger sizes winning ties."""
    layouts = [plan_layout(refs, chunk_size=size, align=align) for size in candidates]
    return min(layouts, key=lambda layout: (layout.padding, -layout.chunk_size))


def test_search_picks_the_minimum_padding_size() -> None:
    refs = unique_parameters(build_gpt(preset("tiny"), device="meta"))
    choice = search_chunk_size(refs, min_chunk_size=1000, max_chunk_size=40_000, step=37)
    candidates = [*range(1000, 40_001, 37), 40_000]
    best = _brute_force(refs, candidates, align=64)
    assert choice.num_candidates == len(candidates)
    assert (choice.chunk_size, choice.num_chunks, choice.padding) == (
        best.chunk_size,
        best.num_chunks,
        best.padding,
    )
    assert choice.waste_fraction == pytest.approx(best.waste_fraction)


def test_search_prefers_the_larger_size_on_ties() -> None:
    refs = _refs([64] * 8)  # 128, 256 and 512 all pack with no padding; 384 does not
    choice = search_chunk_size(refs, min_chunk_size=128, max_chunk_size=512, step=128)
    assert (choice.chunk_size, choice.num_chunks, choice.padding) == (512, 1, 0)
    assert choice.num_candidates == 4


def test_search_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="max_chunk_size"):
        search_chunk_size(_refs([1]), min_chunk_size=10, max_chunk_size=5, step=1)
    with pytest.raises(ValueError, match="step"):
        search_chunk_size(_refs([1]), min_chunk_size=1, max_chunk_size=5, step=0)


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=300), max_size=40),
    chunk_size=st.integers(min_value=1, max_value=200),
    align=st.sampled_from([1, 2, 8, 64]),
)
def test_plan_invariants(numels: list[int], chunk_size: int, align: int) -> None:
    refs = _refs(numels)
    layout = plan_layout(refs, chunk_size=chunk_size, align=align)
    layout.validate()
    in_chunk_order = [slot.names[0] for chunk in layout.chunks for slot in chunk.slots]
    # Every parameter placed once, and chunks are consecutive segments of the given order.
    assert in_chunk_order == [r.names[0] for r in refs]
    assert layout.total_used == sum(numels)
    for ref in refs:
        index, slot = layout.locate(ref.names[0])
        assert slot.numel == ref.numel
        assert layout.chunks[index].is_oversize == (ref.numel > chunk_size)
    choice = search_chunk_size(
        refs, min_chunk_size=chunk_size, max_chunk_size=chunk_size + 50, step=7, align=align
    )
    best = _brute_force(refs, [*range(chunk_size, chunk_size + 51, 7), chunk_size + 50], align)
    assert (choice.chunk_size, choice.padding) == (best.chunk_size, best.padding)


def test_search_over_a_thousand_sizes_for_gpt2_xl() -> None:
    refs = unique_parameters(build_gpt(preset("gpt2-xl"), device="meta"))
    largest_block_param = 1600 * 6400
    choice = search_chunk_size(
        refs,
        min_chunk_size=largest_block_param,
        max_chunk_size=largest_block_param + 999 * 4096,
        step=4096,
    )
    assert choice.num_candidates == 1000
    layout = plan_layout(refs, chunk_size=choice.chunk_size)
    layout.validate()
    assert (layout.num_chunks, layout.padding) == (choice.num_chunks, choice.padding)
    embed_chunk = layout.chunks[layout.locate("lm_head.weight")[0]]
    assert [c.is_oversize for c in layout.chunks].count(True) == 1 and embed_chunk.is_oversize


@pytest.mark.parametrize(
    ("name", "min_chunks", "max_chunks"), [("tiny", 2, 8), ("gpt2-small", 24, 60)]
)
def test_default_chunk_size(name: str, min_chunks: int, max_chunks: int) -> None:
    refs = unique_parameters(build_gpt(preset(name), device="meta"))
    choice = default_chunk_size(refs)
    assert min_chunks <= choice.num_chunks <= max_chunks
    assert choice.waste_fraction < 0.10
    layout = plan_layout(refs, chunk_size=choice.chunk_size)
    assert layout.padding == choice.padding
    # Only the token embedding may be oversize: every block parameter fits a chunk.
    oversize = [c.slots[0].names[0] for c in layout.chunks if c.is_oversize]
    assert oversize in ([], ["tok_embed.weight"])


def test_default_chunk_size_respects_the_cap_and_rejects_nothing_to_plan() -> None:
    refs = unique_parameters(build_gpt(preset("gpt2-small"), device="meta"))
    choice = default_chunk_size(refs, max_chunk_size=1_000_000)
    # Only parameters up to the cap are regular; the largest of them (the 1024 x 768 position
    # embedding) sets the lower end, and the block matrices over the cap become oversize chunks.
    assert 1024 * 768 <= choice.chunk_size <= 1_000_000
    with pytest.raises(ValueError, match="empty"):
        default_chunk_size([])


def test_a_model_of_few_layers_gets_several_chunks_by_default() -> None:
    """The README's MLP got one chunk of everything, which the device budget had to hold."""
    from torch import nn

    mlp = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                        nn.Linear(512, 10))  # fmt: skip
    refs = unique_parameters(mlp)
    choice = default_chunk_size(refs)
    assert choice.num_chunks >= 4
    assert choice.waste_fraction < 0.01
    layout = plan_layout(refs, chunk_size=choice.chunk_size)
    largest_chunk = max(spec.capacity for spec in layout.chunks)
    assert largest_chunk < sum(r.numel for r in refs) * 0.95  # no chunk of nearly everything
