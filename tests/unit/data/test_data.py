"""tidal.data: the stdlib byte corpus and its cache, synthetic tokens, deterministic batches."""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import tidal.data.text as text_module
from tidal.config import ConfigError, from_dict
from tidal.data import (
    BatchSampler,
    DataConfig,
    build_token_splits,
    default_cache_dir,
    is_validation_file,
    load_stdlib_corpus,
    stdlib_corpus_dir,
    stdlib_dir,
    stdlib_source_files,
    synthetic_tokens,
)

# ---------------------------------------------------------------------------------------------
# the real stdlib corpus (built once for the module)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tidal-cache")


@pytest.fixture(scope="module")
def corpus(cache_dir: Path) -> text_module.TokenSplits:
    return load_stdlib_corpus(cache_dir)


def _relative_paths(paths: list[Path], root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in paths]


def test_source_files_are_sorted_stdlib_modules_outside_installed_packages() -> None:
    relative = _relative_paths(stdlib_source_files(), stdlib_dir())
    assert len(relative) > 100
    assert relative == sorted(relative)
    assert {"os.py", "json/__init__.py"} <= set(relative)
    assert all(r.endswith(".py") for r in relative)
    assert not [r for r in relative if {"site-packages", "dist-packages"} & set(r.split("/"))]


def test_about_one_file_in_twenty_goes_to_validation_by_path_hash() -> None:
    relative = _relative_paths(stdlib_source_files(), stdlib_dir())
    val = [r for r in relative if is_validation_file(r)]
    assert val == [r for r in relative if zlib.crc32(r.encode()) % 20 == 0]
    assert 0.02 < len(val) / len(relative) < 0.1


def test_corpus_is_the_sources_split_by_file(corpus: text_module.TokenSplits) -> None:
    root = stdlib_dir()
    files = stdlib_source_files()
    sizes = {r: p.stat().st_size for r, p in zip(_relative_paths(files, root), files, strict=True)}
    val_sizes = {r: n for r, n in sizes.items() if is_validation_file(r)}
    assert corpus.vocab_size == 256
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert len(corpus.train) + len(corpus.val) == sum(sizes.values())
    assert len(corpus.val) == sum(val_sizes.values())
    assert 0 < len(corpus.val) < len(corpus.train)

    # A val file sits in val after every earlier val file, in sorted order.
    val_names = [r for r in val_sizes if val_sizes[r] > 0]
    chosen = val_names[len(val_names) // 2]
    offset = sum(val_sizes[r] for r in val_names[: val_names.index(chosen)])
    expected = (root / chosen).read_bytes()
    assert bytes(corpus.val[offset : offset + len(expected)]) == expected


def test_second_load_reuses_the_cache_without_reading_sources(
    corpus: text_module.TokenSplits, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_reading(path: Path) -> bytes:
        raise AssertionError(f"read {path} although the corpus is cached")

    monkeypatch.setattr(text_module, "_read_source_bytes", no_reading)
    again = load_stdlib_corpus(cache_dir)
    assert isinstance(again.train, np.memmap) and not again.train.flags.writeable
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert again.name == corpus.name == stdlib_corpus_dir(cache_dir).name
    assert [p.name for p in cache_dir.iterdir()] == [corpus.name]


def test_default_cache_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TIDAL_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "tidal"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tidal"


# ---------------------------------------------------------------------------------------------
# the cache build, on a small fake stdlib


@pytest.fixture
def fake_stdlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """A tiny stdlib with two validation files; returns the included files by relative path."""
    root = tmp_path / "fake-stdlib"
    val_names = [n for n in (f"v{i}.py" for i in range(1000)) if is_validation_file(n)][:2]
    train_names = [n for n in ("a.py", "pkg/b.py", "pkg/c.py", "z.py") if not is_validation_file(n)]
    included = {
        name: f"# {name}\n".encode() * (i + 1) for i, name in enumerate(val_names + train_names)
    }
    excluded = {"site-packages/x.py": b"x", "pkg/dist-packages/y.py": b"y", "notes.txt": b"n"}
    for name, data in {**included, **excluded}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    monkeypatch.setattr(text_module, "stdlib_dir", lambda: root)
    return dict(sorted(included.items()))


def _expected_split(files: dict[str, bytes], split: str) -> bytes:
    return b"".join(d for n, d in files.items() if is_validation_file(n) == (split == "val"))


def _assert_fake_corpus(corpus: text_module.TokenSplits, files: dict[str, bytes]) -> None:
    assert bytes(corpus.train) == _expected_split(files, "train")
    assert bytes(corpus.val) == _expected_split(files, "val")


def test_fake_stdlib_source_list(fake_stdlib: dict[str, bytes]) -> None:
    assert _relative_paths(stdlib_source_files(), text_module.stdlib_dir()) == list(fake_stdlib)


def test_a_crashed_build_leaves_no_corpus_and_a_later_build_works(
    fake_stdlib: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir = tmp_path / "cache"
    real_reader = text_module._read_source_bytes
    num_reads = 0

    def crash_on_third_file(path: Path) -> bytes:
        nonlocal num_reads
        num_reads += 1
        if num_reads == 3:
            raise OSError("disk on fire")
        return real_reader(path)

    monkeypatch.setattr(text_module, "_read_source_bytes", crash_on_third_file)
    with pytest.raises(OSError, match="disk on fire"):
        load_stdlib_corpus(cache_dir)
    corpus_dir = stdlib_corpus_dir(cache_dir)
    assert not corpus_dir.exists()
    assert list(cache_dir.iterdir()) == []

    # What a killed builder leaves behind: half-written temporary directories.
    for leftover in (cache_dir / f".{corpus_dir.name}.crashed", Path(f"{corpus_dir}.tmp")):
        leftover.mkdir()
        (leftover / "train.bin").write_bytes(b"half")
    monkeypatch.setattr(text_module, "_read_source_bytes", real_reader)
    _assert_fake_corpus(load_stdlib_corpus(cache_dir), fake_stdlib)
    assert (corpus_dir / "meta.json").is_file()


def test_a_builder_that_loses_the_race_uses_the_winners_corpus(
    fake_stdlib: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tidal.data.text")
    cache_dir = tmp_path / "cache"
    real_reader = text_module._read_source_bytes
    raced = False

    def another_builder_finishes_first(path: Path) -> bytes:
        nonlocal raced
        if not raced:
            raced = True
            load_stdlib_corpus(cache_dir)  # the other process, start to finish
        return real_reader(path)

    monkeypatch.setattr(text_module, "_read_source_bytes", another_builder_finishes_first)
    corpus = load_stdlib_corpus(cache_dir)
    assert raced
    _assert_fake_corpus(corpus, fake_stdlib)
    assert [p.name for p in cache_dir.iterdir()] == [corpus.name]  # the loser's copy is gone
    assert [r.message.startswith("built the stdlib corpus") for r in caplog.records] == [True]


# ---------------------------------------------------------------------------------------------
# batches


def _sampler(tokens: np.ndarray, seed: int = 0) -> BatchSampler:
    return BatchSampler(tokens, batch_size=4, seq_len=8, seed=seed)


def _equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_batch_is_a_function_of_seed_and_index() -> None:
    tokens = np.arange(10_000, dtype=np.int32)
    assert _equal(_sampler(tokens).batch(3), _sampler(tokens).batch(3))
    assert not _equal(_sampler(tokens).batch(3), _sampler(tokens).batch(4))
    assert not _equal(_sampler(tokens).batch(3), _sampler(tokens, seed=1).batch(3))


def test_targets_are_the_next_tokens_of_the_inputs() -> None:
    tokens = np.arange(10_000, dtype=np.int32)  # every token names its own position
    inputs, targets = _sampler(tokens).batch(0)
    assert inputs.shape == targets.shape == (4, 8)
    assert inputs.dtype == targets.dtype == torch.int64
    starts = inputs[:, :1]
    assert torch.equal(inputs, starts + torch.arange(8))
    assert torch.equal(targets, inputs + 1)


def test_windows_reach_the_last_token() -> None:
    exact = np.arange(9, dtype=np.int64)  # seq_len + 1 tokens: a single window
    inputs, targets = _sampler(exact).batch(0)
    assert torch.equal(inputs[0], torch.arange(8)) and torch.equal(targets[0], torch.arange(1, 9))
    two_windows = _sampler(np.arange(10, dtype=np.int64))
    starts = {int(s) for i in range(20) for s in two_windows.batch(i)[0][:, 0]}
    assert starts == {0, 1}
    with pytest.raises(ValueError, match="too short for seq_len=8"):
        _sampler(np.arange(8, dtype=np.int64))


def test_batches_of_the_stdlib_corpus_follow_the_documented_draw(
    corpus: text_module.TokenSplits,
) -> None:
    sampler = BatchSampler(corpus.val, batch_size=3, seq_len=16, seed=7)
    inputs, targets = sampler.batch(5)
    starts = np.random.default_rng([7, 5]).integers(0, len(corpus.val) - 16, size=3)
    for row, start in enumerate(starts):
        window = torch.from_numpy(corpus.val[start : start + 17].astype(np.int64))
        assert torch.equal(inputs[row], window[:-1]) and torch.equal(targets[row], window[1:])


def test_sampler_state_round_trip_continues_the_sequence() -> None:
    tokens = np.arange(10_000, dtype=np.int32)
    first = _sampler(tokens, seed=3)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    assert state == {"next_index": 3, "seed": 3}
    expected = [first.next_batch() for _ in range(2)]

    resumed = _sampler(tokens, seed=3)
    resumed.load_state_dict(state)
    assert all(_equal(resumed.next_batch(), e) for e in expected)
    assert resumed.next_index == 5
    with pytest.raises(ValueError, match="seed"):
        _sampler(tokens, seed=4).load_state_dict(state)


def test_fixed_batches_are_the_first_batches() -> None:
    sampler = _sampler(np.arange(10_000, dtype=np.int32))
    sampler.next_index = 17
    fixed = sampler.fixed_batches(3)
    assert len(fixed) == 3
    assert all(_equal(fixed[i], sampler.batch(i)) for i in range(3))
    assert all(_equal(a, b) for a, b in zip(fixed, sampler.fixed_batches(3), strict=True))


# ---------------------------------------------------------------------------------------------
# synthetic tokens and the config


def test_synthetic_tokens_are_deterministic_and_in_range() -> None:
    a = synthetic_tokens(vocab_size=300, num_tokens=10_000, seed=1)
    b = synthetic_tokens(vocab_size=300, num_tokens=10_000, seed=1)
    c = synthetic_tokens(vocab_size=300, num_tokens=10_000, seed=2)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.train, c.train)
    assert (len(a.train), len(a.val)) == (9_500, 500)
    assert a.train.dtype == np.uint16 and a.vocab_size == 300
    assert max(a.train.max(), a.val.max()) == 299 and min(a.train.min(), a.val.min()) == 0
    assert synthetic_tokens(vocab_size=256, num_tokens=2, seed=0).train.dtype == np.uint8


def test_stdlib_source_needs_a_byte_vocabulary() -> None:
    with pytest.raises(ConfigError) as info:
        build_token_splits(DataConfig(source="stdlib"), vocab_size=64, seed=0)
    assert info.value.key == "model.vocab_size"
    assert "256" in info.value.message


def test_build_token_splits_dispatches(corpus: text_module.TokenSplits, cache_dir: Path) -> None:
    stdlib = build_token_splits(DataConfig(cache_dir=str(cache_dir)), vocab_size=512, seed=0)
    assert stdlib.name == corpus.name and stdlib.vocab_size == 256
    config = DataConfig(source="synthetic", synthetic_num_tokens=1_000)
    synthetic = build_token_splits(config, vocab_size=64, seed=0)
    assert synthetic.vocab_size == 64 and len(synthetic.train) + len(synthetic.val) == 1_000


def test_data_config_validates() -> None:
    with pytest.raises(ConfigError) as info:
        DataConfig(synthetic_num_tokens=1)
    assert info.value.key == "synthetic_num_tokens"
    with pytest.raises(ConfigError, match=r"data\.source"):
        from_dict(DataConfig, {"source": "web"}, path="data")
