"""The same data on every rank, or a one-line refusal before the first step.

[Note: same data on every rank]
Every rank draws the same global batches and trains its rows of each ([Note: global batch] in
trainer.py), so the ranks must read the same corpus with the same settings. Each reads it
itself, and nothing else would notice if one machine held another version of a file, or a rank
was given another seed: the ranks would train on different batches and the run would still
look healthy. So at start each rank fingerprints what decides its batches (the samplers'
``fingerprint()``: the corpus sampled in blocks, the seed, the shapes; or your data's first
batch) and the fingerprints are compared; any difference stops every rank, naming which ranks
differ.
"""

from __future__ import annotations

import torch.distributed as dist

from tidal.config import ConfigError

__all__ = ["check_same_data"]


def check_same_data(fingerprint: str) -> None:
    """Refuse ranks whose data fingerprints differ ([Note: same data on every rank])."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    prints: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint)
    groups: dict[str | None, list[int]] = {}
    for rank, seen in enumerate(prints):
        groups.setdefault(seen, []).append(rank)
    if len(groups) > 1:
        said = "; ".join(
            f"ranks {', '.join(map(str, ranks))}: {seen}" for seen, ranks in groups.items()
        )
        raise ConfigError(
            "data",
            f"the ranks would train on different data (fingerprints {said}): give every rank "
            f"the same corpus (the same files at the same paths on every machine) and the same "
            f"[data] settings and seed",
        )
