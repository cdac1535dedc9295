"""Bit-for-bit comparison of nested checkpoint trees, for tests."""

from __future__ import annotations

import torch

__all__ = ["assert_equal_tree"]


def assert_equal_tree(a: object, b: object, path: str = "state") -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit; ``path`` names a miss."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_equal_tree(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    else:
        assert a == b, path
