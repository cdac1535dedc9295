"""``tidal.Trainer`` on language models as they come: a module returning ``(batch, seq, vocab)``
logits and a Hugging Face model returning ``.logits``, trained on ``(batch, seq)`` targets with
the default loss ([Note: default loss] in tidal/train/losses.py)."""

from __future__ import annotations

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
    assert steps[2].startswith("step 2  val_loss ") and "checkpoint" in steps[3]
    assert fit("quiet", progress=False) == ""
    # a callback that shows progress itself (here through logging) replaces the line
    assert fit("logged", callbacks=[tidal.train.LogCallback(log_every=1, total_steps=2)]) == ""
