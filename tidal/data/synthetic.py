"""Uniform random tokens for benchmarks: any vocabulary size and length, no files."""

from __future__ import annotations

import numpy as np

from tidal.data.batches import TokenSplits

__all__ = ["synthetic_tokens"]

_UNSIGNED_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)
_VAL_FRACTION_DENOMINATOR = 20  # 1/20 = 5% validation, like the stdlib corpus


def smallest_token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id in ``[0, vocab_size)``."""
    for dtype in _UNSIGNED_DTYPES:
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in 64 bits")


def synthetic_tokens(*, vocab_size: int, num_tokens: int, seed: int) -> TokenSplits:
    """``num_tokens`` uniform tokens from ``numpy.random.default_rng(seed)``, split 95/5."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2 (one train and one val token), got {num_tokens}")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=num_tokens, dtype=smallest_token_dtype(vocab_size))
    # Read-only like the memory-mapped stdlib corpus, so no caller comes to rely on writing.
    tokens.flags.writeable = False
    num_val_tokens = max(1, num_tokens // _VAL_FRACTION_DENOMINATOR)
    return TokenSplits(
        train=tokens[:-num_val_tokens],
        val=tokens[-num_val_tokens:],
        vocab_size=vocab_size,
        name=f"synthetic-v{vocab_size}-n{num_tokens}-s{seed}",
    )
