"""Split a decoder-only language model into pipeline stage modules.

``split_parts(model, parts, block_ranges)`` cuts a model into ``len(block_ranges)``
:class:`PipelineStage` modules. Stage ``s`` holds the transformer blocks ``block_ranges[s] =
(start, end)``; the first stage also holds the embeddings, the last the final norm, the LM head
and the loss. Composing the stages (each one's output into the next one's input) computes what
the whole model computes.

This layer knows no model: ``parts`` (:class:`StageParts`) says where a decoder keeps its
embedding, its blocks and its head, and what else its blocks take. A model's ``ModelSpec`` (a
layer above) gives them: ``spec.split(model, block_ranges)`` is ``split_parts`` over the parts
of tidal's GPT or of a Hugging Face LLaMA / GPT-2.

[Note: stage boundaries]
Exactly one tensor crosses a boundary: the residual stream ``x_BTD`` (``[B, T, D]``, the
model's activation dtype), forward as the activation and backward as its gradient. Nothing else
has to, because everything else a block needs is a function of the sequence length alone and
each stage recomputes it: positions are ``arange(T)``, a LLaMA stage runs its own copy of
``rotary_emb`` on them (a few ``T x head_dim`` tensors, cheaper to recompute than to send),
and causality needs no mask (sdpa with ``attention_mask=None`` is causal); a stage computes
what its blocks take besides the stream with ``StageParts.block_inputs``. Token ids enter at the
first stage and targets at the last one; they come from the data loader, not from a neighbour.
One tensor per boundary keeps the runtime's point-to-point protocol a fixed-shape send/receive
pair per microbatch and direction.

[Note: loss convention]
The last stage returns ``F.cross_entropy(logits.float(), targets)`` averaged over the
microbatch's tokens: the fp32 mean next-token cross-entropy that tidal's GPT's forward takes. ``targets_BT``
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import require

__all__ = [
    "NormHead",
    "PipelineStage",
    "StageParts",
    "TokenAndPositionEmbed",
    "TokenEmbed",
    "even_ranges",
    "split_parts",
    "tied_parameters",
    "whole_model_stage",
    "validate_block_ranges",
]


@dataclass(kw_only=True, frozen=True)
class StageParts:
    """Where a decoder keeps what its stages hold: modules of the model itself (the wrappers
    below hold the model's own submodules), so parameter names map back by identity."""

    embed: nn.Module | None  # token ids [B, T] -> the residual stream [B, T, D]; None: none
    blocks: nn.ModuleList  # the model's transformer blocks, in order
    head: nn.Module | None  # [B, T, D] -> logits [B, T, V]; None: the loss takes the stream
    # [B, T, D] -> the keyword arguments every block takes besides the stream (LLaMA's positions
    # and rotary tables); None: blocks take the stream alone. [Note: stage boundaries]
    block_inputs: nn.Module | None = None
    container: str  # the dotted path of ``blocks`` in the model (profiles name units by it)
    # (output, targets) -> the microbatch's mean loss; None: [Note: loss convention]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


# ---------------------------------------------------------------------------------------------
# the first and last stage's extra parts


class TokenAndPositionEmbed(nn.Module):
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


class TokenEmbed(nn.Module):
    """Token embeddings alone (LLaMA: positions enter through rotary embeddings)."""

    def __init__(self, tok: nn.Embedding) -> None:
        super().__init__()
        self.tok = tok

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok(idx_BT)


class NormHead(nn.Module):
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
    the stage's parameter names to the name of the model parameter it was copied from,
    ``source_buffers`` each persistent buffer's likewise.
    """

    def __init__(
        self,
        *,
        stage_index: int,
        num_stages: int,
        embed: nn.Module | None,
        layers: Sequence[nn.Module],
        head: nn.Module | None,
        block_inputs: nn.Module | None = None,
        first_block: int = 0,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        model_loss: bool = False,
    ) -> None:
        """``model_loss``: the one layer is a whole model that takes the targets and returns
        its loss (:func:`whole_model_stage`)."""
        super().__init__()
        assert not model_loss or (len(layers) == 1 and embed is head is None), "one whole model"
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.first_block = first_block  # the model's index of layers[0]
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.head = head
        self.block_inputs = block_inputs  # each stage recomputes what its blocks take
        self.loss_fn = loss_fn  # the last stage's; None: [Note: loss convention]
        self.model_loss = model_loss
        self.source_names: dict[str, str] = {}
        self.source_buffers: dict[str, str] = {}  # the persistent buffers' model names

    @property
    def block_range(self) -> tuple[int, int]:
        return (self.first_block, self.first_block + len(self.layers))

    def forward(self, x: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        if self.model_loss:
            return self.layers[0](x, targets_BT)
        x_BTD = self.embed(x) if self.embed is not None else x
        kwargs = self.block_inputs(x_BTD) if self.block_inputs is not None else {}
        for layer in self.layers:
            x_BTD = layer(x_BTD, **kwargs)
        if not self.is_last:
            return x_BTD
        if targets_BT is None:
            raise ValueError(
                f"stage {self.stage_index} is the last stage: it needs targets_BT to compute the loss"
            )
        out = self.head(x_BTD) if self.head is not None else x_BTD
        if self.loss_fn is not None:
            return self.loss_fn(out, targets_BT)
        # fp32 softmax, as GPT.forward: see [Note: loss convention].
        return F.cross_entropy(out.float().flatten(0, 1), targets_BT.flatten())


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
# splitting


def split_parts(
    model: nn.Module,
    parts: StageParts,
    block_ranges: Sequence[tuple[int, int]],
    *,
    copy_stages: bool = True,
) -> list[PipelineStage]:
    """Stages of ``model`` whose parts are ``parts``; ``block_ranges[s] = (start, end)`` are
    stage ``s``'s blocks (see the module docstring). ``copy_stages=False``: each stage holds
    ``model``'s own modules, not copies, so that a layout made for ``model``'s module paths
    finds them ([Note: planned pipeline stages] in tidal/train/plan_stage.py); a weight tied
    across stages is then one parameter of this process's model, which is right only where
    each process trains stages that do not share it (every rank builds its own model)."""
    validate_block_ranges(block_ranges, len(parts.blocks))
    model_names = {id(p): name for name, p in model.named_parameters()}
    state_names = set(model.state_dict())  # a non-persistent buffer is not the model's state
    model_buffers = {id(b): name for name, b in model.named_buffers() if name in state_names}
    num_stages = len(block_ranges)
    stages = []
    for s, (start, end) in enumerate(block_ranges):
        # Built around the model's own modules first, so names map back by identity...
        shell = PipelineStage(
            stage_index=s,
            num_stages=num_stages,
            embed=parts.embed if s == 0 else None,
            layers=list(parts.blocks[start:end]),
            head=parts.head if s == num_stages - 1 else None,
            block_inputs=parts.block_inputs if end > start else None,
            first_block=start,
            loss_fn=parts.loss_fn if s == num_stages - 1 else None,
        )
        shell.source_names = {
            name: model_names[id(p)] for name, p in shell.named_parameters(remove_duplicate=False)
        }
        shell.source_buffers = {name: model_buffers[id(b)] for name, b in shell.named_buffers()
                                if id(b) in model_buffers}  # fmt: skip
        # ...then deep-copied: one copy per stage breaks a cross-stage tie and keeps an
        # in-stage one (see [Note: tied embeddings across stages]).
        stages.append(copy.deepcopy(shell) if copy_stages else shell)
    return stages


def whole_model_stage(
    model: nn.Module,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> PipelineStage:
    """``model`` as the one stage of a schedule, itself and not a copy (a transform that hooks
    into the model's own forward, a plan's layout, stays in force): the loss is ``loss_fn(
    model(x), targets)``, or with no ``loss_fn`` ``model(x, targets)`` (tidal's GPT takes its
    own)."""
    stage = PipelineStage(stage_index=0, num_stages=1, embed=None, layers=[model], head=None,
                          loss_fn=loss_fn, model_loss=loss_fn is None)  # fmt: skip
    state_names = set(model.state_dict())
    first = {id(p): name for name, p in model.named_parameters()}  # a tied weight's first name
    stage.source_names = {f"layers.0.{name}": first[id(p)]
                          for name, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip
    stage.source_buffers = {f"layers.0.{name}": name for name, _ in model.named_buffers()
                            if name in state_names}  # fmt: skip
    return stage


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
