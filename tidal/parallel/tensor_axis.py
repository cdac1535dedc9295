"""A plan's tensor axis on a model: DTensor parameters, hooks converting activations, the loss.

:func:`parallelize_tensor_axis` is the tensor-axis half of ``apply`` (plan_apply.py): it follows
[Note: plan realisation], [Note: fused qkv under tensor parallelism] and [Note: colwise inputs
kept sharded] there, and [Note: attention heads per rank] here, on any model whose wiring
(tidal/planner/wiring.py) the plan was checked against (tidal/planner/check.py).

[Note: attention heads per rank]
Under ``heads`` a rank's attention core gets q, k and v of its own ``H/t`` heads (and ``G/t``
key/value heads), and what it reads of head counts must say so. tidal's GPT counts heads from
the width. LLaMA's attention does too (``view(B, T, -1, head_dim)``), and its
``num_key_value_groups = H/G`` is the same per rank, so GQA's ``repeat_kv`` and SDPA's
``enable_gqa`` pair a rank's q heads with its own key/value heads. GPT-2's splits its fused
output at ``split_size``, the model's width: that must become the rank's ``H K / t``. So apply
divides, on each split attention module, the integers HF keeps head counts and widths under
(``num_heads``, ``num_attention_heads``, ``num_key_value_heads``, ``embed_dim``,
``split_size``), and only where they equal the whole model's value, so nothing else is touched.
The model's ``config`` is left alone: every layer and the mask code share it, and the attention
forwards read only the attention implementation from it. ``head_dim`` and the scaling are per
head and unchanged.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import Placement

from tidal.planner.check import PlanWiring, split_dim
from tidal.planner.plan import Layout, StrategyName
from tidal.planner.wiring import ModelWiring

__all__ = ["param_placement", "parallelize_tensor_axis", "projection_rows"]

S = StrategyName
R, SEQ, HID, P = Layout.R, Layout.SEQ, Layout.HID, Layout.P

# [Note: attention heads per rank]: attribute -> which whole-model count it holds
_PER_RANK = {
    "num_heads": "heads",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "embed_dim": "width",
    "split_size": "width",
}
REORDERED = "_tidal_reordered"  # model attribute: state-dict key -> (dim, order) apply used


def parallelize_tensor_axis(
    model: nn.Module, wiring: PlanWiring, mesh: DeviceMesh, full_recompute: set[str]
) -> None:
    """DTensor parameters and boundary hooks for every planned module unit; ``full_recompute``:
    the blocks recomputed whole."""
    _reorder_projections(model, wiring, mesh.size())
    _split_heads(model, wiring, mesh.size())
    distributed: dict[int, nn.Parameter] = {}  # by the original's id: tied weights stay one
    for name, unit in wiring.units.items():
        spec = wiring.model.units[name]
        if spec.segment is not None or spec.role == "positions":
            continue
        boundary = _boundary(wiring, name, mesh, full_recompute)
        for i in range(wiring.model.repetitions(name)):
            module = model.get_submodule(wiring.model.module_path(name, i))
            for pname, param in list(module.named_parameters(recurse=False)):
                if id(param) not in distributed:
                    placement = param_placement(wiring.model, name, unit.strategy, pname)
                    value = distribute_tensor(param.detach(), mesh, [placement])
                    distributed[id(param)] = nn.Parameter(value, param.requires_grad)
                module.register_parameter(pname, distributed[id(param)])
            module.register_forward_pre_hook(boundary.before)
            module.register_forward_hook(boundary.after)
    for prefix, block in wiring.model.blocks.items():
        entry = wiring.block_entry[prefix]
        for i in range(block.count):
            given = wiring.block_in[prefix][min(i, 1)]
            hook = functools.partial(_enter_block, mesh, given, entry)
            model.get_submodule(prefix.replace("*", str(i))).register_forward_pre_hook(
                hook, with_kwargs=True
            )
    _hook_model_outputs(model, wiring, mesh)


def _boundary(
    wiring: PlanWiring, name: str, mesh: DeviceMesh, full_recompute: set[str]
) -> _Boundary:
    unit, spec, model = wiring.units[name], wiring.model.units[name], wiring.model
    colwise = (spec.role, unit.strategy) == ("linear", S.COLWISE)
    # inside a fully recomputed block the checkpoint keeps nothing; lm_head is outside it
    keep_share = colwise and model.block_of.get(name) not in full_recompute
    return _Boundary(
        mesh=mesh,
        wire_in=wiring.wire_in[name],
        run_in=R if colwise else unit.in_layout,
        run_out=unit.out_layout,
        wire_out=wiring.wire_out[name],
        indices=spec.role == "embedding",
        on_dtensors=name in model.owns_params,
        keep_dtensor=name == _vocabulary_logits(wiring),
        saved=_SavedShards(mesh) if keep_share and unit.in_layout is SEQ else None,
    )


def param_placement(
    wiring: ModelWiring, name: str, strategy: StrategyName, param: str = "weight"
) -> Placement:
    """The tensor-axis placement of parameter ``param`` of unit ``name`` under ``strategy``
    (:func:`~tidal.planner.check.split_dim`, the planner's word for it, as a DTensor placement)."""
    dim = split_dim(wiring, name, strategy, param)
    return Replicate() if dim is None else Shard(dim)


def projection_rows(parts: tuple[int, ...], t: int) -> torch.Tensor:
    """Output features in the order giving rank ``r`` each part's ``r``-th share, side by side
    (``[q_r; k_r; v_r]``; [Note: fused qkv under tensor parallelism] in plan_apply.py)."""
    starts = [sum(parts[:k]) for k in range(len(parts))]
    return torch.cat(
        [
            torch.arange(width // t) + start + r * (width // t)
            for r in range(t)
            for start, width in zip(starts, parts, strict=True)
        ]
    )


def _reorder_projections(model: nn.Module, wiring: PlanWiring, t: int) -> None:
    reordered: dict[str, tuple[int, torch.Tensor]] = {}
    for name, projection in wiring.model.projections.items():
        parts = projection.parts
        if parts is None or len(parts) == 1 or wiring.units[name].strategy is not S.COLWISE:
            continue
        rows = projection_rows(parts, t)
        for i in range(wiring.model.repetitions(name)):
            path = wiring.model.module_path(name, i)
            for pname, param in model.get_submodule(path).named_parameters(recurse=False):
                dim = 1 if pname == "weight" and name in wiring.model.transposed else 0
                with torch.no_grad():
                    param.copy_(param.index_select(dim, rows.to(param.device)))
                reordered[f"{path}.{pname}"] = (dim, rows)
    setattr(model, REORDERED, reordered)


def _split_heads(model: nn.Module, wiring: PlanWiring, t: int) -> None:
    """[Note: attention heads per rank]"""
    for name, (heads, kv_heads, head_dim) in wiring.model.attention.items():
        if wiring.units[name].strategy is not S.HEADS:
            continue
        whole = {"heads": heads, "kv_heads": kv_heads, "width": heads * head_dim}
        for i in range(wiring.model.repetitions(name)):
            module = model.get_submodule(wiring.model.module_path(name, i))
            for attribute, which in _PER_RANK.items():
                value = getattr(module, attribute, None)
                if isinstance(value, int) and value == whole[which]:
                    setattr(module, attribute, value // t)


def _vocabulary_logits(wiring: PlanWiring) -> str | None:
    """The linear giving a vocabulary-parallel loss its logits, if the plan has one."""
    for name, unit in wiring.units.items():
        if wiring.model.units[name].role == "loss" and unit.in_layout is HID:
            return next(
                (s for s in wiring.model.producers(name) if wiring.model.units[s].role == "linear"),
                None,
            )
    return None


def _enter_block(
    mesh: DeviceMesh,
    given: Layout,
    entry: Layout,
    block: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Convert a block's input to the layout it is entered in. A fully recomputed block's
    checkpoint (whose pre-hook runs after this one) keeps the converted input and replays the
    forward on it, this hook included: converting it again would split it twice."""
    state = checkpoint.state(block)
    if state is not None and not state.enable_hook:  # the checkpoint is recomputing
        return None
    if args:
        return (_relayout(args[0], mesh, given, entry), *args[1:]), kwargs
    key = next(iter(inspect.signature(block.forward).parameters))
    return args, {**kwargs, key: _relayout(kwargs[key], mesh, given, entry)}


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


def _hook_model_outputs(model: nn.Module, wiring: PlanWiring, mesh: DeviceMesh) -> None:
    losses = [n for n in wiring.units if wiring.model.units[n].role == "loss"]
    loss_layout = wiring.units[losses[0]].in_layout if losses else R
    split = {i for n in losses for i in wiring.model.inputs.get(n, ())} if losses else set()
    split_sequence = any(SEQ in (u.in_layout, u.out_layout) for u in wiring.units.values())
    outputs = _ModelOutputs(mesh, loss_layout, split_sequence, split if loss_layout is SEQ else ())
    model.register_forward_pre_hook(outputs.before, with_kwargs=True)
    logits = _vocabulary_logits(wiring)
    if logits is not None:
        module = model.get_submodule(wiring.model.module_path(logits, 0))
        module.register_forward_hook(outputs.logits_made)
    model.register_forward_hook(outputs.finish)


class _ModelOutputs:
    """The model's inputs and outputs, whole and plain outside, as the loss needs inside.

    ``S(hid)``: ``loss_parallel()`` is kept on while the loss is taken from vocabulary-split
    logits, in forward between the logits' forward hook and the model's, in backward between the
    loss's gradient and the logits'. ``S(seq)``: each rank takes the mean loss of its share of
    the sequence, on its share of the targets (the caller's tensors the loss reads); the loss is
    the mean over the ranks, and each rank's loss counts ``1/t`` towards the gradients, which the
    tensor axis then sums. A model without a loss unit hands its logits whole.
    """

    def __init__(
        self, mesh: DeviceMesh, loss: Layout, split_sequence: bool, split_inputs: Any
    ) -> None:
        self.mesh, self.loss, self.split_sequence = mesh, loss, split_sequence
        self.split_inputs = frozenset(split_inputs)  # positions among the caller's arguments
        self._context: Any = None  # loss_parallel(), while on
        self._logits: DTensor | None = None

    def before(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        names = list(inspect.signature(model.forward).parameters)
        ids = args[0] if args else kwargs.get(names[0])
        if self.split_sequence and ids is not None and ids.shape[1] % self.mesh.size():
            raise ValueError(
                f"the plan splits sequences over {self.mesh.size()} ranks, which "
                f"{ids.shape[1]} tokens do not divide"
            )
        inputs, kwargs = list(args), dict(kwargs)
        for i in self.split_inputs:
            if i < len(inputs):
                inputs[i] = _relayout(inputs[i], self.mesh, R, SEQ, indices=True)
            elif kwargs.get(names[i]) is not None:
                kwargs[names[i]] = _relayout(kwargs[names[i]], self.mesh, R, SEQ, indices=True)
        return tuple(inputs), kwargs

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

    def finish(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        logits, self._logits = self._logits, None
        if logits is not None:
            self._exit()
            if out.ndim == 0 and out.requires_grad:
                out.register_hook(self._enter)
                logits.register_hook(self._exit)
        if not isinstance(out, torch.Tensor):
            return out  # e.g. a Hugging Face output, whose logits lm_head handed whole
        if self.loss is SEQ and out.ndim == 0:
            total = out.detach().clone()
            dist.all_reduce(total, group=self.mesh.get_group())
            return (out + (total - out.detach())) / self.mesh.size()
        if self.loss is SEQ:
            return _relayout(out, self.mesh, SEQ, R)  # logits, without targets
        return out.full_tensor() if isinstance(out, DTensor) else out
