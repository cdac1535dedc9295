"""What the machine offers: the training device, memory readings per tier, peak FLOP/s."""

from __future__ import annotations

import resource
import sys
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
    """The peak that MFU divides by: the user's figure, a GPU's datasheet, or a CPU estimate."""
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
        return _estimate_cpu_peak(torch.bfloat16 if precision == "bf16" else torch.float32)
    return None


# FLOPs per cycle per core of the widest vector FMA a CPU reports, assuming two FMA units (an
# upper bound: some parts have one, or split 512-bit work in two), so CPU MFU is a lower bound.
_CPU_FP32_FLOPS_PER_CYCLE = (("avx512f", 64), ("avx2", 32), ("sse2", 16))


def _cpu_flags_and_ghz() -> tuple[set[str], float | None]:
    flags: set[str] = set()
    mhz: float | None = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "cpu MHz":
                    mhz = max(mhz or 0.0, float(value))
    except OSError:
        pass
    try:  # the rated maximum clock, where the kernel exposes it, beats the current one
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz = max(mhz or 0.0, int(f.read()) / 1000)
    except (OSError, ValueError):
        pass
    return flags, (mhz / 1000 if mhz else None)


def _estimate_cpu_peak(dtype: torch.dtype) -> PeakFlops | None:
    # A noisy virtual CPU makes a start-up measurement swing by 2x between runs; a figure from
    # the ISA and clock is stable and, like a GPU datasheet, an upper bound.
    flags, ghz = _cpu_flags_and_ghz()
    if ghz is None:
        return None
    isa, per_cycle = next(
        ((name, n) for name, n in _CPU_FP32_FLOPS_PER_CYCLE if name in flags), ("scalar", 2)
    )
    kind = "fp32"
    if dtype == torch.bfloat16 and "avx512_bf16" in flags:
        per_cycle, isa, kind = 2 * per_cycle, "avx512_bf16", "bf16"
    threads = torch.get_num_threads()
    tflops = threads * ghz * 1e9 * per_cycle / 1e12
    source = (
        f"estimated CPU peak: {threads} threads x {ghz:.2f} GHz x {per_cycle} {kind} "
        f"FLOP/cycle ({isa}, two FMA units assumed)"
    )
    return PeakFlops(tflops=tflops, source=source)
