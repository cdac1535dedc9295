"""Deferred construction: parameter values streamed into chunks, one parameter at a time.

[Note: deferred construction]
A model larger than host memory cannot be built whole before its chunks are made: every rank
would first hold all of it. So the chunk engines accept a model built on the meta device
(shapes only) together with an *init source*: a function that returns a fresh iterable of
``(name, value)``, every parameter once (a tied one under any of its names), each value a
full-size CPU tensor made when asked for. The stores and the master builders consume it chunk by
chunk (:func:`feed_chunks`): a chunk's buffer (or this rank's shard of it) is allocated when its
first value arrives, each value is copied into its slot (a rank copies only the range its shard
covers) and dropped, and a chunk that has all its values is finished (a shard on the NVMe tier
is written there and leaves host memory). So a rank holds one parameter value plus the chunks
still being filled, not the model. Sources are called once per consumer (the bf16 masters and
the parameter chunks each take one pass) and must give the same values every time. A model
that is already materialized is its own source (:func:`values_of`), so both paths are one.

Parameters are then re-pointed at their chunk's device buffer: ``param.data = view`` for a
materialized parameter; a meta one cannot change device that way, so its tensor is swapped
(``torch.utils.swap_tensors``), which keeps the Parameter object: ids, ties and hooks stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tidal.memory.layout import ChunkLayout

__all__ = [
    "ParameterValues",
    "check_buffers",
    "feed_chunks",
    "materialize",
    "meta_parameters",
    "repoint",
    "values_of",
]

# A fresh iterable of (parameter name, full value) per call; see [Note: deferred construction].
ParameterValues = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def values_of(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A materialized model's own parameters as a source (tied ones once)."""
    for name, param in model.named_parameters():
        yield name, param.detach()


def meta_parameters(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.is_meta]


def feed_chunks(
    layout: ChunkLayout,
    values: Iterable[tuple[str, torch.Tensor]],
    *,
    write: Callable[[int, int, torch.Tensor], None],
    begin: Callable[[int], None] = lambda index: None,
    end: Callable[[int], None] = lambda index: None,
) -> None:
    """Give every value to ``write(chunk index, slot, value)``, calling ``begin(index)`` before
    a chunk's first value and ``end(index)`` once it has all of them; every parameter of the
    layout must come exactly once."""
    where = {name: (spec.index, slot) for spec in layout.chunks
             for slot, info in enumerate(spec.slots) for name in info.names}  # fmt: skip
    remaining = {spec.index: len(spec.slots) for spec in layout.chunks}
    done: set[tuple[int, int]] = set()
    for name, value in values:
        if name not in where:
            raise ValueError(
                f"the init source gave {name!r}, which is not a parameter of the model"
            )
        index, slot = where[name]
        if (index, slot) in done:
            raise ValueError(f"the init source gave {name!r} (or a name tied to it) twice")
        info = layout.chunks[index].slots[slot]
        if value.numel() != info.numel:
            raise ValueError(
                f"the init source gave {name!r} {value.numel():,} elements; the parameter has "
                f"{info.numel:,} ({tuple(info.shape)})"
            )
        if remaining[index] == len(layout.chunks[index].slots):
            begin(index)
        done.add((index, slot))
        write(index, slot, value)
        remaining[index] -= 1
        if remaining[index] == 0:
            end(index)
    missing = [spec.slots[slot].names[0] for spec in layout.chunks
               for slot in range(len(spec.slots)) if (spec.index, slot) not in done]  # fmt: skip
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"the init source gave no value for {', '.join(missing[:3])}{more}")


def repoint(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` a view of ``view``'s storage, keeping the Parameter object (and its
    class: a chunked parameter refuses ``.data = ...`` from anyone else)."""
    if param.is_meta:
        cls = type(param)
        torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
        param.__class__ = cls
    else:
        with torch._C.DisableTorchFunctionSubclass():
            param.data = view


def materialize(model: nn.Module, values: ParameterValues, device: torch.device) -> None:
    """Give a meta model's parameters storage on ``device`` and the source's values (engines
    that keep the whole model in one place: the reference engine)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unset = {id(p): name for name, p in params.items() if p.is_meta}
    for param in {id(p): p for p in params.values()}.values():
        if param.is_meta:
            repoint(param, torch.empty(param.shape, dtype=param.dtype, device=device))
    with torch.no_grad():
        for name, value in values():
            if name not in params:
                raise ValueError(f"the init source gave {name!r}, which is not a parameter")
            params[name].copy_(value)
            unset.pop(id(params[name]), None)
    if unset:
        raise ValueError(f"the init source gave no value for {', '.join(list(unset.values())[:3])}")


def check_buffers(model: nn.Module) -> None:
    """Buffers are not streamed: a deferred model must have them materialized already."""
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise ValueError(
            f"buffers on the meta device ({', '.join(meta[:3])}): deferred construction streams "
            f"parameters only; materialize the buffers before tidal.initialize (e.g. build them "
            f"outside the meta-device context)"
        )
