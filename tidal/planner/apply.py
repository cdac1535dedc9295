"""Carry out a :class:`~tidal.planner.plan.Plan` on tidal's GPT: DTensor on ``tp``, FSDP2 on ``dp``.

``apply(model, plan, mesh)`` changes ``model`` in place and returns it; ``mesh`` comes from
:func:`make_mesh`. A training loop then needs nothing special: the loss comes back as a plain
tensor, the gradients of parameters FSDP does not own are reduced by hooks, and
:func:`full_state_dict` gives the parameters back in the single-device layout. Plans that do not
fit the model, or that DTensor hooks cannot carry out, raise ``ValueError`` (:func:`check_plan`).

[Note: plan realisation]
Between modules an activation travels as a plain local tensor in one layout of [Note: plan
layouts], its *wire* layout; DTensors live only inside a module's forward. A module unit's
forward pre-hook wraps its input as a DTensor in the wire layout and redistributes it to what the
module computes on; its forward hook redistributes the output to its own wire layout and unwraps
it. A unit's wire layout is

- for a segment (code in a parent's forward, which no hook can convert): its ``out_layout``,
  except positions (``[0]``), which are always made whole: slicing them is free, and pos_embed
  does it;
- for a module feeding a segment: that segment's ``in_layout``, so rowwise partial sums reach the
  residual adds already reduced (``P -> R`` all-reduce, ``P -> S(seq)`` reduce-scatter);
- for a module whose ``out_layout`` is ``P``: its consumers' common ``in_layout``;
- otherwise its ``out_layout``, converted by each consumer's pre-hook.

So a segment's inputs must already arrive in its ``in_layout``, and a unit fed by several
producers must get one wire layout from all; other plans are rejected. Consumers come from the
model's structure (:func:`gpt_edges`), not from ``plan.edges``; a dropout unit missing from the
plan (the planner drops them at ``p = 0``) passes whatever it gets through. The loss segment
takes ``R`` logits, or ``S(hid)`` ones under ``loss_parallel()``; an ``S(seq)`` loss is taken on
gathered logits, since GPT.forward flattens batch and sequence together.

With ``tp > 1`` every parameter becomes a DTensor on the tensor axis (``Replicate`` unless the
strategy splits it), so FSDP sees one kind of parameter. A whole weight used on split tokens
(``sequence``) gets a ``Partial`` gradient; a post-accumulate hook reduces it (FSDP does it
itself for the parameters it owns).

[Note: fused qkv under tensor parallelism]
qkv's weight rows are ``[q; k; v]``, each ``H`` heads of ``K`` rows. A contiguous ``Shard(0)``
over ``t`` ranks would give rank 0 all of q and part of k. apply reorders the rows (and the bias)
so that rank r's block is ``[q_r; k_r; v_r]``, the rows of its ``H/t`` heads; the attention core
splits its local output in three and counts heads from the width, so it runs unchanged on a
share. Parameters, gradients and optimizer state are then in that order; :func:`full_state_dict`
undoes it. Hence qkv is ``colwise`` exactly when the attention core is ``heads``.

[Note: colwise inputs kept sharded]
A colwise linear fed ``S(seq)`` all-gathers its input, and autograd would keep the gathered input
for the weight gradient. As in Megatron's sequence parallelism (and as the cost model assumes), a
``saved_tensors_hooks`` pair keeps only this rank's ``1/t`` of each replicated DTensor the module
saves and all-gathers it again in backward. Blocks recomputed in full skip it: their checkpoint
keeps nothing of the inside anyway.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import Placement

from tidal.models.gpt import GPT
from tidal.planner.plan import Layout, Plan, Recompute, StrategyName, UnitChoice

__all__ = [
    "GPT_UNITS",
    "UnitSpec",
    "apply",
    "check_plan",
    "full_state_dict",
    "gpt_edges",
    "make_mesh",
]

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P


@dataclass(kw_only=True, frozen=True, slots=True)
class UnitSpec:
    """Where a decision unit of tidal's GPT lives, in the planner's terms, and what it does."""

    module: str  # path, ``*`` for the block index
    segment: int | None
    kind: str  # the planner's kind
    role: str  # positions, embedding, norm, linear, dropout, elementwise, attention, loss


def _spec(module: str, segment: int | None, kind: str, role: str) -> UnitSpec:
    return UnitSpec(module=module, segment=segment, kind=kind, role=role)


GPT_UNITS: dict[str, UnitSpec] = {
    "[0]": _spec("", 0, "elementwise", "positions"),
    "tok_embed": _spec("tok_embed", None, "embedding", "embedding"),
    "pos_embed": _spec("pos_embed", None, "embedding", "embedding"),
    "[1]": _spec("", 1, "elementwise", "elementwise"),
    "drop": _spec("drop", None, "elementwise", "dropout"),
    "blocks.*.ln_1": _spec("blocks.*.ln_1", None, "norm", "norm"),
    "blocks.*.attn.qkv": _spec("blocks.*.attn.qkv", None, "linear", "linear"),
    "blocks.*.attn[0]": _spec("blocks.*.attn", 0, "attention", "attention"),
    "blocks.*.attn.proj": _spec("blocks.*.attn.proj", None, "linear", "linear"),
    "blocks.*.attn.resid_drop": _spec("blocks.*.attn.resid_drop", None, "elementwise", "dropout"),
    "blocks.*[0]": _spec("blocks.*", 0, "elementwise", "elementwise"),
    "blocks.*.ln_2": _spec("blocks.*.ln_2", None, "norm", "norm"),
    "blocks.*.mlp.fc": _spec("blocks.*.mlp.fc", None, "linear", "linear"),
    "blocks.*.mlp[0]": _spec("blocks.*.mlp", 0, "elementwise", "elementwise"),
    "blocks.*.mlp.proj": _spec("blocks.*.mlp.proj", None, "linear", "linear"),
    "blocks.*.mlp.drop": _spec("blocks.*.mlp.drop", None, "elementwise", "dropout"),
    "blocks.*[1]": _spec("blocks.*", 1, "elementwise", "elementwise"),
    "ln_f": _spec("ln_f", None, "norm", "norm"),
    "lm_head": _spec("lm_head", None, "linear", "linear"),
    "[2]": _spec("", 2, "loss", "loss"),
}

# (strategy, in_layout, out_layout) each role can carry out.
_SHAPES: dict[str, set[tuple[StrategyName, Layout, Layout]]] = {
    "linear": {
        (S.REPLICATE, R, R),
        (S.SEQUENCE, SEQ, SEQ),
        (S.COLWISE, R, HID),
        (S.COLWISE, SEQ, HID),
        (S.ROWWISE, HID, P),
    },
    "embedding": {(S.REPLICATE, R, R), (S.SEQUENCE, SEQ, SEQ), (S.VOCAB, R, P)},
    "norm": {(S.REPLICATE, R, R), (S.SEQUENCE, SEQ, SEQ)},
    "elementwise": {(S.REPLICATE, R, R), (S.SEQUENCE, SEQ, SEQ), (S.HIDDEN, HID, HID)},
    "attention": {(S.REPLICATE, R, R), (S.HEADS, HID, HID)},
}
_SHAPES["dropout"] = _SHAPES["loss"] = _SHAPES["elementwise"]


def gpt_edges(num_layers: int) -> list[tuple[str, str, int]]:
    """The data flow between the GPT's units, as ``(producer, consumer, count)``."""
    b = "blocks.*"
    edges = [
        ("[0]", "pos_embed", 1),
        ("tok_embed", "[1]", 1),
        ("pos_embed", "[1]", 1),
        ("[1]", "drop", 1),
        ("drop", f"{b}.ln_1", 1),
        ("drop", f"{b}[0]", 1),
        (f"{b}.ln_1", f"{b}.attn.qkv", num_layers),
        (f"{b}.attn.qkv", f"{b}.attn[0]", num_layers),
        (f"{b}.attn[0]", f"{b}.attn.proj", num_layers),
        (f"{b}.attn.proj", f"{b}.attn.resid_drop", num_layers),
        (f"{b}.attn.resid_drop", f"{b}[0]", num_layers),
        (f"{b}[0]", f"{b}.ln_2", num_layers),
        (f"{b}[0]", f"{b}[1]", num_layers),
        (f"{b}.ln_2", f"{b}.mlp.fc", num_layers),
        (f"{b}.mlp.fc", f"{b}.mlp[0]", num_layers),
        (f"{b}.mlp[0]", f"{b}.mlp.proj", num_layers),
        (f"{b}.mlp.proj", f"{b}.mlp.drop", num_layers),
        (f"{b}.mlp.drop", f"{b}[1]", num_layers),
        (f"{b}[1]", f"{b}.ln_1", num_layers - 1),
        (f"{b}[1]", f"{b}[0]", num_layers - 1),
        (f"{b}[1]", "ln_f", 1),
        ("ln_f", "lm_head", 1),
        ("lm_head", "[2]", 1),
    ]
    return [e for e in edges if e[2] > 0]


# ---------------------------------------------------------------------------------------------
# checking a plan against the model


@dataclass(kw_only=True, frozen=True, slots=True)
class _Wiring:
    """Each planned unit's choice, the wire layout it gets and the one it gives."""

    units: dict[str, UnitChoice]
    wire_in: dict[str, Layout]
    wire_out: dict[str, Layout]

    def uses(self, layout: Layout) -> bool:
        return any(layout in (u.in_layout, u.out_layout) for u in self.units.values())


def check_plan(model: nn.Module, plan: Plan) -> None:
    """Raise ``ValueError`` naming the problem and its fix unless ``apply`` can realise ``plan``."""
    _wire(model, plan)


def _wire(model: nn.Module, plan: Plan) -> _Wiring:
    if not isinstance(model, GPT):
        raise ValueError(f"apply realises plans on tidal's GPT, not {type(model).__name__}")
    units = _check_units(plan)
    for name, unit in units.items():
        role = GPT_UNITS[name].role
        if (
            role != "positions"
            and (unit.strategy, unit.in_layout, unit.out_layout) not in _SHAPES[role]
        ):
            shapes = ", ".join(sorted(f"{s} {i}->{o}" for s, i, o in _SHAPES[role]))
            raise ValueError(
                f"unit {name!r} is {unit.strategy} {unit.in_layout}->{unit.out_layout}, which a "
                f"{role} cannot do with DTensor; it can do: {shapes}"
            )
    _check_sizes(model, plan, units)
    _check_pairs(model, units)
    edges = _contract(units, gpt_edges(len(model.blocks)))
    wire_out = {name: _own_wire(name, units, edges) for name in units}
    for src, dst in sorted(edges):
        if GPT_UNITS[dst].segment is not None and wire_out[src] != _takes(units[dst]):
            raise ValueError(
                f"unit {dst!r} takes {units[dst].in_layout} but {src!r} gives {wire_out[src]}; "
                f"{dst!r} is code in a module's forward, which cannot convert layouts: make "
                f"{src!r} give {units[dst].in_layout}"
            )
    wire_in = {"tok_embed": R}  # the token ids come whole
    for name in units:
        producers = {wire_out[src] for src, dst in edges if dst == name}
        if len(producers) > 1:
            raise ValueError(f"unit {name!r} is fed in several layouts ({_join(producers)})")
        if producers:
            wire_in[name] = producers.pop()
    return _Wiring(units=units, wire_in=wire_in, wire_out=wire_out)


def _check_units(plan: Plan) -> dict[str, UnitChoice]:
    units = {u.name: u for u in plan.units}
    unknown = [n for n in units if n not in GPT_UNITS]
    if unknown:
        raise ValueError(
            f"the plan has units tidal's GPT does not: {', '.join(map(repr, unknown))}; it was "
            f"made for another model: make it again with `tidal plan` for this one"
        )
    missing = [n for n, s in GPT_UNITS.items() if n not in units and s.role != "dropout"]
    if missing:
        raise ValueError(f"the plan has no choice for units {', '.join(map(repr, missing))}")
    for name, unit in units.items():
        spec = GPT_UNITS[name]
        if (unit.module, unit.segment) != (spec.module, spec.segment):
            raise ValueError(
                f"unit {name!r} names module {unit.module!r} segment {unit.segment}, but in "
                f"tidal's GPT it is module {spec.module!r} segment {spec.segment}"
            )
        if unit.zero not in (0, 1, 2, 3):
            raise ValueError(f"unit {name!r} has ZeRO level {unit.zero}; levels are 0 to 3")
    extra = set(plan.recompute) - {"blocks.*"}
    if extra:
        raise ValueError(f"recompute names {_join(extra)}; only 'blocks.*' can be recomputed")
    return units


def _check_sizes(model: GPT, plan: Plan, units: dict[str, UnitChoice]) -> None:
    t, config = plan.tp, model.config
    if t == 1:
        return
    fix = f"choose a tensor-axis size that divides it (plan again with fewer than {t} ranks)"
    needs = [("num_heads", config.num_heads, "blocks.*.attn[0]", S.HEADS)]
    needs += [("d_model", config.d_model, n, s) for n, s in _D_MODEL_SPLITS]
    needs += [("ffn_dim", config.ffn_dim, "blocks.*.mlp.fc", S.COLWISE)]
    needs += [("ffn_dim", config.ffn_dim, "blocks.*.mlp.proj", S.ROWWISE)]
    for field_name, size, unit_name, strategy in needs:
        unit = units.get(unit_name)
        if unit is not None and unit.strategy is strategy and size % t:
            raise ValueError(
                f"unit {unit_name!r} is {strategy} on a tensor axis of {t} ranks, but the model's "
                f"{field_name} {size} is not divisible by {t}: {fix}"
            )
    if any(HID in (u.in_layout, u.out_layout) for u in units.values()) and config.d_model % t:
        raise ValueError(
            f"S(hid) activations need d_model {config.d_model} divisible by {t}: {fix}"
        )
    if any(SEQ in (u.in_layout, u.out_layout) for u in units.values()) and plan.seq_len % t:
        raise ValueError(f"S(seq) activations need seq_len {plan.seq_len} divisible by {t}: {fix}")


_D_MODEL_SPLITS = [("blocks.*.attn.qkv", S.COLWISE), ("blocks.*.attn.proj", S.ROWWISE)]


def _check_pairs(model: GPT, units: dict[str, UnitChoice]) -> None:
    """Choices that only work together: fused qkv and heads, tied weights, vocabulary loss."""
    qkv, core = units["blocks.*.attn.qkv"], units["blocks.*.attn[0]"]
    if (qkv.strategy is S.COLWISE) != (core.strategy is S.HEADS):
        raise ValueError(
            f"blocks.*.attn.qkv is {qkv.strategy} and blocks.*.attn[0] is {core.strategy}: the "
            f"fused qkv splits cleanly only by heads, so qkv colwise goes with the attention core "
            f"heads, and only with it ([Note: fused qkv under tensor parallelism])"
        )
    if model.config.tie_embeddings:
        tok, head = units["tok_embed"], units["lm_head"]
        if _weight_placement("embedding", tok.strategy) != _weight_placement(
            "linear", head.strategy
        ):
            raise ValueError(
                f"tok_embed ({tok.strategy}) and lm_head ({head.strategy}) share one weight but "
                f"split it differently: pair vocab with colwise, or replicate/sequence with "
                f"replicate/sequence"
            )
        if tok.zero != head.zero:
            raise ValueError(
                f"tok_embed (ZeRO {tok.zero}) and lm_head (ZeRO {head.zero}) share one weight: "
                f"give them one ZeRO level"
            )
    if units["[2]"].in_layout is HID and units["lm_head"].strategy not in (S.COLWISE, S.ROWWISE):
        raise ValueError(
            f"the loss [2] takes S(hid) logits (vocabulary-parallel) but lm_head is "
            f"{units['lm_head'].strategy}: make lm_head colwise"
        )


def _weight_placement(role: str, strategy: StrategyName) -> Placement:
    if (role, strategy) in (("linear", S.COLWISE), ("embedding", S.VOCAB)):
        return Shard(0)
    if (role, strategy) == ("linear", S.ROWWISE):
        return Shard(1)
    return Replicate()  # whole weights: replicated work, or split tokens


def _contract(units: dict[str, UnitChoice], edges: list[tuple[str, str, int]]) -> set[tuple]:
    """The edges between planned units, bridging the dropout units the plan leaves out."""
    pairs = {(src, dst) for src, dst, _ in edges}
    for gone in [n for n in GPT_UNITS if n not in units]:
        into = [s for s, d in pairs if d == gone]
        out = [d for s, d in pairs if s == gone]
        pairs = {(s, d) for s, d in pairs if gone not in (s, d)}
        pairs |= {(s, d) for s in into for d in out}
    return pairs


def _takes(unit: UnitChoice) -> Layout:
    """The layout a segment's inputs must arrive in."""
    if unit.name == "[2]" and unit.in_layout is SEQ:
        return R  # see [Note: plan realisation]: the loss flattens batch and sequence
    return unit.in_layout


def _own_wire(name: str, units: dict[str, UnitChoice], edges: set[tuple]) -> Layout:
    unit = units[name]
    if GPT_UNITS[name].role == "positions":
        return R
    if GPT_UNITS[name].segment is not None:
        return unit.out_layout
    consumers = [units[d] for s, d in edges if s == name]
    fixed = {_takes(c) for c in consumers if GPT_UNITS[c.name].segment is not None}
    if not fixed and unit.out_layout is P:
        fixed = {c.in_layout for c in consumers}
    if len(fixed) > 1:
        raise ValueError(f"unit {name!r} feeds units that take different layouts ({_join(fixed)})")
    wire = fixed.pop() if fixed else unit.out_layout
    if wire is P:
        raise ValueError(f"a consumer of {name!r} takes partial sums; only R, S(seq), S(hid) can")
    return wire


def _join(items: Any) -> str:
    return ", ".join(sorted(str(i) for i in items))


# ---------------------------------------------------------------------------------------------
# realising it


def make_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The ``(dp, tp)`` mesh ``plan`` runs on, over the default process group."""
    world = dist.get_world_size()
    if world != plan.dp * plan.tp:
        raise ValueError(
            f"the plan's mesh is dp {plan.dp} x tp {plan.tp} = {plan.dp * plan.tp} ranks, but "
            f"{world} are running: launch {plan.dp * plan.tp} ranks or plan for {world}"
        )
    return init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))


def apply(model: GPT, plan: Plan, mesh: DeviceMesh) -> GPT:
    """Realise ``plan`` on ``model`` in place and return it; see [Note: plan realisation].

    ``model`` must be the same on every rank (built from one seed). The order is torchtitan's:
    the tensor axis, then recomputation, then FSDP, which must see the tensor axis's DTensors.
    """
    wiring = _wire(model, plan)
    if mesh.mesh_dim_names != ("dp", "tp") or tuple(mesh.shape) != (plan.dp, plan.tp):
        raise ValueError(
            f"the plan needs a mesh ('dp', 'tp') of shape ({plan.dp}, {plan.tp}), got "
            f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}: make it with make_mesh(plan)"
        )
    recompute = Recompute(plan.recompute.get("blocks.*", Recompute.NONE))
    if plan.tp > 1:
        _parallelize_tensor_axis(model, wiring, mesh["tp"], recompute is Recompute.FULL)
    for block in model.blocks:
        if recompute is Recompute.FULL:
            checkpoint(block)  # the composable one keeps parameter names
        block.attn.recompute_core = recompute is Recompute.SELECTIVE
    if plan.dp > 1:
        _shard_data_axis(model, wiring, mesh["dp"])
    dp_group = mesh.get_group("dp") if plan.dp > 1 else None
    for param in {id(p): p for p in model.parameters()}.values():
        if _owned_by_fsdp(param) or (dp_group is None and not isinstance(param, DTensor)):
            continue
        param.register_post_accumulate_grad_hook(functools.partial(_reduce_grad, group=dp_group))
    return model


def full_state_dict(model: nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """The model's state, whole and in the single-device layout, on every rank.

    A collective: every rank must call it. Undoes the qkv row order of [Note: fused qkv under
    tensor parallelism], so the result loads into a model built by ``build_gpt``.
    """
    state = {
        name: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        for name, value in model.state_dict().items()
    }
    if plan.tp > 1 and plan.unit("blocks.*.attn.qkv").strategy is S.COLWISE:
        for name, value in state.items():
            if ".attn.qkv." in name:
                state[name] = value[torch.argsort(_qkv_rows(value.shape[0] // 3, plan.tp))]
    return state


def _modules(model: GPT, path: str) -> list[nn.Module]:
    if "*" not in path:
        return [model.get_submodule(path)]
    return [model.get_submodule(path.replace("*", str(i))) for i in range(len(model.blocks))]


def _parallelize_tensor_axis(
    model: GPT, wiring: _Wiring, mesh: DeviceMesh, full_recompute: bool
) -> None:
    units = wiring.units
    if units["blocks.*.attn.qkv"].strategy is S.COLWISE:
        rows = _qkv_rows(model.config.d_model, mesh.size())
        for block in model.blocks:
            with torch.no_grad():
                for param in block.attn.qkv.parameters():
                    param.copy_(param[rows.to(param.device)])
    distributed: dict[int, nn.Parameter] = {}  # by the original's id: tied weights stay one
    for name, unit in units.items():
        spec = GPT_UNITS[name]
        if spec.segment is not None:
            continue
        keep_saved_whole = unit.strategy is not S.COLWISE or unit.in_layout is not SEQ
        boundary = _Boundary(
            mesh=mesh,
            wire_in=wiring.wire_in[name],
            run_in=R if (spec.role, unit.strategy) == ("linear", S.COLWISE) else unit.in_layout,
            run_out=unit.out_layout,
            wire_out=wiring.wire_out[name],
            indices=spec.role == "embedding",
            on_dtensors=spec.role not in ("dropout",),
            keep_dtensor=name == "lm_head" and units["[2]"].in_layout is HID,
            saved=None if keep_saved_whole or full_recompute else _ShardSavedReplicas(mesh),
        )
        for module in _modules(model, spec.module):
            for pname, param in list(module.named_parameters(recurse=False)):
                if id(param) not in distributed:
                    split = _weight_placement(spec.role, unit.strategy)
                    placement = split if pname == "weight" or split == Shard(0) else Replicate()
                    value = distribute_tensor(param.detach(), mesh, [placement])
                    distributed[id(param)] = nn.Parameter(value, param.requires_grad)
                module.register_parameter(pname, distributed[id(param)])
            module.register_forward_pre_hook(boundary.before)
            module.register_forward_hook(boundary.after)
    if wiring.uses(SEQ):
        model.register_forward_pre_hook(functools.partial(_check_length, tp=mesh.size()))
    loss = _VocabParallelLoss()
    if units["[2]"].in_layout is HID:
        model.lm_head.register_forward_hook(loss.logits_made)
    model.register_forward_hook(loss.finish)


def _qkv_rows(d_model: int, tp: int) -> torch.Tensor:
    """qkv rows in the order giving rank r ``[q_r; k_r; v_r]`` ([Note: fused qkv under ...])."""
    share = d_model // tp
    starts = [part * d_model + r * share for r in range(tp) for part in range(3)]
    return torch.cat([torch.arange(share) + start for start in starts])


def _check_length(model: nn.Module, args: tuple[Any, ...], *, tp: int) -> None:
    if args[0].shape[1] % tp:
        raise ValueError(
            f"the plan splits the sequence over {tp} ranks; a batch's length "
            f"({args[0].shape[1]}) must be divisible by {tp}"
        )


def _placement(layout: Layout, x: torch.Tensor, indices: bool = False) -> Placement:
    if layout is R:
        return Replicate()
    if layout is HID:
        return Shard(x.ndim - 1)
    assert layout is SEQ, layout  # partial sums never travel between modules
    return Shard(x.ndim - 1 if indices else x.ndim - 2)  # [B, T] ids, [B, T, D] or [T, D] values


def _relayout(x: torch.Tensor, mesh: DeviceMesh, src: Layout, dst: Layout) -> torch.Tensor:
    if src is dst:
        return x
    x_dt = DTensor.from_local(x, mesh, [_placement(src, x)], run_check=False)
    return x_dt.redistribute(mesh, [_placement(dst, x)]).to_local()


@dataclass(kw_only=True, frozen=True, slots=True)
class _Boundary:
    """The hooks converting one module's input and output ([Note: plan realisation])."""

    mesh: DeviceMesh
    wire_in: Layout  # what its producer hands over
    run_in: Layout  # what it computes on
    run_out: Layout  # what a module without parameters gives
    wire_out: Layout  # what it hands on
    indices: bool  # its input is token or position ids
    on_dtensors: bool  # it has parameters, DTensors on the tensor axis
    keep_dtensor: bool  # its output stays a DTensor, for the vocabulary-parallel loss
    saved: _ShardSavedReplicas | None

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        if self.on_dtensors:
            wire = _placement(self.wire_in, x, self.indices)
            x = DTensor.from_local(x, self.mesh, [wire], run_check=False)
            x = x.redistribute(self.mesh, [_placement(self.run_in, x, self.indices)])
        else:
            x = _relayout(x, self.mesh, self.wire_in, self.run_in)
        if self.saved is not None:
            self.saved.enter()
        return (x, *rest)

    def after(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if self.saved is not None:
            self.saved.exit()
        if not isinstance(out, DTensor):
            return _relayout(out, self.mesh, self.run_out, self.wire_out)
        out = out.redistribute(self.mesh, [_placement(self.wire_out, out)])
        return out if self.keep_dtensor else out.to_local()


@dataclass(frozen=True, slots=True)
class _SavedShard:
    local: torch.Tensor
    dim: int


class _ShardSavedReplicas:
    """Saved-tensor hooks of [Note: colwise inputs kept sharded]."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._open: list[torch.autograd.graph.saved_tensors_hooks] = []

    def enter(self) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def exit(self) -> None:
        self._open.pop().__exit__(None, None, None)

    def _pack(self, x: torch.Tensor) -> Any:
        t = self.mesh.size()
        if not isinstance(x, DTensor) or any(not p.is_replicate() for p in x.placements):
            return x
        dim = next((d for d in range(x.ndim) if x.shape[d] % t == 0), None)
        if dim is None:
            return x
        with torch.no_grad():
            share = x.to_local().chunk(t, dim)[self.mesh.get_local_rank()]
        return _SavedShard(share.clone(), dim)  # a view would keep the whole input alive

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedShard):
            return saved
        x = DTensor.from_local(saved.local, self.mesh, [Shard(saved.dim)], run_check=False)
        return x.redistribute(self.mesh, [Replicate()])


class _VocabParallelLoss:
    """``loss_parallel()`` around the loss's forward and backward, and whole model outputs.

    The loss segment runs between lm_head's forward hook and the model's; in backward, between
    the gradient of the loss and that of the logits. Hooks at those four points switch the
    context on and off, so callers need not know that the loss is vocabulary-parallel.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._context: Any = None
        self._logits: DTensor | None = None

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._context = loss_parallel()
            self._context.__enter__()
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._context.__exit__(None, None, None)

    def logits_made(self, module: nn.Module, args: tuple[Any, ...], out: DTensor) -> None:
        self._enter()
        self._logits = out

    def finish(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        logits, self._logits = self._logits, None
        if logits is not None:
            self._exit()
            if out.ndim == 0 and out.requires_grad:
                out.register_hook(self._enter)
                logits.register_hook(self._exit)
        return out.full_tensor() if isinstance(out, DTensor) else out


def _owned_by_fsdp(param: nn.Parameter) -> bool:
    return isinstance(param, DTensor) and "dp" in (param.device_mesh.mesh_dim_names or ())


def _reduce_grad(param: nn.Parameter, *, group: dist.ProcessGroup | None) -> None:
    """Finish a gradient FSDP does not own: tensor-axis partial sums, then the data-axis mean."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(grad.device_mesh, param.placements)
    if group is not None and grad is not None:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)  # gloo has no average
        local.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------------------------
# the data axis


def _shard_data_axis(model: GPT, wiring: _Wiring, mesh: DeviceMesh) -> None:
    """FSDP2 per block and on the root at the plan's ZeRO levels.

    ZeRO-3 reshards parameters after forward. ZeRO-1 is realised as ZeRO-2: FSDP2 without
    resharding after forward, which also shards gradients; FSDP2 has no optimizer-only sharding.
    ZeRO-0 parameters are FSDP's ``ignored_params``; hooks all-reduce their gradients. Units of
    one block (or of the root) at different levels get FSDP groups of their own.
    """
    ignored: set[nn.Parameter] = set()
    sharded = [
        _shard_group(block, _members(model, wiring, i), mesh, ignored)
        for i, block in enumerate(model.blocks)
    ]
    root_members = _members(model, wiring, None)
    levels = {zero for zero, _ in root_members}
    root_level = levels.pop() if len(levels) == 1 else 0
    if len(levels) > 1 or root_level == 0:
        sharded.append(_shard_group(None, root_members, mesh, ignored))
    if any(sharded) or root_level:
        fully_shard(model, mesh=mesh, reshard_after_forward=root_level == 3, ignored_params=ignored)


def _members(model: GPT, wiring: _Wiring, block: int | None) -> list[tuple[int, list[nn.Module]]]:
    """(ZeRO level, modules) of each unit with parameters in a block, or outside the blocks
    (``block=None``); tied units come as one."""
    found: dict[int, tuple[int, list[nn.Module]]] = {}
    for name, unit in wiring.units.items():
        spec = GPT_UNITS[name]
        if spec.segment is not None or spec.module.startswith("blocks.") != (block is not None):
            continue
        module = model.get_submodule(spec.module.replace("*", str(block)))
        params = list(module.parameters())
        if params:
            found.setdefault(id(params[0]), (unit.zero, []))[1].append(module)
    return list(found.values())


def _shard_group(
    owner: nn.Module | None,
    members: list[tuple[int, list[nn.Module]]],
    mesh: DeviceMesh,
    ignored: set[nn.Parameter],
) -> bool:
    """Shard ``owner`` as one group if its units agree on a level, else each unit; say if any."""
    levels = {zero for zero, _ in members}
    if owner is not None and len(levels) == 1 and levels != {0}:
        fully_shard(owner, mesh=mesh, reshard_after_forward=levels == {3})
        return True
    sharded = False
    for zero, modules in members:
        if zero == 0:
            ignored.update(p for m in modules for p in m.parameters())
        else:
            group = modules[0] if len(modules) == 1 else modules
            fully_shard(group, mesh=mesh, reshard_after_forward=zero == 3)
            sharded = True
    return sharded
