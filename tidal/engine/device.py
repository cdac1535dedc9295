"""What the machine offers: the training device, memory readings per tier, peak FLOP/s."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

from tidal.config import ConfigError

__all__ = [
    "PeakFlops",
    "device_description",
    "memory_bytes",
    "peak_flops",
    "peak_memory_bytes",
    "reset_peak_memory",
    "resolve_device",
]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; a CUDA request on a machine without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "training.device",
            f"{name!r} asked for, but torch sees no CUDA device; use 'cpu' or 'auto'",
        )
    return device


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# [Note: memory tiers in metrics]
# Figures are reported per tier: "device" is the accelerator's allocator (CUDA), "host" is the
# process's resident set. Training on a CPU has no separate device tier, so only "host" appears.
# The host peak comes from getrusage and cannot be reset within a process; the device peak is
# the allocator's and is reset at the start of a run.


def _host_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        return _host_peak_rss_bytes()


def _host_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_bytes(device: torch.device) -> dict[str, int]:
    """Bytes in use now, per tier (see [Note: memory tiers in metrics])."""
    out = {"host": _host_rss_bytes()}
    if device.type == "cuda":
        out["device"] = torch.cuda.memory_allocated(device)
    return out


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak bytes per tier since the last reset (see [Note: memory tiers in metrics])."""
    out = {"host": _host_peak_rss_bytes()}
    if device.type == "cuda":
        out["device"] = torch.cuda.max_memory_allocated(device)
    return out


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(kw_only=True, frozen=True, slots=True)
class PeakFlops:
    tflops: float
    source: str


# Dense peak TFLOP/s with bf16 inputs, from the vendors' datasheets (no sparsity).
_GPU_BF16_DENSE_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "RTX 4090": 165.0,
}


def peak_flops(
    device: torch.device, precision: str, override_tflops: float | None = None
) -> PeakFlops | None:
    """The peak that MFU divides by: the user's figure, a GPU's datasheet, or a CPU measurement."""
    if override_tflops is not None:
        return PeakFlops(tflops=override_tflops, source="metrics.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _GPU_BF16_DENSE_TFLOPS.items():
            if key in name:
                # fp32 runs use TF32 tensor cores at half the bf16 rate on these parts.
                factor = 1.0 if precision in ("bf16", "fp16") else 0.5
                return PeakFlops(tflops=tflops * factor, source=f"datasheet: {key} dense")
        return None
    if device.type == "cpu":
        return _measure_cpu_matmul(torch.bfloat16 if precision == "bf16" else torch.float32)
    return None


def _measure_cpu_matmul(dtype: torch.dtype, size: int = 1024, budget_s: float = 0.5) -> PeakFlops:
    # A CPU has no datasheet figure that torch reaches; the best square matmul this process can
    # do is the honest ceiling for a model made of matmuls.
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best_s = float("inf")
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - start)
    tflops = 2 * size**3 / best_s / 1e12
    name = str(dtype).removeprefix("torch.")
    return PeakFlops(tflops=tflops, source=f"measured: best {size}x{size} {name} matmul on CPU")
