"""Pipeline parallelism: schedules as data, a simulator, a partitioner, a stage runtime, PipeMare.

Map (docs/pipeline.md): ``ir`` (actions and programs) -> ``schedules`` (generators) ->
``simulate`` (discrete-event timing) ; ``split`` and ``partition`` (stages of a model) ->
``weights``/``pipemare`` (per-stage versions, delays, redirection) -> ``executor`` (one interpreter;
``run_local``: every stage in one process) -> ``runtime`` (one process per rank over
``torch.distributed``). ``tidal.train.pipeline_part`` trains a recipe with it (through the one Trainer).
"""

from tidal.pipeline.config import PipelineConfig
from tidal.pipeline.executor import UpdateRules
from tidal.pipeline.ir import Action, Kind, Schedule, format_program, parse_program
from tidal.pipeline.local import run_local
from tidal.pipeline.pipemare import AsyncConfig, StageWeights, WeightMode
from tidal.pipeline.runtime import PipelineRuntime, RuntimeConfig
from tidal.pipeline.schedules import SCHEDULE_NAMES, make_schedule
from tidal.pipeline.simulate import Deadlock, Simulation, StageCosts, simulate
from tidal.pipeline.split import (
    PipelineStage,
    StageParts,
    even_ranges,
    split_parts,
    tied_parameters,
)

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "AsyncConfig",
    "Deadlock",
    "Kind",
    "PipelineConfig",
    "PipelineRuntime",
    "PipelineStage",
    "RuntimeConfig",
    "Schedule",
    "Simulation",
    "StageCosts",
    "StageParts",
    "StageWeights",
    "UpdateRules",
    "WeightMode",
    "even_ranges",
    "format_program",
    "make_schedule",
    "parse_program",
    "run_local",
    "simulate",
    "split_parts",
    "tied_parameters",
]
