"""Chunk layout: which parameter lives in which chunk, at which offset, as a plain value.

A :class:`ChunkLayout` is computed by pure functions from a list of :class:`ParamRef` and is
carried out by the runtime. It is counted in elements, never bytes: the fp32 master weights,
gradients and optimizer states live in chunks that mirror the parameter chunks exactly (same
index, same offsets, another dtype; only where a chunk holds trainable parameters), so one layout
serves every chunk type. Planning uses integers only, so a meta-device model of any size can be
planned, and the chunk-size search can try a thousand sizes in a fraction of a second.

[Note: layout order]
:func:`plan_layout` packs parameters *next-fit* in the order given, which is their first-use
order from a trace (or construction order before there is one): a parameter goes at the end of
the open chunk if its aligned slot fits there, otherwise it opens a new chunk, and a closed
chunk is never reopened. First-fit would pack tighter, but it would put late parameters into the
holes of early chunks; next-fit keeps every chunk one contiguous segment of the access order, so
chunk indices are themselves the order of use. That is what makes prefetching the next chunks
and evicting the chunk used farthest ahead effective: a chunk is fetched once per pass and is
done with as soon as compute moves past it. The search over chunk sizes makes up for the looser
packing.

[Note: frozen parameters]
Trainable and frozen parameters (``requires_grad=False``) never share a chunk. Gradient, master
and optimizer-state chunks exist only for the chunk indices that hold trainable parameters, so a
frozen parameter costs no gradient or state bytes at all; sharing a chunk with trainable ones
would leave holes of its size in each of those chunks. :func:`_pack` keeps one open chunk per
group and applies [Note: layout order] and [Note: oversize parameters] within each group: the
order of use holds inside a group, and a chunk takes its index when it opens, so chunk indices
still follow the first use of each chunk's first parameter. With nothing frozen the layout is
exactly the one-group layout.

[Note: oversize parameters]
A parameter larger than ``chunk_size`` (typically a token embedding) gets a chunk of its own
whose capacity is its numel rounded up to ``align``. It takes the next chunk index at the point
where it appears, and the chunk it interrupts is closed: later parameters open a new chunk
after it. Keeping the interrupted chunk open would fill its tail but break the contiguity of
[Note: layout order]; the tail it leaves is padding, which the search counts. Only the open
chunk of the parameter's own group is closed ([Note: frozen parameters]).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ChunkLayout",
    "ChunkSizeChoice",
    "ChunkSpec",
    "ParamRef",
    "TensorSlot",
    "default_chunk_size",
    "plan_layout",
    "search_chunk_size",
    "unique_parameters",
]

DEFAULT_MAX_CHUNK_SIZE = 2**27  # elements: 256 MiB as fp16, 512 MiB per fp32 master chunk
MAX_DEFAULT_CANDIDATES = 1024
MIN_DEFAULT_CHUNKS = 4  # fewer, and the device budget holds most of the model at once


@dataclass(kw_only=True, frozen=True, slots=True)
class ParamRef:
    """One distinct parameter tensor: its canonical name first, then the names it is shared under."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    requires_grad: bool = True

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a parameter needs at least one name")
        if self.numel != math.prod(self.shape):
            raise ValueError(f"{self.names[0]}: numel {self.numel} != prod(shape {self.shape})")


def unique_parameters(model: nn.Module) -> list[ParamRef]:
    """The distinct parameters of ``model`` in registration order; tied ones once, all names kept."""
    groups: dict[int, tuple[Any, list[str]]] = {}  # id -> (parameter, its names)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), (param, []))[1].append(name)
    return [
        ParamRef(
            names=tuple(n), shape=tuple(p.shape), numel=p.numel(), requires_grad=p.requires_grad
        )
        for p, n in groups.values()
    ]


@dataclass(kw_only=True, frozen=True, slots=True)
class TensorSlot:
    """Where one parameter sits in its chunk; ``offset`` counts elements from the chunk start."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(kw_only=True, frozen=True, slots=True)
class ChunkSpec:
    """One chunk: ``capacity`` elements holding ``slots`` in offset order.

    ``is_oversize`` marks a chunk made for one parameter larger than the chunk size (see
    [Note: oversize parameters]); it is stored because a chunk alone does not know the layout's
    chunk size, and :meth:`ChunkLayout.validate` checks it against the capacity.
    """

    index: int
    capacity: int
    slots: tuple[TensorSlot, ...]
    is_oversize: bool = False

    @property
    def used(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @property
    def padding(self) -> int:
        """Elements holding no parameter: alignment gaps and the unused tail."""
        return self.capacity - self.used


@dataclass(kw_only=True, frozen=True)  # no slots: ``_by_name`` is a cached_property
class ChunkLayout:
    """Chunks of ``chunk_size`` elements (oversize ones aside), slot offsets aligned to ``align``."""

    chunk_size: int
    align: int
    chunks: tuple[ChunkSpec, ...]

    @functools.cached_property
    def _by_name(self) -> dict[str, tuple[int, TensorSlot]]:
        return {
            name: (chunk.index, slot)
            for chunk in self.chunks
            for slot in chunk.slots
            for name in slot.names
        }

    def locate(self, name: str) -> tuple[int, TensorSlot]:
        """``(chunk index, slot)`` of the parameter called ``name`` (canonical name or alias)."""
        try:
            return self._by_name[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._by_name), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"no parameter {name!r} in this layout of {len(self._by_name)} names{hint}"
            raise KeyError(message) from None

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def total_capacity(self) -> int:
        return sum(chunk.capacity for chunk in self.chunks)

    @property
    def total_used(self) -> int:
        return sum(chunk.used for chunk in self.chunks)

    @property
    def padding(self) -> int:
        return self.total_capacity - self.total_used

    @property
    def waste_fraction(self) -> float:
        """``padding / total_capacity``; 0.0 for an empty layout."""
        total = self.total_capacity
        return self.padding / total if total else 0.0

    def validate(self) -> None:
        """Raise ValueError listing every broken invariant, naming the chunk and parameter.

        Invariants: chunks indexed 0, 1, ...; capacity == chunk_size except oversize chunks (one
        parameter > chunk_size, capacity its aligned numel); slots in offset order, aligned,
        inside the capacity, not overlapping; every name placed once.
        """
        problems = list(_layout_problems(self))
        if problems:
            raise ValueError("invalid chunk layout:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChunkLayout:
        """The layout written by :meth:`to_dict`, validated (a stored plan may be hand-edited)."""
        chunks = tuple(
            ChunkSpec(**{**chunk, "slots": tuple(_slot_from_dict(s) for s in chunk["slots"])})
            for chunk in data["chunks"]
        )
        layout = cls(chunk_size=data["chunk_size"], align=data["align"], chunks=chunks)
        layout.validate()
        return layout


def _slot_from_dict(data: Mapping[str, Any]) -> TensorSlot:
    return TensorSlot(**{**data, "names": tuple(data["names"]), "shape": tuple(data["shape"])})


def _layout_problems(layout: ChunkLayout) -> Iterator[str]:
    if layout.chunk_size < 1 or layout.align < 1:
        yield f"chunk_size and align must be >= 1, got {layout.chunk_size} and {layout.align}"
        return
    seen: set[str] = set()
    for position, chunk in enumerate(layout.chunks):
        where = f"chunk {position}"
        if chunk.index != position:
            yield f"{where}: has index {chunk.index}"
        if not chunk.slots:
            yield f"{where}: holds no parameter"
            continue
        yield from _capacity_problems(chunk, layout.chunk_size, layout.align, where)
        previous_end = 0
        for slot in chunk.slots:
            what = f"{where}, {slot.names[0] if slot.names else '<unnamed>'}"
            yield from _slot_problems(slot, chunk.capacity, layout.align, previous_end, what)
            previous_end = max(previous_end, slot.end)
            if repeated := seen.intersection(slot.names):
                yield f"{what}: {sorted(repeated)} already placed"
            seen.update(slot.names)


def _capacity_problems(chunk: ChunkSpec, chunk_size: int, align: int, where: str) -> Iterator[str]:
    if not chunk.is_oversize:
        if chunk.capacity != chunk_size:
            yield f"{where}: capacity {chunk.capacity} != chunk_size {chunk_size}"
    elif len(chunk.slots) != 1 or chunk.slots[0].numel <= chunk_size:
        yield f"{where}: an oversize chunk must hold one parameter larger than {chunk_size}"
    elif chunk.capacity != _round_up(chunk.slots[0].numel, align):
        yield f"{where}: oversize capacity {chunk.capacity} != its numel rounded up to {align}"


def _slot_problems(
    slot: TensorSlot, capacity: int, align: int, previous_end: int, what: str
) -> Iterator[str]:
    checks = (
        (bool(slot.names), "has no name"),
        (slot.numel == math.prod(slot.shape), f"numel {slot.numel} != prod{slot.shape}"),
        (slot.offset % align == 0, f"offset {slot.offset} is not a multiple of {align}"),
        (slot.offset >= previous_end, f"offset {slot.offset} overlaps up to {previous_end}"),
        (slot.end <= capacity, f"ends at {slot.end}, past the capacity {capacity}"),
    )
    yield from (f"{what}: {message}" for ok, message in checks if not ok)


# ---------------------------------------------------------------------------------------------
# planning


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _pack(
    numels: Sequence[int], aligned_numels: Sequence[int], frozen: Sequence[bool], chunk_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Next-fit: ``(chunk index per param, offset per param, capacity per chunk)``.

    See [Note: layout order], [Note: oversize parameters] and [Note: frozen parameters]. The
    search calls this for every candidate size, so it is one tight integer loop.
    """
    chunk_of: list[int] = []
    offset_of: list[int] = []
    capacities: list[int] = []
    closed = chunk_size + 1  # a cursor past the end: nothing fits, the next param opens a chunk
    cursors = [closed, closed]  # per group (0: trainable, 1: frozen): the end of its open chunk
    open_chunks = [-1, -1]  # per group: the index of its open chunk
    for numel, aligned, group in zip(numels, aligned_numels, frozen, strict=True):
        if numel > chunk_size:
            capacities.append(aligned)
            chunk_of.append(len(capacities) - 1)
            offset_of.append(0)
            cursors[group] = closed
            continue
        if cursors[group] + numel > chunk_size:
            capacities.append(chunk_size)
            open_chunks[group] = len(capacities) - 1
            cursors[group] = 0
        chunk_of.append(open_chunks[group])
        offset_of.append(cursors[group])
        cursors[group] += aligned  # cursor stays a multiple of align: slots start aligned
    return chunk_of, offset_of, capacities


def _frozen_flags(params: Sequence[ParamRef]) -> list[bool]:
    return [not p.requires_grad for p in params]


def plan_layout(params: Sequence[ParamRef], *, chunk_size: int, align: int = 64) -> ChunkLayout:
    """Pack ``params`` in the given order into chunks of ``chunk_size`` elements, next-fit.

    Trainable and frozen parameters go to separate chunks: see [Note: frozen parameters].
    """
    _require_positive(chunk_size=chunk_size, align=align)
    numels = [p.numel for p in params]
    aligned_numels = [_round_up(n, align) for n in numels]
    chunk_of, offset_of, capacities = _pack(
        numels, aligned_numels, _frozen_flags(params), chunk_size
    )
    slots: list[list[TensorSlot]] = [[] for _ in capacities]
    for param, index, offset in zip(params, chunk_of, offset_of, strict=True):
        slot = TensorSlot(names=param.names, shape=param.shape, numel=param.numel, offset=offset)
        slots[index].append(slot)
    chunks = tuple(
        ChunkSpec(index=i, capacity=c, slots=tuple(s), is_oversize=c > chunk_size)
        for i, (c, s) in enumerate(zip(capacities, slots, strict=True))
    )
    return ChunkLayout(chunk_size=chunk_size, align=align, chunks=chunks)


@dataclass(kw_only=True, frozen=True, slots=True)
class ChunkSizeChoice:
    """The outcome of a chunk-size search: the chosen size and what its layout costs."""

    chunk_size: int
    num_chunks: int
    padding: int
    waste_fraction: float
    num_candidates: int


def search_chunk_size(
    params: Sequence[ParamRef],
    *,
    min_chunk_size: int,
    max_chunk_size: int,
    step: int,
    align: int = 64,
) -> ChunkSizeChoice:
    """The size in ``min, min + step, ..., max`` (``max`` always tried) with the least padding.

    Padding counts every element of chunk capacity that holds no parameter, so oversize chunks
    add only their alignment tail. Ties go to the larger size: fewer chunks mean fewer hook
    calls, copies and collectives per step.
    """
    _require_positive(min_chunk_size=min_chunk_size, step=step, align=align)
    if max_chunk_size < min_chunk_size:
        raise ValueError(f"max_chunk_size {max_chunk_size} < min_chunk_size {min_chunk_size}")
    candidates = list(range(min_chunk_size, max_chunk_size + 1, step))
    if candidates[-1] != max_chunk_size:
        candidates.append(max_chunk_size)
    numels = [p.numel for p in params]
    aligned_numels = [_round_up(n, align) for n in numels]
    frozen = _frozen_flags(params)
    total_used = sum(numels)
    best: tuple[int, int, int] | None = None  # (padding, chunk_size, num_chunks)
    for chunk_size in candidates:
        capacities = _pack(numels, aligned_numels, frozen, chunk_size)[2]
        padding = sum(capacities) - total_used
        if best is None or padding <= best[0]:  # ascending sizes: "<=" keeps the larger on ties
            best = (padding, chunk_size, len(capacities))
    assert best is not None
    padding, chunk_size, num_chunks = best
    total_capacity = padding + total_used
    return ChunkSizeChoice(
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        padding=padding,
        waste_fraction=padding / total_capacity if total_capacity else 0.0,
        num_candidates=len(candidates),
    )


def default_chunk_size(
    params: Sequence[ParamRef], *, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE, align: int = 64
) -> ChunkSizeChoice:
    """Search sizes from the largest regular parameter to 4x it (at most ``max_chunk_size``).

    A parameter is *regular* unless its numel exceeds ``max_chunk_size`` or the mean plus three
    standard deviations of all numels (Gemini's outlier rule); the others, such as a token
    embedding, get oversize chunks instead of setting the chunk size. Starting at the largest
    regular parameter (rounded up to ``align``) lets every regular parameter fit a chunk while
    keeping chunks as small as that allows, since the resident working set and the unit of
    transfer are a few chunks. Up to 4x gives the search room to pack whole groups of layers;
    about a thousand evenly spaced sizes (steps a multiple of ``align``) are tried.

    A model of a few layers, one of which holds most of its parameters (a user's MLP), would
    get one chunk of everything, which the device budget must hold whole. Where the search
    gives fewer than ``MIN_DEFAULT_CHUNKS`` chunks, sizes up to the model over that many are
    searched instead: the large parameters get chunks of their own (exact, so no padding) and
    the device holds a module's chunks at a time.
    """
    _require_positive(max_chunk_size=max_chunk_size, align=align)
    if not params:
        raise ValueError("cannot choose a chunk size for an empty parameter list")
    numels = [p.numel for p in params]
    mean = sum(numels) / len(numels)
    std = math.sqrt(sum((n - mean) ** 2 for n in numels) / len(numels))
    limit = min(mean + 3 * std, max_chunk_size)
    largest_regular = max((n for n in numels if n <= limit), default=max_chunk_size)
    low = min(max(_round_up(largest_regular, align), align), max_chunk_size)
    high = min(4 * low, max_chunk_size)
    choice = _search_evenly(params, low, high, align)
    total = sum(numels)
    if choice.num_chunks >= MIN_DEFAULT_CHUNKS or len(params) < MIN_DEFAULT_CHUNKS:
        return choice
    small = max(align, _round_up(total // MIN_DEFAULT_CHUNKS, align))
    return _search_evenly(params, align, min(small, max_chunk_size), align)


def _search_evenly(params: Sequence[ParamRef], low: int, high: int, align: int) -> ChunkSizeChoice:
    """:func:`search_chunk_size` over at most ``MAX_DEFAULT_CANDIDATES`` sizes in ``[low, high]``."""
    step = max(align, _round_up(-(-(high - low) // (MAX_DEFAULT_CANDIDATES - 1)), align))
    return search_chunk_size(
        params, min_chunk_size=low, max_chunk_size=high, step=step, align=align
    )
