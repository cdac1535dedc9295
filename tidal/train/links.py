"""The links the saver planner prices, measured on the run's ranks before the first step.

[Note: measured links]
- host: each rank copies ``LINK_PROBE_BYTES`` from its device into memory of the host tier's kind
  (pinned on CUDA) and back, synchronised, once to warm up and once timed;
- peer: each rank sends as many bytes to the next rank of the pipeline group and receives from
  the previous one (a ring of ``isend`` / ``recv``), once to warm up and once timed;
- every rank then takes the slowest rank's seconds (an all-reduce of the maximum), so all ranks
  plan with the same numbers and make the same plan.
The ring times neighbours only; other pairs are taken to be alike (one machine's loopback, or
GPUs joined by a switch). Outside a process group there is no peer (0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["LINK_PROBE_BYTES", "Links", "measure_links"]

LINK_PROBE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Links:
    """Bytes per second each way: to the host and back, and to a peer rank."""

    host_bytes_per_s: float
    peer_bytes_per_s: float


def measure_links(device: torch.device, *, num_bytes: int = LINK_PROBE_BYTES) -> Links:
    """[Note: measured links]; collective over the default group when there is one."""
    host_s = _host_seconds(device, num_bytes)
    peer_s = 0.0
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if grouped:
        peer_s = _ring_seconds(device, num_bytes)
        on = device if dist.get_backend() == "nccl" else torch.device("cpu")
        slowest = torch.tensor([host_s, peer_s], dtype=torch.float64, device=on)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        host_s, peer_s = (float(x) for x in slowest.cpu())
    return Links(host_bytes_per_s=2 * num_bytes / max(host_s, 1e-9),
                 peer_bytes_per_s=num_bytes / peer_s if grouped and peer_s > 0 else 0.0)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_seconds(device: torch.device, num_bytes: int) -> float:
    on_device = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    seconds = 0.0
    for _ in range(2):  # the first warms up
        _sync(device)
        start = time.perf_counter()
        host.copy_(on_device, non_blocking=True)
        on_device.copy_(host, non_blocking=True)
        _sync(device)
        seconds = time.perf_counter() - start
    return seconds


def _ring_seconds(device: torch.device, num_bytes: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    out = torch.ones(num_bytes, dtype=torch.uint8, device=on)
    back = torch.empty(num_bytes, dtype=torch.uint8, device=on)
    seconds = 0.0
    for _ in range(2):
        _sync(device)
        start = time.perf_counter()
        work = dist.isend(out, dst=(rank + 1) % world)
        dist.recv(back, src=(rank - 1) % world)
        if work is not None:
            work.wait()
        _sync(device)
        seconds = time.perf_counter() - start
    return seconds
