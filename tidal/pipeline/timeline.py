"""Draw a simulated schedule as a timeline: one row per rank, one box per F/B/W/U action."""

from __future__ import annotations

from pathlib import Path

from tidal.pipeline.ir import NO_MICROBATCH, parse_action
from tidal.pipeline.simulate import Simulation

__all__ = ["draw_timeline"]

_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#8c8c3c", "U": "#c44e52"}
_WIDTH_IN = 12.0
_MIN_LABEL_PX_PER_CHAR = 7.0


def draw_timeline(sim: Simulation, path: str | Path, *, dpi: int = 100) -> Path:
    """Write ``sim`` as an image to ``path`` (format from its suffix) and return the path.

    Send/receive actions take no rank time in the model and are not drawn; the gaps between
    boxes are the bubbles. Boxes carry their microbatch id (or the version an update makes)
    when the text fits.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # an optional dependency: only the drawing needs it
        raise RuntimeError(
            "drawing a timeline needs matplotlib; install it (pip install matplotlib)"
        ) from err
    schedule = sim.schedule
    num_ranks = schedule.num_ranks
    figure = Figure(figsize=(_WIDTH_IN, 0.5 * num_ranks + 1.2), dpi=dpi)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    makespan = max(sim.makespan_s, 1e-12)
    px_per_s = _WIDTH_IN * dpi * 0.8 / makespan  # the axes take about 80% of the width
    for event in sim.events:
        action = parse_action(event.action)
        if action.kind.is_comm:
            continue
        duration = event.end_s - event.start_s
        y = num_ranks - 1 - event.rank
        chunk = action.stage // num_ranks  # later chunks of interleaved schedules are paler
        ax.broken_barh(
            [(event.start_s, duration)],
            (y - 0.4, 0.8),
            facecolors=_COLOURS[action.kind.value],
            edgecolors="white",
            linewidth=0.5,
            alpha=1.0 if chunk % 2 == 0 else 0.6,
        )
        if action.microbatch != NO_MICROBATCH:
            label = str(action.microbatch)
        else:
            label = "" if action.version is None else f"v{action.version}"
        if label and duration * px_per_s >= _MIN_LABEL_PX_PER_CHAR * (len(label) + 1):
            centre = event.start_s + duration / 2
            ax.text(centre, y, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in reversed(range(num_ranks))])
    ax.set_xlim(0, makespan)
    ax.set_ylim(-0.6, num_ranks - 0.4)
    ax.set_xlabel("time (s)")
    ax.set_title(
        f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} microbatches"
        f" x {schedule.num_steps} steps; makespan {sim.makespan_s:.4g} s, "
        f"bubble {sim.bubble_fraction:.1%}",
        fontsize=10,
    )
    kinds = {parse_action(e.action).kind.value for e in sim.events}
    handles = [Patch(color=c, label=k) for k, c in _COLOURS.items() if k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out)
    return out
