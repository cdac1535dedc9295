"""The Python standard library's own ``.py`` source as a byte-level corpus (vocabulary 256).

Every machine that runs tidal has this text offline, so examples and tests train on real code
without a download. A file goes to validation iff ``crc32(relative path) % 20 == 0`` (about 5%);
files are concatenated as raw bytes in sorted path order, so the same Python gives the same corpus
on every machine. It is built once into a cache directory and then memory-mapped read-only.

[Note: atomic cache build]
A corpus directory in the cache is always complete: nothing but ``os.rename`` of a finished
directory ever creates it. A builder writes ``train.bin``, ``val.bin`` and then ``meta.json`` into
a fresh temporary sibling (unique per builder, so leftovers of a crashed build never collide with
a later one), fsyncs them, and renames the sibling into place. A rename onto an existing corpus
fails, which means a concurrent builder won; its corpus is identical, so the loser deletes its
own copy and uses the winner's. Hence "the directory exists" is the whole cache-hit test, and a
crash at any point leaves at worst an unused temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidal.data.batches import TokenSplits

__all__ = [
    "BYTE_VOCAB_SIZE",
    "default_cache_dir",
    "is_validation_file",
    "load_stdlib_corpus",
    "stdlib_corpus_dir",
    "stdlib_dir",
    "stdlib_source_files",
]

logger = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256
_VAL_MODULUS = 20
# Part of the cache key: change it whenever the split or the layout changes.
_SPLIT_RULE = "v1: val iff zlib.crc32(relative_posix_path.encode()) % 20 == 0"
_EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages"})
_SPLITS = ("train", "val")


def stdlib_dir() -> Path:
    """The standard library of the running Python (the base install's, also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files() -> list[Path]:
    """Every ``*.py`` below :func:`stdlib_dir`, outside installed packages, in relative-path order."""
    root = stdlib_dir()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _EXCLUDED_DIR_NAMES]
        found.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted((p for p in found if p.is_file()), key=lambda p: _relative_posix(p, root))


def is_validation_file(relative_posix_path: str) -> bool:
    """The split rule: about one file in 20, chosen by a hash of its path relative to stdlib."""
    path_bytes = relative_posix_path.encode("utf-8", "surrogateescape")
    return zlib.crc32(path_bytes) % _VAL_MODULUS == 0


def default_cache_dir() -> Path:
    """``$TIDAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tidal``, else ``~/.cache/tidal``."""
    if explicit := os.environ.get("TIDAL_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg_cache := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg_cache).expanduser() / "tidal"
    return Path.home() / ".cache" / "tidal"


@dataclass(frozen=True, slots=True)
class _SourceFile:
    path: Path
    relative_path: str
    num_bytes: int

    @property
    def split(self) -> str:
        return "val" if is_validation_file(self.relative_path) else "train"


def _relative_posix(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _scan_sources() -> list[_SourceFile]:
    root = stdlib_dir()
    return [
        _SourceFile(path, _relative_posix(path, root), path.stat().st_size)
        for path in stdlib_source_files()
    ]


def _read_source_bytes(path: Path) -> bytes:
    return path.read_bytes()


def stdlib_corpus_dir(cache_dir: Path | None = None) -> Path:
    """Where :func:`load_stdlib_corpus` keeps (or will keep) this Python's corpus."""
    return _corpus_dir(cache_dir, _scan_sources())


def _corpus_dir(cache_dir: Path | None, sources: list[_SourceFile]) -> Path:
    digest = hashlib.sha256(_SPLIT_RULE.encode())
    for source in sources:
        digest.update(
            f"\n{source.relative_path}\t{source.num_bytes}".encode("utf-8", "surrogateescape")
        )
    major, minor = sys.version_info[:2]
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / f"stdlib-py{major}.{minor}-{digest.hexdigest()[:12]}"


def load_stdlib_corpus(cache_dir: Path | None = None) -> TokenSplits:
    """The stdlib byte corpus, built on first use (see [Note: atomic cache build])."""
    sources = _scan_sources()
    corpus_dir = _corpus_dir(cache_dir, sources)
    if not corpus_dir.is_dir():
        _build_corpus(sources, corpus_dir)
    return _open_corpus(corpus_dir)


def _build_corpus(sources: list[_SourceFile], corpus_dir: Path) -> None:
    """See [Note: atomic cache build]."""
    start_s = time.perf_counter()
    corpus_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{corpus_dir.name}.", dir=corpus_dir.parent))
    try:
        meta = _write_corpus(sources, tmp_dir)
        tmp_dir.chmod(0o755)  # mkdtemp makes it private; a cache may be shared
        won = _rename_unless_exists(tmp_dir, corpus_dir)
    finally:
        # Still there after a failure or a lost race; after a won rename it is gone.
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if won:
        logger.info(
            "built the stdlib corpus in %.1fs: files %s, bytes %s -> %s",
            time.perf_counter() - start_s,
            meta["num_files"],
            meta["num_bytes"],
            corpus_dir,
        )


def _write_corpus(sources: list[_SourceFile], out_dir: Path) -> dict[str, Any]:
    num_files = dict.fromkeys(_SPLITS, 0)
    num_bytes = dict.fromkeys(_SPLITS, 0)
    with (
        (out_dir / "train.bin").open("wb") as train_out,
        (out_dir / "val.bin").open("wb") as val_out,
    ):
        outputs = {"train": train_out, "val": val_out}
        for source in sources:
            data = _read_source_bytes(source.path)
            outputs[source.split].write(data)
            num_files[source.split] += 1
            num_bytes[source.split] += len(data)
        for out in outputs.values():
            _flush_to_disk(out)
    major, minor, micro = sys.version_info[:3]
    meta = {
        "python_version": f"{major}.{minor}.{micro}",
        "split_rule": _SPLIT_RULE,
        "num_files": num_files,
        "num_bytes": num_bytes,
    }
    with (out_dir / "meta.json").open("w") as meta_out:
        json.dump(meta, meta_out, indent=2)
        _flush_to_disk(meta_out)
    return meta


def _flush_to_disk(file: Any) -> None:
    # Without this a power loss after the rename could publish a directory of empty files.
    file.flush()
    os.fsync(file.fileno())


def _rename_unless_exists(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst``; False when ``dst`` already exists (another builder won)."""
    try:
        os.rename(src, dst)
    except OSError:
        if dst.is_dir():
            return False
        raise
    return True


def _open_corpus(corpus_dir: Path) -> TokenSplits:
    meta_path = corpus_dir / "meta.json"
    if not meta_path.is_file():
        raise RuntimeError(
            f"{corpus_dir} is not a tidal corpus (no meta.json); delete it to rebuild"
        )
    meta = json.loads(meta_path.read_text())
    train, val = (_open_split(corpus_dir / f"{s}.bin", meta["num_bytes"][s]) for s in _SPLITS)
    return TokenSplits(train=train, val=val, vocab_size=BYTE_VOCAB_SIZE, name=corpus_dir.name)


def _open_split(path: Path, expected_num_bytes: int) -> np.ndarray:
    num_bytes = path.stat().st_size
    if num_bytes != expected_num_bytes:
        raise RuntimeError(
            f"{path} holds {num_bytes} bytes but meta.json records {expected_num_bytes}; "
            f"delete {path.parent} to rebuild it"
        )
    if num_bytes == 0:  # mmap cannot map an empty file
        empty = np.empty(0, dtype=np.uint8)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=np.uint8, mode="r")
