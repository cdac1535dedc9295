"""Token splits and deterministic, resumable batches of random windows.

A batch is a pure function of (tokens, seed, index): its window starts come from a generator
seeded with ``[seed, index]``. So a resumed run needs only the next index to continue exactly
where it stopped, and validation can use the same first N batches at every evaluation.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Batch", "BatchSampler", "Batches", "DataBatches", "TokenSplits"]

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

    def fingerprint(self) -> str:
        """What decides the batches, in a few hex digits ([Note: same data on every rank] in
        tidal/train/same_data.py): the corpus (its length and a CRC-32 of up to 65 blocks of
        64 KiB spread over it, so a corpus of any size is read in milliseconds), the seed and
        the shapes."""
        return _digest(
            f"{len(self.tokens)}:{self.tokens.dtype}:{self.seed}:{self.batch_size}:{self.seq_len}",
            _sampled_bytes(self.tokens),
        )

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


class Batches(Protocol):
    """What a training loop draws from: a job's token sampler or a user's own batches."""

    def next_batch(self) -> Batch: ...


class DataBatches:
    """A user's own data as the trainer's batches: ``(inputs, targets)`` pairs from a
    re-iterable (a list, a DataLoader with a seeded generator), in its order, epoch after epoch.

    [Note: data positions]
    A checkpoint keeps how many batches were drawn; a resume draws and drops that many again, so
    it continues with the batch it would have trained next, provided the data gives the same
    batches in the same order each time it is iterated (a DataLoader's shuffle needs a seeded
    ``generator``). Every batch must hold ``batch_size`` rows: each rank trains its slice.
    """

    def __init__(self, data: Iterable[Any], *, batch_size: int) -> None:
        self.data = data
        self.batch_size = batch_size
        self.next_index = 0
        self._iterator: Iterator[Any] | None = None

    def _pair(self, item: Any) -> Batch:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(
                f"each batch must be an (inputs, targets) pair, got {type(item).__name__}"
            )
        inputs, targets = item
        if inputs.shape[0] != self.batch_size:
            raise ValueError(
                f"a batch of {inputs.shape[0]} rows where training.batch_size is {self.batch_size}; "
                f"set training.batch_size={inputs.shape[0]} (or drop_last=True on a DataLoader)"
            )
        return inputs, targets

    def next_batch(self) -> Batch:
        if self._iterator is None:
            self._iterator = iter(self.data)
        try:
            item = next(self._iterator)
        except StopIteration:  # the next epoch
            self._iterator = iter(self.data)
            try:
                item = next(self._iterator)
            except StopIteration:
                raise ValueError("the training data gave no batch at all") from None
        self.next_index += 1
        return self._pair(item)

    def fixed_batches(self, num_batches: int) -> list[Batch]:
        """The first ``num_batches`` batches (all of them if fewer): the same on every call."""
        return [self._pair(item) for _, item in zip(range(num_batches), self.data, strict=False)]

    def fingerprint(self) -> str:
        """The first batch's bytes and shapes, in a few hex digits: your data gives the same
        batches on every rank only if it starts with the same one."""
        if not self.fixed_batches(1):
            return _digest("empty", [])
        inputs, targets = self.fixed_batches(1)[0]
        tensors = [t.detach().cpu().contiguous() for t in (inputs, targets)]
        shapes = ":".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
        return _digest(shapes, [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors])

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Draw again the batches a saved run drew ([Note: data positions])."""
        self._iterator, self.next_index = None, 0
        for _ in range(int(state["next_index"])):
            self.next_batch()


_BLOCK_BYTES = 64 << 10
_NUM_BLOCKS = 65  # odd: the first, the middle and the last block among them


def _sampled_bytes(tokens: np.ndarray) -> list[bytes]:
    """Up to ``_NUM_BLOCKS`` blocks of ``_BLOCK_BYTES`` spread evenly over ``tokens``."""
    flat = tokens.reshape(-1)
    per_block = max(1, _BLOCK_BYTES // flat.itemsize)
    if len(flat) <= per_block * _NUM_BLOCKS:
        return [np.ascontiguousarray(flat).tobytes()]
    starts = np.linspace(0, len(flat) - per_block, _NUM_BLOCKS, dtype=np.int64)
    return [np.ascontiguousarray(flat[s : s + per_block]).tobytes() for s in starts]


def _digest(header: str, blocks: list[bytes]) -> str:
    crc = zlib.crc32(header.encode())
    for block in blocks:
        crc = zlib.crc32(block, crc)
    return f"{crc:08x}"
