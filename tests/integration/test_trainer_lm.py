"""``tidal.Trainer`` on language models as they come: a module returning ``(batch, seq, vocab)``
logits and a Hugging Face model returning ``.logits``, trained on ``(batch, seq)`` targets with
the default loss ([Note: default loss] in tidal/train/losses.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tidal
from tidal.train.metrics import read_metrics

BATCH, SEQ, VOCAB = 4, 8, 32


class TinyLM(nn.Module):
    """Embedding and a projection back to the vocabulary: ``(batch, seq, vocab)`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=SEQ)  # fmt: skip
    return LlamaForCausalLM(config)


def token_batches(num_batches: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next-token pairs: targets are the inputs shifted by one."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(num_batches)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def config(run_dir: Path, *, steps: int = 4, **sections: Any) -> dict[str, Any]:
    training = {"steps": steps, "batch_size": BATCH, "log_every": 1, "val_every": 0,
                "val_batches": 1, "grad_clip_norm": 0.0, **sections.pop("training", {})}  # fmt: skip
    return {"run_dir": str(run_dir), "training": training, **sections}


@pytest.mark.parametrize("build", [TinyLM, tiny_llama], ids=["logits", "hf-logits"])
def test_language_models_train_on_token_targets_with_the_default_loss(
    build: Any, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    trainer = tidal.Trainer(build(), config(tmp_path, optimizer={"lr": 1e-2, "warmup_steps": 0}),
                            train_data=token_batches(), val_data=token_batches(1))  # fmt: skip
    summary = trainer.fit(callbacks=[])
    losses = [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert summary["val_loss"] is not None and abs(losses[0] - torch.log(torch.tensor(VOCAB))) < 1


def test_fit_prints_the_progress_line_without_any_logging_set_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fit(run: str, **kwargs: Any) -> str:
        run_config = config(tmp_path / run, steps=2, training={"val_every": 2})
        tidal.Trainer(TinyLM(), run_config, train_data=token_batches(),
                      val_data=token_batches(1)).fit(**kwargs)  # fmt: skip
        return capsys.readouterr().out

    out = fit("default").splitlines()
    assert out[0].startswith("run: starting; your TinyLM with 1,056 params on cpu (fp32, ")
    assert "; 32 tokens/step; " in out[0]
    steps = [line for line in out if line.startswith("step ")]
    assert steps[0].startswith("step 1/2  loss ") and " tps " in steps[0] and "memory" in steps[0]
    assert " tflops " in steps[1] and " mfu " in steps[1]  # 6 x params per token: token targets
    assert steps[2].startswith("step 2  val_loss ") and "checkpoint" in steps[3]
    assert fit("quiet", progress=False) == ""
    # a callback that shows progress itself (here through logging) replaces the line
    assert fit("logged", callbacks=[tidal.train.LogCallback(log_every=1, total_steps=2)]) == ""


def _plain_torch(make_optimizer: Any, make_scheduler: Any = None, steps: int = 4) -> tuple:
    """The loop a user writes by hand: losses, learning rates and final weights."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = make_optimizer(model.parameters())
    scheduler = make_scheduler(opt) if make_scheduler else None
    losses, lrs = [], []
    for inputs, targets in token_batches()[:steps]:
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs, model.state_dict()


def _fit_own(run_dir: Path, *, steps: int = 4, resume: bool = False, **own: Any) -> tuple:
    torch.manual_seed(0)
    model = TinyLM()
    sections = own.pop("sections", {})
    trainer = tidal.Trainer(model, config(run_dir, steps=steps, **sections),
                            train_data=token_batches(), **own)  # fmt: skip
    trainer.fit(resume=resume, progress=False)
    records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    weights = trainer.engine.model_state_dict()
    return [r["loss"] for r in records], [r["lr"] for r in records], weights


def _assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0] and got[1] == want[1]  # bit for bit: the same torch objects
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2])


SGD = {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}


def test_your_torch_optimizer_class_or_factory_equals_the_plain_torch_loop(tmp_path: Path) -> None:
    want = _plain_torch(lambda params: torch.optim.SGD(params, **SGD))
    _assert_same(
        _fit_own(tmp_path / "class", optimizer=torch.optim.SGD, optimizer_kwargs=SGD), want
    )
    factory = _fit_own(tmp_path / "factory", optimizer=lambda p: torch.optim.SGD(p, **SGD))
    _assert_same(factory, want)
    assert want[1] == [0.5] * 4  # no scheduler: the optimizer's own rate, not tidal's warm-up
    saved = json.loads((tmp_path / "class" / "config.json").read_text())
    assert saved["user_optimizer"] == (
        "torch.optim.sgd.SGD(lr=0.5, momentum=0.9, weight_decay=0.01)"
    )


def test_your_lr_scheduler_steps_once_per_optimizer_step_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    def schedule(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    own = {"optimizer": torch.optim.SGD, "optimizer_kwargs": SGD, "lr_scheduler": schedule}
    want = _plain_torch(lambda params: torch.optim.SGD(params, **SGD), schedule)
    _assert_same(_fit_own(tmp_path / "whole", **own), want)
    assert want[1] == [0.5, 0.25, 0.25, 0.125]
    _fit_own(tmp_path / "split", steps=3, **own)
    _assert_same(_fit_own(tmp_path / "split", resume=True, **own), want)
    # over [optimizer]'s own optimizer, from its peak lr
    lrs = _fit_own(tmp_path / "configured", lr_scheduler=schedule,
                   sections={"optimizer": {"lr": 0.2, "warmup_steps": 5}})[1]  # fmt: skip
    assert lrs == [0.2, 0.1, 0.1, 0.05]


CHUNK = {"engine": "chunk", "chunk": {"size": 512}}


def test_the_chunk_engine_takes_torch_adamw_adam_sgd_as_torch_computes_them(
    tmp_path: Path,
) -> None:
    kwargs = {"lr": 0.01, "betas": (0.8, 0.9), "fused": False}
    want = _fit_own(tmp_path / "ref", optimizer=torch.optim.AdamW, optimizer_kwargs=kwargs)
    got = _fit_own(tmp_path / "chunk", optimizer=torch.optim.AdamW, optimizer_kwargs=kwargs,
                   sections=CHUNK)  # fmt: skip
    assert got[0] == pytest.approx(want[0], rel=1e-6) and got[1] == want[1] == [0.01] * 4
    assert all(torch.allclose(got[2][k], want[2][k], atol=1e-6) for k in want[2])
    section = json.loads((tmp_path / "chunk" / "config.json").read_text())["optimizer"]
    assert section | {"beta1": 0.8} == section and section["weight_decay"] == 0.01  # torch's
    assert section["weight_decay_on"] == "all" and section["min_lr_ratio"] == 1.0


@pytest.mark.parametrize(
    ("own", "what"),
    [
        ({"optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}, "not the factory .*<lambda>"),
        ({"optimizer": torch.optim.RMSprop}, "not torch.optim.rmsprop.RMSprop"),
        ({"optimizer": torch.optim.Adam, "optimizer_kwargs": {"amsgrad": True}}, "amsgrad=True"),
        ({"lr_scheduler": lambda opt: None}, "not lr_scheduler="),
    ],
    ids=["factory", "rmsprop", "amsgrad", "scheduler"],
)
def test_what_the_chunk_engine_cannot_honour_is_refused_in_one_line(
    own: dict[str, Any], what: str, tmp_path: Path
) -> None:
    with pytest.raises(tidal.ConfigError, match=f"the chunk engine steps its own .*{what}") as err:
        tidal.Trainer(TinyLM(), config(tmp_path, **CHUNK), train_data=token_batches(), **own)
    assert "\n" not in str(err.value) and "train with engine = 'reference' for that" in str(
        err.value
    )


def test_the_optimizer_is_said_once(tmp_path: Path) -> None:
    with pytest.raises(tidal.ConfigError, match="optimizer: given twice"):
        tidal.Trainer(TinyLM(), config(tmp_path, optimizer={"lr": 0.1}),
                      train_data=token_batches(), optimizer=torch.optim.SGD)  # fmt: skip
    with pytest.raises(tidal.ConfigError, match="optimizer_kwargs: go with an optimizer class"):
        tidal.Trainer(TinyLM(), config(tmp_path), train_data=token_batches(),
                      optimizer=lambda p: torch.optim.SGD(p), optimizer_kwargs={"lr": 1.0})  # fmt: skip


def _resume_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "resuming at step" in r.getMessage()]


def test_resuming_with_another_lr_or_length_says_what_changed_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def fit(steps: int, lr: float, resume: bool) -> None:
        optimizer = {"lr": lr, "warmup_steps": 0}
        tidal.Trainer(TinyLM(), config(tmp_path, steps=steps, optimizer=optimizer),
                      train_data=token_batches()).fit(resume=resume, progress=False)  # fmt: skip

    fit(2, 1e-3, resume=False)
    with caplog.at_level(logging.WARNING, logger="tidal.train.trainer"):
        fit(2, 1e-3, resume=True)  # nothing changed: nothing said
        assert _resume_warnings(caplog) == []
        fit(4, 3e-4, resume=True)
    (line,) = _resume_warnings(caplog)
    assert line == (
        "tidal: resuming at step 2 with optimizer.lr 0.0003 (was 0.001), training.steps 4 (was 2); "
        "the next step's learning rate is 1.65e-04 (the saved schedule's: 1.00e-04)"
    )  # halfway down the new cosine; the saved one had reached its floor
    with pytest.raises(tidal.ConfigError, match="optimizer.name: the checkpoint at step 4 holds "
                       "adamw's optimizer state, which sgd cannot take; resume with "
                       "optimizer.name = 'adamw'"):  # fmt: skip
        tidal.Trainer(TinyLM(), config(tmp_path, steps=6, optimizer={"name": "sgd"}),
                      train_data=token_batches()).fit(resume=True, progress=False)  # fmt: skip


def test_resuming_with_another_optimizer_of_yours_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _fit_own(tmp_path, steps=2, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5})
    with caplog.at_level(logging.WARNING, logger="tidal.train.trainer"):
        _fit_own(tmp_path, resume=True, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    assert _resume_warnings(caplog) == [
        "tidal: resuming at step 2 with training.steps 4 (was 2), user_optimizer "
        "torch.optim.sgd.SGD(lr=0.1) (was torch.optim.sgd.SGD(lr=0.5))"
    ]
    with pytest.raises(tidal.ConfigError, match=r"optimizer: the checkpoint at step 4 holds "
                       r"torch.optim.sgd.SGD's optimizer state, which torch.optim.adam.Adam "
                       r"cannot take; resume with optimizer=torch.optim.sgd.SGD"):  # fmt: skip
        _fit_own(tmp_path, steps=6, resume=True, optimizer=lambda p: torch.optim.Adam(p))
