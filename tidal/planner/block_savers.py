"""What a repeated block does with each class of the tensors it saves: pure, read by the cost
model, the ILP and the plan's realisation alike.

[Note: savers per tensor class]
MPress chooses per tensor what a stage does with what its backward needs: keep it, recompute
it, or swap it to the host (or to a peer). A plan chooses per kind of block among modes
(:class:`~tidal.planner.plan.Recompute`) that say it per class of tensor, the classes being the
block's own child modules:

- attention: the child holding the block's attention core (its projections' saved inputs and
  the core's own tensors);
- MLP: the other children holding linear units;
- the rest: norms, residual adds, dropout masks between them.

=====================  ==================  ===========  ===========
mode                   attention           MLP          the rest
=====================  ==================  ===========  ===========
none                   kept                kept         kept
selective              core recomputed     kept         kept
full                   recomputed from the block's input (kept)
swap                   host                host         host
swap-attention         host                kept         kept
swap-mlp               kept                host         kept
selective+swap-mlp     core recomputed     host         kept
=====================  ==================  ===========  ===========

A unit's :class:`Fate` under a mode is what the cost model prices for it: a kept unit's
activations stay on the device, a selective core keeps its selective share and runs its
forward again, a fully recomputed block keeps its input and runs every forward again, and a
unit on the host has its activations there between its forward and its backward, the copies
priced against the whole block's compute ([Note: activations on the host] in ilp.py). The
modes with the host in them are searched where ``--swap`` asks; the run swaps each class's
child module of every repetition of the block with the activation savers' host swap
(``_recompute`` in tidal/parallel/plan_apply.py), so what is priced per unit is what moves.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from tidal.planner.graph import ModelGraph, Unit
from tidal.planner.plan import Recompute
from tidal.planner.wiring import ModelWiring

__all__ = [
    "HOST_MODES",
    "Fate",
    "class_children",
    "classes_of",
    "fate",
    "host_children",
    "unit_class",
]


class Fate(enum.Enum):
    KEPT = "kept"
    SELECTIVE = "selective"  # an attention core recomputed; its selective share kept
    RECOMPUTED = "recomputed"  # the whole block recomputed from its input
    ON_HOST = "on host"


# each mode's classes on the host ("rest": what no child module of the two classes saves)
_ON_HOST: dict[Recompute, frozenset[str]] = {
    Recompute.SWAP: frozenset({"attention", "mlp", "rest"}),
    Recompute.SWAP_ATTENTION: frozenset({"attention"}),
    Recompute.SWAP_MLP: frozenset({"mlp"}),
    Recompute.SELECTIVE_SWAP_MLP: frozenset({"mlp"}),
}
HOST_MODES = tuple(_ON_HOST)
_SELECTIVE = (Recompute.SELECTIVE, Recompute.SELECTIVE_SWAP_MLP)


def _child(prefix: str, module: str) -> str | None:
    """The block's child module ``module`` is in (``attn``), None for the block's own code."""
    rest = module[len(prefix) + 1 :] if module.startswith(prefix + ".") else ""
    return rest.split(".")[0] or None


def class_children(graph: ModelGraph | ModelWiring, prefix: str) -> dict[str, str]:
    """The child modules of block ``prefix`` that make its classes: ``{child: class}``; of a
    measured graph, or of a model's wiring (what apply reads)."""
    if isinstance(graph, ModelGraph):
        units = [(u.module, u.kind) for u in graph.units if graph.block_of(u) == prefix]
    else:
        units = [(spec.module, spec.kind) for name, spec in graph.units.items()
                 if graph.block_of.get(name) == prefix]  # fmt: skip
    return classes_of(units, prefix)


def classes_of(units: Iterable[tuple[str, str]], prefix: str) -> dict[str, str]:
    """:func:`class_children` from the ``(module, kind)`` of block ``prefix``'s units (a
    plan's, whose modules name the block ``prefix``: ``blocks.*``)."""
    units = list(units)
    found = {c: "attention" for module, kind in units if kind == "attention"
             for c in [_child(prefix, module)] if c is not None}  # fmt: skip
    for module, kind in units:
        child = _child(prefix, module)
        if kind == "linear" and child is not None and child not in found:
            found[child] = "mlp"
    return found


def unit_class(graph: ModelGraph, unit: Unit) -> str | None:
    """``attention``, ``mlp`` or ``rest`` for a unit in a repeated block; None outside one."""
    prefix = graph.block_of(unit)
    if prefix is None:
        return None
    child = _child(prefix, unit.module)
    return class_children(graph, prefix).get(child or "", "rest")


def fate(graph: ModelGraph, unit: Unit, mode: Recompute) -> Fate:
    """What ``mode`` does with what ``unit`` (in a repeated block) saves."""
    if mode is Recompute.FULL:
        return Fate.RECOMPUTED
    if unit_class(graph, unit) in _ON_HOST.get(mode, ()):
        return Fate.ON_HOST
    if mode in _SELECTIVE and unit.kind == "attention":
        return Fate.SELECTIVE
    return Fate.KEPT


def host_children(graph: ModelGraph | ModelWiring, prefix: str,
                  mode: Recompute) -> tuple[str, ...] | None:  # fmt: skip
    """The child modules of block ``prefix`` whose saved tensors ``mode`` keeps on the host;
    None: the whole block's (``swap``)."""
    if mode is Recompute.SWAP:
        return None
    on_host = _ON_HOST.get(mode, frozenset())
    return tuple(c for c, cls in class_children(graph, prefix).items() if cls in on_host)
