"""The NVMe tier: chunk payloads in files of a directory, read and written by a thread pool.

[Note: nvme tier]
The third tier holds what the host cannot: first what is touched once per step, fp32 master and
optimizer-state shards (AdamW's 12 of every 14 bytes of model data per parameter in bf16), then,
when the host is shorter still, parameter and gradient shards ([Note: nvme placement] in
tidal/sharding/swap.py). Each payload gets its own file, created at its full size once and
rewritten in place, so a step's traffic is plain ``pwrite``/``preadv`` of whole payloads: the
largest sequential requests a disk can serve, with no allocator or file-system metadata work in
the steady state. Checkpoints read and write ranges of those files (a rank's piece of one
parameter). Reads and writes run on a small thread pool (the GIL is released during the system
calls), so the optimizer updates one chunk while the next is read and the previous one written
([Note: streamed optimizer]), and parameter shards are read while the model computes. Like the
other tiers it keeps a byte budget (``memory.nvme_budget``) that it refuses to exceed and counts
what it holds and what crossed in and out of it. Files are removed when the tier closes (or the
process ends); a crashed run leaves a folder named after its process (``tidal-<pid>-<random>``,
one per tier) that the next run in the same directory removes. Checkpoints never point into this folder: it is scratch space, not
storage.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tidal.config import ConfigError, format_bytes

__all__ = ["NvmeTier"]


class NvmeTier:
    """Payload files under ``directory`` with a byte budget; see [Note: nvme tier]."""

    def __init__(
        self, directory: str | Path, *, budget_bytes: int | None, threads: int = 4
    ) -> None:
        base = Path(directory)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError("memory.nvme_dir", f"cannot create {base}: {err}") from err
        _remove_dead_folders(base)
        # One folder per tier: several engines of one process (or of one test) may share a dir.
        self.directory = Path(tempfile.mkdtemp(prefix=f"tidal-{os.getpid()}-", dir=base))
        self.budget_bytes = budget_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tidal-nvme")
        self._files: dict[str, tuple[int, int]] = {}  # key -> (file descriptor, bytes)
        self._held_bytes = 0
        self.peak_bytes = 0
        self.bytes_in = 0
        self.bytes_out = 0
        atexit.register(self.close)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def holds(self, key: str) -> bool:
        return key in self._files

    def write(
        self, key: str, tensor: torch.Tensor, *, offset_bytes: int | None = None
    ) -> Future[None]:
        """Start writing ``tensor`` (contiguous, CPU) to ``key``'s file: the whole file, or with
        ``offset_bytes`` a range inside a file written whole before. The caller keeps the
        tensor alive and unchanged until the future is done."""
        assert tensor.device.type == "cpu" and tensor.is_contiguous(), tensor.device
        num_bytes = tensor.nbytes
        if offset_bytes is None:
            fd, offset_bytes = self._file(key, num_bytes), 0
        else:
            fd = self._range(key, offset_bytes, num_bytes)
        self.bytes_in += num_bytes
        return self._pool.submit(_pwrite_all, fd, _bytes_of(tensor), offset_bytes)

    def read(self, key: str, out: torch.Tensor, *, offset_bytes: int | None = None) -> Future[None]:
        """Start reading ``key``'s file into ``out`` (contiguous, CPU): the whole file (``out``
        has its size), or with ``offset_bytes`` the range of ``out``'s size there."""
        assert out.device.type == "cpu" and out.is_contiguous(), out.device
        if offset_bytes is None:
            fd, num_bytes = self._files[key]
            assert out.nbytes == num_bytes, (key, out.nbytes, num_bytes)
            offset_bytes = 0
        else:
            fd = self._range(key, offset_bytes, out.nbytes)
        self.bytes_out += out.nbytes
        return self._pool.submit(_pread_all, fd, _bytes_of(out), offset_bytes)

    def _range(self, key: str, offset_bytes: int, num_bytes: int) -> int:
        fd, size = self._files[key]
        assert offset_bytes >= 0 and offset_bytes + num_bytes <= size, (key, offset_bytes, size)
        return fd

    def _file(self, key: str, num_bytes: int) -> int:
        if key in self._files:
            fd, size = self._files[key]
            assert size == num_bytes, f"{key}: {num_bytes} bytes into a file of {size}"
            return fd
        if self.budget_bytes is not None and self._held_bytes + num_bytes > self.budget_bytes:
            raise ConfigError(
                "memory.nvme_budget",
                f"{format_bytes(self.budget_bytes)} is too small: {key} needs "
                f"{format_bytes(num_bytes)} more with {format_bytes(self._held_bytes)} held; "
                f"raise it or leave it unset (no limit)",
            )
        fd = os.open(self.directory / key, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, num_bytes)
        self._files[key] = (fd, num_bytes)
        self._held_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        return fd

    def stats(self) -> dict[str, int | None]:
        return {"held_bytes": self._held_bytes, "peak_bytes": self.peak_bytes,
                "in_bytes": self.bytes_in, "out_bytes": self.bytes_out,
                "budget_bytes": self.budget_bytes}  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if not tensor.nbytes:
        return memoryview(b"")
    # An ndarray is a buffer; numpy's stubs declare __buffer__ for Python >= 3.12 only.
    return memoryview(tensor.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"unexpected end of file after {done} of {len(view)} bytes")
        done += got


def _remove_dead_folders(base: Path) -> None:
    for path in base.glob("tidal-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
