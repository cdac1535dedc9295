"""Benchmark programs: they write JSON under benchmarks/results/ and return rows for a table."""

from tidal.bench.results import environment, results_dir, write_results
from tidal.bench.train import bench_train

__all__ = ["bench_train", "environment", "results_dir", "write_results"]
