"""Parameters that know their chunk: every use of a chunked parameter goes through its store.

[Note: parameter uses]
A chunked parameter is a view of its chunk's device buffer ([Note: chunk store] in store.py),
and that buffer holds memory only while the chunk is on the device. A kernel that reads it while
it is off the device reads a null pointer: on torch 2.13 element-wise ops and reductions on
such a tensor kill the process (SIGSEGV), and only view and ``set_`` paths raise. So no use may
reach a kernel unchecked. The module hooks (hooks.py) cover a module's own parameters; every
other use is caught by the parameter itself: the store makes each parameter a
:class:`ChunkParameter`, an ``nn.Parameter`` subclass whose ``__torch_function__`` sends every
torch call that receives it (methods, functions, property reads) through
:meth:`ParameterUses.run`. What a call gets:

- *metadata* (``dtype``, ``shape``, ``device``, ``requires_grad``, ``grad``, ``size()``, ...)
  is read as it is: no fetch, no moment. Models read ``weight.dtype`` all the time.
- a call whose parameters a moment holds (their module is running) runs as it is: the fast path,
  a dictionary lookup per argument.
- *while the model runs* (an engine iteration is open, from ``engine(...)`` to the end of
  ``engine.backward``, or the model's own forward is running), any other parameter is accessed
  as a ``fn:`` moment, held for the call and released after it, like a module moment: a head
  that calls ``F.linear(x, self.embed.weight)``, a norm gain read in a parent's forward, an L2
  penalty over ``model.parameters()`` added to the loss. The call runs under the meter's
  saved-tensor hooks, so a parameter it saves for backward is fetched again when backward
  unpacks it ([Note: non-model memory] in activations.py). The moments are recorded like hook
  moments, in call order, which does not depend on residency: the trace of an iteration stays
  the same from one iteration to the next.
- *between iterations* (after a backward, around a step: a user's logging, EMA or checkpoint
  code) the call gets its chunks too, then runs; only a result that *aliases* a chunk
  (``detach()``, ``.data``, a view) is refused unless the chunk is pinned ([Note: optimizer
  placement] in tidal/parallel/chunk_engine.py): the chunk moves, and a view of it would read
  freed memory later. The error says how to take a copy. Under ZeRO-3 a chunk not gathered now
  is refused too: a gather needs every rank, and code between iterations may run on one.
- *writes*: ``p.copy_(value)`` (what ``model.load_state_dict`` does) writes through, to
  wherever the parameter's weights live (the chunk on either tier, the fp32 master, this rank's
  shard), so nothing is lost at the next step. Other in-place ops run on the device copy where
  that copy is the weights (fp32, one process) and are refused elsewhere, naming ``copy_``; ops
  that would cut the parameter from its chunk (``set_``, ``resize_``, ``.data = ...``) are
  refused always.
- *copies*: ``torch.save(p)``, ``copy.deepcopy(p)`` and the values of ``model.state_dict()``
  read the full-precision weights through the engine (the fp32 masters under bf16), whatever
  the residency.

A parameter whose slot holds its gradient ([Note: gradients in parameter chunks] in optim.py)
refuses every data use, through the store's access. Results of a call are plain tensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from tidal.memory.hooks import StoreHook

if TYPE_CHECKING:
    from tidal.memory.store import ChunkStore

__all__ = ["ChunkParameter", "ParameterUseError", "ParameterUses"]

Call = Callable[[Sequence[Any], dict[str, Any]], Any]


class ParameterUseError(RuntimeError):
    """A use of a chunked parameter that cannot be carried out safely; the message says why."""


def _getters(*names: str) -> set[Any]:
    return {getattr(torch.Tensor, name).__get__ for name in names}


def _setters(*names: str) -> set[Any]:
    return {getattr(torch.Tensor, name).__set__ for name in names}


# Calls that read or set metadata only: they never touch a chunk's data.
_METADATA = frozenset(
    _getters(
        "dtype", "shape", "device", "is_meta", "is_cuda", "is_cpu", "ndim", "requires_grad",
        "is_leaf", "grad", "grad_fn", "layout", "is_sparse", "is_quantized", "is_nested",
        "itemsize", "nbytes", "_version", "output_nr", "is_mkldnn", "_base",
    )
    | _setters("grad", "requires_grad")
    | {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
        torch.Tensor.ndimension, torch.Tensor.element_size, torch.Tensor.stride,
        torch.Tensor.storage_offset, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
        torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.get_device,
        torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.register_hook,
        torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr, torch.Tensor.is_pinned, torch.Tensor.is_shared,
        torch.Tensor.__len__, torch.Tensor._is_view,
    }
)  # fmt: skip

# In-place calls that change what the parameter *is* (its storage or shape), not its values.
_RESHAPING = frozenset(
    {"set_", "resize_", "resize_as_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
     "transpose_", "swapdims_", "swapaxes_", "detach_", "share_memory_", "__set__"}
)  # fmt: skip
_IN_PLACE_DUNDERS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
     "__imatmul__", "__setitem__"}
)  # fmt: skip


def _plain(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class ChunkParameter(nn.Parameter):
    """A parameter whose data lives in a chunk; see [Note: parameter uses].

    Each store makes its own subclass (:meth:`ParameterUses.adopt`) with ``_uses_ref`` set, so
    a call finds the store of every parameter it receives from the argument types alone.

    [Note: an engine can be collected]
    The class holds its :class:`ParameterUses` weakly, and the gradient hooks (hooks.py) hold
    the collector weakly: a parameter that has been through backward is also owned by autograd's
    C++ side, so the garbage collector treats everything it references as a root, and a strong
    reference from it would keep the engine, its chunks and their device memory alive after the
    last user reference went (seen on CUDA as a probe engine's bytes counted as the next
    engine's activations). The model keeps the engine alive through its state-dict hooks,
    which are ordinary module attributes; a parameter kept alone after the model and engine
    went raises on use.
    """

    _uses_ref: ClassVar[weakref.ReferenceType[ParameterUses]]

    @classmethod
    def _uses(cls) -> ParameterUses:
        uses = cls._uses_ref()
        if uses is None:
            raise RuntimeError(
                "this parameter's engine and model were deleted, so its chunk is gone; keep "
                "the model (or the engine) while you use its parameters, or take a copy first"
            )
        return uses

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func in _METADATA:
            return _plain(func, args, kwargs)
        call: Call = functools.partial(_plain, func)
        owners = [t._uses() for t in types if issubclass(t, ChunkParameter)]
        if len(owners) == 1:
            return owners[0].run(call, func, args, kwargs)
        for uses in set(owners):  # parameters of several engines in one call: each makes its own
            call = functools.partial(uses.run, call, func)
        return call(args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save and pickle: a plain Parameter with the weights, not the (maybe empty) view.
        value = type(self)._uses().read(self)
        hooks: collections.OrderedDict[int, Any] = collections.OrderedDict()
        return (torch._utils._rebuild_parameter, (value, self.requires_grad, hooks))

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) not in memo:
            value = type(self)._uses().read(self)
            memo[id(self)] = nn.Parameter(value, requires_grad=self.requires_grad)
        return memo[id(self)]


class ParameterUses:
    """Carries out calls on one store's parameters; see [Note: parameter uses].

    ``read(param)`` returns a new tensor with the parameter's full-precision weights;
    ``write(param, value)`` writes ``value`` to wherever its weights live; ``in_place`` says
    whether the parameter's device copy is its weights (then in-place ops may run on it);
    ``fetch_between_iterations`` whether a chunk may be brought in outside an iteration.
    """

    def __init__(
        self,
        store: ChunkStore,
        *,
        read: Callable[[nn.Parameter], torch.Tensor],
        write: Callable[[nn.Parameter, torch.Tensor], None],
        in_place: bool,
        fetch_between_iterations: bool,
    ) -> None:
        self.store = store
        self.read = read
        self.write = write
        self.in_place = in_place
        self.fetch_between_iterations = fetch_between_iterations
        self._saving = 0  # state_dict calls in progress: their detach() is replaced after

    def adopt(self, model: nn.Module) -> list[Any]:
        """Make the store's parameters :class:`ChunkParameter` and hook ``model``'s state dict;
        returns the hook handles."""
        namespace = {"_uses_ref": weakref.ref(self), "__module__": __name__}
        cls = type("ChunkParameter", (ChunkParameter,), namespace)
        for param in self.store.params.values():
            param.__class__ = cls
        handles: list[Any] = []
        for module in model.modules():
            if any(id(p) in self.store.slot_of for p in module.parameters(recurse=False)):
                hooks = (
                    (module.register_state_dict_pre_hook, self._before_state_dict),
                    (module.register_state_dict_post_hook, self._after_state_dict),
                    (module.register_load_state_dict_pre_hook, self._before_load),
                )
                handles += [register(StoreHook(hook)) for register, hook in hooks]
        return handles

    # -- state dicts -------------------------------------------------------------------------

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._saving += 1

    def _after_state_dict(
        self, module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any
    ) -> None:
        self._saving -= 1
        for name, param in module.named_parameters(recurse=False):
            key = prefix + name
            if key in state and state[key] is not param:  # keep_vars gives the Parameter
                state[key] = self.read(param)

    def _before_load(
        self, module: nn.Module, state: Any, prefix: str, metadata: Any, *rest: Any
    ) -> None:
        if isinstance(metadata, dict) and metadata.get("assign_to_params_buffers"):
            raise ParameterUseError(
                "load_state_dict(assign=True) would replace the chunked parameters of "
                f"{type(module).__name__} with new tensors outside their chunks; load with "
                "assign=False (the values are copied into the chunks)"
            )

    # -- calls -------------------------------------------------------------------------------

    def run(
        self, call: Call, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        params = _params_among(self.store, args, kwargs)
        if not params:
            return call(args, kwargs)
        written = _written(func, args, kwargs, params)
        if written is not None:
            return self._write(call, func, args, kwargs, written)
        if self._saving and getattr(func, "__name__", "") == "detach":
            return call(args, kwargs)  # state_dict's detach: replaced by the read after it
        idle = [p for p in params if not self.store.in_use(p)]
        if not idle:
            return call(args, kwargs)
        if self.store.model_running:
            return self._during_iteration(call, args, kwargs, idle)
        return self._between_iterations(call, func, args, kwargs, idle)

    def _during_iteration(
        self, call: Call, args: Sequence[Any], kwargs: dict[str, Any], idle: list[nn.Parameter]
    ) -> Any:
        label = "fn:" + ",".join(self.store.names_of(idle))
        with self.store.holding(label, idle), self._saving_tensors():
            return call(args, kwargs)

    def _saving_tensors(self) -> contextlib.AbstractContextManager[None]:
        # A call outside the model's forward (a loss term) saves parameters for backward too:
        # through the meter's hooks, backward fetches them again when it unpacks them.
        if torch.is_grad_enabled():
            return self.store.meter.tracking()
        return contextlib.nullcontext()

    def _between_iterations(
        self,
        call: Call,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        idle: list[nn.Parameter],
    ) -> Any:
        absent = [p for p in idle if not self.store.on_device(p)]
        if absent and not self.fetch_between_iterations:
            raise ParameterUseError(
                f"{_describe(func)} reads {self._names(absent)} between iterations, where its "
                f"chunk is sharded over the ranks and not gathered; gathering needs every rank. "
                f"Read the weights on every rank with model.state_dict() or "
                f"engine.model_state_dict(), or use them inside the model's forward"
            )
        label = "use:" + ",".join(self.store.names_of(idle))
        with self.store.holding(label, idle), self._saving_tensors():
            result = call(args, kwargs)
        aliased = self.store.unpinned_chunk_views(_tensors(result))
        if aliased:
            raise ParameterUseError(
                f"{_describe(func)} on {self._names(idle)} returns a view of its chunk, which "
                f"moves between the device and the host between iterations (the view would "
                f"read freed memory after the next move). Take a copy instead: "
                f"p.clone().detach(), model.state_dict() or engine.model_state_dict() to read; "
                f"p.copy_(value) under torch.no_grad() to write"
            )
        return result

    def _write(
        self,
        call: Call,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        param: nn.Parameter,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__set__" and len(args) >= 2 and _same_view(args[1], param):
            return None  # ``module.to(dtype)`` with the dtype it has: ``p.data = p``, a no-op
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            with torch.no_grad():
                self.write(param, args[1])
            return param
        if name not in _RESHAPING and self.in_place:
            with self.store.holding(f"write:{self._names([param])}", [param]):
                return call(args, kwargs)
        why = (
            "would cut it from its chunk"
            if name in _RESHAPING
            else "would change only its low-precision or gathered copy, which the next step "
            "overwrites from the weights (the fp32 master, or the shards)"
        )
        raise ParameterUseError(
            f"{_describe(func)} writes {self._names([param])} in place, which {why}; write new "
            f"values with p.copy_(value) under torch.no_grad() (or model.load_state_dict), "
            f"which writes through to the weights"
        )

    def _names(self, params: list[nn.Parameter]) -> str:
        return ", ".join(self.store.names_of(params))


def _params_among(
    store: ChunkStore, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[nn.Parameter]:
    """The store's parameters among a call's arguments (and one level of lists), once each."""
    found: list[nn.Parameter] = []
    for value in (*args, *kwargs.values()):
        values = value if type(value) in (list, tuple) else (value,)
        for item in values:
            # A live object's id is unique, so this finds parameters without isinstance.
            if id(item) in store.slot_of and all(item is not seen for seen in found):
                found.append(item)
    return found


def _written(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: list[nn.Parameter],
) -> nn.Parameter | None:
    """The parameter a call writes in place (its first argument, or ``out=``), if any."""
    out = kwargs.get("out")
    for target in out if isinstance(out, tuple | list) else (out,):
        if any(target is p for p in params):
            return target
    name = getattr(func, "__name__", "")
    writes_first = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS
    if name == "__set__":  # ``p.data = x``: the getset descriptor's setter
        writes_first = getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    if writes_first and args and any(args[0] is p for p in params):
        return args[0]
    return None


def _same_view(value: Any, param: nn.Parameter) -> bool:
    """Whether ``value`` is ``param``'s own data: the same storage, offset, shape and strides."""
    if value is param:
        return True
    if not isinstance(value, torch.Tensor):
        return False
    with DisableTorchFunctionSubclass():
        return (
            value.untyped_storage()._cdata == param.untyped_storage()._cdata
            and value.storage_offset() == param.storage_offset()
            and value.shape == param.shape
            and value.stride() == param.stride()
            and value.dtype == param.dtype
        )


def _tensors(result: Any) -> Iterator[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        yield result
    elif isinstance(result, tuple | list):
        for item in result:
            if isinstance(item, torch.Tensor):
                yield item


def _describe(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        return f"the attribute .{getattr(owner, '__name__', '?')}"
    return f"{name}()"
