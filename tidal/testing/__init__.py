"""Test helpers for tidal and for code built on it."""

from tidal.testing.dist import RankFailure, RankOutcome, free_port, run_on_ranks

__all__ = ["RankFailure", "RankOutcome", "free_port", "run_on_ranks"]
