"""The training layer: the job config, the trainer loop, checkpoints, metrics, reports."""

from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.reference import ReferenceEngine
from tidal.train.config import CheckpointConfig, MetricsConfig
from tidal.train.job import JobConfig, list_recipes, load_job
from tidal.train.trainer import Callback, LogCallback, ProgressLine, Trainer

__all__ = [
    "Callback",
    "CheckpointConfig",
    "JobConfig",
    "LogCallback",
    "MemoryConfig",
    "MetricsConfig",
    "OptimizerConfig",
    "ProgressLine",
    "ReferenceEngine",
    "Trainer",
    "TrainingConfig",
    "list_recipes",
    "load_job",
]
