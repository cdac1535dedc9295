"""Training data: the stdlib byte corpus, synthetic tokens, and deterministic batches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tidal.config import ConfigError, require
from tidal.data.batches import Batch, Batches, BatchSampler, DataBatches, TokenSplits
from tidal.data.synthetic import smallest_token_dtype, synthetic_tokens
from tidal.data.text import (
    BYTE_VOCAB_SIZE,
    default_cache_dir,
    is_validation_file,
    load_stdlib_corpus,
    stdlib_corpus_dir,
    stdlib_dir,
    stdlib_source_files,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "Batch",
    "BatchSampler",
    "Batches",
    "DataBatches",
    "DataConfig",
    "TokenSplits",
    "build_token_splits",
    "default_cache_dir",
    "is_validation_file",
    "load_stdlib_corpus",
    "smallest_token_dtype",
    "stdlib_corpus_dir",
    "stdlib_dir",
    "stdlib_source_files",
    "synthetic_tokens",
]

DataSource = Literal["stdlib", "synthetic"]
_SOURCES: tuple[DataSource, ...] = ("stdlib", "synthetic")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The ``[data]`` section of a recipe.

    Attributes:
        source: ``stdlib`` (the Python standard library's source as bytes, vocabulary 256) or
            ``synthetic`` (uniform random tokens over the model's vocabulary, for benchmarks).
        cache_dir: where the stdlib corpus is cached; ``None`` means ``$TIDAL_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/tidal``, else ``~/.cache/tidal``.
        synthetic_num_tokens: length of the synthetic token stream (train and val together).
    """

    source: DataSource = "stdlib"
    cache_dir: str | None = None
    synthetic_num_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        require(
            self.source in _SOURCES,
            "source",
            f"expected one of {', '.join(map(repr, _SOURCES))}, got {self.source!r}",
        )
        require(
            self.synthetic_num_tokens >= 2,
            "synthetic_num_tokens",
            f"must be >= 2 (one train and one val token), got {self.synthetic_num_tokens}",
        )


def build_token_splits(config: DataConfig, *, vocab_size: int, seed: int) -> TokenSplits:
    """The token splits ``config`` names, for a model with ``vocab_size`` embeddings."""
    if config.source == "stdlib":
        if vocab_size < BYTE_VOCAB_SIZE:
            raise ConfigError(
                "model.vocab_size",
                f"the byte-level stdlib corpus needs a vocabulary of at least "
                f"{BYTE_VOCAB_SIZE}, got {vocab_size} (or set data.source = 'synthetic')",
            )
        cache_dir = Path(config.cache_dir) if config.cache_dir is not None else None
        return load_stdlib_corpus(cache_dir)
    if config.source == "synthetic":
        require(vocab_size >= 1, "model.vocab_size", f"must be >= 1, got {vocab_size}")
        return synthetic_tokens(
            vocab_size=vocab_size, num_tokens=config.synthetic_num_tokens, seed=seed
        )
    raise ConfigError("data.source", f"expected one of {_SOURCES}, got {config.source!r}")
