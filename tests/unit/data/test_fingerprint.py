"""Data fingerprints ([Note: same data on every rank] in tidal/train/same_data.py): equal for
the same batches, different when the corpus, the seed or your first batch differs."""

from __future__ import annotations

import numpy as np
import torch

from tidal.data import BatchSampler, DataBatches


def _sampler(tokens: np.ndarray, seed: int = 0) -> BatchSampler:
    return BatchSampler(tokens, batch_size=2, seq_len=8, seed=seed)


def test_a_sampler_fingerprint_follows_the_corpus_and_the_seed() -> None:
    tokens = np.arange(3_000_000, dtype=np.uint16) % 251  # above 64 blocks of 64 KiB: sampled
    same = _sampler(tokens.copy()).fingerprint()
    assert _sampler(tokens).fingerprint() == same
    assert _sampler(tokens, seed=1).fingerprint() != same
    for index in (0, len(tokens) // 2, len(tokens) - 1):  # in the first, a middle, the last block
        changed = tokens.copy()
        changed[index] += 1
        assert _sampler(changed).fingerprint() != same, index
    assert _sampler(tokens[:-1]).fingerprint() != same  # another length


def test_your_data_is_fingerprinted_by_its_first_batch() -> None:
    batch = (torch.arange(8.0).reshape(2, 4), torch.tensor([0, 1]))
    same = DataBatches([batch, batch], batch_size=2).fingerprint()
    assert DataBatches([tuple(t.clone() for t in batch)], batch_size=2).fingerprint() == same
    other = (batch[0] + 1, batch[1])
    assert DataBatches([other, batch], batch_size=2).fingerprint() != same
