"""The one checkpoint format across engines: what the reference engine writes, the chunk engine
resumes, and the other way round ([Note: checkpoint keys] in tidal/train/checkpoint.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import tidal
from tidal.models import build_gpt
from tidal.train.build import build_engine
from tidal.train.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from tidal.train.job import load_job

SETTINGS = ["training.device=cpu", "optimizer.lr=1e-2", "optimizer.warmup_steps=0"]
ENGINES = {"reference": (), "chunk": ("engine=chunk", "chunk.size=128")}


def _engine(kind: str, model: torch.nn.Module) -> object:
    """The engine ``kind`` names; ``stage-...``: what tidal.initialize gives for it, the model
    one stage of the train step ([Note: one model on stages] in tidal/runtime/stage_engine.py)."""
    job = load_job("tiny", [*SETTINGS, *ENGINES[kind.removeprefix("stage-")]])
    if kind.startswith("stage-"):
        return tidal.initialize(copy.deepcopy(model), job)
    return build_engine(copy.deepcopy(model), job)


def _batch(seed: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _step(engine: object, seed: int, vocab_size: int) -> float:
    loss = engine(*_batch(seed, vocab_size))  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return float(loss.detach())


@pytest.mark.parametrize(
    ("writer", "reader"),
    [("reference", "chunk"), ("chunk", "reference"),
     ("reference", "stage-reference"), ("stage-reference", "reference"),
     ("chunk", "stage-chunk"), ("stage-chunk", "reference")],
)  # fmt: skip
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


def test_a_chunk_stage_holding_both_names_of_a_tied_weight_resumes_it() -> None:
    """One stage holds the embedding and the head that shares its matrix (a model of one
    stage, or a user's stage tied inside): the restore writes the checkpoint's value under both
    names, so the stale one cannot win."""
    from types import SimpleNamespace

    from tidal.models.gpt import GPTConfig, split_gpt
    from tidal.parallel.chunk_stage import ChunkStageConfig, ChunkStageParams
    from tidal.parallel.config import OptimizerConfig
    from tidal.parallel.flat_state import model_layout
    from tidal.pipeline.schedules import make_schedule
    from tidal.runtime.executor import UpdateRules
    from tidal.runtime.local import run_local
    from tidal.runtime.precision import LossScaler
    from tidal.train.engine_state import PipelineStages

    config = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, d_model=16)
    model = build_gpt(config, seed=0)
    layout = model_layout(model, {n: t.shape for n, t in model.state_dict().items()})
    chunk_config = ChunkStageConfig(optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0))

    def stages_of() -> SimpleNamespace:
        (stage,) = split_gpt(copy.deepcopy(model), [(0, 2)])
        assert len(dict(stage.named_parameters(remove_duplicate=False))) > len(
            dict(stage.named_parameters())
        ), "the stage should hold the tied matrix under two names"
        return SimpleNamespace(modules={0: stage}, weights={0: ChunkStageParams(stage, chunk_config)},
                               rules=UpdateRules(), asynchronous=False,
                               scaler=LossScaler("fp32"), step=0)  # fmt: skip

    trained = stages_of()
    schedule = make_schedule("gpipe", stages=1, microbatches=1, steps=2)
    run_local(schedule, [trained.modules[0]], [trained.weights[0]],
              lambda step: _batch(step, 64), lambda _: 1e-2)  # fmt: skip
    trained.step = 2
    split = {"schedule": "gpipe", "block_ranges": [[0, 2]]}
    saved = PipelineStages(trained, layout, split).checkpoint_state()
    tensors = saved.tensors
    meta = {**saved.meta, "numels": {k: t.numel() for k, t in tensors.items()}}

    def load(targets: dict[str, torch.Tensor]) -> None:
        for key, target in targets.items():
            target.copy_(tensors[key].reshape(-1).view(target.dtype) if target.dtype == torch.uint8
                         else tensors[key].reshape(-1))  # fmt: skip

    resumed = stages_of()
    PipelineStages(resumed, layout, split).restore_checkpoint(load, saved.extras, meta)
    want, got = trained.weights[0].model_state_dict(), resumed.weights[0].model_state_dict()
    assert want.keys() == got.keys() and len(want) > len(
        dict(trained.modules[0].named_parameters())
    )
    assert not torch.equal(want["embed.tok.weight"], model.state_dict()["tok_embed.weight"])
    for name, value in want.items():
        assert torch.equal(got[name], value), name
