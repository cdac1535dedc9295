"""``[distributed] timeout_s`` reaches the process group, and a bad value is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tidal.train.trainer as trainer_module
from tidal.config import ConfigError
from tidal.train import Trainer, load_job


def test_the_collective_timeout_is_the_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def joined(**kwargs: Any) -> bool:
        seen.update(kwargs)
        return False

    monkeypatch.setattr(trainer_module, "init_from_env", joined)
    Trainer("tiny", {"run_dir": str(tmp_path), "distributed": {"timeout_s": 45}})
    assert seen["timeout_s"] == 45.0
    assert load_job("tiny").distributed.timeout_s == 600.0


def test_a_timeout_of_zero_is_named() -> None:
    with pytest.raises(ConfigError, match=r"distributed.timeout_s: must be > 0 seconds, got 0"):
        load_job("tiny", ["distributed.timeout_s=0"])
