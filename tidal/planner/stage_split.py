"""Where a pipeline's stages cut a model with one repeated block: Megatron's even split, or the
first and last stage with block counts of their own.

[Note: stage splits]
A pipelined option of ``p`` stages gives the first stage ``k_1`` blocks and what comes before the
blocks (the embeddings), the last ``k_p`` blocks and what comes after (the final norm, the head,
the loss), and each middle stage ``k`` blocks: ``k_1 + (p - 2) k + k_p = L``, every count at
least 1 (Megatron-LM's shape: ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-
pipeline-num-layers``). Three splits are searched (``PlannerConfig.stage_splits``):

- ``even``: ``L / p`` blocks a stage where ``p`` divides ``L`` (Megatron's default);
- ``time``: the least bottleneck ``max_s (F_s + B_s)``, ties to the least largest stage: the
  head and loss cost blocks' worth of time (GPT-3 1.3B's head is two blocks of work), so the
  last stage takes fewer blocks;
- ``memory``: the least largest stage, ties to the least bottleneck: the first stage, with the
  most micro-batches in flight and the embeddings, takes fewer blocks.

Each is chosen over every ``(k_1, k, k_p)`` with the units priced on one device with nothing
recomputed: time by the cost model's roofline (``max(flops / rate, bytes / bandwidth)``, the
backward twice the forward), memory as tidal/pipeline/partition.py prices a stage, ``(param +
grad + optimizer bytes) * params + in_flight * saved bytes``, with ``p - s`` micro-batches in
flight on stage ``s`` (1F1B with ``m >= p``, PipeMare). A tensor or data axis scales every unit
alike, so one split serves every mesh of the stage's devices; the stages' per-unit ILPs then
choose recompute, ZeRO, offload and layouts on it.

Why this shape and not the partitioner's free splits: a split is priced by an ILP per distinct
stage. Here the middle stages are alike but for their micro-batches in flight, so three ILPs
price every stage: the first, the last, and the second (the middle stage holding the most), which
bounds the other middle ones. Where ``k <= k_1`` the first bounds the middle stages ([Note:
pipeline stages] in pipelines.py) and two do. A free split would need up to ``p``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidal.planner.cluster import ClusterSpec
from tidal.planner.graph import ModelGraph, Unit
from tidal.planner.strategies import TrainingSpec

__all__ = ["SPLITS", "StageSplit", "repeated_block", "stage_splits"]

SPLITS = ("even", "time", "memory")


@dataclass(frozen=True, slots=True)
class StageSplit:
    """Blocks a stage, first to last, and the split that chose them (one of SPLITS)."""

    kind: str
    blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.kind in SPLITS and len(self.blocks) >= 2 and min(self.blocks) >= 1, self

    @property
    def first(self) -> int:
        return self.blocks[0]

    @property
    def last(self) -> int:
        return self.blocks[-1]

    @property
    def middle(self) -> int:
        """The most blocks a middle stage holds (0: two stages)."""
        return max(self.blocks[1:-1], default=0)

    @property
    def is_even(self) -> bool:
        return len(set(self.blocks)) == 1

    @property
    def needs_middle(self) -> bool:
        """Whether a middle stage holds more blocks than the first ([Note: stage splits])."""
        return self.middle > self.first

    def describe(self) -> str:
        """The blocks a stage in runs: ``"3, 4 x 6, 1"``."""
        runs: list[list[int]] = []
        for k in self.blocks:
            if runs and runs[-1][0] == k:
                runs[-1][1] += 1
            else:
                runs.append([k, 1])
        return ", ".join(f"{k} x {n}" if n > 1 else str(k) for k, n in runs)


def repeated_block(graph: ModelGraph) -> tuple[str, int] | None:
    """The model's repeated block and its count, when it has exactly one."""
    if len(graph.blocks) != 1:
        return None
    ((prefix, count),) = graph.blocks.items()
    return (prefix, count) if count >= 2 else None


def stage_splits(graph: ModelGraph, p: int, *, kinds: Sequence[str], spec: TrainingSpec,
                 cluster: ClusterSpec) -> list[StageSplit]:  # fmt: skip
    """The splits ``kinds`` name of the model's blocks into ``p`` stages, each once (a split two
    kinds agree on under the first's name); see [Note: stage splits]."""
    found = repeated_block(graph)
    assert found is not None, "stage splits need a model with one repeated block"
    prefix, count = found
    if p > count:
        return []
    priced = _Priced.of(graph, prefix, count, spec, cluster)
    shaped = [(priced.time_s(b, p), priced.peak_bytes(b, p), b) for b in _shapes(count, p)]
    splits: dict[tuple[int, ...], StageSplit] = {}
    for kind in kinds:
        if kind == "even":
            blocks = (count // p,) * p if count % p == 0 else None
        elif kind == "time":
            blocks = min(shaped)[2]
        else:
            blocks = min(shaped, key=lambda x: (x[1], x[0], x[2]))[2]
        if blocks is not None and blocks not in splits:
            splits[blocks] = StageSplit(kind=kind, blocks=blocks)
    return list(splits.values())


def _shapes(count: int, p: int) -> list[tuple[int, ...]]:
    """Every ``(k_1, k x (p - 2), k_p)`` of ``count`` blocks, each at least 1."""
    shapes = []
    for k in range(1, count + 1) if p > 2 else (0,):
        for first in range(1, count - (p - 2) * k):
            last = count - first - (p - 2) * k
            shapes.append((first, *(k,) * (p - 2), last))
    return shapes


@dataclass(frozen=True, slots=True)
class _Priced:
    """A block's, the embeddings' and the head's figures ([Note: stage splits])."""

    block: tuple[float, float, float]  # (forward + backward s, model data bytes, saved bytes)
    before: tuple[float, float, float]
    after: tuple[float, float, float]

    @classmethod
    def of(cls, graph: ModelGraph, prefix: str, count: int, spec: TrainingSpec,
           cluster: ClusterSpec) -> _Priced:  # fmt: skip
        inside = [i for i, u in enumerate(graph.units) if graph.block_of(u) == prefix]
        rate = cluster.peak_flops * cluster.flops_efficiency
        bandwidth = cluster.memory_bandwidth * cluster.bandwidth_efficiency
        per_param = spec.param_bytes + spec.grad_bytes + spec.optimizer_bytes

        def figures(units: list[Unit], share: float) -> tuple[float, float, float]:
            forward_s = sum(share * u.count * max(u.flops / rate, u.io_bytes / bandwidth)
                            for u in units)  # fmt: skip
            # a weight tied across the ends is a copy on each stage ([Note: pipeline stages])
            params = sum(share * u.count * math.prod(q.shape) for u in units for q in u.params)
            saved = sum(share * u.count * u.saved_bytes for u in units)
            return 3 * forward_s, params * per_param, saved

        return cls(block=figures([graph.units[i] for i in inside], 1 / count),
                   before=figures(graph.units[: inside[0]], 1.0),
                   after=figures(graph.units[inside[-1] + 1 :], 1.0))  # fmt: skip

    def _stages(self, blocks: tuple[int, ...]) -> list[tuple[float, float, float]]:
        """Each stage's (forward + backward s, model data bytes, saved bytes)."""
        ends = {0: self.before, len(blocks) - 1: self.after}
        stages = []
        for s, k in enumerate(blocks):
            (t, data, saved), (te, de, se) = self.block, ends.get(s, (0.0, 0.0, 0.0))
            stages.append((k * t + te, k * data + de, k * saved + se))
        return stages

    def time_s(self, blocks: tuple[int, ...], p: int) -> float:
        return max(t for t, _, _ in self._stages(blocks))

    def peak_bytes(self, blocks: tuple[int, ...], p: int) -> float:
        return max(data + (p - s) * saved
                   for s, (_, data, saved) in enumerate(self._stages(blocks)))  # fmt: skip
