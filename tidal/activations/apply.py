"""Savers on a module, in place: recompute its submodules, or swap what they save to the host
tier or to a peer (the swaps are runtime.py's).

[Note: savers in place]
:func:`apply_savers` changes the named submodules of a model (or of a pipeline stage) and
returns the handles that undo it:

- ``RECOMPUTE``: torch's composable non-reentrant checkpoint on the submodule: its forward keeps
  only its inputs, and its backward runs the forward again (same kernels, same inputs: the
  gradients are bit for bit the same in fp32 with deterministic ops).
- savers name disjoint submodules: one inside another's would take the tensors the outer one's
  hooks must see (a recompute's own saved-tensor hooks, or the host copies), so that is refused.
- ``HOST``: while the submodule's forward runs, autograd's saved tensors go through
  ``saved_tensors_hooks`` to buffers of the host tier (byte budgeted: past the budget,
  :class:`~tidal.memory.tiers.TierBudgetError` before anything is copied) and come back when
  their backward reads them; a host buffer is given back when autograd drops the last saved
  tensor that uses it. Parameters (and views of them) are not copied: they stay where they
  are, and autograd gets them back as they were saved ([Note: host swap by storage] in
  runtime.py).
- ``PEER``: what the submodule saves joins a bundle that the schedule's lending actions send to
  a lender rank and bring back ([Note: lending] in tidal/pipeline/lending.py).

A recompute runs the forward again inside the backward; under a stashing schedule (PipeDream,
2BW) ``recompute_context`` swaps in the version that forward used
(``StageWeights.forward_weights``); PipeMare keeps no copy of it, so :func:`check_schedule`
refuses recompute there.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed._composable import checkpoint

from tidal.activations.costs import Saver, Stripe
from tidal.activations.runtime import HostSwap, PeerSwap, around_forward
from tidal.config import ConfigError
from tidal.memory.tiers import Tier

__all__ = ["SaverHandles", "apply_savers", "check_schedule"]


@dataclass(slots=True)
class SaverHandles:
    """What :func:`apply_savers` did, to count and to undo."""

    host: HostSwap | None
    recomputed: tuple[str, ...]
    swapped: tuple[str, ...]
    lent: tuple[str, ...] = ()
    _hooks: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def apply_savers(model: nn.Module, savers: Mapping[str, Saver], *, host: Tier | None = None,
                 peer: PeerSwap | None = None, lenders: Mapping[str, Stripe] | None = None,
                 recompute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None
                 = None) -> SaverHandles:  # fmt: skip
    """Recompute, host-swap or lend the submodules ``savers`` names ([Note: savers in place]);
    ``host``: the tier host swaps use (needed when any is asked); ``peer`` and ``lenders[path]``
    (the ranks each lent submodule lends to): what peer swaps use; ``recompute_context()``: held
    open around each recompute (a stashing stage's forward weights)."""
    unknown = sorted(set(savers) - {name for name, _ in model.named_modules()})
    if unknown:
        raise ConfigError("pipeline.memory", f"no submodule {unknown[0]!r} in the model to save on")
    moves = {path: saver for path, saver in savers.items() if saver is not Saver.KEEP}
    lent = [path for path, saver in moves.items() if saver is Saver.PEER]
    if lent and (peer is None or lenders is None or any(p not in lenders for p in lent)):
        raise ConfigError("pipeline.memory", "a peer swap needs the rank it lends to, in a "
                          "pipeline whose schedule lends ([Note: lending])")  # fmt: skip
    for outer, inner in itertools.permutations(moves, 2):
        if inner.startswith(outer + ".") or outer == "":
            raise ConfigError("pipeline.memory", f"savers on {outer or 'the model'!r} and on "
                              f"{inner!r}, inside it: name one of them, not both")  # fmt: skip
    swaps = [path for path, saver in moves.items() if saver is Saver.HOST]
    if swaps and host is None:
        raise ConfigError("memory.host_budget", "host swaps need a host tier to swap to")
    handles = SaverHandles(
        host=HostSwap(host) if host is not None and swaps else None,
        recomputed=tuple(p for p, s in moves.items() if s is Saver.RECOMPUTE),
        swapped=tuple(swaps),
    )
    for path in handles.recomputed:
        if recompute_context is None:
            checkpoint(model.get_submodule(path))
        else:
            checkpoint(model.get_submodule(path), context_fn=_recompute_in(recompute_context))
    params = frozenset(_local(p).untyped_storage().data_ptr() for p in model.parameters())
    if handles.host is not None:  # runs first: a saver on the whole model opens inside its run
        handles._hooks += around_forward(model, handles.host.running)
        for path in swaps:
            handles._hooks += _swap_saved(model.get_submodule(path), handles.host, params)
    for path in lent:
        assert peer is not None and lenders is not None
        handles._hooks += around_forward(
            model.get_submodule(path),
            lambda p=peer, r=lenders[path]: p.swapping(r, params),  # type: ignore[misc]
        )
    handles.lent = tuple(lent)
    return handles


def _local(param: nn.Parameter) -> Any:
    """A parameter's own storage: a DTensor's local share (a plan's layout)."""
    return param._local_tensor if hasattr(param, "_local_tensor") else param


def _recompute_in(
    context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Callable[[], tuple[contextlib.AbstractContextManager[Any], ...]]:
    """A checkpoint's context_fn: nothing around the forward, ``context()`` around the recompute."""
    return lambda: (contextlib.nullcontext(), context())


def _swap_saved(module: nn.Module, host: HostSwap, params: frozenset[int]) -> list[Any]:
    """Hooks that hold ``host``'s saved-tensor hooks around each forward of ``module``."""
    return around_forward(module, lambda: host.swapping(params))


def check_schedule(savers: Mapping[str, Saver], *, asynchronous: bool, stashes: bool,
                   schedule: str) -> None:  # fmt: skip
    """Refuse recompute under an asynchronous schedule that keeps no weight versions
    ([Note: savers in place])."""
    if asynchronous and not stashes and any(s is Saver.RECOMPUTE for s in savers.values()):
        raise ConfigError(
            "pipeline.memory",
            f"recompute runs under synchronous and stashing schedules, not {schedule!r}: it "
            "would run the forward again on weights the forward did not use (host and peer "
            "swap run under it)",
        )
