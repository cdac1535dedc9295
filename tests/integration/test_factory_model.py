"""A user's own model in a recipe ([Note: factory models] in tidal/models/factory.py): the same
trainer, metrics, checkpoints and exact resume, on the reference and the chunk engine."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.train import Trainer
from tidal.train.export import export_info
from tidal.train.metrics import read_metrics

USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 48)
            self.mix = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))
            self.norm = nn.LayerNorm(48)
            self.head = nn.Linear(48, 256)
            self.register_buffer("scale", torch.full((48,), 0.5))  # a value the meta device lacks

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            h = h + self.mix(h) * self.scale
            return self.head(self.norm(torch.cumsum(h, dim=1) / ids.shape[1]))

    def build() -> nn.Module:
        return TinyLM()
    """
)

ENGINES = {
    "reference": [],
    "chunk": ["engine=chunk", "chunk.size=4096", "memory.device_budget=600KiB"],
}


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_lm.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_lm:build"


def _run(run_dir: Path, factory: str, engine: str, steps: int, resume: bool = False) -> dict:
    overrides = [f"model.factory={factory}", "model.seq_len=32", f"run_dir={run_dir}",
                 f"training.steps={steps}", "training.val_every=2", "training.log_every=1",
                 "checkpoint.every_steps=2", "optimizer.decay_steps=6", *ENGINES[engine]]  # fmt: skip
    return Trainer("tiny", overrides).fit(resume=resume)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_factory_model_trains_checkpoints_and_resumes_exactly(
    engine: str, user_module: str, tmp_path: Path
) -> None:
    whole = _run(tmp_path / "whole", user_module, engine, 6)
    _run(tmp_path / "split", user_module, engine, 4)
    split = _run(tmp_path / "split", user_module, engine, 6, resume=True)

    def losses(run: str) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / run)]

    assert losses("split") == losses("whole") and len(losses("whole")) == 9  # 6 steps, 3 vals
    assert whole["factory"] == user_module and whole["preset"] is None
    assert whole["num_params"] == 48 * 256 + 2 * 48 * 96 + 96 + 48 + 2 * 48 + 48 * 256 + 256
    assert split["resumed_from_step"] == 4 and whole["engine"] == engine
    assert whole["final_loss"] < 5.4  # below uniform guessing over 256 bytes (ln 256 = 5.55)
    if engine == "chunk":
        assert whole["evictions"] > 0


def test_the_cli_trains_it_and_says_what_it_cannot_do(
    user_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--recipe", "tiny", "--no-plots", "--set", "model.seq_len=32",
            "--set", "training.steps=2", "--set", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main([*argv, "--set", f"model.factory={user_module}"]) == 0
    capsys.readouterr()
    for factory, fragment in (("no_such_module:build", "cannot import 'no_such_module'"),
                              ("user_lm:missing", "has no function 'missing'")):  # fmt: skip
        assert main([*argv, "--overwrite", "--set", f"model.factory={factory}"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and fragment in err, err
    # Exported under its own names; --check loads it strictly into what the factory builds.
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--check"]) == 0
    said = capsys.readouterr().out
    assert "loads strictly into the model of the recipe's factory user_lm:build" in said, said
    assert export_info(tmp_path / "out")["kind"] == "factory"


def _records(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


@pytest.mark.parametrize("engine", ["reference", "chunk"])
def test_a_recipe_trains_a_model_that_is_not_a_language_model(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tidal train --recipe cnn-tiny``: ``[custom] factory`` gives a CNN and its image
    batches; the run validates, checkpoints, resumes exactly and exports under its own names."""
    sets = ["--set", f"engine={engine}", "--set", "chunk.size=512"]
    if engine == "chunk":
        sets += ["--set", "memory.device_budget=136KiB"]

    def train(run: str, *extra: str) -> int:
        args = ["train", "--recipe", "cnn-tiny", "--no-plots", "--set", f"run_dir={tmp_path / run}"]
        return main([*args, *sets, *extra])

    assert train("whole") == 0
    assert train("split", "--set", "training.steps=4") == 0
    assert train("split", "--resume") == 0
    whole = _records(tmp_path / "whole")
    assert _records(tmp_path / "split") == whole and len(whole) == 9  # 6 steps, 3 validations
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "whole"), "--out", str(out), "--check"]) == 0
    assert "11 tensors equal to" in capsys.readouterr().out


def test_a_custom_run_misconfigured_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["train", "--recipe", "cnn-tiny", "--no-plots", "--set", f"run_dir={tmp_path / 'x'}"]
    cases = [
        ("model.factory=pkg:fn,model.seq_len=16", "custom.factory: builds the model itself"),
        ("custom.loss=hinge", "custom.loss: expected one of cross_entropy, mse"),
        ("custom.factory=tidal.testing.your_models:mlp", "must return (model, train_batches"),
    ]
    for settings, said in cases:
        sets = [arg for setting in settings.split(",") for arg in ("--set", setting)]
        assert main([*base, *sets]) == 2, settings
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (settings, err)
