"""Fixtures of the integration tests."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tidal.cli.main import main

BenchRun = Callable[[list[str], Path, str], tuple[str, dict[str, Any]]]


@pytest.fixture
def bench_cli(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> BenchRun:
    """Run ``tidal ARGV`` through the CLI's entry point in this process (a bench's cases and
    ranks are processes of their own anyway), with the argv its results file records as its
    command; return its stdout and the one results file matching ``pattern`` in ``folder``,
    checked for what every results file records."""

    def run(argv: list[str], folder: Path, pattern: str) -> tuple[str, dict[str, Any]]:
        monkeypatch.setattr(sys, "argv", ["tidal", *argv])
        code = main(argv)
        stdout, stderr = capfd.readouterr()  # stderr: the ranks' too
        assert code == 0, stderr
        (path,) = folder.glob(pattern)
        data = json.loads(path.read_text())
        for key in ("command", "git_commit", "torch_version", "device"):
            assert key in data
        assert data["command"] == " ".join(["tidal", *argv])
        return stdout, data

    return run
