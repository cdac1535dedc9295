"""Per-layer profiles for the pipeline partitioner: ``embed, blocks.0, ..., head`` of a model.

Analytic profiles come from the planner's meta-device trace (:func:`tidal.planner.measure.measure`:
FLOPs, bytes moved and saved activations per unit, nothing allocated) at H100-like achieved
rates; measured ones time each unit as a one-unit stage on the model's device. They live in the
planner because the pipeline layer sits below it: :mod:`tidal.pipeline.partition` takes plain
:class:`~tidal.pipeline.partition.LayerProfile` values and never traces anything itself.

The planner builds and recognises no model: :func:`profile_model` takes a built one and its
:class:`~tidal.pipeline.split.StageParts` (what a model's ``ModelSpec`` gives), and traces a meta
twin of it; a model that returns logits rather than its loss is traced with a cross-entropy
added after it, so every profile's ``head`` holds a loss.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import require
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.split import StageParts, split_parts
from tidal.planner.cluster import ClusterSpec
from tidal.planner.measure import ModelGraph
from tidal.planner.measure import measure as trace_model
from tidal.planner.wiring import meta_twin, takes_targets

__all__ = ["DEFAULT_FLOPS_PER_S", "DEFAULT_MEMORY_BYTES_PER_S", "profile_model"]

_H100 = ClusterSpec(devices=1)
# Achieved, not peak: the planner's H100 defaults times their efficiencies.
DEFAULT_FLOPS_PER_S = _H100.peak_flops * _H100.flops_efficiency
DEFAULT_MEMORY_BYTES_PER_S = _H100.memory_bandwidth * _H100.bandwidth_efficiency
# Backward computes the input and the weight gradient, each about one forward's work.
_BACKWARD_PER_FORWARD = 2.0

# ---------------------------------------------------------------------------------------------
# profiles


def _block_of(module: str, container: str) -> int | str | None:
    """``"*"`` for a unit of every (clustered) block, ``i`` for block ``i``, ``None`` outside."""
    if not module.startswith(container + "."):
        return None
    head = re.split(r"[.\[]", module[len(container) + 1 :], maxsplit=1)[0]
    if head == "*":
        return "*"
    return int(head) if head.isdigit() else None


@dataclass(slots=True)
class _Layer:
    time_s: float = 0.0
    param_bytes: int = 0
    activation_bytes: float = 0.0


def _graph_profiles(
    graph: ModelGraph,
    container: str,
    num_blocks_: int,
    *,
    flops_per_s: float,
    memory_bytes_per_s: float,
) -> list[LayerProfile]:
    """Units of a traced model summed into ``embed``, ``blocks.i`` and ``head``: units before
    the first block are the embedding's, after the blocks the head's (final norm, LM head, loss).
    A unit's forward time is its roofline ``max(FLOPs / flops_per_s, bytes / memory_bytes_per_s)``.
    """
    layers = {"embed": _Layer(), **{f"blocks.{i}": _Layer() for i in range(num_blocks_)}}
    layers["head"] = _Layer()
    layer_of_unit: dict[str, list[str]] = {}
    seen_block = False
    for unit in graph.units:
        index = _block_of(unit.module, container)
        if index is None:
            names = ["head" if seen_block else "embed"]
        else:
            seen_block = True
            names = (
                [f"blocks.{i}" for i in range(num_blocks_)] if index == "*" else [f"blocks.{index}"]
            )
        layer_of_unit[unit.name] = names
        time_s = max(unit.flops / flops_per_s, unit.io_bytes / memory_bytes_per_s)
        for p in unit.params:
            # A weight tied to another layer's (embedding and head) is held there and here.
            if p.tied_to is not None and layer_of_unit.get(p.tied_to) == names:
                continue
            for name in names:
                layers[name].param_bytes += p.nbytes
        for name in names:
            layers[name].time_s += time_s
            layers[name].activation_bytes += unit.saved_bytes
    return [
        LayerProfile(
            name=name,
            forward_s=layer.time_s,
            backward_s=_BACKWARD_PER_FORWARD * layer.time_s,
            param_bytes=layer.param_bytes,
            activation_bytes=math.ceil(layer.activation_bytes),
        )
        for name, layer in layers.items()
    ]


def _require_rates(flops_per_s: float, memory_bytes_per_s: float) -> None:
    require(flops_per_s > 0, "flops_per_s", f"must be > 0, got {flops_per_s}")
    require(memory_bytes_per_s > 0, "memory_bytes_per_s", f"must be > 0, got {memory_bytes_per_s}")


class _LogitsLoss(nn.Module):
    """A model returning logits (a Hugging Face causal LM: ``.logits``) as ``(ids, targets) ->
    loss``, the call the tracer makes: the fp32 mean cross-entropy of
    [Note: loss convention] in tidal/pipeline/split.py."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        out = self.inner(idx_BT)
        logits_BTV = getattr(out, "logits", out)
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())


def _traced(model: nn.Module, container: str) -> tuple[nn.Module, str]:
    """A meta twin of ``model`` that returns its loss, and where its blocks are in it."""
    twin = meta_twin(model)
    if takes_targets(twin):
        return twin, container
    return _LogitsLoss(twin), f"inner.{container}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _token_ids(parts: StageParts, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Random ids below the vocabulary of the embedding's first (token) table."""
    assert parts.embed is not None, "a decoder's stage parts have an embedding"
    table = next(m for m in parts.embed.modules() if isinstance(m, nn.Embedding))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, table.num_embeddings, shape, generator=generator).to(device)


def _measured_times(
    model: nn.Module, parts: StageParts, *, micro_batch: int, seq_len: int, repeats: int
) -> list[tuple[float, float]]:
    """Median forward and backward seconds of each unit, run as a one-unit stage on the model's
    device (one warm-up, then ``repeats`` timed runs). Copies the model once."""
    num = len(parts.blocks)
    units = split_parts(model, parts, [(0, 0), *((i, i + 1) for i in range(num)), (num, num)])
    device = next(model.parameters()).device
    idx_BT = _token_ids(parts, (micro_batch, seq_len), device)
    inputs = [idx_BT]
    with torch.no_grad():
        for stage in units[:-1]:
            inputs.append(stage(inputs[-1]))
    times = []
    for stage, x in zip(units, inputs, strict=True):
        forward_s, backward_s = [], []
        for _ in range(1 + repeats):
            x_in = x if stage.is_first else x.detach().requires_grad_(True)
            _sync(device)
            start = time.perf_counter()
            out = stage(x_in, idx_BT) if stage.is_last else stage(x_in)
            _sync(device)
            middle = time.perf_counter()
            out.backward(None if stage.is_last else torch.ones_like(out))
            _sync(device)
            forward_s.append(middle - start)
            backward_s.append(time.perf_counter() - middle)
        times.append((statistics.median(forward_s[1:]), statistics.median(backward_s[1:])))
    return times


def profile_model(
    model: nn.Module,
    *,
    parts: StageParts,
    micro_batch: int,
    seq_len: int,
    measure: bool = False,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    memory_bytes_per_s: float = DEFAULT_MEMORY_BYTES_PER_S,
    repeats: int = 3,
) -> list[LayerProfile]:
    """Profiles ``embed, blocks.0, ..., head`` of ``model``, whose stage parts are ``parts``,
    for one microbatch of ``micro_batch`` sequences of ``seq_len`` tokens.

    Bytes (weights, activations) always come from a meta-device trace of a twin of ``model`` in
    its dtype (on any device; nothing is allocated); times too, unless ``measure=True``: then
    each unit's forward and backward are timed on the model's own device (slow on CPU: meant for
    small models there).
    """
    require(micro_batch >= 1, "micro_batch", f"must be >= 1, got {micro_batch}")
    require(seq_len >= 1, "seq_len", f"must be >= 1, got {seq_len}")
    require(repeats >= 1, "repeats", f"must be >= 1, got {repeats}")
    _require_rates(flops_per_s, memory_bytes_per_s)
    twin, container = _traced(model, parts.container)
    idx = torch.empty((micro_batch, seq_len), dtype=torch.long, device="meta")
    graph = trace_model(twin, (idx, idx), name=type(model).__name__)
    profiles = _graph_profiles(
        graph,
        container,
        len(parts.blocks),
        flops_per_s=flops_per_s,
        memory_bytes_per_s=memory_bytes_per_s,
    )
    if not measure:
        return profiles
    times = _measured_times(model, parts, micro_batch=micro_batch, seq_len=seq_len, repeats=repeats)
    return [
        dataclasses.replace(p, forward_s=f, backward_s=b)
        for p, (f, b) in zip(profiles, times, strict=True)
    ]
