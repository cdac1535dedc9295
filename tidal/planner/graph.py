"""The graph ``measure`` (measure.py) returns, as plain data: decision units, the edges between
them, the repeated blocks, and the folding of identical blocks into one unit per position."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Edge", "ModelGraph", "ParamInfo", "Unit", "cluster_blocks", "with_micro_batch"]


@dataclass(kw_only=True, slots=True)
class ParamInfo:
    """A parameter a unit owns. ``tied_to`` names the unit that counts a shared tensor."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    tied_to: str | None = None


@dataclass(kw_only=True, slots=True)
class Unit:
    """One decision unit (per occurrence; ``count`` occurrences after clustering)."""

    name: str
    module: str
    segment: int | None
    kind: str  # linear, embedding, norm, elementwise, attention, loss
    count: int = 1
    params: list[ParamInfo] = field(default_factory=list)
    flops: float = 0.0  # forward
    io_bytes: float = 0.0  # bytes read and written by its ops, forward
    saved_input_bytes: float = 0.0
    saved_output_bytes: float = 0.0
    saved_internal_bytes: float = 0.0
    out_bytes: float = 0.0  # its largest output activation
    shared_saved_bytes: float = 0.0  # saved here too, but counted by an earlier unit
    in_features: int | None = None
    out_features: int | None = None
    weight_transposed: bool = False  # HF Conv1D keeps [in, out]
    heads: int | None = None
    kv_heads: int | None = None
    # [Note: structure facts]
    head_dim: int | None = None
    inputs: tuple[int, ...] = ()  # the caller's positional tensors it reads
    split_widths: tuple[int, ...] = ()  # its first last-dim split of a tensor it was handed
    dropout: bool = False
    ops: tuple[str, ...] = ()  # its first few distinct ops (not views), to name a module's own

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params if p.tied_to is None)

    @property
    def num_params(self) -> int:
        return sum(_numel(p.shape) for p in self.params if p.tied_to is None)

    @property
    def saved_bytes(self) -> float:
        return self.saved_input_bytes + self.saved_output_bytes + self.saved_internal_bytes

    def signature(self) -> tuple[Any, ...]:
        shapes = tuple((p.shape, p.tied_to is None) for p in self.params)
        # Shared inputs (a model's rotary cos/sin, saved by every layer) are counted by the first
        # layer that saves them; comparing with them included keeps the layers identical.
        saved = self.saved_bytes + self.shared_saved_bytes
        return (self.kind, self.segment, shapes, self.flops, saved, self.out_bytes)


@dataclass(kw_only=True, slots=True)
class Edge:
    """Activations flowing from ``src`` to ``dst``: the largest tensor's bytes, ``count`` times."""

    src: str
    dst: str
    nbytes: float
    count: int = 1


@dataclass(kw_only=True, slots=True)
class ModelGraph:
    """Decision units in execution order, the edges between them, and the repeated blocks."""

    name: str
    units: list[Unit]
    edges: list[Edge]
    micro_batch: int
    seq_len: int
    blocks: dict[str, int] = field(default_factory=dict)  # cluster prefix ("blocks.*") -> count
    # module -> units whose outputs its own code reads the shape of ([Note: structure facts])
    shape_reads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # whether dim 1 of its activations is a sequence of tokens ([Note: models without tokens]
    # in wiring.py): traced on token ids, as tidal's GPT and Hugging Face decoders are
    tokens: bool = True
    # whether its first block's input comes from outside the graph: a pipeline stage's, sent
    # by the stage before (stage_graph in pipelines.py); the units the block's input enters
    # then read what the caller hands, as an embedding reads the token ids
    handed: bool = False
    # the bytes of an element of its floating activations (2: traced in bf16): what its saved
    # and sent bytes assume, which a run in another precision scales
    element_bytes: int = 2

    def unit(self, name: str) -> Unit:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"no unit {name!r}")

    def block_of(self, unit: Unit) -> str | None:
        """The repeated-block prefix a unit belongs to, if any."""
        for prefix in self.blocks:
            if unit.module == prefix or unit.module.startswith(prefix + "."):
                return prefix
        return None

    @property
    def num_params(self) -> int:
        return sum(u.num_params * u.count for u in self.units)

    @property
    def flops(self) -> float:
        return sum(u.flops * u.count for u in self.units)


def with_micro_batch(graph: ModelGraph, micro_batch: int) -> ModelGraph:
    """``graph`` at micro-batches of ``micro_batch`` rows: every unit's flops, bytes moved and
    saved, and every edge, scaled by the rows; the parameters as they are.

    [Note: micro-batch scaling]
    Exact where each op's work and tensors grow with the rows, as nearly all of a decoder's do
    (matmuls, attention within each sequence, norms, elementwise ops, the embedding's lookup).
    What one sequence shares with the others does not: the position ids, a learned position
    embedding's output, the loss's scalar; scaling over-counts them (for tidal's GPT a few KiB
    before the blocks, the test says how few). So the planner traces the model again at each
    size where its caller can (``make_plan(retrace=...)``: `tidal plan` and `tidal bench plan`
    do), and scales where it cannot (a model of your own, traced on your inputs)."""
    assert micro_batch >= 1, micro_batch
    r = micro_batch / graph.micro_batch
    units = [
        dataclasses.replace(u, params=list(u.params), flops=u.flops * r, io_bytes=u.io_bytes * r,
                            saved_input_bytes=u.saved_input_bytes * r,
                            saved_output_bytes=u.saved_output_bytes * r,
                            saved_internal_bytes=u.saved_internal_bytes * r,
                            out_bytes=u.out_bytes * r, shared_saved_bytes=u.shared_saved_bytes * r)
        for u in graph.units
    ]  # fmt: skip
    edges = [dataclasses.replace(e, nbytes=e.nbytes * r) for e in graph.edges]
    return dataclasses.replace(graph, units=units, edges=edges, micro_batch=micro_batch,
                               blocks=dict(graph.blocks), shape_reads=dict(graph.shape_reads))  # fmt: skip


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# clustering identical blocks

_INDEXED = re.compile(r"^(.*?)\.(\d+)(\.|\[|$)")


def _block_key(module: str) -> tuple[str, int] | None:
    match = _INDEXED.match(module)
    return (match.group(1), int(match.group(2))) if match else None


def cluster_blocks(graph: ModelGraph) -> ModelGraph:
    """Fold units of identical repeated blocks (``blocks.0`` ... ``blocks.N``) into one each."""
    groups: dict[str, dict[int, list[Unit]]] = {}
    for unit in graph.units:
        key = _block_key(unit.module)
        if key is not None:
            groups.setdefault(key[0], {}).setdefault(key[1], []).append(unit)
    renames: dict[str, str] = {}
    blocks: dict[str, int] = {}
    for prefix, members in groups.items():
        signatures = {
            i: tuple((u.name.removeprefix(f"{prefix}.{i}"), u.signature()) for u in us)
            for i, us in members.items()
        }
        if len(members) < 2 or len(set(signatures.values())) != 1:
            continue
        blocks[f"{prefix}.*"] = len(members)
        for i, us in members.items():
            for u in us:
                renames[u.name] = f"{prefix}.*" + u.name.removeprefix(f"{prefix}.{i}")
    units: dict[str, Unit] = {}
    for unit in graph.units:
        new = renames.get(unit.name, unit.name)
        if new in units:
            units[new].count += 1
            continue
        unit.name = new
        unit.module = new if unit.segment is None else new[: new.rindex("[")]
        for p in unit.params:
            p.name = _star_path(p.name, blocks)
            p.tied_to = renames.get(p.tied_to, p.tied_to) if p.tied_to else None
        units[new] = unit
    edges: dict[tuple[str, str], Edge] = {}
    for e in graph.edges:
        src, dst = renames.get(e.src, e.src), renames.get(e.dst, e.dst)
        if (src, dst) in edges:
            merged = edges[(src, dst)]
            merged.count += e.count
            merged.nbytes = max(merged.nbytes, e.nbytes)
        else:
            edges[(src, dst)] = Edge(src=src, dst=dst, nbytes=e.nbytes, count=e.count)
    reads: dict[str, set[str]] = {}
    for module, producers in graph.shape_reads.items():
        found = reads.setdefault(_star_module(module, blocks), set())
        found.update(renames.get(p, p) for p in producers)
    return ModelGraph(
        name=graph.name,
        units=list(units.values()),
        edges=list(edges.values()),
        micro_batch=graph.micro_batch,
        seq_len=graph.seq_len,
        blocks=blocks,
        shape_reads={m: tuple(sorted(v)) for m, v in reads.items()},
        tokens=graph.tokens,
        element_bytes=graph.element_bytes,
    )


def _star_module(module: str, blocks: dict[str, int]) -> str:
    """A module path with its block index starred (``blocks.0.attn`` -> ``blocks.*.attn``)."""
    for prefix in blocks:
        head = prefix.removesuffix(".*")
        match = re.match(rf"^{re.escape(head)}\.\d+(\..*)?$", module)
        if match:
            return prefix + (match.group(1) or "")
    return module


def _star_path(path: str, blocks: dict[str, int]) -> str:
    for prefix in blocks:
        head = prefix.removesuffix(".*")
        match = re.match(rf"^{re.escape(head)}\.\d+(\..*)$", path)
        if match:
            return prefix + match.group(1)
    return path
