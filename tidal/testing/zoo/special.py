"""The special cases: a branch taken on alternate steps, frozen parts, parameters used outside
their module, activation checkpointing, and a recurrent layer (torch's LSTM keeps its own list
of its parameters)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.testing.zoo.base import VOCAB, LossOf, ZooModel, lm_batch

__all__ = ["SPECIAL_FAMILIES", "AlternatingBranch", "LstmLM", "OutsideUses"]

WIDTH = 32


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class AlternatingBranch(nn.Module):
    """Takes its ``extra`` block on even steps only (the step is counted by the forward)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
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
        return _next_token_loss(self.head(h), labels)


def _alternating(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return AlternatingBranch()


class OutsideUses(nn.Module):
    """Parameters used outside their module in the root's forward: the output layer is
    ``F.linear`` on the embedding's weight, a LayerNorm that is never called lends its gain,
    and an L2 penalty reads the first body layer's weight after that layer returned."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.gain = nn.LayerNorm(width, bias=False)  # never called: only its weight is read

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.body(h) * self.gain.weight
        logits = F.linear(h, self.embed.weight) * h.shape[-1] ** -0.5
        penalty = 1e-3 * self.body[0].weight.pow(2).sum()
        return _next_token_loss(logits, labels) + penalty


def _outside_uses(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return OutsideUses()


def _llama(seed: int, **extra: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * WIDTH, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _llama_frozen(seed: int) -> nn.Module:
    model = _llama(seed)
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    return LossOf(model)


def _llama_checkpointing(seed: int) -> nn.Module:
    model = _llama(seed)
    # Non-reentrant: each decoder layer's forward runs again inside the backward.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return LossOf(model)


class LstmLM(nn.Module):
    """An embedding, a two-layer ``nn.LSTM`` and a linear head. The LSTM calls its kernel with
    ``self._flat_weights``, a list of its parameters it keeps beside the module's own."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(input_ids))
        return _next_token_loss(self.head(states), labels)


def _lstm(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return LstmLM()


_FROZEN = tuple(
    f"model.model.{name}" for name in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight")
)

SPECIAL_FAMILIES = (
    ZooModel(name="alternating-branch", kind="special", build=_alternating, batch=lm_batch,
             sits_out=("extra.0.weight", "extra.1.weight"), one_call_per_step=True,
             notes="a block used on even steps only"),
    ZooModel(name="llama-frozen", kind="special", build=_llama_frozen, batch=lm_batch,
             needs=("transformers",), never_trained=_FROZEN,
             notes="Llama with its embedding and first block frozen (requires_grad False)"),
    ZooModel(name="outside-use", kind="special", build=_outside_uses, batch=lm_batch,
             notes="F.linear on the embedding's weight, an uncalled LayerNorm's gain and an L2 "
             "penalty in the root's forward"),
    ZooModel(name="llama-checkpointing", kind="special", build=_llama_checkpointing,
             batch=lm_batch, needs=("transformers",),
             notes="activation checkpointing (non-reentrant): layers run again in the backward"),
    ZooModel(name="lstm", kind="special", build=_lstm, batch=lm_batch,
             notes="nn.LSTM: the cuDNN-style flat weight list beside its parameters"),
)  # fmt: skip
