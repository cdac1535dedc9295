"""Carry out a :class:`~tidal.planner.plan.Plan` on tidal's GPT: DTensor on ``tp``, FSDP2 on ``dp``.

``apply(model, plan, make_mesh(plan, "cuda"))`` changes the model in place. Training then needs
nothing special: the loss comes back plain and whole, hooks reduce the gradients FSDP does not
own, and :func:`full_state_dict` gives the single-device parameters back. Plans that do not fit
the model, or that DTensor cannot carry out, raise ``ValueError`` (:func:`check_plan`).

[Note: plan realisation]
Between modules an activation travels as a plain local tensor in one layout of [Note: plan
layouts], its *wire* layout. A module unit's pre-hook wraps its input as a DTensor in that
layout and redistributes it to what the module computes on; its forward hook redistributes the
output to its own wire layout and unwraps it. A unit's wire layout is, for a segment (code in a
forward, which no hook can convert), its ``out_layout``, but whole for positions ``[0]``
(pos_embed slices them); for a module feeding a segment, that segment's ``in_layout`` (so
rowwise partial sums reach the residual adds reduced: ``P -> R`` all-reduce, ``P -> S(seq)``
reduce-scatter); for a module giving ``P``, its consumers' common ``in_layout``; else its
``out_layout``, converted by each consumer. So segments must get their ``in_layout``; plans
where they do not are rejected. A block's input, which feeds ln_1 and the add ``blocks.*[0]``,
is converted to the add's layout by the block's pre-hook, and ln_1 converts from there (with a
warning when that is a detour the plan did not count). Consumers come from the model's
structure (:func:`gpt_edges`), not ``plan.edges``; a dropout unit the plan leaves out (the
planner does at ``p = 0``) passes on what it gets. The loss [2] takes ``R`` logits, ``S(hid)``
ones under ``loss_parallel()``, or ``S(seq)`` ones with targets split alike (_ModelOutputs).

With ``tp > 1`` every parameter is a DTensor on the tensor axis (``Replicate`` unless its
strategy splits it), so FSDP sees one kind. A whole weight used on split tokens gets a
``Partial`` gradient, which a post-accumulate hook reduces (FSDP does it for its own). Dropout
draws from each rank's own generator: seed a tensor axis's ranks alike, as replicated
activations need equal masks.

[Note: fused qkv under tensor parallelism]
qkv's weight rows are ``[q; k; v]``, each ``H`` heads of ``K`` rows, so a contiguous ``Shard(0)``
would give rank 0 all of q and part of k. apply reorders the rows (and the bias) so that rank
r's block is ``[q_r; k_r; v_r]`` for its ``H/t`` heads; the attention core splits its share in
three and counts heads from the width. Parameters, gradients and optimizer state keep that
order; :func:`full_state_dict` undoes it. So qkv is ``colwise`` exactly when the core is
``heads``.

[Note: colwise inputs kept sharded]
A colwise linear fed ``S(seq)`` all-gathers its input, and autograd would keep the gathered
input. As in Megatron's sequence parallelism (and the cost model), saved-tensor hooks keep this
rank's ``1/t`` of each replicated DTensor the module saves and all-gather it in backward; not in
fully recomputed blocks, whose checkpoint keeps nothing inside anyway.
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
from tidal.planner.gpt_wiring import (  # noqa: F401 - re-exported
    GPT_UNITS,
    UnitSpec,
    _weight_placement,
    _wire,
    _Wiring,
    check_plan,
    gpt_edges,
)
from tidal.planner.plan import Layout, Plan, Recompute, StrategyName

__all__ = [
    "set_accumulating",
    "GPT_UNITS", "UnitSpec", "apply", "check_plan", "full_state_dict", "gpt_edges", "make_mesh"
]  # fmt: skip

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P


# ---------------------------------------------------------------------------------------------
# the tensor axis


def make_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The ``(dp, tp)`` mesh ``plan`` runs on, over the default process group."""
    if dist.get_world_size() != plan.dp * plan.tp:
        raise ValueError(
            f"the plan's mesh is dp {plan.dp} x tp {plan.tp}, but {dist.get_world_size()} ranks "
            f"are running: launch {plan.dp * plan.tp} or plan for {dist.get_world_size()}"
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
            f"the plan needs a mesh ('dp', 'tp') of shape ({plan.dp}, {plan.tp}), not "
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
        axes = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
        if "dp" in (axes or ()) or (dp_group is None and axes is None):
            continue  # FSDP reduces its own; a plain parameter on one data rank needs nothing
        param.register_post_accumulate_grad_hook(functools.partial(_reduce_grad, group=dp_group))
    return model


def full_state_dict(model: nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """The model's state, whole and in the single-device layout ([Note: fused qkv under tensor
    parallelism]), on every rank: a collective, which every rank must call."""
    state = {
        name: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        for name, value in model.state_dict().items()
    }
    if plan.tp > 1 and plan.unit("blocks.*.attn.qkv").strategy is S.COLWISE:
        for name, value in state.items():
            if ".attn.qkv." in name:
                state[name] = value[torch.argsort(_qkv_rows(value.shape[0] // 3, plan.tp))]
    return state


def _parallelize_tensor_axis(
    model: GPT, wiring: _Wiring, mesh: DeviceMesh, full_recompute: bool
) -> None:
    units = wiring.units
    if units["blocks.*.attn.qkv"].strategy is S.COLWISE:
        rows = _qkv_rows(model.config.d_model, mesh.size())
        with torch.no_grad():
            for param in (p for block in model.blocks for p in block.attn.qkv.parameters()):
                param.copy_(param[rows.to(param.device)])
    distributed: dict[int, nn.Parameter] = {}  # by the original's id: tied weights stay one
    for name, unit in units.items():
        spec = GPT_UNITS[name]
        if spec.segment is not None:
            continue
        colwise = (spec.role, unit.strategy) == ("linear", S.COLWISE)
        # inside a fully recomputed block the checkpoint keeps nothing; lm_head is outside it
        keep_share = colwise and not (full_recompute and "*" in spec.module)
        boundary = _Boundary(
            mesh=mesh,
            wire_in=wiring.wire_in[name],
            run_in=R if colwise else unit.in_layout,
            run_out=unit.out_layout,
            wire_out=wiring.wire_out[name],
            indices=spec.role == "embedding",
            on_dtensors=spec.role != "dropout",
            keep_dtensor=name == "lm_head" and units["[2]"].in_layout is HID,
            saved=_SavedShards(mesh) if keep_share and unit.in_layout is SEQ else None,
        )
        for i in range(len(model.blocks) if "*" in spec.module else 1):
            module = model.get_submodule(spec.module.replace("*", str(i)))
            for pname, param in list(module.named_parameters(recurse=False)):
                if id(param) not in distributed:
                    split = _weight_placement(spec.role, unit.strategy)
                    placement = split if pname == "weight" or split == Shard(0) else Replicate()
                    value = distribute_tensor(param.detach(), mesh, [placement])
                    distributed[id(param)] = nn.Parameter(value, param.requires_grad)
                module.register_parameter(pname, distributed[id(param)])
            module.register_forward_pre_hook(boundary.before)
            module.register_forward_hook(boundary.after)
    for i, block in enumerate(model.blocks):
        given, entry = wiring.block_in[min(i, 1)], units["blocks.*[0]"].in_layout
        block.register_forward_pre_hook(functools.partial(_enter_block, mesh, given, entry))
    split_sequence = any(SEQ in (u.in_layout, u.out_layout) for u in units.values())
    outputs = _ModelOutputs(mesh, units["[2]"].in_layout, split_sequence)
    model.register_forward_pre_hook(outputs.before, with_kwargs=True)
    if units["[2]"].in_layout is HID:
        model.lm_head.register_forward_hook(outputs.logits_made)
    model.register_forward_hook(outputs.finish)


def _qkv_rows(d_model: int, tp: int) -> torch.Tensor:
    """qkv rows in the order giving rank r ``[q_r; k_r; v_r]`` ([Note: fused qkv under ...])."""
    share = d_model // tp
    starts = [part * d_model + r * share for r in range(tp) for part in range(3)]
    return torch.cat([torch.arange(share) + start for start in starts])


def _enter_block(
    mesh: DeviceMesh, given: Layout, entry: Layout, block: nn.Module, args: tuple[Any, ...]
) -> tuple[Any, ...]:
    return (_relayout(args[0], mesh, given, entry), *args[1:])


def _placement(layout: Layout, x: torch.Tensor, indices: bool = False) -> Placement:
    if layout is R:
        return Replicate()
    assert layout is not P  # partial sums never travel between modules
    # the sequence dim of [B, T] or [T] ids, and of [B, T, D] or [T, D] values
    return Shard(x.ndim - 1 if layout is HID or indices else x.ndim - 2)


def _relayout(
    x: torch.Tensor, mesh: DeviceMesh, src: Layout, dst: Layout, indices: bool = False
) -> torch.Tensor:
    if src is dst:
        return x
    x_dt = DTensor.from_local(x, mesh, [_placement(src, x, indices)], run_check=False)
    return x_dt.redistribute(mesh, [_placement(dst, x, indices)]).to_local()


@dataclass(kw_only=True, frozen=True, slots=True)
class _Boundary:
    """The hooks converting one module's input and output ([Note: plan realisation])."""

    mesh: DeviceMesh
    wire_in: Layout  # what its producer hands over
    run_in: Layout  # what it computes on
    run_out: Layout  # what it gives if it has no parameters (a plain tensor)
    wire_out: Layout  # what it hands on
    indices: bool  # its input is token or position ids
    on_dtensors: bool  # it has parameters, DTensors on the tensor axis
    keep_dtensor: bool  # its output stays a DTensor, for the vocabulary-parallel loss
    saved: _SavedShards | None

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, *rest = args
        if self.on_dtensors:
            wire = _placement(self.wire_in, x, self.indices)
            x = DTensor.from_local(x, self.mesh, [wire], run_check=False)
            x = x.redistribute(self.mesh, [_placement(self.run_in, x, self.indices)])
        else:
            x = _relayout(x, self.mesh, self.wire_in, self.run_in)
        if self.saved is not None:
            self.saved.hooks.__enter__()
        return (x, *rest)

    def after(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if self.saved is not None:
            self.saved.hooks.__exit__(None, None, None)
        if not isinstance(out, DTensor):
            return _relayout(out, self.mesh, self.run_out, self.wire_out)
        out = out.redistribute(self.mesh, [_placement(self.wire_out, out)])
        return out if self.keep_dtensor else out.to_local()


class _SavedShards:
    """The saved-tensor hooks of [Note: colwise inputs kept sharded]."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, x: torch.Tensor) -> Any:
        t = self.mesh.size()
        if not isinstance(x, DTensor) or not all(p.is_replicate() for p in x.placements):
            return x
        dim = next((d for d in range(x.ndim) if x.shape[d] % t == 0), None)
        if dim is None:
            return x
        with torch.no_grad():
            share = x.to_local().chunk(t, dim)[self.mesh.get_local_rank()]
        return (self, share.clone(), dim)  # a view would keep the whole input alive

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not (isinstance(saved, tuple) and saved[0] is self):
            return saved
        x = DTensor.from_local(saved[1], self.mesh, [Shard(saved[2])], run_check=False)
        return x.redistribute(self.mesh, [Replicate()])


class _ModelOutputs:
    """The model's inputs and outputs, whole and plain outside, as the loss [2] needs inside.

    ``S(hid)``: ``loss_parallel()`` is kept on while the loss is taken from vocabulary-split
    logits, in forward between lm_head's forward hook and the model's, in backward between the
    loss's gradient and the logits'. ``S(seq)``: each rank takes the mean loss of its share of
    the sequence, on its share of the targets; the loss is the mean over the ranks, and each
    rank's loss counts ``1/t`` towards the gradients, which the tensor axis then sums.
    """

    def __init__(self, mesh: DeviceMesh, loss: Layout, split_sequence: bool) -> None:
        self.mesh, self.loss, self.split_sequence = mesh, loss, split_sequence
        self._context: Any = None  # loss_parallel(), while on
        self._logits: DTensor | None = None

    def before(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if self.split_sequence and args[0].shape[1] % self.mesh.size():
            raise ValueError(
                f"the plan splits sequences over {self.mesh.size()} ranks, which "
                f"{args[0].shape[1]} tokens do not divide"
            )
        if self.loss is SEQ and len(args) > 1:
            args = (args[0], _relayout(args[1], self.mesh, R, SEQ, indices=True), *args[2:])
        elif self.loss is SEQ and kwargs.get("targets_BT") is not None:
            targets = _relayout(kwargs["targets_BT"], self.mesh, R, SEQ, indices=True)
            kwargs = {**kwargs, "targets_BT": targets}
        return args, kwargs

    def _enter(self, *_: Any) -> None:
        if self._context is None:  # else left on by a forward that raised
            self._context = loss_parallel()
            self._context.__enter__()

    def _exit(self, *_: Any) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

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
        if self.loss is SEQ and out.ndim == 0:
            total = out.detach().clone()
            dist.all_reduce(total, group=self.mesh.get_group())
            return (out + (total - out.detach())) / self.mesh.size()
        if self.loss is SEQ:
            return _relayout(out, self.mesh, SEQ, R)  # logits, without targets
        return out.full_tensor() if isinstance(out, DTensor) else out


def _reduce_grad(param: nn.Parameter, *, group: dist.ProcessGroup | None) -> None:
    """Finish a gradient FSDP does not own: tensor-axis partial sums, then the data-axis mean."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(grad.device_mesh, param.placements)
    if group is not None:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)  # gloo has no average
        local.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------------------------
# the data axis


def _shard_data_axis(model: GPT, wiring: _Wiring, mesh: DeviceMesh) -> None:
    """FSDP2 per block and on the root at the plan's ZeRO levels.

    ZeRO-3 reshards parameters after forward; ZeRO-1 and -2 do not (FSDP2 has no optimizer-only
    sharding). ZeRO-1 groups are tagged for :func:`set_accumulating`, which keeps their whole
    gradients until a step's last micro-batch; see [Note: ZeRO as executed] in strategies.py.
    ZeRO-0 parameters are FSDP's ``ignored_params``; hooks all-reduce their gradients. Units of
    one block (or of the root) at different levels get FSDP groups of their own.
    """
    ignored: set[nn.Parameter] = set()
    sharded = [
        _shard_group(block, _members(model, wiring, str(i)), mesh, ignored)
        for i, block in enumerate(model.blocks)
    ]
    root_members = _members(model, wiring, None)
    levels = {zero for zero, _ in root_members}
    if len(levels) == 1 and levels != {0}:  # the root's own group holds them
        fully_shard(model, mesh=mesh, reshard_after_forward=levels == {3}, ignored_params=ignored)
    elif _shard_group(None, root_members, mesh, ignored) or any(sharded):
        fully_shard(model, mesh=mesh, ignored_params=ignored)  # a root for the groups below


def set_accumulating(model: nn.Module, accumulating: bool) -> None:
    """Say whether the coming backward is a step's last micro-batch (``False``) or not.

    ZeRO-1 units keep their gathered weights and accumulate whole gradients over the step's
    micro-batches, and reduce-scatter once, in the last backward ([Note: ZeRO as executed] in
    strategies.py). Without this call they reduce every micro-batch, like ZeRO-2: the same
    result, more traffic."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if getattr(module, "_tidal_zero1", False) and isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(not accumulating, recurse=False)
            module.set_reshard_after_backward(not accumulating, recurse=False)


def _members(model: GPT, wiring: _Wiring, block: str | None) -> list[tuple[int, list[nn.Module]]]:
    """(ZeRO level, modules) of each unit with parameters in one block, or outside the blocks
    (``block=None``). Tied units come as one, at the first's level: the planner gives the others
    no parameters of their own, hence no level."""
    found: dict[int, tuple[int, list[nn.Module]]] = {}
    for name, spec in GPT_UNITS.items():
        in_blocks, unit = spec.module.startswith("blocks."), wiring.units.get(name)
        if unit is None or spec.segment is not None or in_blocks != (block is not None):
            continue
        module = model.get_submodule(spec.module.replace("*", block or ""))
        for param in list(module.parameters())[:1]:
            found.setdefault(id(param), (unit.zero, []))[1].append(module)
    return list(found.values())


def _shard_group(owner: nn.Module | None, members: list, mesh: DeviceMesh, ignored: set) -> bool:
    """Shard ``owner`` as one group if its units agree on a level, else each unit; say if any."""
    levels = {zero for zero, _ in members}
    if owner is not None and len(levels) == 1 and levels != {0}:
        fully_shard(owner, mesh=mesh, reshard_after_forward=levels == {3})
        if levels == {1}:
            owner._tidal_zero1 = True
        return True
    for zero, modules in members:
        if zero == 0:
            ignored.update(p for m in modules for p in m.parameters())
        else:
            group = modules[0] if len(modules) == 1 else modules
            fully_shard(group, mesh=mesh, reshard_after_forward=zero == 3)
            if zero == 1:
                for module in modules:
                    module._tidal_zero1 = True
    return any(zero for zero, _ in members)
