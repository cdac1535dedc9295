"""The Trainer's default loss on what models return: [Note: default loss] in
tidal/train/losses.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.train.losses import default_loss

B, S, V = 3, 5, 7


def _lm() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, S, V, generator=g), torch.randint(0, V, (B, S), generator=g)


def test_language_model_logits_are_one_row_per_token() -> None:
    logits, targets = _lm()
    expected = F.cross_entropy(logits.reshape(B * S, V), targets.reshape(B * S))
    assert torch.equal(default_loss(logits, targets), expected)
    targets[0, 0] = -100  # padding, as Hugging Face marks it
    kept = targets.reshape(-1) != -100
    expected = F.cross_entropy(logits.reshape(B * S, V)[kept], targets.reshape(-1)[kept])
    assert torch.allclose(default_loss(logits, targets), expected)


def test_hugging_face_outputs_give_their_logits() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits, targets = _lm()
    expected = default_loss(logits, targets)
    assert torch.equal(default_loss(CausalLMOutputWithPast(logits=logits), targets), expected)
    assert torch.equal(default_loss((logits, None), targets), expected)  # return_dict=False
    assert torch.equal(default_loss({"logits": logits}, targets), expected)


def test_a_loss_the_model_took_itself_is_used_as_it_is() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits, targets = _lm()
    own = torch.tensor(1.25)
    assert default_loss(CausalLMOutputWithPast(loss=own, logits=logits), targets) is own
    assert default_loss(CausalLMOutputWithPast(loss=own), None) is own
    with pytest.raises(ValueError, match="no targets, and the model returned no .loss"):
        default_loss(CausalLMOutputWithPast(logits=logits), None)


def test_classifiers_and_torch_layouts_as_cross_entropy_reads_them() -> None:
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    assert torch.equal(default_loss(logits, labels), F.cross_entropy(logits, labels))
    pixels, classes = torch.randn(2, 3, 4, 5), torch.randint(0, 3, (2, 4, 5))
    assert torch.equal(default_loss(pixels, classes), F.cross_entropy(pixels, classes))
    probabilities = torch.softmax(torch.randn(4, 3), dim=-1)
    assert torch.equal(default_loss(logits, probabilities), F.cross_entropy(logits, probabilities))


def test_shapes_it_cannot_pair_say_so_and_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(2, 9\) with targets of shape \(4,\).*loss_fn="):
        default_loss(torch.randn(2, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="returned str, which holds no logits.*loss_fn="):
        default_loss("text", torch.zeros(4, dtype=torch.long))
