"""The engine layer: the reference engine, the training loop, checkpoints, metrics, reports."""

from tidal.engine.config import (
    CheckpointConfig,
    MemoryConfig,
    MetricsConfig,
    OptimizerConfig,
    TrainingConfig,
)
from tidal.engine.job import JobConfig, list_recipes, load_job
from tidal.engine.reference import ReferenceEngine
from tidal.engine.trainer import Callback, LogCallback, Trainer

__all__ = [
    "Callback",
    "CheckpointConfig",
    "JobConfig",
    "LogCallback",
    "MemoryConfig",
    "MetricsConfig",
    "OptimizerConfig",
    "ReferenceEngine",
    "Trainer",
    "TrainingConfig",
    "list_recipes",
    "load_job",
]
