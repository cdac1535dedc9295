"""The loss the Trainer takes when you give none: cross-entropy of what a model returns, as
language models and classifiers come ([Note: default loss])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["default_loss", "logits_of"]


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's ``output``: the tensor itself, a Hugging Face ``ModelOutput``'s
    (or a dict's) ``logits``, or the first element of a tuple (Hugging Face's
    ``return_dict=False`` form)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if logits is None and isinstance(output, tuple | list) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(output).__name__}, which holds no logits (a tensor, "
            f"an object with .logits, or a tuple starting with them); pass loss_fn= to say "
            f"how its output and the targets make the loss"
        )
    return logits


def default_loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The mean cross-entropy of ``output``'s logits against ``targets``, in fp32.

    [Note: default loss]
    Shapes as models come:

    - ``(batch, seq, vocab)`` logits against ``(batch, seq)`` targets, a language model's:
      flattened to one row per token. ``targets[b, s]`` is the token ``logits[b, s]``
      predicts (already shifted, as tidal's batches are; Hugging Face's ``labels`` are not);
      a target of -100 is ignored, as in Hugging Face and torch.
    - ``(batch, classes)`` against ``(batch,)``, a classifier's, and torch's own
      ``(batch, classes, d1, ...)`` against ``(batch, d1, ...)`` (per-pixel classes).
      Where the shapes fit both readings, the classes are the last dimension.
    - targets of the logits' shape: class probabilities, as ``F.cross_entropy`` reads them.

    The logits are a tensor, a Hugging Face ``ModelOutput``'s ``.logits`` or a tuple's first
    element (:func:`logits_of`). An output that carries a ``.loss`` (not None) is a model
    that took its loss itself, from its own inputs (it is called with the inputs only):
    that loss is returned as it is and ``targets`` are not read; give the model no loss, or
    pass ``loss_fn=``, to train on the targets. ``targets=None`` needs such a loss.
    """
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    if targets is None:
        raise ValueError(
            "no targets, and the model returned no .loss: give (inputs, targets) batches, or "
            "a model that returns its own loss"
        )
    logits = logits_of(output).float()
    if logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    torch_reading = logits.dim() == targets.dim() + 1 and (
        logits.shape[:1] + logits.shape[2:] == targets.shape
    )
    if torch_reading or logits.shape == targets.shape:
        return F.cross_entropy(logits, targets)
    raise ValueError(
        f"the default loss (cross-entropy) cannot pair logits of shape {tuple(logits.shape)} "
        f"with targets of shape {tuple(targets.shape)}: it takes (batch, seq, vocab) with "
        f"(batch, seq), or (batch, classes) with (batch,); pass loss_fn= for other shapes"
    )
