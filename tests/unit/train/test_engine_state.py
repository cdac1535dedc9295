"""The one checkpoint format across engines: what the reference engine writes, the chunk engine
resumes, and the other way round ([Note: checkpoint keys] in tidal/train/checkpoint.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tidal.models import build_gpt
from tidal.train.build import build_engine
from tidal.train.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from tidal.train.job import load_job

SETTINGS = ["training.device=cpu", "optimizer.lr=1e-2", "optimizer.warmup_steps=0"]
ENGINES = {"reference": (), "chunk": ("engine=chunk", "chunk.size=128")}


def _engine(kind: str, model: torch.nn.Module) -> object:
    return build_engine(copy.deepcopy(model), load_job("tiny", [*SETTINGS, *ENGINES[kind]]))


def _batch(seed: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _step(engine: object, seed: int, vocab_size: int) -> float:
    loss = engine(*_batch(seed, vocab_size))  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return float(loss.detach())


@pytest.mark.parametrize(("writer", "reader"), [("reference", "chunk"), ("chunk", "reference")])
def test_one_engine_resumes_what_another_wrote(tmp_path: Path, writer: str, reader: str) -> None:
    model = build_gpt(load_job("tiny").model.resolve(), seed=0)
    vocab_size = model.config.vocab_size
    first, second = _engine(writer, model), _engine(reader, model)
    for seed in range(3):  # AdamW moments that differ from a fresh optimizer's
        _step(first, seed, vocab_size)
    path = save_checkpoint(tmp_path, 3, state=first.checkpoint_state(),
                           train_state={}, keep=1)  # fmt: skip
    checkpoint = load_checkpoint(path)
    second.restore_checkpoint(
        checkpoint.load_tensors, checkpoint.train_state["engine"], checkpoint.meta
    )
    assert second.global_step == 3  # type: ignore[attr-defined]
    saved = load_model_state(path)
    for name, value in second.state_dict()["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(value, saved[name]), name
    # The next step agrees: the weights, the moments, the step counts and the rate came back.
    # (A fresh optimizer's first AdamW step moves every weight by about lr; this is far less.)
    _step(first, 3, vocab_size)
    _step(second, 3, vocab_size)
    after_first = first.state_dict()["model"]  # type: ignore[attr-defined]
    for name, value in second.state_dict()["model"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(value, after_first[name], atol=2e-5, rtol=0, msg=name)
