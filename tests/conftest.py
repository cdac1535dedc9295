"""Suite-wide set-up: one corpus cache per test session, shared with subprocesses."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A fresh cache per session tests the real build path once; subprocesses inherit the variable.
    if "TIDAL_CACHE_DIR" not in os.environ:
        os.environ["TIDAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tidal-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
