"""Pipeline parallelism: schedules as data, a simulator, a partitioner, a stage runtime, PipeMare."""

from tidal.pipeline.ir import Action, Kind, Schedule, format_program, parse_program

__all__ = ["Action", "Kind", "Schedule", "format_program", "parse_program"]
