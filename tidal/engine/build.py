"""Choose and build the engine a job asks for."""

from __future__ import annotations

from torch import nn

from tidal.engine.chunk_engine import ChunkEngine
from tidal.engine.job import JobConfig
from tidal.engine.reference import ReferenceEngine

__all__ = ["Engine", "build_engine"]

Engine = ReferenceEngine | ChunkEngine


def build_engine(model: nn.Module, job: JobConfig) -> Engine:
    """``engine = "reference"``: plain PyTorch; ``"chunk"``: parameters in chunks under budgets."""
    if job.engine == "chunk":
        return ChunkEngine(
            model,
            optimizer=job.optimizer,
            training=job.training,
            memory=job.memory,
            chunk=job.chunk,
        )
    return ReferenceEngine(model, optimizer=job.optimizer, training=job.training, memory=job.memory)
