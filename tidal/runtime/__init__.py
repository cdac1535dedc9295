"""What carries a pipeline schedule out, above the transforms it drives.

Map (docs/pipeline.md, docs/architecture.md): ``executor`` (one interpreter of a rank's program
over its stages, through the stage-parameter protocol of tidal/parallel/stage_params.py) ->
``local`` (``run_local``: every rank in one process, the simulator of weight delays) and
``distributed`` (one process per rank over ``torch.distributed``, ``p2p`` for the messages);
``weights``/``pipemare`` (a stage's plain parameters: versions, delays, saved-tensor redirection),
``precision`` (autocast and the loss scale), ``eval``, and ``build.pipeline`` which assembles a
rank's runtime over the one mesh.
"""

from tidal.runtime.distributed import PipelineRuntime, RuntimeConfig
from tidal.runtime.executor import UpdateRules
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

__all__ = [
    "AsyncConfig",
    "PipelineRuntime",
    "RuntimeConfig",
    "StageWeights",
    "UpdateRules",
    "WeightMode",
    "run_local",
]
