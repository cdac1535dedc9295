"""Module and gradient hooks that drive the chunk store.

Every module that owns parameters (``recurse=False``) gets four hooks: before its forward and
before its backward it asks the store for its chunks (one moment each); after either it releases
them (a moment too: [Note: chunk store] in store.py). A parameter shared by several modules (a
tied embedding and LM head) is owned by each of them, so each use fetches it. Gradients are
collected per parameter by a post-accumulate-grad hook, which fires once per backward after
autograd has summed every use of the parameter. The root module's forward is marked too: while
it runs, a parameter used outside its own module is fetched like one used inside an engine
iteration ([Note: parameter uses] in uses.py), so calling the model directly (``generate``)
works as well.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils.hooks import RemovableHandle

from tidal.memory.store import ChunkStore

__all__ = ["OUTPUT_ONLY_HOOK_WARNING", "StoreHook", "install_hooks"]

# torch warns when a module's full backward hook fires for outputs only, which is the normal
# case for an embedding whose inputs are integer ids; the chunk hooks expect exactly that, so
# the engine filters this message around backward.
OUTPUT_ONLY_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect"


def _inert(*_args: Any) -> None:
    """What a copy of a store's hook does: nothing."""


class StoreHook:
    """A hook that drives a store, which a copy of the model leaves behind.

    ``copy.deepcopy(model)`` and ``torch.save(model)`` copy a module's hooks with it, and a
    closure over the store would tie the copy to the engine's chunks (a copy's forward moving
    them). The copy's parameters are plain tensors with the weights ([Note: parameter uses] in
    uses.py), so its hooks have nothing to do: a copy of this hook does nothing.
    """

    __slots__ = ("__dict__", "fn")  # torch marks registered hooks with an attribute

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_hook, ())


def _inert_hook() -> Callable[..., None]:
    return _inert


def install_hooks(
    model: nn.Module,
    store: ChunkStore,
    *,
    on_grad: Callable[[nn.Parameter], None],
) -> list[RemovableHandle]:
    """Hook every parameter-owning module of ``model`` to ``store``; returns removable handles."""
    handles: list[RemovableHandle] = [
        model.register_forward_pre_hook(StoreHook(lambda _module, _args: store.enter_forward())),
        model.register_forward_hook(
            StoreHook(lambda _module, _args, _output: store.leave_forward()), always_call=True
        ),
    ]
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            handles += _hook_module(module, name or "<root>", own, store)
    seen: set[int] = set()
    collect = StoreHook(functools.partial(_plainly, _weakly(on_grad)))
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            handles.append(param.register_post_accumulate_grad_hook(collect))
    return handles


def _weakly(fn: Callable[[nn.Parameter], None]) -> Callable[[], Callable[..., None] | None]:
    """A bound method held weakly ([Note: an engine can be collected] in uses.py); any other
    callable as it is."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


def _plainly(on_grad: Callable[[], Callable[..., None] | None], param: nn.Parameter) -> None:
    # The collector reads and sets .grad and .dtype several times per parameter: as plain
    # tensor attribute reads, not calls through ChunkParameter.__torch_function__ (uses.py).
    collect = on_grad()
    assert collect is not None, "a gradient reached a deleted engine's parameter"
    with DisableTorchFunctionSubclass():
        collect(param)


def _hook_module(
    module: nn.Module, name: str, own: list[nn.Parameter], store: ChunkStore
) -> list[RemovableHandle]:
    forward_label, backward_label = f"fwd:{name}", f"bwd:{name}"

    entered = [0]  # forwards whose access went through (a refused one holds nothing)

    def before_forward(_module: nn.Module, _args: Any) -> None:
        store.access(forward_label, own)
        entered[0] += 1

    def after_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        if entered[0]:
            entered[0] -= 1
            store.release(own, label=forward_label)

    def before_backward(_module: nn.Module, _grad_output: Any) -> None:
        store.access(backward_label, own)

    def after_backward(_module: nn.Module, _grad_input: Any, _grad_output: Any) -> None:
        store.release(own, label=backward_label)

    return [
        module.register_forward_pre_hook(StoreHook(before_forward)),
        # always: a recompute that stops early (non-reentrant checkpoint, once it has what the
        # backward needs) ends a forward by an exception, which would leave its chunks held
        module.register_forward_hook(StoreHook(after_forward), always_call=True),
        module.register_full_backward_pre_hook(StoreHook(before_backward)),
        module.register_full_backward_hook(StoreHook(after_backward)),
    ]
