"""What one case of ``tidal bench compat`` runs, inside its worker process (see
:mod:`benchmarks.isolated`): a zoo family in one mode, with the chunk engine and with the
reference engine on the same seeds and batches, judged on the losses.

[Note: compat modes]
Every mode trains ``steps`` micro-batches through :func:`tidal.testing.zoo.run_steps` (the
global RNG reseeded per micro-batch, so layerdrop and dropout draw alike in both engines).

- fp32, unlimited: no device budget. Must equal the reference to ``FP32_RTOL`` relative on
  every loss (the issue's bound; in practice the losses are bit for bit equal).
- tight: the budget is ``stats()["min_device_bytes"]`` of the unlimited run of the same
  precision and accumulation (the least budget every iteration of that run fitted in, [Note:
  the least budget] in tidal/memory/store.py), so chunks are evicted and fetched throughout.
  ``same_as_unlimited`` records whether its losses equal the unlimited run's bit for bit
  (placement must never change the arithmetic).
- bf16: both engines compute under bf16 autocast (norms, softmax and the loss in fp32), the
  chunk engine from bf16 weights (fp32 masters), the reference from fp32 weights that
  autocast rounds to bf16 where it computes in bf16. So the two differ by the rounding of the
  weights where autocast keeps fp32, and a model that computes its loss from bf16 logits gets
  a loss known only to bf16's spacing, 2^-7 of it at most. The bound is
  ``max(4 * own, BF16_FLOOR)``: ``own`` is how
  far the reference's bf16 losses are from its fp32 ones (the bound of
  tests/unit/parallel/test_chunk_engine.py), ``BF16_FLOOR`` that spacing. Placement is held to more:
  ``same_as_unlimited`` must hold in bf16 too. And ``first_loss_as_plain`` says whether the
  first loss equals, bit for bit, plain PyTorch's on the model with its parameters (and norm
  statistics) cast to bf16 under autocast (the same arithmetic, before any update), which
  tells a difference of precision policy from an error.
- accumulation: two micro-batches per optimizer step in both engines.
- ranks: the sharded engine on ``ranks`` gloo processes, each on its share of the batch rows,
  with SGD and momentum (Adam divides by the root of the second moment, so a gradient that is
  zero up to rounding moves by the whole learning rate in a direction the rounding picks, and
  the ranks sum in another order than one process; see tests/distributed/
  test_sitting_out_ranks.py). See [Note: the data-parallel reference] for what it equals.

[Note: the data-parallel reference]
N ranks each compute the mean loss of their rows and the gradients are averaged: that is one
process running the rows of each rank as a micro-batch of gradient accumulation, not one
process on the whole batch, where the loss is a batch statistic (BatchNorm normalises by the
batch's moments; a masked LM averages over a number of labelled tokens that differs between
the shares). So the reference runs the shares as micro-batches, reseeding the RNG before each
as every rank does. A family whose forward keeps state across calls (``one_call_per_step``: a
call counter) is compared with one process on the whole batch instead, once per step; its loss
is a mean over rows of equal weight, so that is the same quantity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.isolated import error_result
from tidal.memory.config import ChunkConfig
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.testing.zoo import ZooModel, run_steps, seed_step
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

__all__ = [
    "BF16_FLOOR",
    "FP32_RTOL",
    "MODES",
    "Case",
    "Mode",
    "cached",
    "judge",
    "quiet_transformers",
    "ranks_modes",
    "single_process_case",
    "training",
]

FP32_RTOL = 1e-5
BF16_FLOOR = 2.0**-7  # the spacing of bf16 numbers relative to their value, at most
ADAMW = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=0, weight_decay=0.1)
SGD = OptimizerConfig(name="sgd", lr=5e-2, warmup_steps=0, weight_decay=0.1, momentum=0.9)


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One way to train a family; see [Note: compat modes]."""

    name: str
    precision: str = "fp32"
    grad_accum_steps: int = 1
    tight: bool = False
    ranks: int = 1


MODES = {
    mode.name: mode
    for mode in (
        Mode(name="fp32-unlimited"),
        Mode(name="fp32-tight", tight=True),
        Mode(name="bf16-tight", precision="bf16", tight=True),
        Mode(name="accum2-tight", grad_accum_steps=2, tight=True),
    )
}


def ranks_modes(ranks: int) -> tuple[Mode, Mode]:
    return (
        Mode(name=f"ranks{ranks}-unlimited", ranks=ranks),
        Mode(name=f"ranks{ranks}-tight", ranks=ranks, tight=True),
    )


@dataclass(frozen=True, kw_only=True)
class Case:
    family: str  # a zoo name, or module:ATTR (see tidal.testing.zoo.find_family)
    mode: Mode
    steps: int
    chunk_elements: int
    ranks_timeout_s: float = 300.0


@dataclass(frozen=True, kw_only=True)
class Run:
    losses: list[float]
    wall_s: float
    stats: dict[str, Any]  # the chunk engine's figures; empty for the reference
    sat_out: int = 0  # trainable parameters without a gradient after some backward


# Runs a worker has made, shared by its cases; see [Note: isolated cases].
_RUNS: dict[tuple[Any, ...], Any] = {}


def cached(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()`` once per worker. A failure is kept and raised again: a run that failed (a
    multi-process one that hung until its timeout) is not run again for the next mode."""
    if key not in _RUNS:
        try:
            _RUNS[key] = make()
        except Exception as err:
            _RUNS[key] = err
    value = _RUNS[key]
    if isinstance(value, Exception):
        raise value
    return value


def single_process_case(case: Case, family: ZooModel) -> dict[str, Any]:
    plain = {} if case.mode.precision == "fp32" else _plain_first_loss(family, case.mode.precision)
    try:
        row = _compared(case, family)
    except Exception as err:
        return error_result(err) | plain
    if "plain_first_loss" in plain:
        plain["first_loss_as_plain"] = row["losses"][0] == plain["plain_first_loss"]
    return row | plain


def _plain_first_loss(family: ZooModel, precision: str) -> dict[str, Any]:
    """The first step's loss of plain PyTorch on the model with its parameters cast to
    ``precision``, under autocast: what the chunk engine computes from its low-precision
    parameter chunks. Of the buffers only norm layers' statistics are cast, as in the chunk
    engine (``model.to(torch.bfloat16)`` would round rotary frequencies too)."""
    model = family.build(0)
    dtype = _DTYPES[precision]
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._NormBase):
                for name, buffer in module._buffers.items():
                    if buffer is not None and buffer.is_floating_point():
                        module._buffers[name] = buffer.to(dtype)
    seed_step(0)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            return {"plain_first_loss": model(**family.batch(0)).item()}
    except Exception as err:
        return {"plain_error": error_result(err)["error"]}


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _compared(case: Case, family: ZooModel) -> dict[str, Any]:
    mode = case.mode
    want = _reference(case, family, mode.precision, mode.grad_accum_steps)
    unlimited = cached(("chunk", case.family, mode.precision, mode.grad_accum_steps, None),
                       lambda: _chunk(case, family, None))  # fmt: skip
    budget = unlimited.stats["min_device_bytes"] if mode.tight else None
    got = _chunk(case, family, budget) if mode.tight else unlimited
    tolerance = FP32_RTOL
    if mode.precision != "fp32":
        fp32 = _reference(case, family, "fp32", mode.grad_accum_steps)
        own = max(_relative(a, b) for a, b in zip(want.losses, fp32.losses, strict=True))
        tolerance = max(4 * own, BF16_FLOOR)
    row = {"budget_bytes": budget, **judge(got.losses, want.losses, tolerance)}
    if mode.tight:
        row["same_as_unlimited"] = got.losses == unlimited.losses
    return row | _figures(got, want)


def _figures(got: Run, want: Run) -> dict[str, Any]:
    stats = got.stats
    return {
        "peak_device_bytes": stats["peak_device_bytes"],
        "min_device_bytes": stats["min_device_bytes"],
        "evictions": stats["evictions"],
        "num_chunks": stats["num_chunks"],
        "params_without_grad": want.sat_out,
        "wall_s": got.wall_s,
        "reference_wall_s": want.wall_s,
        "losses": got.losses,
        "reference_losses": want.losses,
    }


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def judge(got: list[float], want: list[float], tolerance: float) -> dict[str, Any]:
    """``match`` when every loss is within ``tolerance`` of the reference's, relative."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} losses against {len(want)} of the reference")
    finite = all(math.isfinite(x) for x in (*got, *want))
    rel = max((_relative(a, b) for a, b in zip(got, want, strict=True)), default=0.0)
    absolute = max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
    return {
        "result": "match" if finite and rel <= tolerance else "mismatch",
        "max_rel_loss_diff": rel if finite else None,
        "max_abs_loss_diff": absolute if finite else None,
        "tolerance": tolerance,
    }


def training(case: Case, precision: str, grad_accum_steps: int) -> TrainingConfig:
    return TrainingConfig(device="cpu", steps=case.steps, precision=precision,  # type: ignore[arg-type]
                          grad_accum_steps=grad_accum_steps)  # fmt: skip


def _reference(case: Case, family: ZooModel, precision: str, grad_accum_steps: int) -> Run:
    def run() -> Run:
        engine = ReferenceEngine(family.build(0), optimizer=ADAMW,
                                 training=training(case, precision, grad_accum_steps))  # fmt: skip
        recorder = SatOut(engine)
        started = time.perf_counter()
        losses = run_steps(recorder, family, case.steps)
        return Run(losses=losses, wall_s=time.perf_counter() - started, stats={},
                   sat_out=len(recorder.names))  # fmt: skip

    return cached(("reference", case.family, precision, grad_accum_steps), run)


def _chunk(case: Case, family: ZooModel, budget: int | None) -> Run:
    mode = case.mode
    engine = ChunkEngine(
        family.build(0),
        optimizer=ADAMW,
        training=training(case, mode.precision, mode.grad_accum_steps),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=case.chunk_elements),
    )
    started = time.perf_counter()
    losses = run_steps(engine, family, case.steps)
    return Run(losses=losses, wall_s=time.perf_counter() - started, stats=engine.stats())


class SatOut:
    """An engine that notes the trainable parameters left without a gradient by a backward."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.names: set[str] = set()

    def __call__(self, **batch: torch.Tensor) -> Any:
        return self.engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        params = self.engine.model.named_parameters()
        self.names |= {n for n, p in params if p.requires_grad and p.grad is None}

    def step(self) -> None:
        self.engine.step()


def quiet_transformers() -> None:
    """Hugging Face's config warnings (a tiny vocabulary, a default loss) are noise here."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()
