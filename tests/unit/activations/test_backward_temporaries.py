"""[Note: backward temporaries] in tidal/activations/measure.py: what a backward holds for a
while, beyond what it leaves behind."""

from __future__ import annotations

import torch

from tidal.activations.measure import backward_temporary_bytes


def test_a_heads_backward_holds_its_logits_gradient() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 1000)
    x = torch.randn(8, 16, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(head(x), torch.randint(0, 1000, (8,)))
    temporary = backward_temporary_bytes(lambda: loss.backward())
    logits_bytes = 8 * 1000 * 4
    # The logits' gradient, and a scalar or two; not the weight's gradient (64 KB, left behind)
    assert logits_bytes <= temporary < logits_bytes + 1024


def test_what_the_backward_leaves_behind_is_not_counted() -> None:
    weight = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256)
    out = (x @ weight).sum()
    # d(sum)/d(x @ w) is a broadcast of ones (a 4 x 256 temporary); the gradient of the weight
    # (256 x 256) stays.
    temporary = backward_temporary_bytes(lambda: out.backward())
    assert weight.grad is not None
    assert temporary < 256 * 256 * 4
