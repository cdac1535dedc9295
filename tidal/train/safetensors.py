"""A small writer and reader of the safetensors format, so exports need no extra dependency.

The format (https://github.com/huggingface/safetensors, "Format")::

    8 bytes         N, the header's length, unsigned 64-bit little-endian
    N bytes         a JSON object: {name: {"dtype": "F32", "shape": [...], "data_offsets":
                    [begin, end]}, ..., "__metadata__": {str: str}}, padded with spaces so that
                    the data starts at a multiple of 8
    the rest        every tensor's raw little-endian bytes, row-major, back to back; offsets are
                    relative to the start of this section

The reference reader insists that the tensors' byte ranges tile the data section exactly (no gaps,
no overlap), that metadata values are strings, and that names are unique; this writer keeps to all
three. Tensors that share storage (tied weights) are written once per name, as separate bytes.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch

__all__ = ["DTYPES", "read_safetensors", "read_safetensors_metadata", "write_safetensors"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
_METADATA_KEY = "__metadata__"
# The reference implementation refuses headers above 100 MB; a header is ~100 bytes per tensor.
_MAX_HEADER_BYTES = 100_000_000


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is already contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # An ndarray is a buffer; numpy's stubs declare __buffer__ for Python >= 3.12 only.
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``tensors`` (in the mapping's order) to ``path``, fsync'd; return the file's bytes."""
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    header: dict[str, object] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(v, str)}
        assert not bad, f"safetensors metadata values must be strings: {bad}"
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, tensor in tensors.items():
        if name == _METADATA_KEY or tensor.dtype not in DTYPES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {tensor.dtype} as safetensors")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    path = Path(path)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            if tensor.numel():
                f.write(_raw_bytes(tensor))
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, dict], dict[str, str], int]:
    (length,) = struct.unpack("<Q", f.read(8))
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
    header = json.loads(f.read(length))
    metadata = header.pop(_METADATA_KEY, None) or {}
    return header, metadata, 8 + length


def read_safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (``{}`` when it has none)."""
    path = Path(path)
    with path.open("rb") as f:
        return _read_header(f, path)[1]


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, in the file's byte order, each in its own CPU memory."""
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    with path.open("rb") as f:
        header, _, data_start = _read_header(f, path)
        data_bytes = path.stat().st_size - data_start
        expected_begin = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _BY_NAME.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            shape = info["shape"]
            numel = 1
            for dim in shape:
                numel *= dim
            itemsize = torch.empty((), dtype=dtype).element_size()
            if begin != expected_begin or end - begin != numel * itemsize or end > data_bytes:
                raise ValueError(f"{path}: tensor {name!r} has bad data_offsets {[begin, end]}")
            expected_begin = end
            if numel == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            f.seek(data_start + begin)
            buffer = bytearray(f.read(end - begin))
            out[name] = torch.frombuffer(buffer, dtype=dtype).reshape(shape)
        if expected_begin != data_bytes:
            raise ValueError(f"{path}: {data_bytes - expected_begin} trailing bytes after tensors")
    return out
