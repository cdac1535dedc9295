"""One case of ``tidal bench compat`` in its worker: one process (:mod:`benchmarks.compat_cases`)
or gloo ranks (:mod:`benchmarks.compat_ranks`, which builds on the former)."""

from __future__ import annotations

from typing import Any

from benchmarks.compat_cases import Case, quiet_transformers, single_process_case
from benchmarks.compat_ranks import ranks_case
from benchmarks.isolated import error_result
from tidal.testing.zoo import find_family

__all__ = ["run_case"]


def run_case(case: Case) -> dict[str, Any]:
    """The figures of one case; an exception becomes ``{"error": ...}`` (the worker's
    process dying is :func:`benchmarks.isolated.run_isolated`'s to report)."""
    quiet_transformers()
    try:
        family = find_family(case.family)
        if case.mode.ranks > 1:
            return ranks_case(case, family)
        return single_process_case(case, family)
    except Exception as err:
        return error_result(err)
