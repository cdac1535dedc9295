"""tidal's GPT in the planner's terms: its decision units, their edges, and which plans it can run.

:func:`check_plan` and the wiring (:class:`_Wiring`) are what ``apply`` (apply.py) relies on: every
unit known, every strategy one the unit can carry out, sizes that split, tied weights split
alike, and each activation's *wire* layout between modules ([Note: plan realisation] in
apply.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tidal.models.gpt import GPT
from tidal.planner.plan import Layout, Plan, StrategyName, UnitChoice

__all__ = ["GPT_UNITS", "UnitSpec", "check_plan", "gpt_edges"]

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P


@dataclass(kw_only=True, frozen=True, slots=True)
class UnitSpec:
    """Where a decision unit of tidal's GPT lives, in the planner's terms, and what it does."""

    module: str  # path, ``*`` for the block index
    segment: int | None
    kind: str  # the planner's kind
    role: str  # positions, embedding, norm, linear, dropout, elementwise, attention, loss


def _spec(module: str, segment: int | None, kind: str, role: str | None = None) -> UnitSpec:
    return UnitSpec(module=module, segment=segment, kind=kind, role=role or kind)


GPT_UNITS: dict[str, UnitSpec] = {
    "[0]": _spec("", 0, "elementwise", "positions"),
    "tok_embed": _spec("tok_embed", None, "embedding"),
    "pos_embed": _spec("pos_embed", None, "embedding"),
    "[1]": _spec("", 1, "elementwise"),
    "drop": _spec("drop", None, "elementwise", "dropout"),
    "blocks.*.ln_1": _spec("blocks.*.ln_1", None, "norm"),
    "blocks.*.attn.qkv": _spec("blocks.*.attn.qkv", None, "linear"),
    "blocks.*.attn[0]": _spec("blocks.*.attn", 0, "attention"),
    "blocks.*.attn.proj": _spec("blocks.*.attn.proj", None, "linear"),
    "blocks.*.attn.resid_drop": _spec("blocks.*.attn.resid_drop", None, "elementwise", "dropout"),
    "blocks.*[0]": _spec("blocks.*", 0, "elementwise"),
    "blocks.*.ln_2": _spec("blocks.*.ln_2", None, "norm"),
    "blocks.*.mlp.fc": _spec("blocks.*.mlp.fc", None, "linear"),
    "blocks.*.mlp[0]": _spec("blocks.*.mlp", 0, "elementwise"),
    "blocks.*.mlp.proj": _spec("blocks.*.mlp.proj", None, "linear"),
    "blocks.*.mlp.drop": _spec("blocks.*.mlp.drop", None, "elementwise", "dropout"),
    "blocks.*[1]": _spec("blocks.*", 1, "elementwise"),
    "ln_f": _spec("ln_f", None, "norm"),
    "lm_head": _spec("lm_head", None, "linear"),
    "[2]": _spec("", 2, "loss"),
}

# (strategy, in_layout, out_layout) each role can carry out; positions take any.
_TOKENWISE = {(S.REPLICATE, R, R), (S.SEQUENCE, SEQ, SEQ)}
_SHAPES: dict[str, set[tuple[StrategyName, Layout, Layout]]] = {
    "linear": _TOKENWISE | {(S.COLWISE, R, HID), (S.COLWISE, SEQ, HID), (S.ROWWISE, HID, P)},
    "embedding": _TOKENWISE | {(S.VOCAB, R, P)},
    "norm": _TOKENWISE,
    "elementwise": _TOKENWISE | {(S.HIDDEN, HID, HID)},
    "attention": {(S.REPLICATE, R, R), (S.HEADS, HID, HID)},
}
_SHAPES["dropout"] = _SHAPES["loss"] = _SHAPES["elementwise"]


def gpt_edges(num_layers: int) -> list[tuple[str, str, int]]:
    """The data flow between the GPT's units, as ``(producer, consumer, count)``."""
    n = num_layers
    chain = ["ln_1", "attn.qkv", "attn[0]", "attn.proj", "attn.resid_drop", "[0]", "ln_2"]
    chain += ["mlp.fc", "mlp[0]", "mlp.proj", "mlp.drop", "[1]"]
    block = [f"blocks.*{u}" if u.startswith("[") else f"blocks.*.{u}" for u in chain]
    first, add_0, add_1 = block[0], block[5], block[-1]
    edges = [("[0]", "pos_embed", 1), ("tok_embed", "[1]", 1), ("pos_embed", "[1]", 1)]
    edges += [("[1]", "drop", 1), ("drop", first, 1), ("drop", add_0, 1)]
    edges += [(a, b, n) for a, b in zip(block[:-1], block[1:], strict=True)] + [(add_0, add_1, n)]
    edges += [(add_1, first, n - 1), (add_1, add_0, n - 1), (add_1, "ln_f", 1)]
    edges += [("ln_f", "lm_head", 1), ("lm_head", "[2]", 1)]
    return [e for e in edges if e[2] > 0]


# ---------------------------------------------------------------------------------------------
# checking a plan against the model


@dataclass(kw_only=True, frozen=True, slots=True)
class _Wiring:
    """Each planned unit's choice, the wire layout it gets and the one it gives."""

    units: dict[str, UnitChoice]
    wire_in: dict[str, Layout]
    wire_out: dict[str, Layout]
    block_in: tuple[Layout, Layout]  # what the first block is handed, and what the others are


def check_plan(model: nn.Module, plan: Plan) -> None:
    """Raise ``ValueError`` naming the problem and its fix unless ``apply`` can realise ``plan``."""
    _wire(model, plan)


def _wire(model: nn.Module, plan: Plan) -> _Wiring:
    if not isinstance(model, GPT):
        raise ValueError(f"apply realises plans on tidal's GPT, not on {type(model).__name__}")
    units = _check_units(plan)
    for name, unit in units.items():
        role, shape = GPT_UNITS[name].role, (unit.strategy, unit.in_layout, unit.out_layout)
        if role != "positions" and shape not in _SHAPES[role]:
            can = _join(f"{s} {i}->{o}" for s, i, o in _SHAPES[role])
            raise ValueError(
                f"unit {name!r} is {unit.strategy} {unit.in_layout}->{unit.out_layout}, which a "
                f"{role} cannot do with DTensor; it can do: {can}"
            )
    _check_sizes(model, plan, units)
    _check_pairs(model, units)
    edges = _contract(units, gpt_edges(len(model.blocks)))
    # A block's input enters its forward, whose pre-hook converts it for ln_1 and [0] both.
    entry, heads = units["blocks.*[0]"].in_layout, ("blocks.*.ln_1", "blocks.*[0]")
    into = {(s, d) for s, d in edges if d in heads and not s.startswith("blocks.*")}
    later = {(s, d) for s, d in edges if d in heads and s == "blocks.*[1]"}
    edges -= into | later
    wire_out = {name: _own_wire(name, units, edges) for name in units}
    block_in = (wire_out[next(iter(into))[0]], wire_out["blocks.*[1]"] if later else entry)
    for src, dst in sorted(edges):
        if GPT_UNITS[dst].segment is not None and wire_out[src] != units[dst].in_layout:
            raise ValueError(
                f"unit {dst!r} takes {units[dst].in_layout} but {src!r} gives {wire_out[src]}; "
                f"{dst!r} is code in a forward, which cannot convert: make {src!r} give "
                f"{units[dst].in_layout}"
            )
    if plan.tp > 1:
        _warn_detour(units, entry, block_in)
    # Only segments have two producers, and those must agree (above); token ids come whole.
    wire_in = {"tok_embed": R, "blocks.*.ln_1": entry} | {d: wire_out[s] for s, d in edges}
    return _Wiring(units=units, wire_in=wire_in, wire_out=wire_out, block_in=block_in)


def _warn_detour(units: dict[str, UnitChoice], entry: Layout, block_in: tuple) -> None:
    ln_1 = units["blocks.*.ln_1"].in_layout
    for which, given in zip(("the first block", "later blocks"), block_in, strict=True):
        if given != entry and ln_1 != entry:
            message = f"in {which}, blocks.*.ln_1 takes {ln_1} but the block's input ({given}) "
            message += f"must become {entry} for the add blocks.*[0] first: ln_1 then converts "
            warnings.warn(
                f"{message}{entry} -> {ln_1}, a cost the plan does not count", stacklevel=4
            )


def _check_units(plan: Plan) -> dict[str, UnitChoice]:
    units = {u.name: u for u in plan.units}
    unknown = [n for n in units if n not in GPT_UNITS]
    if unknown:
        raise ValueError(
            f"the plan has units tidal's GPT does not have ({_join(map(repr, unknown))}): it was "
            f"made for another model; make it again with `tidal plan` for this one"
        )
    missing = [n for n, s in GPT_UNITS.items() if n not in units and s.role != "dropout"]
    if missing:
        raise ValueError(f"the plan has no choice for units {_join(map(repr, missing))}")
    for name, unit in units.items():
        spec = GPT_UNITS[name]
        if (unit.module, unit.segment) != (spec.module, spec.segment):  # another version's?
            raise ValueError(f"unit {name!r} is {spec.module!r} segment {spec.segment} in the GPT")
        if unit.zero not in (0, 1, 2, 3):
            raise ValueError(f"unit {name!r} has ZeRO level {unit.zero}; levels are 0 to 3")
    if set(plan.recompute) - {"blocks.*"}:
        raise ValueError(f"recompute names {_join(plan.recompute)}; only 'blocks.*' can be")
    return units


def _check_sizes(model: GPT, plan: Plan, units: dict[str, UnitChoice]) -> None:
    t = plan.tp
    fix = f"make the plan for a tensor axis whose size divides it, or replicate on {t}"
    for name, unit in units.items():
        module = model.get_submodule(GPT_UNITS[name].module.replace("*", "0"))
        if unit.strategy is S.HEADS:
            size, what = model.config.num_heads, "heads"
        elif unit.strategy is S.ROWWISE:
            size, what = module.in_features, "inputs"
        elif unit.strategy is S.COLWISE and name != "lm_head":  # a vocabulary may split unevenly
            size, what = module.out_features, "outputs"
        else:
            continue
        if size % t:
            raise ValueError(
                f"unit {name!r} is {unit.strategy} on a tensor axis of {t} ranks, but its {size} "
                f"{what} are not divisible by {t}: {fix}"
            )
    splits = ((HID, model.config.d_model, "d_model"), (SEQ, plan.seq_len, "seq_len"))
    for layout, size, what in splits:
        if size % t and any(layout in (u.in_layout, u.out_layout) for u in units.values()):
            raise ValueError(f"{layout} activations need {what} ({size}) divisible by {t}: {fix}")


def _check_pairs(model: GPT, units: dict[str, UnitChoice]) -> None:
    """Choices that only work together: fused qkv and heads, tied weights, vocabulary loss."""
    qkv, core = units["blocks.*.attn.qkv"], units["blocks.*.attn[0]"]
    if (qkv.strategy is S.COLWISE) != (core.strategy is S.HEADS):
        raise ValueError(
            f"blocks.*.attn.qkv is {qkv.strategy} and blocks.*.attn[0] is {core.strategy}: the "
            f"fused qkv splits only by heads, so make both colwise/heads or neither ([Note: "
            f"fused qkv under tensor parallelism] in tidal/planner/apply.py)"
        )
    tok, head = units["tok_embed"], units["lm_head"]
    if model.config.tie_embeddings and _weight_placement(
        "embedding", tok.strategy
    ) != _weight_placement("linear", head.strategy):
        raise ValueError(
            f"tok_embed ({tok.strategy}) and lm_head ({head.strategy}) share one weight but "
            f"split it differently: pair vocab with colwise, or replicate and sequence with either"
        )
    if units["[2]"].in_layout is HID and head.strategy not in (S.COLWISE, S.ROWWISE):
        raise ValueError(
            f"the loss [2] takes S(hid) (vocabulary-parallel) logits, which lm_head "
            f"({head.strategy}) does not make: make lm_head colwise"
        )


def _weight_placement(role: str, strategy: StrategyName) -> Placement:
    if (role, strategy) in (("linear", S.COLWISE), ("embedding", S.VOCAB)):
        return Shard(0)
    return Shard(1) if (role, strategy) == ("linear", S.ROWWISE) else Replicate()


def _contract(units: dict[str, UnitChoice], edges: list[tuple[str, str, int]]) -> set[tuple]:
    """The edges between planned units, bridging the dropout units the plan leaves out."""
    pairs = {(src, dst) for src, dst, _ in edges}
    for gone in [n for n in GPT_UNITS if n not in units]:
        into, out = [s for s, d in pairs if d == gone], [d for s, d in pairs if s == gone]
        pairs = {(s, d) for s, d in pairs if gone not in (s, d)}
        pairs |= {(s, d) for s in into for d in out}
    return pairs


def _own_wire(name: str, units: dict[str, UnitChoice], edges: set[tuple]) -> Layout:
    unit, spec = units[name], GPT_UNITS[name]
    if spec.segment is not None:
        return R if spec.role == "positions" else unit.out_layout
    consumers = [units[d] for s, d in edges if s == name]
    fixed = {c.in_layout for c in consumers if GPT_UNITS[c.name].segment is not None}
    if not fixed and unit.out_layout is P:
        fixed = {c.in_layout for c in consumers}
    if len(fixed) > 1 or P in fixed:
        raise ValueError(
            f"{name!r} feeds units taking {_join(fixed)}, not one of R, S(seq), S(hid)"
        )
    return fixed.pop() if fixed else unit.out_layout


def _join(items: Any) -> str:
    return ", ".join(sorted(str(i) for i in items))
