"""Configs owned by the training loop: checkpoints, metrics, and a run of your own."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import require

__all__ = ["CheckpointConfig", "CustomConfig", "MetricsConfig"]

LOSSES = ("cross_entropy", "mse")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints under ``<run_dir>/checkpoints/step_NNNNNNNN``.

    Attributes:
        every_steps: steps between checkpoints; 0 saves only at the end.
        keep: how many of the newest checkpoints to keep on disk (older ones are deleted).
        at_end: save when the run reaches ``training.steps``.
        on_interrupt: save when Ctrl-C or SIGTERM stops the run (after the step in progress;
            [Note: interrupts at safe points] in tidal/train/interrupts.py).
    """

    every_steps: int = 0
    keep: int = 2
    at_end: bool = True
    on_interrupt: bool = True

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", f"must be >= 0, got {self.every_steps}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


@dataclass(kw_only=True, slots=True)
class CustomConfig:
    """Your own model and data from a recipe ([Note: your own model] in
    tidal/train/training_part.py), in place of ``[model]`` and ``[data]``.

    Attributes:
        factory: "package.module:function" taking no arguments and returning ``(model,
            train_batches, val_batches)``: an ``nn.Module`` and two re-iterables of ``(inputs,
            targets)`` pairs of ``training.batch_size`` rows (``val_batches`` may be None).
            The function runs after ``torch.manual_seed(training.seed)``. For a pipeline the
            model may be built on the meta device: each rank then materialises only its
            stages' children ([Note: sequential pipelines] in tidal/pipeline/sequential.py).
        loss: what the trainer takes of ``model(inputs)`` and the targets: ``cross_entropy``
            (of its logits: ``(batch, seq, vocab)`` against ``(batch, seq)`` too, [Note:
            default loss] in tidal/train/losses.py) or ``mse``.
    """

    factory: str | None = None
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        require(
            self.loss in LOSSES, "loss", f"expected one of {', '.join(LOSSES)}, got {self.loss!r}"
        )


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """How throughput is judged, and where the figures go besides ``metrics.jsonl``.

    Attributes:
        peak_tflops: the device's peak dense TFLOP/s for MFU. ``None``: a table of known GPUs
            (bf16 dense), and on a CPU an upper bound from its vector ISA, clock and threads
            (the summary says which was used).
        tensorboard: also write every figure of ``metrics.jsonl`` as TensorBoard scalars under
            ``<run_dir>/tensorboard`` (needs the ``tensorboard`` package: the extra
            ``tidal[tensorboard]``); view with ``tensorboard --logdir <run_dir>``.
    """

    peak_tflops: float | None = None
    tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.peak_tflops is not None:
            require(self.peak_tflops > 0, "peak_tflops", f"must be > 0, got {self.peak_tflops}")
