"""``tidal bench pipemare``: does PipeMare converge like synchronous training?

A GPT whose blocks are cut into fine-grained pipeline stages (8 blocks in 8 stages by default,
embeddings with the first block, head with the last) is trained on the stdlib byte corpus by
five variants of one pipeline, all in this process through
:func:`tidal.runtime.local.run_local` (the single-process simulator of the stages' weight
delays):

- ``sync``: 1F1B with a flush per step, i.e. plain one-process training;
- ``async``: the ``pipemare`` schedule (no flush, no stashing) with nothing else: naive asynchrony;
- ``pipemare-lr``: the same plus PipeMare's LR rescheduling up to step T1;
- ``pipemare-lr-dc``: plus discrepancy correction (decay D);
- ``pipemarew``: the ``pipemarew`` schedule (T2 flushed steps first) plus both techniques;
- ``pipemare-lr-pred``: LR rescheduling plus tidal's weight prediction in place of correction
  (the forward runs on the weights its backward will find; [Note: weight prediction] in
  pipemare.py).

[Note: a fair comparison]
Every variant of a section starts from the same initial weights (``build_gpt(seed)``), sees the
same batch at each step (``BatchSampler.batch(step)`` of one seed), and uses the same optimizer,
microbatches per step and base learning-rate schedule (linear warm-up, cosine decay); only the
schedule and the PipeMare rules differ. There is no gradient clipping: a synchronous schedule
would clip by the global norm and an asynchronous one per stage, which is a difference of its
own. Results are reported as figures (the final train loss, the validation loss, its ratio to
``sync``), never asserted: whether PipeMare lands within 2% of synchronous training is what the
bench measures.

[Note: the default sections]
A section is (optimizer, m, peak LR); the delay of stage s is about ceil((p - 1 - s) / m).
- ``sgd:1:0.2``: m = 1, so stage 0 lags 7 updates, as much as a 1F1B runtime makes it; PipeMare's
  home ground (the paper's analysis is SGD's). Naive asynchrony blows up early; LR rescheduling
  removes that, but a gap of several percent remains with every technique (the section's
  results in ``benchmarks/results/pipemare-*.json``).
- ``adamw:4:0.001``: delays up to 2. AdamW is far more delay-sensitive than SGD (one-process AdamW
  with 2-step-stale gradients ends ~20% above, at half the LR too); correction and rescheduling
  change little, weight prediction removes most of the gap.
- ``adamw:8:0.001``: m = p, the usual 1F1B setting (its bubble is (p-1)/(m+p-1)); delays up to 1.
The table reports each variant against ``sync`` of the same section and seed; run two seeds
(``--seed``) before trusting a difference of a few percent.
[Note: why one file]
One bench: its config and sections, the five variants, the run, the table and the plot. The
sweep findings in its notes are what a reader of the results needs next to the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.tables import ResultTable
from tidal.config import ConfigError, require
from tidal.data import BatchSampler, DataConfig, TokenSplits, build_token_splits
from tidal.models.gpt import GPT, GPTConfig, build_gpt, split_gpt
from tidal.parallel.lr import WarmupCosine
from tidal.pipeline.ir import Schedule
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.split import PipelineStage, even_ranges
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_SECTIONS",
    "OptimizerName",
    "PipeMareBenchConfig",
    "Section",
    "Variant",
    "VariantRun",
    "add_arguments",
    "bench_pipemare",
    "build_model",
    "config_from_args",
    "lr_schedule",
    "make_optimizer",
    "plot",
    "run",
    "run_variant",
    "samplers",
    "settings",
    "table",
    "tables",
    "validation_loss",
    "variant_schedule",
]

BYTE_VOCAB_SIZE = 256
TARGET_RATIO = 1.02  # the target: PipeMare's loss within 2% of synchronous training


class Variant(enum.StrEnum):
    """One way to run the pipeline; see the module docstring."""

    SYNC = "sync"
    ASYNC = "async"
    PIPEMARE_LR = "pipemare-lr"
    PIPEMARE_LR_DC = "pipemare-lr-dc"
    PIPEMAREW = "pipemarew"
    PIPEMARE_LR_PRED = "pipemare-lr-pred"

    @property
    def schedule_name(self) -> str:
        if self is Variant.SYNC:
            return "1f1b"
        return "pipemarew" if self is Variant.PIPEMAREW else "pipemare"

    @property
    def lr_rescheduling(self) -> bool:
        return self not in (Variant.SYNC, Variant.ASYNC)

    @property
    def correction(self) -> bool:
        return self in (Variant.PIPEMARE_LR_DC, Variant.PIPEMAREW)

    @property
    def prediction(self) -> bool:
        return self is Variant.PIPEMARE_LR_PRED


class OptimizerName(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"  # with momentum


DEFAULT_LR = {OptimizerName.ADAMW: 1e-3, OptimizerName.SGD: 0.2}


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class Section:
    """One comparison: every variant with this optimizer, microbatches per step and peak LR.

    Written ``optimizer:microbatches:lr`` on the command line (``sgd:1:0.2``).
    """

    optimizer: OptimizerName
    microbatches: int
    lr: float

    def __post_init__(self) -> None:
        choices = ", ".join(OptimizerName)
        require(
            self.optimizer in set(OptimizerName),
            "sections",
            f"unknown optimizer {self.optimizer!r}; choose from {choices}",
        )
        object.__setattr__(self, "optimizer", OptimizerName(self.optimizer))
        require(self.microbatches >= 1, "sections", f"microbatches must be >= 1, got {self}")
        require(self.lr > 0, "sections", f"the learning rate must be > 0, got {self}")

    @property
    def name(self) -> str:
        return f"{self.optimizer} m={self.microbatches} lr={self.lr:g}"

    @classmethod
    def parse(cls, text: str) -> Section:
        parts = text.strip().split(":")
        usage = f"expected optimizer:microbatches:lr such as sgd:1:0.2, got {text!r}"
        if len(parts) != 3:
            raise ConfigError("sections", usage)
        try:
            microbatches, lr = int(parts[1]), float(parts[2])
        except ValueError:
            raise ConfigError("sections", usage) from None
        return cls(optimizer=parts[0], microbatches=microbatches, lr=lr)  # type: ignore[arg-type]


DEFAULT_SECTIONS = (
    Section(optimizer=OptimizerName.SGD, microbatches=1, lr=DEFAULT_LR[OptimizerName.SGD]),
    Section(optimizer=OptimizerName.ADAMW, microbatches=4, lr=DEFAULT_LR[OptimizerName.ADAMW]),
    Section(optimizer=OptimizerName.ADAMW, microbatches=8, lr=DEFAULT_LR[OptimizerName.ADAMW]),
)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class PipeMareBenchConfig:
    """What ``tidal bench pipemare`` trains and compares.

    Attributes:
        steps: optimizer steps per variant.
        stages: pipeline stages p (>= 8 for the issue's fine-grained pipeline).
        num_layers, d_model, num_heads, seq_len, batch_size: the GPT and its batches
            (vocabulary 256, untied embeddings: asynchronous schedules refuse tied weights).
        sections: one comparison of every variant per entry: the optimizer (AdamW with betas
            0.9, 0.95 and no weight decay, or SGD with ``momentum``), the microbatches m per
            step (the delay of stage s is about ceil((p - 1 - s) / m)) and the peak LR.
        warmup_fraction, min_lr_ratio: the base schedule: linear warm-up over this fraction of
            the steps, then cosine decay to ``min_lr_ratio`` of the peak at the last step.
        reschedule_fraction: T1 as a fraction of the steps (LR rescheduling ends at T1).
        correction_decay: D of discrepancy correction.
        sync_fraction: T2 as a fraction of the steps (PipeMareW's flushed steps).
        val_batches: held-out batches (the val split) for the final validation loss.
        seed: model init, batch order and validation batches.
        data: ``stdlib`` (the byte corpus) or ``synthetic`` (random tokens, for tests).
        variants: which variants to run, in this order.
    """

    steps: int = 300
    stages: int = 8
    num_layers: int = 8
    d_model: int = 64
    num_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    sections: tuple[Section, ...] = DEFAULT_SECTIONS
    momentum: float = 0.9
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    reschedule_fraction: float = 0.25
    correction_decay: float = 0.1
    sync_fraction: float = 0.1
    val_batches: int = 8
    seed: int = 0
    data: str = "stdlib"
    variants: tuple[Variant, ...] = tuple(Variant)

    def __post_init__(self) -> None:
        for key in ("steps", "stages", "num_layers", "d_model", "num_heads"):
            value = getattr(self, key)
            require(value >= 1, key, f"must be >= 1, got {value}")
        require(
            self.stages <= self.num_layers,
            "stages",
            f"{self.stages} stages for {self.num_layers} blocks: every stage needs a block; "
            f"use at most {self.num_layers} stages or more layers",
        )
        require(len(self.sections) >= 1, "sections", "give at least one section")
        require(
            len(set(self.sections)) == len(self.sections),
            "sections",
            f"give each section at most once, got {[s.name for s in self.sections]}",
        )
        for section in self.sections:
            require(
                section.microbatches <= self.batch_size,
                "sections",
                f"{section.microbatches} microbatches of a {self.batch_size}-row batch: use at "
                f"most {self.batch_size}",
            )
        require(
            len(self.variants) >= 1 and len(set(self.variants)) == len(self.variants),
            "variants",
            f"give each variant at most once, got {[str(v) for v in self.variants]}",
        )
        object.__setattr__(self, "variants", tuple(Variant(v) for v in self.variants))
        for key in ("warmup_fraction", "reschedule_fraction", "sync_fraction"):
            value = getattr(self, key)
            require(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        require(0.0 < self.correction_decay < 1.0, "correction_decay", "must be in (0, 1)")
        require(0.0 <= self.momentum < 1.0, "momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.val_batches >= 1, "val_batches", f"must be >= 1, got {self.val_batches}")
        require(self.data in ("stdlib", "synthetic"), "data", "must be stdlib or synthetic")
        self.gpt_config()  # an impossible GPT raises its own ConfigError

    @property
    def lr_warmup_steps(self) -> int:
        """T1: the step from which PipeMare's LR rescheduling has no effect."""
        return max(1, round(self.reschedule_fraction * self.steps))

    @property
    def sync_steps(self) -> int:
        """T2: PipeMareW's flushed steps."""
        return min(self.steps, round(self.sync_fraction * self.steps))

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=BYTE_VOCAB_SIZE,
            seq_len=self.seq_len,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_model=self.d_model,
            tie_embeddings=False,
        )


# ---------------------------------------------------------------------------------------------
# the pieces every variant shares ([Note: a fair comparison])


def build_model(config: PipeMareBenchConfig) -> GPT:
    """The initial model of every variant."""
    return build_gpt(config.gpt_config(), seed=config.seed)


def make_optimizer(
    params: Any, config: PipeMareBenchConfig, section: Section
) -> torch.optim.Optimizer:
    """The optimizer of one stage (or of the whole model, for a reference run)."""
    if section.optimizer is OptimizerName.SGD:
        return torch.optim.SGD(params, lr=section.lr, momentum=config.momentum)
    return torch.optim.AdamW(params, lr=section.lr, betas=(0.9, 0.95), weight_decay=0.0)


def lr_schedule(config: PipeMareBenchConfig, lr: float) -> WarmupCosine:
    """The base learning rate per step, before PipeMare's rescheduling."""
    return WarmupCosine(
        peak_lr=lr,
        warmup_steps=round(config.warmup_fraction * config.steps),
        decay_steps=config.steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def samplers(
    config: PipeMareBenchConfig, splits: TokenSplits
) -> tuple[BatchSampler, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The training sampler (step k trains on ``batch(k)``) and the fixed validation batches."""
    train = BatchSampler(
        splits.train, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed
    )
    val = BatchSampler(
        splits.val, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed + 1
    )
    return train, val.fixed_batches(config.val_batches)


def _async_config(variant: Variant, config: PipeMareBenchConfig, section: Section) -> AsyncConfig:
    return AsyncConfig(
        weights=WeightMode.CURRENT,
        lr_rescheduling=variant.lr_rescheduling,
        lr_warmup_steps=config.lr_warmup_steps if variant.lr_rescheduling else 0,
        correction=variant.correction,
        correction_decay=config.correction_decay,
        prediction=variant.prediction,
        microbatches_per_update=section.microbatches if variant.prediction else 0,
    )


def variant_schedule(variant: Variant, config: PipeMareBenchConfig, microbatches: int) -> Schedule:
    return make_schedule(
        variant.schedule_name,
        stages=config.stages,
        microbatches=microbatches,
        steps=config.steps,
        sync_steps=config.sync_steps,
    )


@torch.no_grad()
def validation_loss(
    stages: Sequence[PipelineStage], batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Mean loss of the stages chained in order over ``batches`` (equal sizes)."""
    total = 0.0
    for idx_BT, targets_BT in batches:
        x = idx_BT
        for stage in stages[:-1]:
            x = stage(x)
        total += float(stages[-1](x, targets_BT))
    return total / len(batches)


# ---------------------------------------------------------------------------------------------
# one variant


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class VariantRun:
    """What one variant measured.

    ``losses[k]`` is step k's training loss (the row-weighted mean over its microbatches, on the
    weights each microbatch's forward used); ``delays[(stage, mb)]`` the measured tau;
    ``lrs[(stage, step)]`` the learning rate each update used (after rescheduling).
    """

    variant: Variant
    section: Section
    schedule: Schedule
    losses: list[float]
    val_loss: float
    delays: dict[tuple[int, int], int]
    lrs: dict[tuple[int, int], float]
    seconds: float

    def max_tau(self) -> list[int]:
        out = [0] * self.schedule.num_stages
        for (s, _), tau in self.delays.items():
            out[s] = max(out[s], tau)
        return out

    def final_train_loss(self) -> float:
        """Mean training loss of the last 10% of the steps."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)

    def diverged(self) -> bool:
        """A non-finite loss, or a final loss no better than the very first one."""
        if not all(math.isfinite(x) for x in self.losses) or not math.isfinite(self.val_loss):
            return True
        return self.final_train_loss() >= self.losses[0]


def run_variant(
    variant: Variant,
    config: PipeMareBenchConfig,
    section: Section,
    splits: TokenSplits,
) -> VariantRun:
    """Train ``variant`` from the shared initial model with ``section``'s optimizer, m and LR."""
    stages = split_gpt(build_model(config), even_ranges(config.num_layers, config.stages))
    async_config = _async_config(variant, config, section)
    weights = [
        StageWeights(stage, make_optimizer(stage.parameters(), config, section), async_config)
        for stage in stages
    ]
    schedule = variant_schedule(variant, config, section.microbatches)
    train, val_batches = samplers(config, splits)
    base_lr = lr_schedule(config, section.lr).lr_at
    started = time.perf_counter()
    result = run_local(schedule, stages, weights, train.batch, base_lr)
    seconds = time.perf_counter() - started
    return VariantRun(
        variant=variant,
        section=section,
        schedule=schedule,
        losses=result.losses,
        val_loss=validation_loss(stages, val_batches),
        delays=result.delays,
        lrs=result.lrs,
        seconds=seconds,
    )


# ---------------------------------------------------------------------------------------------
# the bench


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a diverged run's figure is null."""
    return value if math.isfinite(value) else None


def _row(run: VariantRun, config: PipeMareBenchConfig) -> dict[str, Any]:
    v = run.variant
    return {
        "section": run.section.name,
        "lr": run.section.lr,
        "variant": str(v),
        "schedule": run.schedule.name,
        "optimizer": str(run.section.optimizer),
        "steps": config.steps,
        "stages": config.stages,
        "microbatches": run.section.microbatches,
        "lr_warmup_steps": config.lr_warmup_steps if v.lr_rescheduling else 0,
        "sync_steps": config.sync_steps if v is Variant.PIPEMAREW else 0,
        "correction_decay": config.correction_decay if v.correction or v.prediction else None,
        "final_train_loss": _finite(run.final_train_loss()),
        "val_loss": _finite(run.val_loss),
        "ratio_to_sync": None,
        "within_2pct_of_sync": None,
        "max_tau": run.max_tau(),
        "diverged": run.diverged(),
        "seconds": run.seconds,
        "losses": [_finite(x) for x in run.losses],
        "stage0_lrs": [run.lrs[0, k] for k in range(config.steps)],
    }


def _compare_to_sync(rows: list[dict[str, Any]]) -> None:
    """Fill ``ratio_to_sync`` (validation loss over sync's) within each section."""
    sync = {r["section"]: r["val_loss"] for r in rows if r["variant"] == Variant.SYNC}
    for row in rows:
        base = sync.get(row["section"])
        if base is None or row["val_loss"] is None:
            continue
        row["ratio_to_sync"] = row["val_loss"] / base
        row["within_2pct_of_sync"] = row["ratio_to_sync"] <= TARGET_RATIO


def settings(config: PipeMareBenchConfig) -> dict[str, Any]:
    """The configuration as JSON values (enums as strings)."""
    out = dataclasses.asdict(config)
    out["sections"] = [
        {"optimizer": str(s.optimizer), "microbatches": s.microbatches, "lr": s.lr}
        for s in config.sections
    ]
    out["variants"] = [str(v) for v in config.variants]
    return out


def bench_pipemare(
    config: PipeMareBenchConfig,
    *,
    splits: TokenSplits | None = None,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Every variant in every section of ``config``: one JSON-ready row each."""
    if splits is None:
        splits = build_token_splits(
            DataConfig(source=config.data),  # type: ignore[arg-type]
            vocab_size=BYTE_VOCAB_SIZE,
            seed=config.seed,
        )
    rows = []
    for section in config.sections:
        for variant in config.variants:
            run_ = run_variant(variant, config, section, splits)
            rows.append({**_row(run_, config), "settings": settings(config)})
            if console is not None:
                console.print(
                    f"{section.name} {variant}: val loss {run_.val_loss:.4f} ({run_.seconds:.0f} s)"
                )
    _compare_to_sync(rows)
    return rows


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "nan" if value is None else format(value, spec)


COLUMNS = (
    "section", "variant", "schedule", "train loss (last 10%)", "val loss", "vs sync",
    "max tau per stage", "diverged", "seconds",
)  # fmt: skip


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """One table of every section and variant ([Note: one table per result] in
    benchmarks/tables.py)."""
    return [table(result["rows"])]


def table(rows: Sequence[dict[str, Any]], *, title: str = "tidal bench pipemare") -> ResultTable:
    cells = []
    for row in rows:
        ratio = row["ratio_to_sync"]
        cells.append([
            row["section"], row["variant"], row["schedule"], _fmt(row["final_train_loss"]),
            _fmt(row["val_loss"]), "-" if ratio is None else f"{100 * (ratio - 1):+.1f}%",
            " ".join(str(t) for t in row["max_tau"]), "yes" if row["diverged"] else "no",
            f"{row['seconds']:.1f}",
        ])  # fmt: skip
    return ResultTable.of(title, COLUMNS, cells, left_columns=3)


def _smooth(values: Sequence[float | None], window: int) -> list[float]:
    """Trailing moving average; NaN from the first missing (diverged) value on."""
    out: list[float] = []
    for k, x in enumerate(values):
        if x is None or (out and math.isnan(out[-1])):
            out.append(math.nan)
            continue
        recent = [v for v in values[max(0, k + 1 - window) : k + 1] if v is not None]
        out.append(sum(recent) / len(recent))
    return out


def plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Smoothed training loss per step, one line per variant, one panel per section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(r["section"] for r in rows))
    fig, axes = plt.subplots(
        1, len(sections), figsize=(6.5 * len(sections), 4.5), squeeze=False, sharey=True
    )
    smoothed = [_smooth(r["losses"], max(1, r["steps"] // 30)) for r in rows]
    lowest = min((x for curve in smoothed for x in curve if math.isfinite(x)), default=0.0)
    for ax, section in zip(axes[0], sections, strict=True):
        members = [r for r in rows if r["section"] == section]
        first = members[0]
        window = max(1, first["steps"] // 30)
        for row in members:
            label = f"{row['variant']} (val {_fmt(row['val_loss'], '.3f')})"
            ax.plot(_smooth(row["losses"], window), label=label, linewidth=1.4)
        initial = next((x for x in first["losses"] if x is not None), 1.0)
        # Shared y axis: every panel's lowest smoothed loss must stay in view.
        ax.set_ylim(bottom=0.98 * lowest, top=initial * 1.02)
        taus = ",".join(str(t) for t in max((r["max_tau"] for r in members), key=max))
        ax.set_title(f"{section}, p={first['stages']}, max tau {taus}", fontsize=10)
        ax.set_xlabel(f"step (train loss, moving average of {window})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss (nats per byte)")
    fig.suptitle("PipeMare vs synchronous and naive asynchronous pipelines (stdlib-corpus GPT)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# command line (wired by tidal.cli as ``tidal bench pipemare``)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PipeMareBenchConfig()
    flags: list[tuple[str, type, Any, str]] = [
        ("--steps", int, d.steps, "optimizer steps per variant"),
        ("--stages", int, d.stages, "pipeline stages p"),
        ("--layers", int, None, "GPT blocks (default: max(8, stages))"),
        ("--d-model", int, d.d_model, "GPT width"),
        ("--heads", int, d.num_heads, "attention heads"),
        ("--seq-len", int, d.seq_len, "tokens per row"),
        ("--batch-size", int, d.batch_size, "rows per step"),
        (
            "--t1",
            float,
            d.reschedule_fraction,
            "LR rescheduling ends at this fraction of the steps",
        ),
        ("--decay", float, d.correction_decay, "discrepancy correction's D"),
        ("--t2", float, d.sync_fraction, "pipemarew: synchronous fraction of the steps"),
        ("--val-batches", int, d.val_batches, "held-out batches for the validation loss"),
        ("--seed", int, d.seed, "model init, batch order and validation batches"),
    ]
    for flag, kind, default, what in flags:
        shown = "" if default is None else f" ({default})"
        parser.add_argument(flag, type=kind, default=default, help=what + shown)
    parser.add_argument(
        "--sections",
        default=",".join(f"{s.optimizer}:{s.microbatches}:{s.lr:g}" for s in d.sections),
        metavar="OPT:M:LR[,...]",
        help="one comparison of every variant each: optimizer (adamw with betas 0.9, 0.95 and "
        "no weight decay, or sgd with momentum 0.9), microbatches per step m (fewer means "
        "larger weight delays) and peak learning rate (%(default)s)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(d.variants),
        metavar="A,B",
        help="a subset of " + ",".join(Variant) + " (default: all)",
    )
    parser.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="write the JSON and PNG here instead of benchmarks/results/",
    )


def _parse_list(text: str, flag: str, parse: Any) -> tuple[Any, ...]:
    try:
        values = tuple(parse(x.strip()) for x in text.split(",") if x.strip())
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(flag, f"expected a comma list, got {text!r}") from None
    if not values:
        raise ConfigError(flag, f"expected a comma list, got {text!r}")
    return values


def config_from_args(args: argparse.Namespace) -> PipeMareBenchConfig:
    sections = _parse_list(args.sections, "--sections", Section.parse)
    names = _parse_list(args.variants, "--variants", str)
    unknown = [n for n in names if n not in set(Variant)]
    if unknown:
        raise ConfigError("--variants", f"unknown {unknown}; choose from {', '.join(Variant)}")
    return PipeMareBenchConfig(
        steps=args.steps,
        stages=args.stages,
        num_layers=args.layers if args.layers is not None else max(8, args.stages),
        d_model=args.d_model,
        num_heads=args.heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        sections=sections,
        reschedule_fraction=args.t1,
        correction_decay=args.decay,
        sync_fraction=args.t2,
        val_batches=args.val_batches,
        seed=args.seed,
        variants=tuple(Variant(n) for n in names),
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """``tidal bench pipemare``: train, print the table, write the JSON and the PNG plot."""
    from benchmarks.results import read_results, write_results
    from benchmarks.tables import show

    config = config_from_args(args)
    rows = bench_pipemare(config, console=console)
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("pipemare", rows, folder=folder)
    png = plot(rows, path.with_suffix(".png"))
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}\nplot: {png}")
    return 0
