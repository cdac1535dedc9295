"""Parameters used outside their own module: fetched when a torch function or backward needs them.

[Note: functional uses]
The module hooks (hooks.py) bring a module's own parameters to the device around its forward and
backward. Models also use parameters elsewhere: a head that calls ``F.linear(x,
self.embed.weight)`` instead of a tied module, a norm weight read in a parent's forward, a
parameter passed to a custom function. PatrickStar's users met this as crashes in ordinary
models; here such a use works, in both directions:

- forward: while the engine's forward runs, a ``TorchFunctionMode`` looks at the arguments of
  every torch function; a parameter whose slot is not in use (no hook of its module holds it)
  is accessed as a moment of its own, labelled ``fn:`` and its names, held for the call and
  released after it. Parameters their module holds cost a dictionary lookup;
- backward: autograd saves the parameters an operation needs, and the saved-tensor hooks of the
  meter (activations.py) report them when backward unpacks them. A chunk not in use is then
  accessed as an ``unpack:`` moment and held until the next module moment or the end of
  backward, because the operation reads it after every one of its saved tensors was unpacked,
  and fetching another of them must not evict it.

Both kinds of moment are recorded like hook moments, in the order the iteration makes them,
which does not depend on residency (a use is a moment whether or not the chunk is on the device),
so the trace of an iteration stays the same from one iteration to the next.

Watching every torch call costs a Python call each (about 8% of the demo's step on a CPU), so
with ``chunk.functional_uses = "auto"`` the engine watches the first forward and afterwards only
while the last training iteration's trace has ``fn:`` moments. A use that first appears later,
on a chunk that is off the device, then fails inside torch (a storage of size 0); the engine
names the cause and the setting (``"always"``) in the error it raises instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.overrides import TorchFunctionMode

from tidal.memory.store import ChunkStore

__all__ = ["FunctionalUses"]


class FunctionalUses(TorchFunctionMode):
    """Fetch the idle parameters a torch function receives; see [Note: functional uses]."""

    def __init__(self, store: ChunkStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        idle = self.store.idle_params(args, kwargs)
        if not idle:
            return func(*args, **kwargs)
        self.store.access("fn:" + ",".join(self.store.names_of(idle)), idle)
        try:
            return func(*args, **kwargs)
        finally:
            self.store.release(idle)
