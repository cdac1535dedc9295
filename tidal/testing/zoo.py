"""Models tidal did not write, small enough to train in a test, each with its batches.

A :class:`ZooModel` builds a module whose forward returns the loss (Hugging Face models are
wrapped: ``model(**batch).loss``) and gives the batch of each step, the same on every call, so
two engines can be compared step for step on the same seeds. Hugging Face models are built
offline from a config (``transformers`` is an optional dependency, imported when one is built).
The families cover what breaks hook-based offload: parameters that sit out a step (a branch
taken on alternate steps, ``layerdrop``, an unused pooler), parameters read outside their
module, ``weight.dtype`` reads, tied and shared weights, BatchNorm buffers, encoders and
encoder-decoders, mixture-of-experts routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZOO", "ZooModel", "zoo_model"]

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One family: ``build(seed)`` makes the model, ``batch(step)`` the step's inputs."""

    name: str
    build: Callable[[int], nn.Module]
    batch: Callable[[int], Batch]
    needs: tuple[str, ...] = ()  # optional packages
    notes: str = ""
    # Parameters that get no gradient in some steps, and those that never get one.
    sits_out: tuple[str, ...] = field(default=())
    never_trained: tuple[str, ...] = field(default=())


class LossOf(nn.Module):
    """A Hugging Face model whose forward returns its ``.loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.model(**batch).loss


def _tokens(step: int, *, vocab: int = 96, batch: int = 4, seq_len: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq_len), generator=g)


def _lm_batch(step: int) -> Batch:
    ids = _tokens(step)
    return {"input_ids": ids, "labels": ids}


class AlternatingBranch(nn.Module):
    """Takes its ``extra`` block on even steps only (the step is counted by the forward)."""

    def __init__(self, vocab: int = 96, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.extra = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
        self.head = nn.Linear(width, vocab)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.body(h)
        if self.training and self.calls % 2 == 0:
            h = h + self.extra(h)
        if self.training:
            self.calls += 1
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _alternating(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return AlternatingBranch()


def _opt_layerdrop(seed: int) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, layerdrop=0.5, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LossOf(OPTForCausalLM(config))


class PooledHead(nn.Module):
    """``AutoModel`` (BERT, with its pooler) and a head on the token states: the pooler runs
    but no loss reads it, so its parameters never get a gradient."""

    def __init__(self, encoder: nn.Module, width: int, vocab: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        states = self.encoder(input_ids=input_ids).last_hidden_state
        logits = self.head(states)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _bert_pooler(seed: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return PooledHead(BertModel(config, add_pooling_layer=True), 32, 96)


ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel(
            name="alternating-branch",
            build=_alternating,
            batch=_lm_batch,
            sits_out=("extra.0.weight", "extra.1.weight"),
            notes="a block used on even steps only",
        ),
        ZooModel(
            name="opt-layerdrop",
            build=_opt_layerdrop,
            batch=_lm_batch,
            needs=("transformers",),
            notes="Hugging Face OPT, layerdrop 0.5: random layers sit out each step",
        ),
        ZooModel(
            name="bert-unused-pooler",
            build=_bert_pooler,
            batch=_lm_batch,
            needs=("transformers",),
            sits_out=("encoder.pooler.dense.weight", "encoder.pooler.dense.bias"),
            never_trained=("encoder.pooler.dense.weight", "encoder.pooler.dense.bias"),
            notes="AutoModel (BERT) with its pooler, a custom head on the token states",
        ),
    )
}


def zoo_model(name: str) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"no zoo model {name!r}; known: {', '.join(ZOO)}")
    return ZOO[name]


def run_steps(engine: Any, model: ZooModel, steps: int, *, seed: int = 0) -> list[float]:
    """Train ``steps`` steps with any engine's calling convention; the global RNG is reseeded
    before each step, so random choices in the forward (layerdrop) are the same for every
    engine."""
    losses = []
    for step in range(steps):
        torch.manual_seed(seed * 1_000 + step)
        loss = engine(**model.batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
