"""Process groups and rank helpers (env.py); ``tidal train --nproc N`` (launch.py)."""

from tidal.distributed.env import (
    all_reduce_mean,
    barrier,
    gather_ints,
    init_from_env,
    is_main,
    rank,
    shutdown,
    world_size,
)

__all__ = [
    "all_reduce_mean",
    "barrier",
    "gather_ints",
    "init_from_env",
    "is_main",
    "rank",
    "shutdown",
    "world_size",
]
