"""What every zoo family shares: the :class:`ZooModel` record, the loss wrapper of Hugging Face
models, and the deterministic batches (token ids, masked tokens, sequence pairs, images)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "Batch",
    "LossOf",
    "ZooModel",
    "image_batch",
    "lm_batch",
    "masked_lm_batch",
    "seq2seq_batch",
    "tokens",
]

Batch = dict[str, torch.Tensor]

VOCAB = 96
BATCH_ROWS = 4  # even, so two ranks take two rows each
SEQ_LEN = 16


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One family: ``build(seed)`` makes the model, ``batch(step)`` the step's inputs.

    ``build`` seeds the global RNG itself, so the same seed gives the same weights in every
    process; ``batch`` draws from a generator of its own, so it never moves the global RNG
    (whose draws in a forward, layerdrop and dropout, :func:`run_steps` seeds per step).
    """

    name: str
    build: Callable[[int], nn.Module]
    batch: Callable[[int], Batch]
    kind: str = ""  # decoder, encoder, encoder-decoder, vision, mixture-of-experts, special
    needs: tuple[str, ...] = ()  # optional packages
    notes: str = ""  # what the family exercises
    # Parameters that get no gradient in some steps, and those that never get one.
    sits_out: tuple[str, ...] = field(default=())
    never_trained: tuple[str, ...] = field(default=())
    # The forward keeps state across calls (a call counter), so a reference must call it once
    # per step ([Note: the data-parallel reference] in benchmarks/compat_cases.py).
    one_call_per_step: bool = False


class LossOf(nn.Module):
    """A Hugging Face model whose forward returns its ``.loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.model(**batch).loss


def _generator(step: int, offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + offset + step)


def tokens(
    step: int, *, vocab: int = VOCAB, rows: int = BATCH_ROWS, seq_len: int = SEQ_LEN
) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq_len), generator=_generator(step))


def lm_batch(step: int) -> Batch:
    """Next-token prediction: the model shifts the labels itself."""
    ids = tokens(step)
    return {"input_ids": ids, "labels": ids}


MASK_ID = 4  # a token id the masked batches never draw otherwise
_MASKED_FRACTION = 0.25


def masked_lm_batch(step: int) -> Batch:
    """A quarter of the positions masked (at least one per row); only those are labelled."""
    ids = torch.randint(MASK_ID + 1, VOCAB, (BATCH_ROWS, SEQ_LEN), generator=_generator(step))
    draw = torch.rand(ids.shape, generator=_generator(step, offset=500))
    masked = draw < _MASKED_FRACTION
    masked[:, 0] = True
    return {
        "input_ids": torch.where(masked, torch.full_like(ids, MASK_ID), ids),
        "labels": torch.where(masked, ids, torch.full_like(ids, -100)),
    }


def seq2seq_batch(step: int) -> Batch:
    """A source of 16 tokens and a target of 8; the model makes the decoder inputs from the
    labels. Ids start above the special tokens (pad, start, end)."""
    source = torch.randint(3, VOCAB, (BATCH_ROWS, SEQ_LEN), generator=_generator(step))
    target = torch.randint(3, VOCAB, (BATCH_ROWS, SEQ_LEN // 2), generator=_generator(step, 500))
    return {"input_ids": source, "labels": target}


IMAGE_SIZE = 16
NUM_CLASSES = 10


def image_batch(step: int) -> Batch:
    g = _generator(step)
    pixels = torch.randn(BATCH_ROWS, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return {
        "pixel_values": pixels,
        "labels": torch.randint(0, NUM_CLASSES, (BATCH_ROWS,), generator=g),
    }
