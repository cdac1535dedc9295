"""A plan on a model: whether ``apply`` can carry it out, and the layouts activations travel in.

:func:`check_plan` and :func:`wire_plan` are what ``apply`` (tidal/parallel/plan_apply.py, a
layer above: the planner runs nothing) relies on: every unit known, every strategy one the unit
can carry out, sizes that split, paired choices made alike (fused projections and heads, tied
weights, a vocabulary-parallel loss) and each activation's *wire* layout between modules
([Note: plan realisation] in plan_apply.py). The model's side comes from its measured graph
(:func:`~tidal.planner.wiring.derive_wiring`), so the same rules hold for tidal's GPT and for
Hugging Face decoders.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from tidal.planner.block_savers import HOST_MODES
from tidal.planner.measure import ModelGraph
from tidal.planner.model_data import chunk_refusal
from tidal.planner.plan import Layout, Offload, Plan, Recompute, StrategyName, UnitChoice
from tidal.planner.wiring import ModelWiring, derive_wiring, structure_graph

__all__ = [
    "NotRun",
    "PlanWiring",
    "check_plan",
    "model_name",
    "not_run",
    "offload_runs",
    "sent_layout",
    "split_dim",
    "wire_plan",
]

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P

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


@dataclass(kw_only=True, frozen=True, slots=True)
class PlanWiring:
    """Each planned unit's choice, the wire layout it gets and the one it gives."""

    model: ModelWiring
    units: dict[str, UnitChoice]
    wire_in: dict[str, Layout]
    wire_out: dict[str, Layout]
    block_in: dict[str, tuple[Layout, Layout]]  # what the first repetition is handed, the others
    block_entry: dict[str, Layout]  # what a block's pre-hook converts its input to


# [Note: selective recomputation contract]
# The planner recomputes an attention core alone (Megatron's selective recomputation) only in a
# module that offers it: one with a boolean attribute named RECOMPUTE_CORE, which ``apply`` sets
# and the module's forward reads (wrapping its core in a checkpoint when true). The planner knows
# no model class; a model opts in by this attribute (tidal's GPT attention does). A core that is
# code inside another forward (Hugging Face's) cannot be cut out, so plans recompute such blocks
# fully or not at all.
RECOMPUTE_CORE = "recompute_core"


def model_name(model: nn.Module) -> str:
    name = type(model).__name__
    return f"tidal's {name}" if type(model).__module__.startswith("tidal.") else name


def check_plan(model: nn.Module, plan: Plan, *, graph: ModelGraph | None = None,
               handed: Layout | None = None) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the problem and its fix unless ``apply`` can realise ``plan``
    on ``model``; ``graph``: the model's :func:`~tidal.planner.wiring.structure_graph`, traced
    here when not given."""
    wire_plan(model, plan, graph=graph, handed=handed)


def wire_plan(model: nn.Module, plan: Plan, *, graph: ModelGraph | None = None,
              handed: Layout | None = None) -> PlanWiring:  # fmt: skip
    """The checked plan with its wire layouts ([Note: plan realisation] in
    tidal/parallel/plan_apply.py). ``handed``: the layout the first block's input arrives in
    from outside the model (a pipeline stage's from the stage before: [Note: planned pipeline
    stages] in tidal/train/plan_stage.py); by default whole."""
    for gap in not_run(plan):
        raise ValueError(gap.why)
    graph = graph or structure_graph(model, seq_len=plan.seq_len)
    wiring = derive_wiring(graph)
    units = _check_units(wiring, plan, model_name(model))
    for name, unit in units.items():
        role, shape = wiring.units[name].role, (unit.strategy, unit.in_layout, unit.out_layout)
        if role != "positions" and shape not in _SHAPES[role]:
            can = _join(f"{s} {i}->{o}" for s, i, o in _SHAPES[role])
            raise ValueError(
                f"unit {name!r} is {unit.strategy} {unit.in_layout}->{unit.out_layout}, which a "
                f"{role} cannot do with DTensor; it can do: {can}"
            )
    _check_sizes(wiring, plan, units)
    _check_pairs(wiring, units)
    _check_whole(wiring, units)
    _check_recompute(wiring, plan, model)
    return _wire(wiring, plan, units, handed)


def sent_layout(plan: Plan, graph: ModelGraph, *, handed: Layout | None = None) -> Layout:
    """The layout a pipeline stage laid out by ``plan`` (its part of the model: ``graph``,
    handed the stream in ``handed``) sends the next stage: the stream as its blocks hand it to
    one another (:attr:`PlanWiring.block_in`'s later layout), the wiring the stage runs."""
    wiring = derive_wiring(graph)
    units = _check_units(wiring, plan, plan.model)
    ((_, later),) = _wire(wiring, plan, units, handed).block_in.values()
    return later


@dataclass(frozen=True, slots=True)
class NotRun:
    """What of a plan ``tidal train --plan`` does not carry out yet: ``what`` says it the way
    ``tidal plan`` does, naming the search option that chose it; ``why`` is the one-line
    refusal a run gives, naming the fix."""

    what: str
    why: str


def not_run(plan: Plan) -> list[NotRun]:
    """What of ``plan`` a plan run refuses (empty: it runs), the one decision ``check_plan``,
    a pipelined plan's load and ``tidal plan``'s printed command share."""
    gaps = []
    if not offload_runs(plan):
        gaps.append(NotRun(what="keeps parameters of units below ZeRO-3 on the host "
                                "(--offload-params)", why=_offload_refusal(plan)))  # fmt: skip
    layout = plan.pipeline
    unversioned = _unversioned(plan)
    if layout is not None and layout.schedule not in ("1f1b", "interleaved") and unversioned:
        gaps.append(NotRun(
            what=f"runs {layout.schedule} on {unversioned} (--schedules {layout.schedule})",
            why=f"the plan runs {layout.schedule} on {unversioned}, which hides or moves the "
                f"weights an asynchronous schedule versions in place ([Note: PipeMare plans] "
                f"in tidal/planner/pipelines.py): make the plan again with this tidal's "
                f"tidal plan, which gives {layout.schedule} stages it can version",
        ))  # fmt: skip
    unheld = _join(sorted({why for p in _plans(plan) if p.chunks is not None
                           for why in [chunk_refusal(plan, p)] if why}))  # fmt: skip
    if unheld:
        gaps.append(NotRun(
            what="keeps model data in tidal's chunks where chunks cannot hold it",
            why=f"the plan keeps a stage's model data in tidal's chunks, and {unheld} "
                f"([Note: chunk stages in plans] in tidal/planner/model_data.py): make the "
                f"plan again with this tidal's tidal plan, which gives chunks the stages they "
                f"can hold, or with --model-data fsdp2",
        ))  # fmt: skip
    lending = [p for p in _plans(plan) if p.memory.lent]
    whole = {m for p in lending for m in p.recompute.values()} & {Recompute.FULL, *HOST_MODES}
    if lending and (whole or (layout is not None and layout.virtual_stages > 1)):
        how = _join(f"{m} blocks" for m in whole) or "interleaved stages"
        gaps.append(NotRun(
            what=f"keeps activations of {how} on a peer stage (--peer)",
            why=f"the plan keeps activations of {how} on the mirror stage's device (MPress's "
                f"peer swap), which plan runs lend from blocks that keep what they save, under "
                f"1F1B ([Note: lending in plan runs] in tidal/train/plan_lending.py): make it "
                f"without --peer",
        ))  # fmt: skip
    return gaps


def _unversioned(plan: Plan) -> str:
    """What of ``plan``'s stages PipeMare cannot version ([Note: PipeMare plans] in
    pipelines.py), for a reader; ``""``: nothing."""
    stages = _plans(plan)
    recomputed = {m for p in stages for m in p.recompute.values()} - {Recompute.NONE}
    found = {
        "tensor-parallel stages": plan.tp > 1,
        "ZeRO-sharded units": any(u.zero for p in stages for u in p.units),
        "recomputed blocks": bool(recomputed),
        "model data off the device": any(p.offload for p in stages),
    }
    return _join(what for what, yes in found.items() if yes)


def offload_runs(plan: Plan) -> bool:
    """Whether ``plan``'s model data offload is one a plan run carries out: any part of the
    optimizer on the host and of that on NVMe ([Note: the optimizer on the host] in
    tidal/runtime/host_optimizer.py), and any part of the parameters of ZeRO-3 units, on one
    device or several (FSDP2's CPU offload of the groups nearest it: [Note: model data
    offload] in strategies.py), each pipeline stage by its own offload."""
    return not _below_zero3(plan)


def _plans(plan: Plan) -> list[Plan]:
    """Each stage as a run realises it (:meth:`Plan.stage_plan`)."""
    return [plan.stage_plan(s) for s in range(1 if plan.pipeline is None else
                                              plan.pipeline.num_stages)]  # fmt: skip


def _stages(plan: Plan) -> list[tuple[Offload, list[UnitChoice]]]:
    """Each stage's offload and units as a run realises them, of the stages FSDP2 holds (chunks
    place any unit's model data: [Note: chunk stages in plans] in model_data.py)."""
    return [(p.offload, p.units) for p in _plans(plan) if p.chunks is None]


def _below_zero3(plan: Plan) -> list[str]:
    """The units holding model data (on the device or off it) whose weights are not sharded,
    in stages that keep parameters on the host."""
    return sorted({u.name for offload, units in _stages(plan) if offload.params for u in units
                   if u.zero != 3 and u.memory.resident + u.memory.host + u.memory.nvme > 0})  # fmt: skip


def _offload_refusal(plan: Plan) -> str:
    below = _below_zero3(plan)
    return (
        f"the plan keeps {plan.describe_offload()}; {_join(map(repr, below[:3]))} are not "
        f"ZeRO-3, which is priced but not run yet: tidal train --plan keeps parameters on the "
        f"host as FSDP2's CPU offload of ZeRO-3 units; make the plan again with this tidal's "
        f"tidal plan (it offers such units ZeRO-3 alone), or with --offload-params 0"
    )


def _wire(wiring: ModelWiring, plan: Plan, units: dict[str, UnitChoice],
          handed: Layout | None = None) -> PlanWiring:  # fmt: skip
    edges = _contract(wiring, units)
    entry = {p: _entry_layout(wiring, p, units) for p in wiring.blocks}
    # A block's input enters its forward, whose pre-hook converts it once for all its heads.
    into = {(s, d) for s, d in edges if _enters_block(wiring, s, d)}
    edges -= into
    feeders = {p: {s for s, d in into if wiring.block_of[d] == p} for p in wiring.blocks}
    wire_out = {name: _own_wire(name, wiring, units, edges, entry, feeders) for name in units}
    block_in = {p: _block_in(wiring, p, feeders[p], wire_out, entry[p]) for p in wiring.blocks}
    if handed is not None:
        assert handed is not Layout.P, "partial sums never travel between modules"
        block_in = {p: (handed, later) for p, (_, later) in block_in.items()}
    positions = {n for n in units if wiring.units[n].role == "positions"}
    for src, dst in sorted(edges):
        spec = wiring.units[dst]
        if spec.segment is None or spec.role in ("positions", "attention") and src in positions:
            continue
        if wire_out[src] != units[dst].in_layout:
            raise ValueError(
                f"unit {dst!r} takes {units[dst].in_layout} but {src!r} gives {wire_out[src]}; "
                f"{dst!r} is code in a forward, which cannot convert: make {src!r} give "
                f"{units[dst].in_layout}"
            )
    if plan.tp > 1:
        for prefix in wiring.blocks:
            _warn_detour(wiring, prefix, units, entry[prefix], block_in[prefix])
    wire_in = {n: _wire_in(n, wiring, units, edges, wire_out, entry) for n in units}
    return PlanWiring(
        model=wiring,
        units=units,
        wire_in=wire_in,
        wire_out=wire_out,
        block_in=block_in,
        block_entry=entry,
    )


def _enters_block(wiring: ModelWiring, src: str, dst: str) -> bool:
    """Whether ``src -> dst`` hands a block its input: from before it, or from the previous
    repetition (a later unit of the block, in the plan's edges where dropouts may be gone)."""
    block = wiring.block_of.get(dst)
    if block is None or dst not in wiring.blocks[block].heads:
        return False
    if wiring.block_of.get(src) != block:
        return wiring.units[src].role != "positions"
    order = wiring.blocks[block].units
    return order.index(src) >= order.index(dst)


def _entry_layout(wiring: ModelWiring, prefix: str, units: dict[str, UnitChoice]) -> Layout:
    """The layout a block's input is converted to on entry: its entry code's, else its first
    head's."""
    spec = wiring.blocks[prefix]
    return units[spec.entry or spec.heads[0]].in_layout


def _block_in(
    wiring: ModelWiring,
    prefix: str,
    feeders: set[str],
    wire_out: dict[str, Layout],
    entry: Layout,
) -> tuple[Layout, Layout]:
    """What the first repetition of a block is handed, and what the later ones are."""
    first = {wire_out[f] for f in feeders if wiring.block_of.get(f) != prefix}
    later = {wire_out[f] for f in feeders if wiring.block_of.get(f) == prefix}
    if len(first) > 1 or len(later) > 1:
        raise ValueError(
            f"the units handing {prefix!r} its input give different layouts "
            f"({_join(first | later)}): make them give one"
        )
    return first.pop() if first else R, later.pop() if later else entry  # the caller's: whole


def _warn_detour(
    wiring: ModelWiring,
    prefix: str,
    units: dict[str, UnitChoice],
    entry: Layout,
    block_in: tuple[Layout, Layout],
) -> None:
    spec = wiring.blocks[prefix]
    for head in (h for h in spec.heads if h != spec.entry and spec.entry is not None):
        takes = units[head].in_layout
        short = head.removeprefix(prefix + ".")
        for which, given in zip(("the first block", "later blocks"), block_in, strict=True):
            if given != entry and takes != entry:
                message = f"in {which}, {head} takes {takes} but the block's input ({given}) "
                message += f"must become {entry} for the add {spec.entry} first: {short} then "
                warnings.warn(
                    f"{message}converts {entry} -> {takes}, a cost the plan does not count",
                    stacklevel=5,
                )


def _check_units(wiring: ModelWiring, plan: Plan, name: str) -> dict[str, UnitChoice]:
    units = {u.name: u for u in plan.units}
    unknown = [n for n in units if n not in wiring.units]
    if unknown:
        raise ValueError(
            f"the plan has units {name} does not have ({_join(map(repr, unknown))}): it was "
            f"made for another model; make it again with `tidal plan` for this one"
        )
    missing = [n for n, s in wiring.units.items() if n not in units and s.role != "dropout"]
    if missing:
        raise ValueError(f"the plan has no choice for units {_join(map(repr, missing))}")
    for unit_name, unit in units.items():
        spec = wiring.units[unit_name]
        if (unit.module, unit.segment) != (spec.module, spec.segment):  # another version's?
            raise ValueError(
                f"unit {unit_name!r} is {spec.module!r} segment {spec.segment} in {name}"
            )
        if unit.count != wiring.counts[unit_name]:
            raise ValueError(
                f"unit {unit_name!r} occurs {wiring.counts[unit_name]} times in {name} but "
                f"{unit.count} in the plan: make the plan for this model with `tidal plan`"
            )
        if unit.zero not in (0, 1, 2, 3):
            raise ValueError(f"unit {unit_name!r} has ZeRO level {unit.zero}; levels are 0 to 3")
    if set(plan.recompute) - set(wiring.blocks):
        raise ValueError(
            f"recompute names {_join(plan.recompute)}; only {_join(map(repr, wiring.blocks))} can be"
        )
    return units


def _is_logits(wiring: ModelWiring, name: str) -> bool:
    """A linear whose output is the model's (or its loss's): a vocabulary, which may split
    unevenly."""
    consumers = wiring.consumers(name)
    return all(wiring.units[c].role == "loss" for c in consumers)


def _check_sizes(wiring: ModelWiring, plan: Plan, units: dict[str, UnitChoice]) -> None:
    t = plan.tp
    fix = f"make the plan for a tensor axis whose size divides it, or replicate on {t}"
    for name, unit in units.items():
        sizes: list[tuple[int, str]] = []
        if unit.strategy is S.HEADS:
            heads, kv_heads, _ = wiring.attention[name]
            sizes = [(heads, "heads"), (kv_heads, "key/value heads")]
        elif unit.strategy is S.ROWWISE:
            sizes = [(wiring.features[name][0] or 1, "inputs")]
        elif unit.strategy is S.COLWISE and not _is_logits(wiring, name):
            sizes = [(wiring.features[name][1] or 1, "outputs")]
        for size, what in sizes:
            if size % t:
                raise ValueError(
                    f"unit {name!r} is {unit.strategy} on a tensor axis of {t} ranks, but its "
                    f"{size} {what} are not divisible by {t}: {fix}"
                )
    splits = ((HID, wiring.hidden_size, "the hidden size"), (SEQ, plan.seq_len, "seq_len"))
    for layout, size, what in splits:
        if size % t and any(layout in (u.in_layout, u.out_layout) for u in units.values()):
            raise ValueError(f"{layout} activations need {what} ({size}) divisible by {t}: {fix}")


def _check_pairs(wiring: ModelWiring, units: dict[str, UnitChoice]) -> None:
    """Choices that only work together: projections and heads, tied weights, vocabulary loss."""
    for name, core in units.items():
        if wiring.units[name].role == "attention" and core.strategy is S.HEADS:
            _check_heads_feed(wiring, name, units)
    for name, projection in wiring.projections.items():
        proj, core = units[name], units[projection.attention]
        fused = projection.parts is not None and len(projection.parts) > 1
        if fused and (proj.strategy is S.COLWISE) != (core.strategy is S.HEADS):
            raise ValueError(
                f"{name} is {proj.strategy} and {projection.attention} is {core.strategy}: the "
                f"fused qkv splits only by heads, so make both colwise/heads or neither ([Note: "
                f"fused qkv under tensor parallelism] in tidal/parallel/plan_apply.py)"
            )
    for name, owner in wiring.ties.items():
        mine, theirs = units[name], units[owner]
        if split_dim(wiring, name, mine.strategy) != split_dim(wiring, owner, theirs.strategy):
            raise ValueError(
                f"{owner} ({theirs.strategy}) and {name} ({mine.strategy}) share one weight but "
                f"split it differently: pair vocab with colwise, or replicate and sequence with "
                f"either"
            )
    for name, loss in units.items():
        if wiring.units[name].role != "loss" or loss.in_layout is not HID:
            continue
        for src in wiring.producers(name):
            if wiring.units[src].role == "linear" and units[src].strategy not in (
                S.COLWISE,
                S.ROWWISE,
            ):
                raise ValueError(
                    f"the loss {name} takes S(hid) (vocabulary-parallel) logits, which {src} "
                    f"({units[src].strategy}) does not make: make {src} colwise"
                )


def _check_heads_feed(wiring: ModelWiring, core: str, units: dict[str, UnitChoice]) -> None:
    for src in wiring.producers(core):
        spec = wiring.units[src]
        if spec.role == "positions":
            continue  # rotary tables and the like: per position, whole for every head
        projection = wiring.projections.get(src)
        if projection is None:
            why = f"it is a {spec.role}, not a linear projecting q, k or v"
        elif projection.parts is None:
            why = projection.why
        else:
            continue
        raise ValueError(
            f"unit {core!r} is heads, but apply cannot split what {src!r} feeds it by heads: "
            f"{why}; make {core!r} replicate"
        )


def _check_whole(wiring: ModelWiring, units: dict[str, UnitChoice]) -> None:
    """[Note: code counts whole sequences] in tidal/planner/wiring.py."""
    for name, why in wiring.whole_in.items():
        if units[name].in_layout is not R:
            raise ValueError(
                f"unit {name!r} takes {units[name].in_layout}, but it must take whole (R) "
                f"activations: {why}; make the plan with this version's `tidal plan`"
            )
    for name, why in wiring.sequence_whole.items():
        if SEQ in (units[name].in_layout, units[name].out_layout):
            raise ValueError(
                f"unit {name!r} is {units[name].strategy} {units[name].in_layout}->"
                f"{units[name].out_layout}, but its sequence must stay whole: {why} ([Note: code "
                f"counts whole sequences] in tidal/planner/wiring.py); make the plan with this "
                f"version's `tidal plan`"
            )


def _check_recompute(wiring: ModelWiring, plan: Plan, model: nn.Module) -> None:
    for prefix, mode in plan.recompute.items():
        if Recompute(mode) not in (Recompute.SELECTIVE, Recompute.SELECTIVE_SWAP_MLP):
            continue
        for name in (n for n in wiring.blocks[prefix].units if n in wiring.attention):
            module = model.get_submodule(wiring.module_path(name, 0))
            if not hasattr(module, RECOMPUTE_CORE):
                raise ValueError(
                    f"the plan recomputes {prefix!r} selectively, but its attention core "
                    f"{name!r} is code inside {type(module).__name__}.forward, which apply "
                    f"cannot recompute on its own (only a module with a {RECOMPUTE_CORE!r} "
                    f"attribute can, as tidal's GPT attention: [Note: selective recomputation "
                    f"contract] in check.py); make the plan with full or no recomputation "
                    f"(`tidal plan` does for such models)"
                )


def split_dim(
    wiring: ModelWiring, name: str, strategy: StrategyName, param: str = "weight"
) -> int | None:
    """The dim of parameter ``param`` of unit ``name`` that ``strategy`` splits over the tensor
    axis (None: replicated): a column (row) parallel linear splits its outputs (inputs), which
    are a Conv1D weight's columns (rows); a vocabulary-parallel embedding its rows; biases
    follow the outputs. tidal/parallel/tensor_axis.py makes DTensor placements of it."""
    role = wiring.units[name].role
    if (role, strategy) == ("embedding", S.VOCAB):
        return 0
    if role != "linear" or strategy not in (S.COLWISE, S.ROWWISE):
        return None
    if param != "weight":
        return 0 if strategy is S.COLWISE else None
    outputs_dim = 1 if name in wiring.transposed else 0
    return outputs_dim if strategy is S.COLWISE else 1 - outputs_dim


def _contract(wiring: ModelWiring, units: dict[str, UnitChoice]) -> set[tuple[str, str]]:
    """The edges between planned units, bridging the dropout units the plan leaves out."""
    pairs = {(src, dst) for src, dst, _ in wiring.edges}
    for gone in [n for n in wiring.units if n not in units]:
        into, out = [s for s, d in pairs if d == gone], [d for s, d in pairs if s == gone]
        pairs = {(s, d) for s, d in pairs if gone not in (s, d)}
        pairs |= {(s, d) for s in into for d in out}
    return pairs


def _own_wire(
    name: str,
    wiring: ModelWiring,
    units: dict[str, UnitChoice],
    edges: set[tuple[str, str]],
    entry: dict[str, Layout],
    feeders: dict[str, set[str]],
) -> Layout:
    unit, spec = units[name], wiring.units[name]
    if spec.role == "positions":
        return R
    if spec.segment is not None:
        return unit.out_layout
    wire = _module_wire(name, wiring, units, edges, entry, feeders)
    # [Note: code counts whole sequences]: code reads its shape; consumers convert from R
    return R if wire is SEQ and name in wiring.hand_whole else wire


def _module_wire(
    name: str,
    wiring: ModelWiring,
    units: dict[str, UnitChoice],
    edges: set[tuple[str, str]],
    entry: dict[str, Layout],
    feeders: dict[str, set[str]],
) -> Layout:
    unit = units[name]
    consumers = [units[d] for s, d in edges if s == name]
    fixed = {c.in_layout for c in consumers if wiring.units[c.name].segment is not None}
    if not fixed and unit.out_layout is P:
        fixed = {c.in_layout for c in consumers}
    if not consumers:
        feeds = [p for p, fed in feeders.items() if name in fed]
        if not feeds:
            return R  # the model's output: whole, for the caller
        if unit.out_layout is P:
            return entry[feeds[0]]
    if len(fixed) > 1 or P in fixed:
        raise ValueError(
            f"{name!r} feeds units taking {_join(fixed)}, not one of R, S(seq), S(hid)"
        )
    return fixed.pop() if fixed else unit.out_layout


def _wire_in(
    name: str,
    wiring: ModelWiring,
    units: dict[str, UnitChoice],
    edges: set[tuple[str, str]],
    wire_out: dict[str, Layout],
    entry: dict[str, Layout],
) -> Layout:
    """What a module unit is handed: whole caller's tensors, a block's converted input, or its
    producer's wire layout."""
    block = wiring.block_of.get(name)
    if block is not None and name in wiring.blocks[block].heads:
        return entry[block]
    given = {wire_out[s] for s, d in edges if d == name}
    if name in wiring.inputs or not given:
        return R
    if len(given) > 1 and wiring.units[name].segment is None:
        raise ValueError(f"{name!r} is handed {_join(given)} by its producers: make them agree")
    return given.pop()


def _join(items: Any) -> str:
    return ", ".join(sorted(str(i) for i in items))
