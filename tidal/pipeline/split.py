"""Split a decoder-only language model into pipeline stage modules.

``split_model(model, block_ranges)`` cuts a model into ``len(block_ranges)`` :class:`PipelineStage`
modules. Stage ``s`` holds the transformer blocks ``block_ranges[s] = (start, end)``; the first
stage also holds the embeddings, the last the final norm, the LM head and the loss. Composing the
stages (each one's output into the next one's input) computes what the whole model computes.

Supported models: tidal's :class:`~tidal.models.GPT`, Hugging Face ``LlamaForCausalLM``
(``model.embed_tokens``, ``.layers``, ``.norm``, ``.rotary_emb``, ``lm_head``) and
``GPT2LMHeadModel`` (``transformer.wte/wpe/drop/h/ln_f``, ``lm_head``), the latter two with sdpa
attention. transformers itself is never imported here: models are recognised by their
``config.model_type`` and layout.

[Note: stage boundaries]
Exactly one tensor crosses a boundary: the residual stream ``x_BTD`` (``[B, T, D]``, the
model's activation dtype), forward as the activation and backward as its gradient. Nothing else
has to, because everything else a block needs is a function of the sequence length alone and
each stage recomputes it: positions are ``arange(T)``, a LLaMA stage runs its own copy of
``rotary_emb`` on them (a few ``T x head_dim`` tensors, cheaper to recompute than to send),
and causality needs no mask (sdpa with ``attention_mask=None`` is causal). Token ids enter at the
first stage and targets at the last one; they come from the data loader, not from a neighbour.
One tensor per boundary keeps the runtime's point-to-point protocol a fixed-shape send/receive
pair per microbatch and direction.

[Note: loss convention]
The last stage returns ``F.cross_entropy(logits.float(), targets)`` averaged over the
microbatch's tokens: the fp32 mean next-token cross-entropy of ``GPT.forward``. ``targets_BT``
are already shifted (``targets[:, t]`` is the token after position ``t``), for Hugging Face
models too: HF's ``model(input_ids, labels=labels)`` shifts inside, and equals this stage's loss
with ``targets = cat(labels[:, 1:], -100)`` (``-100`` is ignored by both).

[Note: tied embeddings across stages]
A token embedding tied to the LM head is one parameter in the model but lives in two stages (the
first and the last) after a split with two or more stages: each stage owns deep copies of its
submodules, so stages can sit in one process and be updated independently. The copies start
equal; :func:`tied_parameters` lists them so the runtime can sum their gradients (the model's
gradient of the tied weight is that sum) and both stay equal after every update. With one stage
the tie is kept: a single parameter.
"""

# Shape suffixes: B batch, T sequence, D d_model, V vocab.

from __future__ import annotations

import copy
import enum
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ConfigError, require
from tidal.models.gpt import GPT

__all__ = [
    "DecoderFamily",
    "PipelineStage",
    "block_container",
    "decoder_family",
    "even_ranges",
    "num_blocks",
    "split_gpt",
    "split_model",
    "tied_parameters",
    "validate_block_ranges",
]

SUPPORTED = (
    "tidal GPT, Hugging Face LlamaForCausalLM (model_type 'llama') and GPT2LMHeadModel "
    "(model_type 'gpt2'), the latter two with attn_implementation='sdpa'"
)


class DecoderFamily(enum.StrEnum):
    """Model layouts :func:`split_model` knows how to cut."""

    TIDAL_GPT = "tidal-gpt"
    HF_LLAMA = "hf-llama"
    HF_GPT2 = "hf-gpt2"


# ---------------------------------------------------------------------------------------------
# the first and last stage's extra parts


class _TokenAndPositionEmbed(nn.Module):
    """Token plus learned position embeddings, then dropout (tidal GPT and GPT-2)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = tok, pos, drop

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        seq_len = idx_BT.shape[1]
        if seq_len > self.pos.num_embeddings:
            raise ValueError(
                f"sequence length {seq_len} is longer than the model's "
                f"{self.pos.num_embeddings} positions"
            )
        pos_T = torch.arange(seq_len, device=idx_BT.device)
        return self.drop(self.tok(idx_BT) + self.pos(pos_T))


class _TokenEmbed(nn.Module):
    """Token embeddings alone (LLaMA: positions enter through rotary embeddings)."""

    def __init__(self, tok: nn.Embedding) -> None:
        super().__init__()
        self.tok = tok

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok(idx_BT)


class _NormHead(nn.Module):
    """Final norm, then the LM head: hidden states to logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x_BTD))


# ---------------------------------------------------------------------------------------------
# the stage


class PipelineStage(nn.Module):
    """One contiguous slice of a decoder: [embeddings] + blocks + [final norm, head and loss].

    The first stage takes token ids ``[B, T]`` (long), the others the hidden state ``[B, T, D]``;
    every stage but the last returns the hidden state, the last the mean next-token
    cross-entropy of the microbatch ([Note: loss convention]). ``source_names`` maps each of
    the stage's parameter names to the name of the model parameter it was copied from.
    """

    def __init__(
        self,
        *,
        stage_index: int,
        num_stages: int,
        family: DecoderFamily,
        embed: nn.Module | None,
        layers: Sequence[nn.Module],
        head: nn.Module | None,
        rotary: nn.Module | None = None,
        first_block: int = 0,
    ) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.family = family
        self.first_block = first_block  # the model's index of layers[0]
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.head = head
        self.rotary = rotary  # LLaMA only: each stage recomputes the rotary tables it needs
        self.source_names: dict[str, str] = {}

    @property
    def block_range(self) -> tuple[int, int]:
        return (self.first_block, self.first_block + len(self.layers))

    def forward(self, x: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        x_BTD = self.embed(x) if self.embed is not None else x
        x_BTD = self._run_layers(x_BTD)
        if self.head is None:
            return x_BTD
        if targets_BT is None:
            raise ValueError(
                f"stage {self.stage_index} is the last stage: it needs targets_BT to compute the loss"
            )
        logits_BTV = self.head(x_BTD)
        # fp32 softmax, as GPT.forward: see [Note: loss convention].
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())

    def _run_layers(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            for layer in self.layers:
                x_BTD = layer(x_BTD)
            return x_BTD
        position_ids = torch.arange(x_BTD.shape[1], device=x_BTD.device).unsqueeze(0)
        position_embeddings = self.rotary(x_BTD, position_ids=position_ids)
        for layer in self.layers:
            # attention_mask=None: sdpa is causal then (see [Note: stage boundaries]).
            x_BTD = layer(
                x_BTD,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        return x_BTD


# ---------------------------------------------------------------------------------------------
# block ranges


def validate_block_ranges(block_ranges: Sequence[tuple[int, int]], num_blocks: int) -> None:
    """Raise :class:`ConfigError` unless ``block_ranges`` cut ``num_blocks`` blocks contiguously
    into stages that each hold something (only the first and last may hold zero blocks)."""
    ranges = [tuple(r) for r in block_ranges]
    require(len(ranges) >= 1, "block_ranges", "need at least one stage, got none")
    expected = 0
    for s, (start, end) in enumerate(ranges):
        require(
            start == expected and start <= end,
            "block_ranges",
            f"stage {s} has blocks ({start}, {end}) but must start at block {expected} and not end "
            f"before it; give contiguous (start, end) ranges covering blocks 0..{num_blocks}",
        )
        is_edge = s == 0 or s == len(ranges) - 1
        require(
            is_edge or end > start,
            "block_ranges",
            f"stage {s} would hold nothing: only the first stage (embeddings) and the last (head) "
            "may hold zero blocks; use fewer stages or move a block into it",
        )
        expected = end
    require(
        expected == num_blocks,
        "block_ranges",
        f"ranges end at block {expected} but the model has {num_blocks} blocks; the last range "
        f"must end at {num_blocks}",
    )


def even_ranges(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``num_blocks`` blocks over ``num_stages`` stages, sizes differing by
    at most one; the first ``num_blocks % num_stages`` stages get the extra block."""
    require(num_stages >= 1, "num_stages", f"must be >= 1, got {num_stages}")
    require(
        num_stages <= num_blocks,
        "num_stages",
        f"{num_stages} stages for {num_blocks} blocks: use at most {num_blocks} stages, or give "
        "block_ranges with an embedding-only first or head-only last stage",
    )
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# ---------------------------------------------------------------------------------------------
# model families


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def decoder_family(model: nn.Module) -> DecoderFamily:
    """Which layout ``model`` has; :class:`ConfigError` naming the supported kinds if none."""
    if isinstance(model, GPT):
        return DecoderFamily.TIDAL_GPT
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family: DecoderFamily | None = None
    if model_type == "llama" and all(
        hasattr(getattr(model, "model", None), a)
        for a in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        family = DecoderFamily.HF_LLAMA
    elif model_type == "gpt2" and hasattr(model, "transformer"):
        family = DecoderFamily.HF_GPT2
        require(
            not getattr(model.config, "add_cross_attention", False),
            "model",
            "GPT-2 with cross-attention cannot be split; use a decoder-only GPT2LMHeadModel",
        )
    if family is None or not hasattr(model, "lm_head"):
        raise ConfigError(
            "model", f"cannot split a {type(model).__name__}: supported are {SUPPORTED}"
        )
    impl = _attn_implementation(model)
    require(
        impl == "sdpa",
        "model",
        f"{type(model).__name__} uses attn_implementation={impl!r}; stages rely on sdpa's causal "
        "attention without a mask: load it with attn_implementation='sdpa' "
        "(or call model.set_attn_implementation('sdpa'))",
    )
    return family


def block_container(model: nn.Module) -> str:
    """The dotted path of ``model``'s list of transformer blocks."""
    return {
        DecoderFamily.TIDAL_GPT: "blocks",
        DecoderFamily.HF_LLAMA: "model.layers",
        DecoderFamily.HF_GPT2: "transformer.h",
    }[decoder_family(model)]


def num_blocks(model: nn.Module) -> int:
    """How many transformer blocks ``model`` has."""
    return len(model.get_submodule(block_container(model)))


def _parts(
    model: nn.Module, family: DecoderFamily
) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module | None]:
    """(embed, blocks, head, rotary) wrappers around the model's own submodules."""
    if family is DecoderFamily.TIDAL_GPT:
        embed = _TokenAndPositionEmbed(model.tok_embed, model.pos_embed, model.drop)
        return embed, model.blocks, _NormHead(model.ln_f, model.lm_head), None
    if family is DecoderFamily.HF_LLAMA:
        inner = model.model
        head = _NormHead(inner.norm, model.lm_head)
        return _TokenEmbed(inner.embed_tokens), inner.layers, head, inner.rotary_emb
    inner = model.transformer
    embed = _TokenAndPositionEmbed(inner.wte, inner.wpe, inner.drop)
    return embed, inner.h, _NormHead(inner.ln_f, model.lm_head), None


def _split(
    model: nn.Module, family: DecoderFamily, block_ranges: Sequence[tuple[int, int]]
) -> list[PipelineStage]:
    embed, blocks, head, rotary = _parts(model, family)
    validate_block_ranges(block_ranges, len(blocks))
    model_names = {id(p): name for name, p in model.named_parameters()}
    num_stages = len(block_ranges)
    stages = []
    for s, (start, end) in enumerate(block_ranges):
        is_last = s == num_stages - 1
        # Built around the model's own modules first, so names map back by identity...
        shell = PipelineStage(
            stage_index=s,
            num_stages=num_stages,
            family=family,
            embed=embed if s == 0 else None,
            layers=list(blocks[start:end]),
            head=head if is_last else None,
            rotary=rotary if end > start else None,
            first_block=start,
        )
        shell.source_names = {
            name: model_names[id(p)] for name, p in shell.named_parameters(remove_duplicate=False)
        }
        # ...then deep-copied: one copy per stage breaks a cross-stage tie and keeps an
        # in-stage one (see [Note: tied embeddings across stages]).
        stages.append(copy.deepcopy(shell))
    return stages


def split_gpt(model: GPT, block_ranges: Sequence[tuple[int, int]]) -> list[PipelineStage]:
    """Stages of a tidal :class:`GPT`; ``block_ranges[s] = (start, end)`` are stage ``s``'s blocks."""
    return _split(model, DecoderFamily.TIDAL_GPT, block_ranges)


def split_model(model: nn.Module, block_ranges: Sequence[tuple[int, int]]) -> list[PipelineStage]:
    """Stages of a tidal GPT or a Hugging Face LLaMA / GPT-2 decoder (see the module docstring)."""
    return _split(model, decoder_family(model), block_ranges)


def tied_parameters(
    stages: Sequence[PipelineStage],
) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Pairs ``((stage, name), (stage, name))`` of stage parameters that are one model weight.

    Each pair's first member is the first occurrence (lowest stage); a weight held by more than
    two stages gives one pair per extra copy. Empty when nothing is tied across stages.
    """
    first: dict[str, tuple[int, str]] = {}
    pairs = []
    for s, stage in enumerate(stages):
        for name, _ in stage.named_parameters():  # a tie inside one stage is one parameter
            source = stage.source_names[name]
            if source in first:
                pairs.append((first[source], (s, name)))
            else:
                first[source] = (s, name)
    return pairs
