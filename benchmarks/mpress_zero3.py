"""ZeRO-3 at the same per-GPU memory, beside the pipeline strategies of ``tidal bench mpress``'s
predicted section (benchmarks/mpress.py).

[Note: ZeRO-3 in the predicted table]
ZeRO-3 has no pipeline, so the simulator does not price it: the planner's cost model does
(``tidal.planner.baselines``), on the same family's traced graph at the same device rates (the
layer profiles the pipelines are priced from are computed at the planner's H100 figures, so a
block's forward and backward cost the same seconds in both), on the same server: one GPU per
stage, each with the same memory, the host link shared by each pair of GPUs (``--host-gbps`` /
2 a GPU when all copy at once), NVSwitch at ``--peer-gbps`` between any two. Data parallel over
every GPU on the sequences the pipeline trains in a step (``--microbatches`` x the micro-batch),
split evenly; each GPU runs its share as micro-batches of any size that divides it (gradient
accumulation, the weights gathered again for each). Two rows, each the best of the settings
DeepSpeed's docs give for large models:

- ``zero3``: model data on the GPUs, with no recompute or with full recompute (activation
  checkpointing);
- ``zero3-offload``: full recompute, with the optimizer state updated on the host
  (ZeRO-Offload), or the parameters, gradients and optimizer state kept there too (FSDP2's
  ``CPUOffloadPolicy``, DeepSpeed's ``offload_param``; tidal's chunk engine with every chunk
  allowed off the GPU), within the host's memory (``ClusterSpec``'s 2 TiB a node).

A row's largest model is the most blocks any of its settings fits (the planner's peak within
``--device-memory``); its step at recompute-only's largest model is the fastest setting that
fits there, for the sequences the schedule's simulated span trains (1F1B: one step; PipeDream:
the three steps it is simulated over), so each is compared with the pipeline on equal work.
The planner prices ZeRO's gathers, reductions and host copies after the compute they feed, not
beside it; DeepSpeed and FSDP2 prefetch the next gather while a layer computes, so the real step
lies between that and the same setting on links that cost nothing (``step_s_floor``: compute,
recompute and, offloaded, the host's Adam), which the rows record too.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tidal.models.gpt import GPTConfig, measure_gpt

if TYPE_CHECKING:  # the planner (scipy) loads when ZeRO-3 is priced, not when the CLI starts
    from tidal.planner.baselines import Baseline
    from tidal.planner.cluster import ClusterSpec
    from tidal.planner.graph import ModelGraph
    from tidal.planner.strategies import TrainingSpec

__all__ = ["ZERO3_ROWS", "Zero3Pricer", "Zero3Setting"]

# a row: the planner baselines it is the best of ([Note: ZeRO-3 in the predicted table])
ZERO3_ROWS = {"zero3": ("zero3", "zero3_full"),
              "zero3-offload": ("zero3_offload", "fsdp2_cpu_offload")}  # fmt: skip
_FREE = 1e30  # bytes/s of a link that costs nothing


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Setting:
    """One ZeRO-3 setting priced at one model size; seconds per step of the pipeline's
    sequences."""

    variant: str  # the planner baseline's name
    micro_batch: int  # sequences a GPU runs at once
    accumulation: int  # micro-batches a GPU runs a step
    peak_bytes: float
    step_s: float  # the planner's price: collectives and copies after the compute
    step_s_floor: float  # the same on links that cost nothing

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _price(variant: str, model: ModelGraph, cluster: ClusterSpec,
           spec: TrainingSpec) -> Baseline | None:  # fmt: skip
    """Baseline ``variant`` on one data-parallel mesh over every GPU (no tensor parallelism)."""
    from tidal.planner.baselines import baseline

    return baseline(variant, model, cluster, lambda mesh: spec, 1)


class Zero3Pricer:
    """Prices ZeRO-3's settings for one family on ``gpus`` GPUs of ``device_memory_bytes``."""

    def __init__(self, config: GPTConfig, *, sequences_per_step: int, gpus: int,
                 device_memory_bytes: int, host_gbps: float, peer_gbps: float) -> None:  # fmt: skip
        if sequences_per_step % gpus:
            raise ValueError(f"ZeRO-3 splits a step's {sequences_per_step} sequences over "
                             f"{gpus} GPUs: make --microbatches x the micro-batch a multiple "
                             f"of --stages")  # fmt: skip
        from tidal.planner.cluster import ClusterSpec

        per_gpu = sequences_per_step // gpus
        two_blocks = dataclasses.replace(config, num_layers=2)  # the block it repeats
        self._graphs: dict[int, ModelGraph] = {
            size: measure_gpt(two_blocks, micro_batch=size)
            for size in range(1, per_gpu + 1) if per_gpu % size == 0
        }  # fmt: skip
        self._per_gpu = per_gpu
        self.cluster = ClusterSpec(devices=gpus, devices_per_node=gpus,
                                   device_memory_bytes=device_memory_bytes,
                                   host_link_bandwidth=host_gbps * 1e9 / 2,
                                   intra_node_bandwidth=peer_gbps * 1e9)  # fmt: skip
        self._free = dataclasses.replace(self.cluster, host_link_bandwidth=_FREE,
                                         intra_node_bandwidth=_FREE, intra_node_latency_s=0.0)  # fmt: skip

    def fitting(self, row: str, layers: int) -> list[Zero3Setting]:
        """Every setting of ``row`` that fits ``layers`` blocks."""
        from tidal.planner.pipelines import stage_graph
        from tidal.planner.strategies import TrainingSpec

        found = []
        for size, graph in self._graphs.items():
            model = stage_graph(graph, blocks=layers, first=True, last=True)
            spec = TrainingSpec(num_microbatches=self._per_gpu // size)
            for variant in ZERO3_ROWS[row]:
                priced = _price(variant, model, self.cluster, spec)
                if priced is None or priced.peak_memory_bytes > self.cluster.device_memory_bytes:
                    continue
                floor = _price(variant, model, self._free, spec)
                assert floor is not None  # the same setting, links aside
                found.append(Zero3Setting(variant=variant, micro_batch=size,
                                          accumulation=self._per_gpu // size,
                                          peak_bytes=priced.peak_memory_bytes,
                                          step_s=priced.step_time_s,
                                          step_s_floor=floor.step_time_s))  # fmt: skip
        return found

    def fastest(self, row: str, layers: int) -> Zero3Setting | None:
        return min(self.fitting(row, layers), key=lambda s: s.step_s, default=None)

    def largest(self, row: str, *, step_layers: int, max_layers: int) -> int:
        """The most blocks (a multiple of ``step_layers``, at most ``max_layers``) a setting of
        ``row`` fits; 0 if none. More blocks never need less memory, so a bisection finds it."""

        def fits(steps: int) -> bool:
            return bool(self.fitting(row, steps * step_layers))

        low, high = 0, max_layers // step_layers
        if fits(high):
            return high * step_layers
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low * step_layers
