"""What ``memory.png`` draws, as data: each panel's series, its y-range and the steps to mark,
from the records of ``metrics.jsonl``. Pure, so a test reads what the plot shows.

[Note: plotted steps]
Some records carry more than their step: the first step of a process pays for warm-up
(allocations, kernel selection: ``warm_up``) and the step after a checkpoint carries the save
(its host memory, its time: ``after_checkpoint_s``). Those steps are marked (a line at each
checkpoint and each resume) and left out of every panel's y-range, so one swollen step cannot
squash the others; a point above the range is drawn as a marker on the panel's top edge, not
off the plot, and a timing's left-out steps are not joined to the line of the others. Peaks are running maxima over the whole file: a resumed process counts its peak
afresh (on another world size over other shards), but the run's peak so far never falls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MemoryFigure", "Panel", "Series", "memory_figure", "off_scale", "running_max"]

# stack: filled, on top of the panel's stacks before it; line; dashed; dots: markers only;
# limit: the budget
Kind = Literal["stack", "line", "dashed", "dots", "limit"]
NAN = float("nan")


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    values: tuple[float, ...]  # one per step of the figure, in the panel's unit; nan: unknown
    kind: Kind = "line"
    group: int = 0  # the colour: a pipeline stage's series share one
    # a timing: the steps left out of the range are not joined to the others (they paid more)
    gaps: bool = False


@dataclass(frozen=True, slots=True)
class Panel:
    ylabel: str
    series: tuple[Series, ...]
    ylim: tuple[float, float]
    title: str = ""
    right: Panel | None = None  # a second y-axis (MFU beside tokens/s)


@dataclass(frozen=True, slots=True)
class MemoryFigure:
    title: str
    steps: tuple[int, ...]
    panels: tuple[Panel, ...]
    checkpoints: tuple[int, ...]  # steps after which a checkpoint was saved
    resumes: tuple[tuple[int, int], ...]  # (step, world size) where a process took over
    excluded: frozenset[int]  # steps left out of the y-ranges ([Note: plotted steps])


def memory_figure(train: Sequence[dict[str, Any]], *, name: str) -> MemoryFigure:
    """The panels of ``memory.png`` for ``train``, a run's train records in step order: the
    device memory (a chunk engine's model data and activations stacked under its budget, a
    pipeline's every stage, else each tier), the bytes moved per step, and the throughput."""
    steps = tuple(r["step"] for r in train)
    excluded = frozenset(
        r["step"] for r in train if r.get("warm_up") or r.get("after_checkpoint_s")
    )
    checkpoints = tuple(r["step"] - 1 for r in train if r.get("after_checkpoint_s"))
    resumes = tuple((r["step"] - 1, r.get("world_size", 1)) for r in train
                    if r.get("warm_up") and r["step"] > 1)  # fmt: skip
    keep = [s not in excluded for s in steps]
    if any(r.get("tiers") for r in train):
        panels, title = _chunk_panels(train, keep), "the chunk engine's device tier (rank 0)"
    elif any(r.get("pipeline_ranks") for r in train):
        panels, title = _pipeline_panels(train, keep), "each pipeline stage"
    else:
        panels, title = _tier_panels(train, keep), "memory per tier"
    return MemoryFigure(
        title=f"{name}: {title}",
        steps=steps,
        panels=(*panels, _throughput_panel(train, keep)),
        checkpoints=checkpoints,
        resumes=resumes,
        excluded=excluded,
    )


def off_scale(panel: Panel, steps: Sequence[int]) -> list[tuple[int, str]]:
    """(step, label) of each point above ``panel``'s range (stacks by their top)."""
    points = []
    for series in panel.series:
        tops = zip(steps, _tops(panel, series), strict=True)
        points += [(step, series.label) for step, v in tops if v > panel.ylim[1]]
    return points


def running_max(values: Sequence[float]) -> tuple[float, ...]:
    """The most so far at each point (nan where nothing is known yet)."""
    out, most = [], NAN
    for v in values:
        most = v if math.isnan(most) else most if math.isnan(v) else max(most, v)
        out.append(most)
    return tuple(out)


# -- panels ---------------------------------------------------------------------------------------


def _chunk_panels(train: Sequence[dict[str, Any]], keep: list[bool]) -> list[Panel]:
    def tier(key: str) -> list[float]:
        return [_num((r.get("tiers") or {}).get(key)) for r in train]

    need, activations = tier("device_need_bytes"), tier("activations_bytes")
    peaks = running_max(tier("device_peak_bytes"))
    unit, scale = _unit([*need, *peaks, *tier("device_budget_bytes")])
    memory = [
        Series("model data (the chunks needed at the step's peak)",
               _scaled([n - a for n, a in zip(need, activations, strict=True)], scale), "stack"),
        Series("activations", _scaled(activations, scale), "stack", group=1),
        Series("device peak so far", _scaled(peaks, scale), "dashed", group=2),
        Series("device budget", _scaled(tier("device_budget_bytes"), scale), "limit"),
    ]  # fmt: skip
    host_peak = max((v for v in tier("host_peak_bytes") if not math.isnan(v)), default=0.0)
    moved = [("to device", "to_device_bytes"), ("to host", "to_host_bytes"),
             ("all-gathered (ZeRO-3)", "gathered_bytes"),
             ("reduce-scattered (ZeRO-3)", "reduce_scattered_bytes")]  # fmt: skip
    traffic = [Series(label, tuple(tier(key)), group=i) for i, (label, key) in enumerate(moved)
               if any(not math.isnan(v) for v in tier(key))]  # fmt: skip
    return [
        _panel(f"device memory ({unit})", memory, keep,
               title=f"host tier peak {host_peak / scale:.1f} {unit}"),
        _traffic_panel(traffic, keep, title="bytes moved per step"),
    ]  # fmt: skip


def _pipeline_panels(train: Sequence[dict[str, Any]], keep: list[bool]) -> list[Panel]:
    """Each rank's stages: with a budget, their measured peak (model data, saved activations,
    what they hold for peers) and model data against it (else each tier, as any run), and what
    their savers swapped per step."""
    num_ranks = max(len(r.get("pipeline_ranks") or ()) for r in train)

    def rank(key: str, r: int) -> list[float]:
        ranks = [rec.get("pipeline_ranks") or () for rec in train]
        return [_num(figures[r].get(key)) if len(figures) > r else NAN for figures in ranks]

    names = [_stage_name(train, r) for r in range(num_ranks)]
    peaks = [running_max(rank("peak_bytes", r)) for r in range(num_ranks)]
    unit, scale = _unit([v for p in peaks for v in p] + rank("budget_bytes", 0))
    memory = [Series("each rank's budget", _scaled(rank("budget_bytes", 0), scale), "limit")]
    for r, stage in enumerate(names):
        memory.append(Series(f"{stage}: measured peak so far", _scaled(peaks[r], scale), "dashed",
                             group=r))  # fmt: skip
        memory.append(Series(f"{stage}: model data", _scaled(rank("model_data_bytes", r), scale),
                             "line", group=r))  # fmt: skip
    budgeted = any(not math.isnan(v) for p in peaks for v in p)
    swaps = []
    for r, stage in enumerate(names):
        swaps.append(Series(f"{stage}: to host", tuple(rank("to_host_bytes", r)), group=r))
        swaps.append(Series(f"{stage}: lent to peers", tuple(rank("lent_bytes", r)), "dashed",
                            group=r))  # fmt: skip
    swapped = any(v > 0 for s in swaps for v in s.values if not math.isnan(v))
    return [
        _panel(f"device memory ({unit})", memory, keep, title="measured peak: model data, "
               "saved activations, what a rank holds for peers") if budgeted
        else _tier_panels(train, keep)[0],
        _traffic_panel(swaps, keep, title="saved activations swapped per step"
                       + ("" if swapped else ": none")),
    ]  # fmt: skip


def _stage_name(train: Sequence[dict[str, Any]], r: int) -> str:
    stages = next(rec["pipeline_ranks"][r]["stages"] for rec in train
                  if len(rec.get("pipeline_ranks") or ()) > r)  # fmt: skip
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {','.join(map(str, stages))}"


def _tier_panels(train: Sequence[dict[str, Any]], keep: list[bool]) -> list[Panel]:
    tiers = sorted({t for r in train for t in (r.get("memory_bytes") or {})})

    def figure(key: str, tier: str) -> list[float]:
        return [_num((r.get(key) or {}).get(tier)) for r in train]

    peaks = {t: running_max(figure("peak_memory_bytes", t)) for t in tiers}
    unit, scale = _unit([v for p in peaks.values() for v in p])
    series = []
    for i, t in enumerate(tiers):
        series.append(Series(f"{t} in use", _scaled(figure("memory_bytes", t), scale), group=i))
        series.append(Series(f"{t} peak so far", _scaled(peaks[t], scale), "dashed", group=i))
    return [_panel(f"memory ({unit})", series, keep)]


def _traffic_panel(moved: Sequence[Series], keep: list[bool], *, title: str) -> Panel:
    """``moved``: bytes per step, drawn in the one unit that suits them all."""
    unit, scale = _unit([v for s in moved for v in s.values])
    series = [dataclasses.replace(s, values=_scaled(s.values, scale)) for s in moved]
    return _panel(f"{unit} per step", series, keep, title=title)


def _throughput_panel(train: Sequence[dict[str, Any]], keep: list[bool]) -> Panel:
    """Each step's tokens/s (its tokens over its time) and MFU (the record's window MFU at
    that step's rate); the records' own figures are averages over a logging window."""
    tokens_per_s, mfu = [], []
    prev_tokens = None
    for r in train:
        tokens = r.get("tokens")
        step_tokens = (tokens - prev_tokens if prev_tokens is not None and tokens is not None
                       else (tokens or 0) / max(1, r["step"]))  # fmt: skip
        prev_tokens = tokens
        rate = step_tokens / r["step_s"] if r.get("step_s") else NAN
        tokens_per_s.append(rate)
        window = r.get("tokens_per_s")
        mfu.append(100 * r["mfu"] * rate / window if r.get("mfu") and window else NAN)
    right = None
    if any(not math.isnan(v) for v in mfu):
        right = _panel("MFU (%)", [Series("MFU", tuple(mfu), "dots", group=1, gaps=True)], keep)
    return _panel("tokens/s", [Series("tokens/s", tuple(tokens_per_s), gaps=True)], keep,
                  title="throughput per step", right=right)  # fmt: skip


# -- helpers --------------------------------------------------------------------------------------


def _panel(ylabel: str, series: Sequence[Series], keep: list[bool], *, title: str = "",
           right: Panel | None = None) -> Panel:  # fmt: skip
    """A panel whose y-range holds every series at the kept steps ([Note: plotted steps])."""
    draft = Panel(ylabel, tuple(series), (0.0, 1.0), title, right)
    tops = [v for s in series for v, k in zip(_tops(draft, s), keep, strict=True)
            if k and not math.isnan(v)]  # fmt: skip
    return Panel(ylabel, tuple(series), (0.0, 1.08 * max(tops, default=0.0) or 1.0), title, right)


def _tops(panel: Panel, series: Series) -> tuple[float, ...]:
    """Where ``series`` reaches: a stack on top of the panel's stacks before it."""
    if series.kind != "stack":
        return series.values
    stacks = [s for s in panel.series if s.kind == "stack"]
    below = stacks[: stacks.index(series) + 1]
    return tuple(sum(0.0 if math.isnan(v) else v for v in column) for column in
                 zip(*(s.values for s in below), strict=True))  # fmt: skip


def _num(value: Any) -> float:
    return NAN if value is None else float(value)


def _unit(values: Sequence[float]) -> tuple[str, float]:
    """KiB, MiB or GiB: the largest under which the biggest of ``values`` is at least 1."""
    most = max((v for v in values if not math.isnan(v)), default=0.0)
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20)):
        if most >= scale:
            return unit, scale
    return "KiB", 2.0**10


def _scaled(values: Sequence[float], scale: float) -> tuple[float, ...]:
    return tuple(v / scale for v in values)
