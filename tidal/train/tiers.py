"""What a step record says about a rank's chunk tiers: one definition for the chunk engine and
for chunk stages.

[Note: tier figures]
A record's ``tiers`` describe this rank's chunk stores after the step: the device budget, the
least the step's last iteration needed there and the activations in it, the device, host and
NVMe peaks so far, the bytes moved to and from the device this step and, sharded (ZeRO-3), the
bytes all-gathered and reduce-scattered this step. A rank holding several stores (pipeline
stages, one store each) reports their sums: budgets and needs add up, and a sum of peaks bounds
the rank's peak from above (the stores' peaks need not coincide).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CHUNK_FIGURES", "StepTiers"]

# A chunk store's traffic and residency figures a run's summary gives (a sharded one's: rank
# 0's), the NVMe tier's.
CHUNK_FIGURES = (
    "bytes_to_device", "bytes_to_host", "evictions", "device_budget", "peak_device_bytes",
    "peak_non_model_bytes", "min_device_bytes", "chunk_size", "largest_chunk_elements",
    "num_chunks", "host_budget", "peak_host_bytes", "bytes_all_gathered", "bytes_reduce_scattered", "bytes_to_nvme",
    "bytes_from_nvme", "peak_nvme_bytes", "chunks_on_nvme", "param_shards_on_nvme",
)  # fmt: skip

_COUNTERS = ("bytes_to_device", "bytes_to_host", "bytes_all_gathered", "bytes_reduce_scattered")


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


class StepTiers:
    """[Note: tier figures] from the chunk stores' ``stats()``, step after step."""

    def __init__(self) -> None:
        self._moved_before: dict[str, int] = {}  # the traffic counters after the last step

    def __call__(self, stores: Sequence[dict[str, Any]]) -> dict[str, int | None]:
        stores = [stats for stats in stores if "bytes_to_device" in stats]
        if not stores:
            return {}
        totals = {key: sum(stats[key] for stats in stores)
                  for key in _COUNTERS if key in stores[0]}  # fmt: skip
        moved = {key: value - self._moved_before.get(key, 0) for key, value in totals.items()}
        self._moved_before = totals

        def total(key: str) -> int | None:
            return _sum([stats.get(key) for stats in stores])

        figures: dict[str, int | None] = {
            "device_budget_bytes": total("device_budget"),
            "device_need_bytes": total("min_device_bytes_last_trace"),
            "activations_bytes": total("non_model_bytes_last_trace"),
            "device_peak_bytes": total("peak_device_bytes"),
            "host_peak_bytes": total("peak_host_bytes"),
            "nvme_peak_bytes": total("peak_nvme_bytes"),
            "to_device_bytes": moved["bytes_to_device"],
            "to_host_bytes": moved["bytes_to_host"],
        }
        if "bytes_all_gathered" in moved:
            figures["gathered_bytes"] = moved["bytes_all_gathered"]
            figures["reduce_scattered_bytes"] = moved["bytes_reduce_scattered"]
        return figures
