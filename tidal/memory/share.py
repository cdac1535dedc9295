"""Which of several pieces of model data go to the host: :func:`host_share` (pure).

A plan offloads fractions of each device's model data ([Note: model data offload] in
tidal/planner/strategies.py); the runtime moves whole pieces, parameters' shares to the host
optimizer ([Note: the optimizer on the host] in tidal/runtime/host_optimizer.py) and FSDP2
groups to the host (``plan_apply``), so it needs the pieces nearest the fraction.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ON_HOST", "host_share"]

# The attribute a parameter whose storage is on the host carries (FSDP2's CPU offload, set by
# plan_apply): the host optimizer updates it in place, as its own master.
ON_HOST = "_tidal_on_host"


def host_share(sizes: Sequence[int], fraction: float) -> frozenset[int]:
    """The indices of ``sizes`` whose sum comes nearest ``fraction`` of their total from below:
    the largest first, each that still fits in what is left, so the sum falls short by less
    than the smallest size left out (none short at 0 and 1). A piece of no bytes goes only with
    all of them: at a fraction below 1 moving it would change nothing but where it is."""
    assert 0 <= fraction <= 1, fraction
    left = fraction * sum(sizes)
    taken = set()
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if (sizes[i] or fraction == 1) and sizes[i] <= left * (1 + 1e-9):
            taken.add(i)
            left -= sizes[i]
    return frozenset(taken)
