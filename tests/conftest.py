"""Suite-wide set-up: one corpus cache per test session, shared with subprocesses."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A fresh cache per session tests the real build path once; subprocesses inherit the variable.
    if "TIDAL_CACHE_DIR" not in os.environ:
        os.environ["TIDAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tidal-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _no_group_of_one_left() -> Iterator[None]:
    """A run on stages in this process makes a process group of its one process and leaves it,
    as a program's later runs reuse it ([Note: a group of one] in tidal/distributed/env.py);
    the next test starts without one, as a fresh process would."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    alone = dist is not None and dist.is_available() and dist.is_initialized()
    if alone and dist.get_world_size() == 1:
        dist.destroy_process_group()
