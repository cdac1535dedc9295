"""say_once: ranks of one launch that fail alike print their line once ([Note: one line per
run] in tidal/distributed/launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.distributed.launch import say_once


def test_a_line_is_printed_once_per_launch_and_other_lines_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIDAL_RUN_LINES_DIR", str(tmp_path))
    for line in ["tidal: error: a", "tidal: error: a", "tidal: error: b", "tidal: error: a"]:
        say_once(line)  # as four ranks would, each in its own process
    assert capsys.readouterr().err.splitlines() == ["tidal: error: a", "tidal: error: b"]


def test_outside_a_launch_or_without_its_folder_every_line_is_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TIDAL_RUN_LINES_DIR", raising=False)
    say_once("x")
    say_once("x")
    monkeypatch.setenv("TIDAL_RUN_LINES_DIR", str(tmp_path / "gone"))  # cannot claim: print
    say_once("x")
    assert capsys.readouterr().err.splitlines() == ["x", "x", "x"]
