"""Pipeline parallelism as data: schedules, a simulator, a partitioner, stage splits, PipeMare's rules.

Map (docs/pipeline.md): ``ir`` (actions and programs) -> ``schedules`` (generators) ->
``simulate`` (discrete-event timing) ; ``split`` and ``partition`` (stages of a model) ;
``async_config`` (PipeMare's per-update rules). What carries a schedule out (the executor, the
stage weights, the runtime over ``torch.distributed``) is ``tidal.runtime``, above the
transforms it drives; ``tidal.train.pipeline_part`` trains a recipe with it.
"""

from tidal.pipeline.config import PipelineConfig
from tidal.pipeline.ir import Action, Kind, Schedule, format_program, parse_program
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
    "Deadlock",
    "Kind",
    "PipelineConfig",
    "PipelineStage",
    "Schedule",
    "Simulation",
    "StageCosts",
    "StageParts",
    "even_ranges",
    "format_program",
    "make_schedule",
    "parse_program",
    "simulate",
    "split_parts",
    "tied_parameters",
]
