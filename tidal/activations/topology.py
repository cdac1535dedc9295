"""The peer links of a server's GPUs, as the saver planner reads them (``Links.peer_bandwidth``
and ``Links.peer_egress``, [Note: stripes] in costs.py).

[Note: two server topologies]
``nvswitch``: every GPU's NVLinks go to switches, so any pair may use all of a GPU's links at once
and a GPU sends no faster to several peers than to one: each pair at ``pair_gbps``, the egress
the same (an H100 or A100 DGX). ``dgx1``: the hybrid cube mesh of a DGX-1 with V100s, six NVLinks
per GPU wired straight to four peers, one link to two of them and two links to the other two, no
NVLink to the remaining three (those pairs go through PCIe and the CPUs: 0, no peer swap). Each
link carries ``nvlink_gbps`` each way; a GPU's egress is the sum of its links, so a stripe over
its four peers moves six links' worth where one peer gets one or two. The wiring is the one
``nvidia-smi topo -m`` prints on a DGX-1V (MPress's own server).
"""

from __future__ import annotations

from tidal.config import ConfigError

__all__ = ["TOPOLOGIES", "peer_links"]

TOPOLOGIES = ("nvswitch", "dgx1")

# NVLinks between each pair of a DGX-1V's GPUs ([Note: two server topologies])
_DGX1_NVLINKS = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)


def peer_links(topology: str, num_ranks: int, *, pair_gbps: float,
               nvlink_gbps: float) -> tuple[tuple[tuple[float, ...], ...], tuple[float, ...]]:  # fmt: skip
    """Bytes/s between each pair of ``num_ranks`` GPUs, and each GPU's egress."""
    if topology == "nvswitch":
        pair = pair_gbps * 1e9
        matrix = tuple(tuple(0.0 if a == b else pair for b in range(num_ranks))
                       for a in range(num_ranks))  # fmt: skip
        return matrix, (max(pair, 1.0),) * num_ranks
    if topology == "dgx1":
        if num_ranks != len(_DGX1_NVLINKS):
            raise ConfigError("--topology", f"a DGX-1 has 8 GPUs, not {num_ranks}: use 8 "
                              "stages, or --topology nvswitch")  # fmt: skip
        link = nvlink_gbps * 1e9
        matrix = tuple(tuple(n * link for n in row) for row in _DGX1_NVLINKS)
        return matrix, tuple(max(sum(row), 1.0) for row in matrix)
    raise ConfigError(
        "--topology", f"unknown topology {topology!r}: one of {', '.join(TOPOLOGIES)}"
    )
