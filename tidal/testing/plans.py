"""Hand-made plans for tests: a strategy per unit of a model's derived wiring, replicated
wherever the test does not say."""

from __future__ import annotations

from typing import Any

from tidal.planner.plan import Layout, MemoryBreakdown, Plan, StrategyName, UnitChoice
from tidal.planner.wiring import ModelWiring

__all__ = ["Choices", "hand_plan", "unit_choices"]

# unit name -> (strategy, input layout, output layout)
Choices = dict[str, tuple[StrategyName, Layout, Layout]]
_REPLICATED = (StrategyName.REPLICATE, Layout.R, Layout.R)


def unit_choices(
    wiring: ModelWiring, choices: Choices, *, zero: int = 0, zeros: dict[str, int] | None = None
) -> list[UnitChoice]:
    """A choice for every unit of ``wiring``: ``choices``, else replicated; ZeRO level
    ``zeros[name]``, else ``zero``."""
    return [
        UnitChoice(
            name=name,
            module=spec.module,
            segment=spec.segment,
            kind=spec.kind,
            strategy=strategy,
            in_layout=in_layout,
            out_layout=out_layout,
            zero=(zeros or {}).get(name, zero),
            count=wiring.counts[name],
        )
        for name, spec in wiring.units.items()
        for strategy, in_layout, out_layout in [choices.get(name, _REPLICATED)]
    ]


def hand_plan(
    wiring: ModelWiring,
    choices: Choices,
    *,
    model: str,
    tp: int,
    seq_len: int,
    dp: int = 1,
    micro_batch: int = 1,
    zero: int = 0,
    zeros: dict[str, int] | None = None,
    **fields: Any,
) -> Plan:
    """A plan on ``dp x tp`` devices with :func:`unit_choices`; ``fields`` go to :class:`Plan`
    (``recompute``, ``edges``)."""
    return Plan(
        model=model,
        devices=dp * tp,
        dp=dp,
        tp=tp,
        micro_batch=micro_batch,
        seq_len=seq_len,
        num_microbatches=1,
        units=unit_choices(wiring, choices, zero=zero, zeros=zeros),
        recompute=fields.pop("recompute", {}),
        memory=MemoryBreakdown(),
        step_time_s=0.0,
        **fields,
    )
