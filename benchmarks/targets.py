"""The targets tidal's figures are held to, each read from the latest run that measures it.

A target names the run it reads (bench, device, the command whose settings the run must have,
the section it needs: [Note: latest runs] in benchmarks/runs.py), what it computes from that
run's JSON, and the bound an issue set for it. ``tidal bench report`` writes every target beside
its figure on docs/results.md and the headline ones into README.md, those that miss with those
that hold; a new run moves the figure, and nothing is written by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from benchmarks.runs import Results, Run

__all__ = ["TARGETS", "Reading", "Target", "read"]

Result = dict[str, Any]


def _row(data: Result, **match: Any) -> dict[str, Any]:
    """The one row of ``data`` whose fields equal ``match``."""
    found = [r for r in data["rows"] if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows with {match}")
    return found[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A figure and the bound it is held to."""

    key: str  # the anchor of its row on the results page
    bench: str
    device: str  # matched, ignoring case, within the run's device name
    command: str  # the run must have this command's settings
    section: str = ""  # the rows' section the figure needs
    figure: str  # what is measured, in words
    compared_with: str
    value: Callable[[Result], float]
    fmt: str  # how the value and the bound are written, e.g. "{:.2f}x"
    at_most: bool  # the value must be <= bound (else >=)
    bound: float
    context: Callable[[Result], str] | None = None  # the other systems of the same run
    set_by: str  # where the bound comes from
    headline: bool = False  # also in README.md

    def matches(self, run: Run, settings: tuple[tuple[str, str], ...]) -> bool:
        """``settings``: those of :attr:`command`, as the results read it."""
        return (
            run.bench == self.bench
            and self.device.lower() in run.device.lower()
            and run.settings == settings
            and self.section in run.sections
        )

    @property
    def bound_text(self) -> str:
        return f"{'≤' if self.at_most else '≥'} {self.fmt.format(self.bound)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reading:
    """A target read from a run: its figure and whether it holds; run None if nothing ran."""

    target: Target
    run: Run | None
    value: float | None = None
    shown: str = "not measured"

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        holds = self.value <= self.target.bound if self.target.at_most else self.value >= self.target.bound  # fmt: skip
        return "holds" if holds else "misses"


def read(target: Target, results: Results) -> Reading:
    """The target on the newest run that matches it."""
    settings = results.settings(target.bench, target.command)
    matching = [run for run in results.runs if target.matches(run, settings)]
    if not matching:
        return Reading(target=target, run=None)
    run = max(matching, key=lambda r: (r.created, r.name))
    value = target.value(run.data)
    shown = target.fmt.format(value)
    if target.context is not None:
        shown += f" ({target.context(run.data)})"
    return Reading(target=target, run=run, value=value, shown=shown)


# -- the figures -----------------------------------------------------------------------------------


def _step_ratio(section: str, system: str) -> Callable[[Result], float]:
    return lambda d: float(_row(d, section=section, system=system)["step_time_ratio"])


def _dp_step(system: str, nproc: int) -> Callable[[Result], float]:
    return lambda d: float(_row(d, section="perf", system=system, nproc=nproc)["median_step_s"])


def _dp_over_peers(d: Result) -> float:
    """tidal's 2-rank step over the faster peer's."""
    peers = (_dp_step(s, 2)(d) for s in ("deepspeed-zero3-offload", "fsdp2-cpu-offload"))
    return _dp_step("tidal", 2)(d) / min(peers)


def _largest_vs(system: str) -> Callable[[Result], float]:
    """tidal's largest model over ``system``'s at the same ranks and host budget."""
    return lambda d: 1 / float(_row(d, section="scale", system=system)["largest_params_vs_tidal"])


def _compose(target: str) -> Callable[[Result], float]:
    """A target ``tidal bench compose`` read off its own rows (NaN where it measured none:
    a configuration that did not run, which then misses)."""

    def value(d: Result) -> float:
        found = _row(d, section="targets", target=target)["value"]
        return float("nan") if found is None else float(found)

    return value


def _compose_best(d: Result) -> str:
    rows = [r for r in d["rows"] if r["section"] == "scale" and r["system"] == "tidal"]
    best = max(rows, key=lambda r: r.get("largest_num_params") or 0)
    capped = ", capped by --max-layers: at least" if best.get("capped") else ""
    return f"{best['label']}{capped}"


def _compat_matching(d: Result) -> float:
    return sum(r["result"] == "match" for r in d["rows"]) / len(d["rows"])


def _compat_counts(d: Result) -> str:
    rows = d["rows"]
    families = len({r["family"] for r in rows})
    return f"{sum(r['result'] == 'match' for r in rows)} of {len(rows)} cases, {families} models"


def _plan_175b(d: Result) -> dict[str, Any]:
    return _row(d, model="gpt3-175b", devices=64)


def _pipemare(section: str, variant: str) -> Callable[[Result], float]:
    return lambda d: float(_row(d, section=section, variant=variant)["ratio_to_sync"]) - 1


def _mpress(schedule: str, strategy: str, section: str) -> Callable[[Result], float]:
    return lambda d: float(
        _row(d, section=section, schedule=schedule, strategy=strategy)["vs_recompute"]
    )


def _worst_error(key: str) -> Callable[[Result], float]:
    """The largest |measured / predicted - 1| over the rows that measured it."""
    return lambda d: max(abs(r[key] - 1) for r in d["rows"] if r.get(key) is not None)


_COMPOSE = "tidal bench compose --host-budget 640MiB"

TARGETS: tuple[Target, ...] = (
    Target(
        key="t-make-test", bench="make", device="cpu", command="tidal bench make",
        figure="`make test` from a fresh clone, 2 CPU cores",
        compared_with="the CI limit", value=lambda d: float(_row(d, target="test")["minutes"]),
        fmt="{:.1f} min", at_most=True, bound=15, set_by="DEVELOPERS.md", headline=True,
    ),
    Target(
        key="t-make-run", bench="make", device="cpu", command="tidal bench make",
        figure="`make run`: the demo's peak device bytes, activations included",
        compared_with="its 40 MiB device budget",
        value=lambda d: _row(d, target="run")["summary"]["peak_device_bytes"] / 2**20,
        fmt="{:.2f} MiB", at_most=True, bound=40, set_by="recipes/demo.toml",
    ),
    Target(
        key="t-offload-cpu", bench="offload", device="cpu", command="tidal bench offload",
        section="overhead",
        figure="chunk engine step, demo, no budget, one process",
        compared_with="plain PyTorch's step", value=_step_ratio("overhead", "tidal-chunk"),
        context=lambda d: f"DeepSpeed ZeRO-3 offload {_step_ratio('overhead', 'deepspeed-zero3-offload')(d):.2f}x",  # fmt: skip
        fmt="{:.2f}x", at_most=True, bound=1.05, set_by="issue 3", headline=True,
    ),
    Target(
        key="t-offload-h100", bench="offload", device="h100", command="tidal bench offload",
        section="overhead",
        figure="chunk engine step, demo, no budget, one GPU",
        compared_with="plain PyTorch's step", value=_step_ratio("overhead", "tidal-chunk"),
        fmt="{:.2f}x", at_most=True, bound=1.05, set_by="issue 3", headline=True,
    ),
    Target(
        key="t-offload-traffic", bench="offload", device="cpu", command="tidal bench offload",
        section="traffic",
        figure="host-to-device bytes per step at 25/50/75% budgets, the worst",
        compared_with="the offline optimum on the same trace",
        value=lambda d: max(r["measured_over_optimal"] for r in d["rows"] if r["section"] == "traffic"),  # fmt: skip
        fmt="{:.2f}x", at_most=True, bound=1.1, set_by="issue 3",
    ),
    Target(
        key="t-offload-scale", bench="offload", device="cpu", command="tidal bench offload",
        section="scale",
        figure="largest model trained under a device + host budget",
        compared_with="the model data the two budgets can hold",
        value=lambda d: float(_row(d, section="scale")["params_over_limit"]),
        fmt="{:.2f}", at_most=False, bound=0.9, set_by="issue 3",
    ),
    Target(
        key="t-offload-host", bench="offload", device="cpu", command="tidal bench offload",
        section="host",
        figure="peak host memory (RSS), gpt2-small",
        compared_with="plain PyTorch's", value=lambda d: float(_row(d, section="host", system="tidal-chunk")["peak_rss_ratio"]),  # fmt: skip
        context=lambda d: f"DeepSpeed ZeRO-3 offload {_row(d, section='host', system='deepspeed-zero3-offload')['peak_rss_ratio']:.2f}x",  # fmt: skip
        fmt="{:.2f}x", at_most=True, bound=1.0, set_by="issue 3",
    ),
    Target(
        key="t-dp-step", bench="dp", device="cpu", command="tidal bench dp", section="perf",
        figure="ZeRO-3 step on 2 gloo ranks, demo",
        compared_with="the faster of DeepSpeed ZeRO-3 offload and FSDP2 offload",
        value=_dp_over_peers,
        context=lambda d: f"DeepSpeed {_dp_step('deepspeed-zero3-offload', 2)(d):.3f} s, FSDP2 {_dp_step('fsdp2-cpu-offload', 2)(d):.3f} s, tidal {_dp_step('tidal', 2)(d):.3f} s",  # fmt: skip
        fmt="{:.2f}x", at_most=True, bound=1.0, set_by="issue 52", headline=True,
    ),
    Target(
        key="t-dp-scale", bench="dp", device="cpu", command="tidal bench dp", section="scale",
        figure="largest model on 2 ranks, 1 GiB host each",
        compared_with="FSDP2 offload's largest", value=_largest_vs("fsdp2-cpu-offload"),
        context=lambda d: f"against DeepSpeed's {_largest_vs('deepspeed-zero3-offload')(d):.2f}x",  # fmt: skip
        fmt="{:.2f}x", at_most=False, bound=1.1, set_by="issue 52", headline=True,
    ),
    Target(
        key="t-compose-deepspeed", bench="compose", device="cpu",
        command=_COMPOSE, section="targets",
        figure="largest GPT of tidal's best composition on 4 gloo ranks, 640 MiB host each",
        compared_with="DeepSpeed ZeRO-3 offload's (dp4)", value=_compose("largest-vs-deepspeed"),
        context=_compose_best, fmt="{:.2f}x", at_most=False, bound=1.25, set_by="issue 50",
    ),
    Target(
        key="t-compose-fsdp2", bench="compose", device="cpu", command=_COMPOSE,
        section="targets", figure="the same against FSDP2",
        compared_with="FSDP2 CPU offload's (dp4)", value=_compose("largest-vs-fsdp2"),
        context=_compose_best, fmt="{:.2f}x", at_most=False, bound=1.25, set_by="issue 50",
    ),
    Target(
        key="t-compose-bytes", bench="compose", device="cpu", command=_COMPOSE,
        section="targets",
        figure="pp2 x dp2 chunk stages: bytes each rank all-gathers, reduce-scatters and sends per step",
        compared_with="dp4 chunk ZeRO-3's, same model", value=_compose("bytes-pp2-dp2-vs-dp4"),
        fmt="{:.2f}x", at_most=True, bound=0.6, set_by="issue 50",
    ),
    Target(
        key="t-compose-bytes-per-step", bench="compose", device="cpu", command=_COMPOSE,
        section="targets",
        figure="the same with sharding.reduce_per_step (one reduce-scatter per step)",
        compared_with="dp4 chunk ZeRO-3's, same model",
        value=_compose("bytes-pp2-dp2-per-step-vs-dp4"),
        fmt="{:.2f}x", at_most=True, bound=0.6, set_by="issue 50",
    ),
    Target(
        key="t-compat", bench="compat", device="cpu", command="tidal bench compat --ranks 2",
        figure="models tidal did not write: losses of the chunk engine (1 and 2 ranks)",
        compared_with="plain PyTorch on the same seeds", value=_compat_matching,
        context=_compat_counts, fmt="{:.1%}", at_most=False, bound=1.0, set_by="issue 15",
        headline=True,
    ),
    Target(
        key="t-plan-memory", bench="plan", device="cpu", command="tidal bench plan",
        figure="GPT-3 175B on 64 GPUs: memory saved within 1.05x of the step (cost model)",
        compared_with="Megatron-LM's fastest configuration that fits",
        value=lambda d: float(_plan_175b(d)["megatron_best"]["plan_near_fastest_step_time"]["saving"]),  # fmt: skip
        fmt="{:.1%}", at_most=False, bound=0.4, set_by="issue 24", headline=True,
    ),
    Target(
        key="t-plan-speed", bench="plan", device="cpu", command="tidal bench plan",
        figure="GPT-3 175B on 64 GPUs: throughput of the fastest plan that fits (cost model)",
        compared_with="Megatron-LM's fastest configuration that fits",
        value=lambda d: _plan_175b(d)["megatron_best"]["fastest"]["step_time_s"] / _plan_175b(d)["pipeline"]["pareto"][0]["step_time_s"],  # fmt: skip
        fmt="{:.2f}x", at_most=False, bound=1.25, set_by="issue 24", headline=True,
    ),
    Target(
        key="t-plan-solve", bench="plan", device="cpu", command="tidal bench plan",
        figure="GPT-3 175B on 64 GPUs: seconds to choose the flat dp x tp plan, every mesh",
        compared_with="-", value=lambda d: float(_plan_175b(d)["phases_s"]["meshes"]),
        context=lambda d: f"with pipelines, frontiers and Megatron-LM's grid {_plan_175b(d)['solve_s']:.1f} s",  # fmt: skip
        fmt="{:.1f} s", at_most=True, bound=10, set_by="issue 5",
    ),
    Target(
        key="t-plan-largest", bench="plan-largest", device="cpu",
        command="tidal bench plan --largest --models gpt3-175b --devices 64",
        figure="largest GPT-3-wide model that fits 64 GPUs of 80 GiB (cost model)",
        compared_with="Megatron-LM's largest", value=lambda d: float(d["rows"][0]["ratio"]),
        fmt="{:.2f}x", at_most=False, bound=2.0, set_by="issue 24", headline=True,
    ),
    Target(
        key="t-mpress-gpt", bench="mpress", device="cpu",
        command="tidal bench mpress --section predicted --max-layers 256", section="predicted",
        figure="MPress plan under PipeDream: largest GPT (4096 wide, 4 GPUs, model)",
        compared_with="recompute-only's largest",
        value=_mpress("pipedream", "mpress", "predicted"),
        context=lambda d: f"ZeRO-3 {_mpress('pipedream', 'zero3', 'predicted')(d):.2f}x; 1F1B plan {_mpress('1f1b', 'mpress', 'predicted')(d):.2f}x",  # fmt: skip
        fmt="{:.2f}x", at_most=False, bound=1.5, set_by="issue 18", headline=True,
    ),
    Target(
        key="t-mpress-bert", bench="mpress", device="cpu",
        command="tidal bench mpress --section predicted --family bert --device-memory 16GiB --micro-batch 16 --max-layers 512 --step-layers 16",  # fmt: skip
        section="predicted",
        figure="MPress plan under PipeDream: largest BERT-like model (model)",
        compared_with="recompute-only's largest",
        value=_mpress("pipedream", "mpress", "predicted"),
        fmt="{:.2f}x", at_most=False, bound=1.5, set_by="issue 18",
    ),
    Target(
        key="t-mpress-measured", bench="mpress", device="cpu",
        command="tidal bench mpress --section measured --measured-ranks 4 --measured-budget 8MiB --measured-max-layers 40",  # fmt: skip
        section="measured",
        figure="`pipeline.memory = auto` under PipeDream: largest GPT trained, 4 gloo ranks",
        compared_with="recompute-only's largest", value=_mpress("pipedream", "auto", "measured"),
        context=lambda d: f"1F1B {_mpress('1f1b', 'auto', 'measured')(d):.2f}x",
        fmt="{:.2f}x", at_most=False, bound=1.5, set_by="issue 18", headline=True,
    ),
    Target(
        key="t-pipemare-m8", bench="pipemare", device="cpu", command="tidal bench pipemare",
        section="adamw m=8 lr=0.001",
        figure="PipeMare + weight prediction, 8 stages, AdamW, 8 microbatches: validation loss",
        compared_with="synchronous 1F1B's", value=_pipemare("adamw m=8 lr=0.001", "pipemare-lr-pred"),  # fmt: skip
        context=lambda d: f"plain asynchrony {_pipemare('adamw m=8 lr=0.001', 'async')(d):+.1%}",
        fmt="{:+.1%}", at_most=True, bound=0.02, set_by="issue 6", headline=True,
    ),
    Target(
        key="t-pipemare-m4", bench="pipemare", device="cpu", command="tidal bench pipemare",
        section="adamw m=4 lr=0.001",
        figure="the same at 4 microbatches (longer delays)",
        compared_with="synchronous 1F1B's", value=_pipemare("adamw m=4 lr=0.001", "pipemare-lr-pred"),  # fmt: skip
        context=lambda d: f"plain asynchrony {_pipemare('adamw m=4 lr=0.001', 'async')(d):+.1%}",
        fmt="{:+.1%}", at_most=True, bound=0.02, set_by="issue 21",
    ),
    Target(
        key="t-plan-check", bench="plan-check", device="h100", command="tidal bench plan-check",
        figure="one-GPU plans (GPT-3 1.3B, 2.7B): allocator peak, the worst",
        compared_with="the planner's prediction",
        value=_worst_error("peak_measured_over_predicted"),
        fmt="{:.1%}", at_most=True, bound=0.1, set_by="issue 20",
    ),
    Target(
        key="t-plan-check-ranks", bench="plan-check-ranks", device="cpu",
        command="tidal bench plan-check --ranks 4",
        figure="plans on 4 gloo ranks (pp2 x dp2, pp2 x tp2 swapping, dp4, pp2 x dp2 all on the host): metered model data per rank, the worst",
        compared_with="the planner's prediction for its pipeline rank",
        value=_worst_error("model_data_measured_over_predicted"),
        context=lambda d: "optimizer state on the device alone " + "{:.1%}".format(max(
            abs(r["measured_model_data"]["optimizer_state"] / r["predicted_memory"]["optimizer"] - 1)
            for r in d["rows"] if r["ran"] and r["predicted_memory"]["optimizer"])),
        fmt="{:.1%}", at_most=True, bound=0.1, set_by="issue 51",
    ),  # fmt: skip
    Target(
        key="t-savers", bench="savers", device="h100", command="tidal bench savers",
        figure="MPress savers on one GPU: allocator peak per stage and strategy, the worst",
        compared_with="the memory model's prediction",
        value=_worst_error("allocator_over_predicted"),
        fmt="{:.1%}", at_most=True, bound=0.1, set_by="issue 18",
    ),
)  # fmt: skip
