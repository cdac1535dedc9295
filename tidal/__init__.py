"""tidal: train PyTorch models larger than the accelerator, spread with minimal redundant memory.

The front door::

    import tidal
    engine = tidal.initialize(model, config)   # config: tidal.Config, a dict, or a TOML path
    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from tidal.config import ConfigError
from tidal.engine import JobConfig, ReferenceEngine, Trainer, load_job

__version__ = "0.1.0"

Config = JobConfig

__all__ = ["Config", "ConfigError", "ReferenceEngine", "Trainer", "__version__", "initialize"]


def initialize(
    model: nn.Module, config: JobConfig | Mapping[str, Any] | str | Path | None = None
) -> ReferenceEngine:
    """Wrap ``model`` in the engine its config asks for, moving it to the training device.

    Only the plain reference engine exists so far; the chunked, sharded and pipelined engines
    will be chosen here from the same config.
    """
    job = load_job(config)
    return ReferenceEngine(model, optimizer=job.optimizer, training=job.training, memory=job.memory)
