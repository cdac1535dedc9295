"""Process groups and rank helpers (env.py); ``tidal train --nproc N`` (launch.py); a heartbeat
that stops the job when a rank dies (watchdog.py), which only a program starts (install_watchdog)."""

from tidal.distributed.env import (
    all_reduce_mean,
    barrier,
    decided_on_main,
    explain_failure,
    gather_ints,
    init_from_env,
    install_watchdog,
    is_main,
    join_alone,
    leave_alike,
    rank,
    shutdown,
    world_size,
)
from tidal.distributed.watchdog import (
    RankDiedError,
    RankWatchdog,
    WatchdogConfig,
    start_watchdog,
)

__all__ = [
    "RankDiedError",
    "RankWatchdog",
    "WatchdogConfig",
    "all_reduce_mean",
    "barrier",
    "decided_on_main",
    "explain_failure",
    "gather_ints",
    "init_from_env",
    "install_watchdog",
    "join_alone",
    "leave_alike",
    "is_main",
    "rank",
    "shutdown",
    "start_watchdog",
    "world_size",
]
