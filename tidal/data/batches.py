"""Token splits and deterministic, resumable batches of random windows.

A batch is a pure function of (tokens, seed, index): its window starts come from a generator
seeded with ``[seed, index]``. So a resumed run needs only the next index to continue exactly
where it stopped, and validation can use the same first N batches at every evaluation.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "BatchSampler", "TokenSplits"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, targets)``, both int64 of shape ``(batch_size, seq_len)``."""


# eq=False: the fields are arrays, for which ``==`` is elementwise, not a truth value.
@dataclass(frozen=True, eq=False)
class TokenSplits:
    """A tokenized corpus: 1-D integer ``train`` and ``val`` arrays (in memory or memory-mapped).

    Attributes:
        vocab_size: every token is in ``[0, vocab_size)``.
        name: names the corpus in logs and run records, e.g. ``stdlib-py3.11-1a2b3c4d5e6f``.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str

    def __post_init__(self) -> None:
        for split_name in ("train", "val"):
            _check_token_array(getattr(self, split_name), split_name)
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")


def _check_token_array(tokens: Any, what: str) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D numpy array of tokens, got {tokens!r:.80}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{what}: expected integer tokens, got dtype {tokens.dtype}")


class BatchSampler:
    """Random ``seq_len + 1`` windows of ``tokens``; targets are the inputs shifted by one.

    ``batch(index)`` is stateless. Training uses the stateful ``next_batch()``, whose position
    ``state_dict()`` saves and ``load_state_dict()`` restores.
    """

    def __init__(self, tokens: np.ndarray, *, batch_size: int, seq_len: int, seed: int) -> None:
        _check_token_array(tokens, "tokens")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"a split of {len(tokens)} tokens is too short for seq_len={seq_len}: a window "
                f"needs seq_len + 1 = {seq_len + 1} tokens (use a shorter seq_len or more data)"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.next_index = 0
        self._window_offsets = np.arange(seq_len + 1, dtype=np.int64)

    @property
    def num_window_starts(self) -> int:
        """How many distinct windows the split holds."""
        return len(self.tokens) - self.seq_len

    def batch(self, index: int) -> Batch:
        """Batch number ``index``; the same (tokens, seed, index) always gives the same batch."""
        index = operator.index(index)
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, self.num_window_starts, size=self.batch_size, dtype=np.int64)
        # One gather of all windows touches only the pages they lie on, even in a memmap.
        windows = np.asarray(self.tokens[starts[:, None] + self._window_offsets], dtype=np.int64)
        inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return inputs, targets

    def next_batch(self) -> Batch:
        """``batch(next_index)``, then advance ``next_index``."""
        result = self.batch(self.next_index)
        self.next_index += 1
        return result

    def fixed_batches(self, num_batches: int) -> list[Batch]:
        """Batches ``0 .. num_batches - 1``: the same set on every call (for validation)."""
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        return [self.batch(index) for index in range(num_batches)]

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position. The seed must match: another seed gives other batches."""
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"the saved data sampler used seed {state['seed']} but this one uses seed "
                f"{self.seed}; resuming with another seed would silently change the batches"
            )
        next_index = int(state["next_index"])
        if next_index < 0:
            raise ValueError(f"next_index must be >= 0, got {next_index}")
        self.next_index = next_index
