"""The special cases: a branch taken on alternate steps, frozen parts, parameters used outside
their module, activation checkpointing, a mixture of experts whose idle experts sit out, and a
recurrent layer (torch's LSTM keeps its own list of its parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.testing.zoo.base import VOCAB, LossOf, ZooModel, lm_batch, tokens

if TYPE_CHECKING:  # transformers is optional: the annotation only
    from transformers import LlamaForCausalLM

__all__ = ["SPECIAL_FAMILIES", "AlternatingBranch", "LstmLM", "OutsideUses", "TopOneMoE"]

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
        first = self.body[0]
        assert isinstance(first, nn.Linear)
        penalty = 1e-3 * first.weight.pow(2).sum()
        return _next_token_loss(logits, labels) + penalty


def _outside_uses(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return OutsideUses()


def _llama(seed: int, **extra: Any) -> LlamaForCausalLM:
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
    # Non-reentrant: each decoder layer's forward runs again inside the backward. transformers 5
    # renamed the call (the old name warns, and goes in 6).
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return LossOf(model)


class TopOneMoE(nn.Module):
    """An embedding, a router and expert MLPs that are modules of their own, top 1: each token
    goes to its router's best expert, scaled by that expert's probability, and an expert that no
    token chose is not called, so its parameters sit out the step. (Hugging Face's Mixtral and
    Qwen2-MoE keep their experts in 3-D parameters, which every step trains; its Switch
    Transformers and NLLB-MoE have expert modules but move their router with ``.to()`` in the
    forward.)"""

    def __init__(self, vocab: int = VOCAB, width: int = 16, num_experts: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(num_experts)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        tokens = h.flatten(0, 1)
        weight, choice = self.router(tokens).softmax(dim=-1).max(dim=-1)
        mixed = torch.zeros_like(tokens)
        for expert in choice.unique().tolist():
            rows = (choice == expert).nonzero().squeeze(1)
            out = self.experts[expert](tokens[rows]) * weight[rows, None]
            mixed = mixed.index_add(0, rows, out.to(mixed.dtype))  # autocast: out is bf16
        return _next_token_loss(self.head(h + mixed.view_as(h)), labels)


def _moe(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TopOneMoE()


def _moe_batch(step: int) -> dict[str, torch.Tensor]:
    """16 tokens for 16 experts: about a third of the experts get none in a step."""
    ids = tokens(step, seq_len=4)
    return {"input_ids": ids, "labels": ids}


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
    ZooModel(name="moe-top1", kind="mixture-of-experts", build=_moe, batch=_moe_batch,
             notes="written here: 16 expert modules, top 1; an expert no token chose is not "
             "called, so its parameters sit out"),
    ZooModel(name="lstm", kind="special", build=_lstm, batch=lm_batch,
             notes="nn.LSTM: the cuDNN-style flat weight list beside its parameters"),
)  # fmt: skip
