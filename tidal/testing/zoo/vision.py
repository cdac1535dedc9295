"""Vision families: a Hugging Face ViT classifier and a small CNN with BatchNorm (written here:
torchvision is not a dependency)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.testing.zoo.base import IMAGE_SIZE, NUM_CLASSES, LossOf, ZooModel, image_batch

__all__ = ["VISION_FAMILIES", "BatchNormCNN"]


def _vit(seed: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    # num_labels: see [Note: config keyword arguments] in hf.py.
    config = ViTConfig(  # type: ignore[call-arg]
        image_size=IMAGE_SIZE, patch_size=4, num_channels=3, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_labels=NUM_CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LossOf(ViTForImageClassification(config))


class BatchNormCNN(nn.Module):
    """Two conv-BatchNorm-ReLU blocks, a strided one, global pooling and a linear classifier.

    BatchNorm normalises by the batch's statistics in training and updates its running mean,
    variance and batch count (buffers, not parameters) in every forward.
    """

    def __init__(self, channels: int = 16, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(2 * channels, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pooled = self.features(pixel_values).mean(dim=(2, 3))
        return F.cross_entropy(self.classifier(pooled), labels)


def _cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return BatchNormCNN()


VISION_FAMILIES = (
    ZooModel(name="vit", kind="vision", build=_vit, batch=image_batch, needs=("transformers",),
             notes="patch embedding reads weight.dtype in the forward, CLS token parameter"),
    ZooModel(name="cnn-batchnorm", kind="vision", build=_cnn, batch=image_batch,
             notes="Conv2d and BatchNorm2d: running statistics are buffers updated in forward"),
)  # fmt: skip
