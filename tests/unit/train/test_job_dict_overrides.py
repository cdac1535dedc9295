"""Overrides as a nested dict, merged key by key onto a recipe, and the wrong kinds named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.config import ConfigError
from tidal.train import Trainer, load_job


def test_a_dict_of_overrides_is_merged_onto_the_recipe() -> None:
    job = load_job("tiny", {"training": {"steps": 7}, "optimizer": {"lr": 0.5}})
    recipe = load_job("tiny")
    assert job.training.steps == 7 and job.optimizer.lr == 0.5
    # Keys the dict leaves out keep the recipe's values, also inside the sections it touches.
    assert job.training.batch_size == recipe.training.batch_size and job.model == recipe.model
    with pytest.raises(ConfigError, match="training.stpes"):
        load_job("tiny", {"training": {"stpes": 7}})


def test_the_trainer_takes_a_recipe_and_a_dict(tmp_path: Path) -> None:
    trainer = Trainer("tiny", {"training": {"steps": 2}, "run_dir": str(tmp_path / "run")})
    assert trainer.job.training.steps == 2 and trainer.run_dir == tmp_path / "run"


def test_a_lone_string_or_a_second_job_is_named() -> None:
    with pytest.raises(ConfigError, match="wrap it in a list"):
        load_job("tiny", "training.steps=1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"pass it first, Trainer\(job\)"):
        Trainer("tiny", load_job("tiny"))
