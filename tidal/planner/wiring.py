"""A model in the planner's terms, derived from its measured graph, not from a table per model.

:func:`derive_wiring` reads a :class:`~tidal.planner.measure.ModelGraph` (the units ``measure``
records, their kinds, the data flow between them, the parameters each owns and the structure
facts of [Note: structure facts]) and says what ``apply`` needs to know to carry a plan out on
the model: each unit's role, which linears feed which attention core and how their outputs
divide into heads, where a repeated block takes its input, which weights are transposed or
tied, and which units must see whole activations. :func:`structure_graph` traces any model
(tidal's GPT, a Hugging Face decoder) for it on the meta device. Everything here is pure.

[Note: derived wiring]
- Roles come from kinds: ``embedding``, ``norm``, ``linear``, ``attention``, ``loss``; a leaf
  module without parameters that called dropout is ``dropout`` (a plan made at ``p = 0`` has no
  such units); a unit without parameters that no unit reading the caller's tensors reaches
  computes from shapes alone, ``positions`` (position ids, rotary tables): it travels whole;
  everything else is ``elementwise``.
- A linear feeding an attention core of ``H`` heads, ``G`` key/value heads of ``K`` features is
  one of separate projections when its outputs are ``H K`` or ``G K`` (contiguous heads: a plain
  column split gives each rank whole heads), or a fused ``[q; k; v]`` when they are
  ``(H + 2 G) K`` and the core splits it along the last dim in exactly those widths (its rows
  are then reordered per rank, [Note: fused qkv under tensor parallelism] in
  tidal/parallel/plan_apply.py). Any
  other feed cannot be split by heads.
- A repeated block's heads are its units reading the block's input (from before the block, or
  from the previous repetition); the one that is code in the block's forward (the residual add)
  fixes the layout the block's input is converted to on entry.
- [Note: code counts whole sequences] says which units must keep the sequence whole.

[Note: code counts whole sequences]
Python code in a module's forward sees the tensors its children hand back, and when it reads
their shape (``arange(x.shape[1])`` for positions, LLaMA's ``q.view(*x.shape[:-1], -1, K)``
with ``x`` the attention's input) or reshapes them with sizes of its own (GPT-2's final
``view(output_shape)``), it counts the sequence they carry. Sequence-split, a rank's share
would be counted as the whole, silently wrong. The trace records those reads and reshapes
(``shape_reads``, [Note: structure facts] in measure.py), and from them: a module whose output
such code uses never hands it on split along the sequence (``R`` instead of ``S(seq)``: its
consumers convert, a block at its entry); code itself (a segment) that such code uses, or that
reads such a module's output, keeps the sequence whole too (the planner offers it nothing
else); and code reading the caller's tensors takes them whole, as they come (a loss's targets
excepted: they are split with its logits). Attention cores and positions work on whole
sequences anyway. tidal's GPT reads only its fused projection's shape, which is never split
along the sequence, so nothing changes there; in LLaMA the embedding, each input norm, the
projections and the final norm hand on whole sequences, and in GPT-2 the embeddings, the
dropout after them and the final norm.

[Note: models without tokens]
The layouts split an activation along dim 1 as a sequence (``S(seq)``) and along its last dim
as features (``S(hid)``), which is what they are in a model of token ids. A model of your own
traced on other inputs (an MLP's ``(batch, features)``, a CNN's images) has no sequence: dim 1
is features or channels, and a split there or along an image's width would cut what a
convolution or a pooling mixes. So in a graph traced on anything but 2-D integer ids, linears
keep their tensor-parallel splits (colwise from whole inputs, rowwise from ``S(hid)``: exact on
any number of leading dims) and every other unit takes whole activations; the data axis
(ZeRO 0-3 per unit) is the same as for a decoder.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tidal.planner.measure import ModelGraph, Unit, measure
from tidal.planner.plan import Layout

__all__ = [
    "BlockSpec",
    "ModelWiring",
    "Projection",
    "UnitSpec",
    "code_to_code",
    "derive_wiring",
    "example_inputs",
    "input_layouts",
    "meta_twin",
    "structure_graph",
]

_TYPED_ROLES = ("embedding", "norm", "linear", "attention", "loss")


@dataclass(kw_only=True, frozen=True, slots=True)
class UnitSpec:
    """Where a decision unit lives, in the planner's terms, and what it does."""

    module: str  # path, ``*`` for the block index
    segment: int | None
    kind: str  # the planner's kind
    role: str  # positions, embedding, norm, linear, dropout, elementwise, attention, loss


@dataclass(kw_only=True, frozen=True, slots=True)
class Projection:
    """A linear feeding an attention core: its output's parts (one, or ``q, k, v`` fused)."""

    attention: str
    parts: tuple[int, ...] | None  # None: not a split apply knows (see why)
    why: str = ""


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockSpec:
    """A repeated block: its units, the ones reading its input, and the code that fixes the
    layout the input is converted to on entry (None: its heads all convert for themselves)."""

    prefix: str  # ``blocks.*``
    count: int
    units: tuple[str, ...]
    heads: tuple[str, ...]
    entry: str | None


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelWiring:
    """What ``apply`` needs to know of a model; see [Note: derived wiring]."""

    units: dict[str, UnitSpec]
    edges: tuple[tuple[str, str, int], ...]
    counts: dict[str, int]
    blocks: dict[str, BlockSpec]
    block_of: dict[str, str]  # unit -> block prefix, for the units of repeated blocks
    owns_params: frozenset[str]
    transposed: frozenset[str]  # linears keeping their weight as [in, out] (HF's Conv1D)
    ties: dict[str, str]  # unit -> the unit owning the weight it shares
    projections: dict[str, Projection]
    attention: dict[str, tuple[int, int, int]]  # unit -> (heads, kv heads, head dim)
    features: dict[str, tuple[int | None, int | None]]  # linear -> (in, out)
    inputs: dict[str, tuple[int, ...]]  # units reading the caller's positional tensors
    # [Note: code counts whole sequences], each unit with the reason
    whole_in: dict[str, str]  # code taking R only: it reads the caller's tensors
    sequence_whole: dict[str, str]  # code whose input and output are never S(seq)
    hand_whole: dict[str, str]  # modules never handing S(seq) on
    hidden_size: int

    def module_path(self, name: str, index: int) -> str:
        """The concrete module path of unit ``name`` in repetition ``index`` of its block."""
        return self.units[name].module.replace("*", str(index))

    def repetitions(self, name: str) -> int:
        block = self.block_of.get(name)
        return self.blocks[block].count if block else 1

    def consumers(self, name: str) -> list[str]:
        return [d for s, d, _ in self.edges if s == name]

    def producers(self, name: str) -> list[str]:
        return [s for s, d, _ in self.edges if d == name]


# ---------------------------------------------------------------------------------------------
# tracing a model for its structure


def meta_twin(model: nn.Module, *, buffers: bool = False) -> nn.Module:
    """A copy of ``model`` whose parameters are meta tensors of the same shapes (shared ones
    shared alike), made without copying their data; its buffers are meta too, or copies with
    ``buffers=True`` (rotary tables a model to be materialized needs)."""
    memo: dict[int, object] = {}
    for param in model.parameters():
        twin = torch.empty_like(param, device="meta")
        memo[id(param)] = nn.Parameter(twin, requires_grad=param.requires_grad)
    for buffer in model.buffers() if not buffers else ():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def takes_targets(model: nn.Module) -> bool:
    """Whether ``model`` follows tidal's convention ``forward(ids, targets=None)`` and returns
    the loss when given the next tokens (tidal's GPT does; Hugging Face models return logits)."""
    names = list(inspect.signature(model.forward).parameters)
    return len(names) >= 2 and names[1].startswith("targets")


def example_inputs(model: nn.Module, *, micro_batch: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Meta token ids (and targets, for a model computing its own loss) to trace ``model`` on."""
    shape = (micro_batch, seq_len)
    ids = torch.empty(shape, dtype=torch.long, device="meta")
    if takes_targets(model):
        return ids, torch.empty(shape, dtype=torch.long, device="meta")
    return (ids,)


def structure_graph(
    model: nn.Module,
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    inputs: tuple[torch.Tensor, ...] | None = None,
) -> ModelGraph:
    """The graph of ``model`` (on any device; a meta twin is traced) with every dropout a unit,
    for :func:`derive_wiring` ([Note: structure facts] in measure.py). It is traced on token
    ids of ``micro_batch x seq_len``, or on ``inputs`` (a sample of your own model's inputs,
    on any device: only their shapes and dtypes are read)."""
    twin = meta_twin(model)
    if inputs is not None:
        traced = tuple(torch.empty_like(t, device="meta") for t in inputs)
    else:
        assert seq_len is not None, "token ids need a sequence length"
        traced = example_inputs(twin, micro_batch=micro_batch, seq_len=seq_len)
    return measure(twin, traced, name=type(model).__name__, dropout_units=True)


# ---------------------------------------------------------------------------------------------
# deriving the wiring


def derive_wiring(graph: ModelGraph) -> ModelWiring:
    """The wiring of the model ``graph`` was measured on; see [Note: derived wiring]."""
    units = {u.name: u for u in graph.units}
    edges = tuple((e.src, e.dst, e.count) for e in graph.edges)
    positions = _positions(graph)
    block_of = {u.name: b for u in graph.units if (b := graph.block_of(u)) is not None}
    blocks = {p: _block(graph, p, n, positions) for p, n in graph.blocks.items()}
    whole_in, sequence_whole, hand_whole = _whole(graph, positions, blocks)
    return ModelWiring(
        units={n: _spec(u, n in positions) for n, u in units.items()},
        edges=edges,
        counts={n: u.count for n, u in units.items()},
        blocks=blocks,
        block_of=block_of,
        owns_params=frozenset(n for n, u in units.items() if u.params),
        transposed=frozenset(n for n, u in units.items() if u.weight_transposed),
        ties={n: p.tied_to for n, u in units.items() for p in u.params if p.tied_to},
        projections=_projections(graph),
        attention={
            n: (u.heads or 1, u.kv_heads or 1, u.head_dim or 1)
            for n, u in units.items()
            if u.kind == "attention"
        },
        features={n: (u.in_features, u.out_features) for n, u in units.items()},
        inputs={n: u.inputs for n, u in units.items() if u.inputs},
        whole_in=whole_in,
        sequence_whole=sequence_whole,
        hand_whole=hand_whole,
        hidden_size=_hidden_size(graph),
    )


def input_layouts(graph: ModelGraph) -> dict[str, tuple[Layout, ...]]:
    """The input layouts units of ``graph`` may take, for those that cannot take them all
    ([Note: code counts whole sequences], [Note: models without tokens]); the planner offers
    them no other."""
    if not graph.tokens:
        return {u.name: (Layout.R, Layout.HID) if u.kind == "linear" else (Layout.R,)
                for u in graph.units}  # fmt: skip
    positions = _positions(graph)
    blocks = {p: _block(graph, p, n, positions) for p, n in graph.blocks.items()}
    whole_in, sequence_whole, _ = _whole(graph, positions, blocks)
    allowed = dict.fromkeys(sequence_whole, (Layout.R, Layout.HID))
    return allowed | dict.fromkeys(whole_in, (Layout.R,))


def _spec(unit: Unit, is_positions: bool) -> UnitSpec:
    if is_positions:
        role = "positions"
    elif unit.kind in _TYPED_ROLES:
        role = unit.kind
    elif unit.dropout and unit.segment is None and not unit.params:
        role = "dropout"
    else:
        role = "elementwise"
    return UnitSpec(module=unit.module, segment=unit.segment, kind=unit.kind, role=role)


def _reachable(graph: ModelGraph, sources: Iterable[str]) -> set[str]:
    seen, todo = set(sources), list(sources)
    while todo:
        name = todo.pop()
        for e in graph.edges:
            if e.src == name and e.dst not in seen:
                seen.add(e.dst)
                todo.append(e.dst)
    return seen


def _positions(graph: ModelGraph) -> set[str]:
    """Units without parameters that nothing derived from the caller's tensors reaches."""
    sources = [u.name for u in graph.units if u.inputs]
    if graph.handed:  # the block's input, handed by the stage before, enters its heads
        block = {u.name: i for i, u in enumerate(graph.units) if graph.block_of(u) is not None}
        sources += [e.dst for e in graph.edges
                    if e.src in block and e.dst in block and block[e.src] >= block[e.dst]]  # fmt: skip
    tokens = _reachable(graph, sources)
    return {u.name for u in graph.units if not u.params and u.name not in tokens}


def _whole(
    graph: ModelGraph, positions: set[str], blocks: dict[str, BlockSpec]
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(code taking R only, code keeping the sequence whole, modules never handing S(seq)), each
    unit with the reason: [Note: code counts whole sequences]."""
    units = {u.name: u for u in graph.units}
    whole_in = {
        u.name: "it reads the caller's tensors, which come whole"
        for u in graph.units
        if u.inputs and u.segment is not None and u.kind != "loss"
    }
    counted: dict[str, str] = {}
    for module, producers in graph.shape_reads.items():
        for name in producers:
            if name not in positions and units[name].kind != "attention":
                why = f"{module or 'the model'!r}'s code counts the sequence it carries"
                counted.setdefault(name, why)
    hand_whole = {n: why for n, why in counted.items() if units[n].segment is None}
    sequence_whole = {n: why for n, why in counted.items() if units[n].segment is not None}
    for e in graph.edges:
        dst = units[e.dst]
        code = dst.segment is not None and dst.kind != "attention"
        if e.src in hand_whole and code and not _enters(blocks, graph, e.src, e.dst):
            why = f"it reads {e.src!r}, which is handed on whole: {hand_whole[e.src]}"
            sequence_whole.setdefault(e.dst, why)
    return whole_in, sequence_whole, hand_whole


def _enters(blocks: dict[str, BlockSpec], graph: ModelGraph, src: str, dst: str) -> bool:
    """Whether ``src -> dst`` hands a block its input, which the block converts on entry."""
    block = graph.block_of(graph.unit(dst))
    if block is None or dst not in blocks[block].heads:
        return False
    order = blocks[block].units
    return src not in order or order.index(src) >= order.index(dst)


def _block(graph: ModelGraph, prefix: str, count: int, positions: set[str]) -> BlockSpec:
    members = [u.name for u in graph.units if graph.block_of(u) == prefix]
    order = {name: i for i, name in enumerate(members)}
    into = [e for e in graph.edges if e.dst in order and e.src not in {*order, *positions}]
    back = [e for e in graph.edges if e.dst in order and e.src in order]
    back = [e for e in back if order[e.src] >= order[e.dst]]
    heads = sorted({e.dst for e in [*into, *back]}, key=order.__getitem__)
    entries = [h for h in heads if graph.unit(h).segment is not None]
    return BlockSpec(
        prefix=prefix,
        count=count,
        units=tuple(members),
        heads=tuple(heads),
        entry=entries[0] if entries else None,
    )


def _projections(graph: ModelGraph) -> dict[str, Projection]:
    found = {}
    for e in graph.edges:
        src, dst = graph.unit(e.src), graph.unit(e.dst)
        if src.kind != "linear" or dst.kind != "attention":
            continue
        heads, kv_heads, head_dim = dst.heads or 1, dst.kv_heads or 1, dst.head_dim or 1
        q, kv, out = heads * head_dim, kv_heads * head_dim, src.out_features
        if out in (q, kv):
            found[src.name] = Projection(attention=dst.name, parts=(out,))
        elif out == q + 2 * kv and dst.split_widths == (q, kv, kv):
            found[src.name] = Projection(attention=dst.name, parts=(q, kv, kv))
        else:
            why = (
                f"its {out} outputs are neither q or k/v ({q} or {kv}: {heads} heads, {kv_heads} "
                f"key/value heads of {head_dim}) nor a fused [q; k; v] that {dst.name!r} splits "
                f"along its last dim (it splits {list(dst.split_widths) or 'nothing'})"
            )
            found[src.name] = Projection(attention=dst.name, parts=None, why=why)
    return found


def _hidden_size(graph: ModelGraph) -> int:
    """The residual stream's width: the word embedding's (the largest table's) columns; 0 for
    a model without tokens, whose ``S(hid)`` activations are each a linear's, checked by unit
    ([Note: models without tokens])."""
    if not graph.tokens:
        return 0
    tables = [u for u in graph.units if u.kind == "embedding" and u.params]
    if tables:
        table = max(tables, key=lambda u: u.num_params)
        return int(table.params[0].shape[-1])
    # a pipeline stage after the first holds no table: its first norm's width is the stream's
    norms = [u for u in graph.units if u.kind == "norm" and u.params]
    return int(norms[0].params[0].shape[-1]) if norms else 1


def code_to_code(graph: ModelGraph) -> set[tuple[str, str]]:
    """Edges between two runs of a forward's own code (segments), where no hook can convert:
    the consumer takes the tensor in the layout the producer made it ([Note: plan realisation]
    in tidal/parallel/plan_apply.py, which refuses plans that convert there). Not an edge into a
    block, whose pre-hook converts, nor one from code that computes positions, which is whole."""
    wiring = derive_wiring(graph)
    units = {u.name: u for u in graph.units}
    found = set()
    for edge in graph.edges:
        src, dst = wiring.units[edge.src], wiring.units[edge.dst]
        if src.segment is None or dst.segment is None or src.role == "positions":
            continue
        block = wiring.block_of.get(edge.dst)
        if block is not None and edge.dst in wiring.blocks[block].heads:
            order = wiring.blocks[block].units
            inside = wiring.block_of.get(edge.src) == block
            if not inside or order.index(edge.src) >= order.index(edge.dst):
                continue  # enters the block: its pre-hook converts
        assert units[edge.src].segment is not None
        found.add((edge.src, edge.dst))
    return found
