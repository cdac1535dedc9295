"""`tidal config show`: the resolved config as TOML that loads back to the same config, a doc
line on every key (read from the config classes' docstrings, so a new key without one fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib

from tidal.cli.config_show import render
from tidal.cli.main import main
from tidal.config import from_dict
from tidal.train.job import JobConfig, load_job


def test_every_key_has_its_doc_line_and_the_toml_loads_back() -> None:
    job = load_job("tiny", ["training.steps=7", "engine=chunk", "memory.device_budget=3MiB"])
    text = render(job)
    settings = [line for line in text.splitlines() if line and not line.startswith("[")]
    undocumented = [line for line in settings if line.count("#") < (2 if "(unset)" in line else 1)]
    assert not undocumented, undocumented
    assert from_dict(JobConfig, tomllib.loads(text)) == job


def test_the_command_prints_a_recipe_with_the_deepspeed_keys_on_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}})
    )
    assert main(["config", "show", "--recipe", "tiny", "--deepspeed", str(ds)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["engine"] == "chunk" and shown["training"]["batch_size"] == 3
