"""Measure: trace a model on the meta device into a graph of decision units, allocating nothing.

The forward pass runs on meta tensors under three observers: module hooks say which module is
running, a dispatch mode sees every aten op (its FLOPs, the tensors it reads and writes) and a
saved-tensor hook sees what autograd keeps for backward. From them :func:`measure` builds a
:class:`ModelGraph`: one :class:`Unit` per leaf module and per run of a module's own operations
between its children ([Note: unit segments]), the data-flow edges between units, and the bytes
each unit saves for backward, split by role ([Note: saved roles]). Identical repeated blocks are
then folded into one unit per position (``blocks.*.attn.qkv``) with a count, so a 96-layer model
has as many decisions as one layer.

[Note: unit segments]
A module with children runs some operations itself: a transformer block's residual adds, an
attention module's split / SDPA / reshape between its ``qkv`` and ``proj`` children, a model's
loss. Each maximal run of such operations between two child calls is a unit of its own, named
``module[k]`` for the k-th non-empty run (``blocks.*[0]`` is a block's first residual add,
``[2]`` is the root's third run). Counting only non-empty runs keeps names independent of how
many children sit between them.

[Note: saved roles]
Each tensor storage autograd saves is counted once, by the first unit that saves it (when it
belongs to a repeated block, once per repetition: a shared input such as a rotary table is then
counted per layer, a small overcount), with a role:
``input`` when another unit (or the caller) produced it, ``output`` when this unit produced it
and another unit reads it, ``internal`` otherwise. The cost model shards a saved input as the
unit's input layout, everything else as the unit's own work; selective recomputation drops the
internal tensors of attention cores.

[Note: structure facts]
Besides costs, a unit records what ``apply`` needs to wire a plan onto the model, all of it seen
in the trace rather than known per architecture: ``inputs``, which of the caller's positional
tensors it reads (token ids, targets); ``head_dim`` of an attention core; ``split_widths``, the
widths in which it splits a tensor it was handed along the last dim (an attention core taking a
fused ``[q; k; v]`` apart); and ``dropout``, that it called dropout. The graph records which
units' outputs each module's own code reads the shape of or reshapes (``shape_reads``: a
torch-function mode sees ``x.shape`` and ``x.size()``, which no kernel does, and the views of
units dropped as dead views are reshapes), leaf modules left out: they run on what their hooks
give them. ``measure(...,
dropout_units=True)`` records every dropout as a unit even at ``p = 0``, where it does no work:
the units a model has whatever its dropout, which a plan made at another dropout is checked
against (tidal/planner/wiring.py).

[Note: branches on values]
Meta tensors have shapes but no values, so code that branches on one cannot run. The one such
branch in the decoders measured here is Hugging Face's check, in training without a cache, that
every row holds a single sequence (not packed ones): a boolean read as ``True``, which is what
a batch of whole sequences gives. Reading any other value fails, as it would without this.

[Note: kernels as on the accelerator]
A meta trace follows the CPU dispatcher, which runs attention with dropout as unfused math in
fp32 and dropout as a float mask. A GPU runs fused attention (saving q, k, v, the output and a
log-sum-exp row) and keeps a one-byte mask. With ``accelerator_kernels=True`` (the default)
:func:`measure` swaps ``F.scaled_dot_product_attention`` and ``F.dropout`` for stand-ins that
save exactly what those kernels save, so the bytes are the ones a training run will hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from tidal.planner.graph import Edge, ModelGraph, ParamInfo, Unit, cluster_blocks

__all__ = ["Edge", "ModelGraph", "ParamInfo", "Unit", "measure"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _kind_of(module: nn.Module) -> str:
    name = type(module).__name__
    if isinstance(module, nn.Linear) or name == "Conv1D":
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "Norm" in name:
        return "norm"
    return "elementwise"


# ---------------------------------------------------------------------------------------------
# stand-ins for the accelerator's kernels; see [Note: kernels as on the accelerator]


# Ops that say nothing of what a run of a module's own ops does (allocations, copies).
_UNNAMING_OPS = frozenset({"new_empty", "empty", "empty_like", "to_copy", "copy", "clone",
                           "zeros", "zeros_like", "fill", "detach", "lift_fresh"})  # fmt: skip


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, K = q.shape
        out = q.new_empty(B, T, H, v.shape[-1]).transpose(1, 2)  # [B, H, T, K] over [B, T, H, K]
        lse = q.new_empty(B, H, T, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def _accelerator_kernels(tracer: _Tracer, dropout_units: bool) -> Iterator[None]:
    original_sdpa, original_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        tracer.note_attention(q, k)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: broadcast K/V heads
            repeat = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        return _FusedAttention.apply(q, k, v)

    def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or (p == 0.0 and not dropout_units):
            return x
        tracer.current_unit().dropout = True
        # at p = 0 native_dropout hands back its input, which would leave no unit in between
        return torch.ops.aten.native_dropout(x, p or 0.5, True)[0]

    # a tracing stand-in: its first parameter's name differs from F.dropout's ``input``
    F.scaled_dot_product_attention, F.dropout = sdpa, dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = original_sdpa, original_dropout


# ---------------------------------------------------------------------------------------------
# the tracer


@dataclass(slots=True)
class _Frame:
    fqn: str
    leaf: bool
    runs: int = 0  # non-empty own-op runs so far
    open_run: int | None = None


class _Tracer(TorchDispatchMode):
    def __init__(self, model: nn.Module, args: tuple[Any, ...]) -> None:
        super().__init__()
        self.model = model
        self.input_index = {  # storage -> position among the caller's arguments
            _storage_key(a): i for i, a in reversed(list(enumerate(args))) if _is_tensor(a)
        }
        self.stack: list[_Frame] = []
        self.units: dict[str, Unit] = {}
        self.producer: dict[int, str] = {}  # storage -> unit that produced it
        self.readers: dict[int, set[str]] = {}  # storage -> units that read it
        self.edges: dict[tuple[str, str], float] = {}
        self.saved: dict[int, tuple[str, int]] = {}  # storage -> (first saver, bytes)
        self.shared: set[tuple[str, int]] = set()  # (unit, storage) saved again by a later unit
        self.keep_alive: list[torch.Tensor] = []
        self.shape_reads: dict[str, set[str]] = {}
        self.param_storages = {_storage_key(p) for p in model.parameters()}
        self.modules = dict(model.named_modules())

    # module frames -----------------------------------------------------------------------
    def enter(self, fqn: str, module: nn.Module) -> None:
        if self.stack:
            self.stack[-1].open_run = None  # a child call ends the parent's run of own ops
        self.stack.append(_Frame(fqn, leaf=not any(True for _ in module.children())))

    def leave(self) -> None:
        self.stack.pop()
        if self.stack:
            self.stack[-1].open_run = None

    def current_unit(self) -> Unit:
        frame = self.stack[-1] if self.stack else _Frame("", leaf=False)
        if frame.leaf:
            name, segment = frame.fqn, None
            kind = _kind_of(self.modules[frame.fqn])
        else:
            if frame.open_run is None:
                frame.open_run, frame.runs = frame.runs, frame.runs + 1
            segment = frame.open_run
            name, kind = f"{frame.fqn}[{segment}]", "elementwise"
        if name not in self.units:
            self.units[name] = self._new_unit(name, frame.fqn, segment, kind)
        return self.units[name]

    def _new_unit(self, name: str, fqn: str, segment: int | None, kind: str) -> Unit:
        unit = Unit(name=name, module=fqn, segment=segment, kind=kind)
        if segment is None:
            module = self.modules[fqn]
            for pname, p in module.named_parameters(recurse=False):
                unit.params.append(
                    ParamInfo(name=f"{fqn}.{pname}", shape=tuple(p.shape), nbytes=_nbytes(p))
                )
            weight = getattr(module, "weight", None)
            if kind == "linear" and isinstance(weight, torch.Tensor):
                unit.weight_transposed = type(module).__name__ == "Conv1D"
                out_f, in_f = weight.shape[::-1] if unit.weight_transposed else weight.shape
                unit.in_features, unit.out_features = int(in_f), int(out_f)
            if kind == "embedding" and isinstance(weight, torch.Tensor):
                unit.out_features = int(weight.shape[0])  # rows: the vocabulary
        return unit

    def note_shape_read(self, t: torch.Tensor) -> None:
        frame = self.stack[-1] if self.stack else None
        src = self.producer.get(_storage_key(t))
        if frame is not None and not frame.leaf and src is not None:
            self.shape_reads.setdefault(frame.fqn, set()).add(src)

    def note_attention(self, q: torch.Tensor, k: torch.Tensor) -> None:
        unit = self.current_unit()
        unit.kind = "attention"
        unit.heads, unit.kv_heads, unit.head_dim = (
            int(q.shape[1]),
            int(k.shape[1]),
            int(q.shape[-1]),
        )
        B, H, T, K = q.shape
        unit.flops += 4.0 * B * H * T * k.shape[2] * K

    # ops -------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype is torch.bool:
            return True  # [Note: branches on values]
        out = func(*args, **kwargs)
        unit = self.current_unit()
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            unit.flops += counter(*args, **kwargs, out_val=out)
        if func._overloadpacket in (torch.ops.aten.log_softmax, torch.ops.aten.nll_loss_forward):
            unit.kind = "loss"
        is_view = bool(outputs) and all(
            _storage_key(o) in {_storage_key(i) for i in inputs} for o in outputs
        )
        self._note_split(unit, func, args, outputs)
        op = func._overloadpacket.__name__.strip("_")
        if not is_view and op not in _UNNAMING_OPS and op not in unit.ops and len(unit.ops) < 3:
            unit.ops = (*unit.ops, op)
        for t in inputs:
            key = _storage_key(t)
            if key in self.param_storages:
                continue
            if key in self.input_index and self.input_index[key] not in unit.inputs:
                unit.inputs = tuple(sorted((*unit.inputs, self.input_index[key])))
            if not is_view:
                unit.io_bytes += _nbytes(t)
            src = self.producer.get(key)
            if src is not None and src != unit.name:
                self.readers.setdefault(key, set()).add(unit.name)
                edge = (src, unit.name)
                self.edges[edge] = max(self.edges.get(edge, 0.0), float(_nbytes(t)))
        for t in outputs:
            key = _storage_key(t)
            if key in self.param_storages or key in self.producer:
                continue
            self.producer[key] = unit.name
            self.keep_alive.append(t)
            unit.io_bytes += _nbytes(t)
            unit.out_bytes = max(unit.out_bytes, float(_nbytes(t)))
        return out

    def _note_split(self, unit: Unit, func: Any, args: tuple, outputs: list[torch.Tensor]) -> None:
        """Record the widths of the unit's first split of a handed-over tensor along its last dim
        ([Note: structure facts])."""
        splits = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)
        if unit.split_widths or func not in splits or not outputs:
            return
        x, dim = args[0], args[2] if len(args) > 2 else 0
        handed = self.producer.get(_storage_key(x)) not in (None, unit.name)
        if handed and dim % x.ndim == x.ndim - 1:
            unit.split_widths = tuple(int(o.shape[-1]) for o in outputs)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self.param_storages:
            return t
        unit = self.current_unit()
        if key in self.saved:
            if self.saved[key][0] != unit.name and (unit.name, key) not in self.shared:
                self.shared.add((unit.name, key))
                unit.shared_saved_bytes += t.untyped_storage().nbytes()
            return t
        self.saved[key] = (unit.name, t.untyped_storage().nbytes())
        self.keep_alive.append(t)
        return t

    def finish(self) -> tuple[list[Unit], list[Edge]]:
        for key, (name, nbytes) in self.saved.items():
            unit, src = self.units[name], self.producer.get(key)
            if src != name:
                unit.saved_input_bytes += nbytes
            elif self.readers.get(key):
                unit.saved_output_bytes += nbytes
            else:
                unit.saved_internal_bytes += nbytes
        edges = [Edge(src=s, dst=d, nbytes=b) for (s, d), b in self.edges.items()]
        return list(self.units.values()), edges


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


_SHAPE_DESCRIPTOR = torch._C.TensorBase.__dict__["shape"]  # x.shape calls its __get__


class _ShapeReads(TorchFunctionMode):
    """Tells the tracer whose shape Python code reads ([Note: structure facts])."""

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        getter = getattr(func, "__self__", None) is _SHAPE_DESCRIPTOR
        if (getter or func is torch.Tensor.size) and args and _is_tensor(args[0]):
            self.tracer.note_shape_read(args[0])
        return func(*args, **(kwargs or {}))


def _install_hooks(model: nn.Module, tracer: _Tracer) -> list[Any]:
    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, fqn=fqn: tracer.enter(fqn, m)))
        handles.append(
            module.register_forward_hook(lambda m, a, o: tracer.leave(), always_call=True)
        )
    return handles


def measure(
    model: nn.Module,
    inputs: Callable[[], tuple[Any, ...]] | tuple[Any, ...],
    *,
    name: str = "model",
    accelerator_kernels: bool = True,
    dropout_units: bool = False,
) -> ModelGraph:
    """Trace ``model(*inputs)`` (on the meta device) into a clustered :class:`ModelGraph`.

    ``inputs`` are meta tensors (or a function returning them); their dim 0 is the micro-batch
    and dim 1 the sequence. The model is run in training mode; nothing is allocated.
    ``dropout_units``: record dropouts at ``p = 0`` too ([Note: structure facts]); it needs
    ``accelerator_kernels``.
    """
    if dropout_units and not accelerator_kernels:
        raise ValueError("dropout_units records dropout through the accelerator's stand-ins")
    args = inputs() if callable(inputs) else inputs
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.device.type != "meta" for t in tensors) or any(
        p.device.type != "meta" for p in model.parameters()
    ):
        raise ValueError(
            "measure traces on the meta device: build the model with device='meta' "
            "(or `with torch.device('meta'):`) and pass meta tensors as inputs"
        )
    tracer = _Tracer(model, args)
    handles = _install_hooks(model, tracer)
    kernels = (
        _accelerator_kernels(tracer, dropout_units)
        if accelerator_kernels
        else contextlib.nullcontext()
    )
    was_training = model.training
    model.train()
    try:
        saved = torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t)
        with kernels, saved, tracer, _ShapeReads(tracer):
            model(*args)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    units, edges = tracer.finish()
    for view in _dead_views(units, edges):  # its module's code reshapes what it viewed
        viewed = {e.src for e in edges if e.dst == view.name}
        tracer.shape_reads.setdefault(view.module, set()).update(viewed)
    dead = {u.name for u in _dead_views(units, edges)}
    units = [u for u in units if u.name not in dead]
    edges = [e for e in edges if e.src not in dead and e.dst not in dead]
    _resolve_ties(model, units)
    batch, seq = (int(tensors[0].shape[0]), int(tensors[0].shape[1])) if tensors else (1, 1)
    kept = {u.name for u in units}
    reads = {m: tuple(sorted(v & kept)) for m, v in tracer.shape_reads.items() if v & kept}
    tokens = not tensors or (tensors[0].dim() == 2 and not tensors[0].is_floating_point())
    floating = [p.dtype.itemsize for p in model.parameters() if p.is_floating_point()]
    graph = ModelGraph(name=name, units=units, edges=edges, micro_batch=batch, seq_len=seq,
                       shape_reads=reads, tokens=tokens,
                       element_bytes=floating[0] if floating else 2)  # fmt: skip
    return cluster_blocks(graph)


def _dead_views(units: list[Unit], edges: list[Edge]) -> list[Unit]:
    """Units that only make views nobody reads through them (a reshape of q whose storage its
    consumers reach straight from the projection) decide nothing: they are dropped, and their
    edges with them."""
    sources = {e.src for e in edges}
    return [
        u
        for u in units
        if u.kind == "elementwise"
        and u.name not in sources
        and not u.params
        and u.flops == 0
        and u.saved_bytes == 0
    ]


def _resolve_ties(model: nn.Module, units: list[Unit]) -> None:
    owners: dict[int, str] = {}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for unit in units:
        for p in unit.params:
            key = id(by_name[p.name])
            if key in owners and owners[key] != unit.name:
                p.tied_to = owners[key]
            else:
                owners.setdefault(key, unit.name)
