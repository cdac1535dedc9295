"""Benchmark programs: they write JSON under benchmarks/results/ and return rows for a table."""

from benchmarks.results import environment, results_dir, write_results
from benchmarks.train import bench_train

__all__ = ["bench_train", "environment", "results_dir", "write_results"]
