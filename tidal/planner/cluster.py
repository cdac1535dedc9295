"""The cluster a plan is made for: devices, their speed and memory, and the links between them.

Communication is costed with the alpha-beta model of ring collectives: a message on ``n`` ranks
of ``B`` bytes (the whole, gathered tensor) takes ``(n - 1) * alpha + (n - 1) / n * B / bw`` for
an all-gather or a reduce-scatter, twice that for an all-reduce, and ``(n - 1) * alpha +
(n - 1) / n**2 * B / bw`` for an all-to-all. The tensor axis of the mesh lives inside a node
(its links are the node's); the data axis crosses nodes as soon as it has more ranks than a node
has left after the tensor axis, and then runs at the inter-node bandwidth per device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tidal.config.configurable import require

__all__ = ["Axis", "ClusterSpec", "Collective", "Mesh", "collective_s", "CLUSTER_PRESETS"]

GiB = 1024**3


class Collective(enum.StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


class Axis(enum.StrEnum):
    DATA = "dp"
    TENSOR = "tp"


@dataclass(kw_only=True, frozen=True, slots=True)
class ClusterSpec:
    """Devices and links. Defaults describe H100 SXM nodes of 8 (bf16 dense peak, NVLink 4
    ring bandwidth per device, one 400 Gb/s NIC per device)."""

    devices: int
    devices_per_node: int = 8
    device_memory_bytes: int = 80 * GiB
    peak_flops: float = 989e12
    memory_bandwidth: float = 3.35e12  # bytes/s
    # The achieved fractions of peak FLOP/s (in matmuls) and of memory bandwidth (in the
    # element-wise ops): figures of a device *and* the kernels run on it; see CLUSTER_PRESETS.
    flops_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.5
    intra_node_bandwidth: float = 300e9  # bytes/s per device in a ring
    inter_node_bandwidth: float = 50e9
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    # The host side, for model data offloaded there ([Note: model data offload] in
    # strategies.py): a DGX H100's 2 TB of memory per node, each device's own PCIe Gen5 x16
    # link (64 GB/s a direction, 50 achieved), and the rate at which the node's CPUs run Adam
    # over fp32 state (an assumption: memory-bound at about 16 bytes read and written a
    # parameter on a two-socket server; no published figure is checked here).
    host_memory_per_node_bytes: int = 2 * 1024 * GiB
    host_link_bandwidth: float = 50e9  # bytes/s per device, each direction
    host_adam_params_per_s: float = 2e9  # per node, all its CPUs
    # A disk for offloaded optimizer state ([Note: model data offload] in strategies.py): none
    # unless given (`tidal plan --nvme 30TB`: a DGX H100 has eight 3.84 TB drives), read and
    # written at ``nvme_bandwidth`` by the node's drives together (an assumption: a few GB/s a
    # drive in RAID 0; no published figure is checked here).
    nvme_bytes_per_node: int = 0
    nvme_bandwidth: float = 25e9  # bytes/s per node, each direction

    def __post_init__(self) -> None:
        require(self.devices >= 1, "devices", f"must be >= 1, got {self.devices}")
        require(
            self.devices_per_node >= 1,
            "devices_per_node",
            f"must be >= 1, got {self.devices_per_node}",
        )
        require(
            self.devices <= self.devices_per_node or self.devices % self.devices_per_node == 0,
            "devices",
            f"{self.devices} devices do not fill whole nodes of {self.devices_per_node}; "
            "use a multiple of --devices-per-node",
        )
        require(
            self.device_memory_bytes > 0,
            "device_memory",
            f"must be > 0, got {self.device_memory_bytes}",
        )
        for name in ("peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                     "host_memory_per_node_bytes", "host_link_bandwidth",
                     "host_adam_params_per_s", "nvme_bandwidth"):  # fmt: skip
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(
            self.nvme_bytes_per_node >= 0,
            "nvme_bytes_per_node",
            f"must be >= 0, got {self.nvme_bytes_per_node}",
        )
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            require(0 < value <= 1, name, f"must be in (0, 1], got {value}")

    @property
    def devices_on_node(self) -> int:
        """The devices sharing one node's host memory and CPUs."""
        return min(self.devices, self.devices_per_node)

    @property
    def host_bytes_per_device(self) -> float:
        """Each device's share of its node's host memory."""
        return self.host_memory_per_node_bytes / self.devices_on_node

    @property
    def nvme_bytes_per_device(self) -> float:
        """Each device's share of its node's NVMe."""
        return self.nvme_bytes_per_node / self.devices_on_node


# [Note: efficiencies]
# An efficiency belongs to a device and the kernels that run on it, so each preset says whose
# runs its two figures stand for. ``h100``: tidal's own (PyTorch, bf16 autocast, SDPA) runs,
# 0.5 and 0.5, which `tidal bench plan-check` sets beside one H100's measured steps.
# ``a100``: Megatron-LM's (cuBLAS matmuls, fused softmax, bias-GeLU and bias-dropout-add
# kernels) on Selene's A100s, 0.70 and 0.80: chosen against Table 1 of Narayanan et al. 2021
# (ten runs), then checked on Table 5 of Korthikanti et al. 2022 (four runs, two recompute
# modes each), which played no part in the choice (docs/planner.md, "Checked against the
# published runs"; tests/unit/planner/test_megatron.py).
CLUSTER_PRESETS: dict[str, dict[str, float]] = {
    "h100": {},
    "a100": {
        "device_memory_bytes": 80 * GiB,
        "peak_flops": 312e12,
        "memory_bandwidth": 2.0e12,
        "flops_efficiency": 0.70,
        "bandwidth_efficiency": 0.80,
        "intra_node_bandwidth": 230e9,
        "inter_node_bandwidth": 25e9,
    },
}


@dataclass(kw_only=True, frozen=True, slots=True)
class Mesh:
    """A ``dp x tp`` factorisation of the cluster's devices (tp innermost, inside a node)."""

    dp: int
    tp: int

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    def size(self, axis: Axis) -> int:
        return self.dp if axis is Axis.DATA else self.tp

    def link(self, axis: Axis, cluster: ClusterSpec) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a ring along ``axis``."""
        intra = (cluster.intra_node_latency_s, cluster.intra_node_bandwidth)
        inter = (cluster.inter_node_latency_s, cluster.inter_node_bandwidth)
        if axis is Axis.TENSOR:
            return intra if self.tp <= cluster.devices_per_node else inter
        return intra if self.dp * self.tp <= cluster.devices_per_node else inter


def collective_s(
    kind: Collective, nbytes: float, mesh: Mesh, axis: Axis, cluster: ClusterSpec
) -> float:
    """Seconds for one ring collective over ``axis`` on a tensor of ``nbytes`` (whole size)."""
    n = mesh.size(axis)
    if n == 1 or nbytes <= 0:
        return 0.0
    alpha, bandwidth = mesh.link(axis, cluster)
    steps = (n - 1) * alpha
    if kind is Collective.ALL_TO_ALL:
        return steps + (n - 1) / n**2 * nbytes / bandwidth
    one_pass = steps + (n - 1) / n * nbytes / bandwidth
    return 2 * one_pass if kind is Collective.ALL_REDUCE else one_pass
