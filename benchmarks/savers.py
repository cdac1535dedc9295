"""``tidal bench savers``: MPress's savers measured on this machine's device, in one process.

What the predicted bench (benchmarks/mpress.py) takes from a cost model, this one measures, and
then checks the memory model with it:

1. copy rates: host to device and back (pinned host memory on CUDA), and a copy within the
   device (on one GPU the only device-to-device copy there is: it is not a peer link);
2. a block's forward and backward seconds, and what recomputing it adds (the block's forward
   and backward under torch's non-reentrant checkpoint, less the plain ones);
3. a GPT cut into ``--stages`` pipeline stages, each stage's forward and backward seconds and
   what each of its parts saves for one microbatch; the simulator's 1F1B step from those
   seconds, and the saver planner fed with them (the measured host rate as the host link; no
   peer: one process has no second device);
4. each stage run alone on the device, as its rank runs it under 1F1B (its forwards and
   backwards in the schedule's order, inputs and output gradients made in advance), once per
   strategy: ``none``, ``recompute`` (every block), ``selective`` (attention only), ``host``
   (every block to the host) and ``plan`` (the planner's plan; each stage's budget the least it
   can hold plus ``--budget-fraction`` of what savers could take off its peak). Per stage: the saved bytes the
   memory model predicts at the peak, the peak a saved-tensor meter counts, the peak predicted
   for the allocator (those saved bytes plus the stage's backward temporaries, measured once:
   [Note: backward temporaries] in tidal/activations/measure.py), the allocator's peak above
   the stage's resting memory (CUDA: ``max_memory_allocated``; elsewhere not measured), and the
   step's seconds against the prediction.

[Note: stages in one process]
A stage run alone holds what its rank would hold of activations: the schedule's order decides
how many microbatches are in flight, and nothing of the other stages is live (their inputs and
output gradients are made before the peak counter is reset). The allocator's peak also counts
what no saver decides: the backward's temporaries (the head's logits' gradient above all),
which are measured per stage and added to the predicted peak; the meter counts saved tensors
only and is what the saver model must match.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.tables import ResultTable
from tidal.activations import Links, Saved, Saver, SaverPlan, TensorClass, evaluate, plan_savers
from tidal.activations.apply import apply_savers
from tidal.activations.costs import Choice, least_peak_bytes
from tidal.activations.measure import backward_temporary_bytes
from tidal.activations.runtime import around_forward
from tidal.config import ConfigError, format_bytes
from tidal.memory.activations import SavedTensorMeter
from tidal.memory.tiers import make_tiers
from tidal.models.gpt import GPTConfig, build_gpt, split_gpt
from tidal.pipeline.ir import Kind
from tidal.pipeline.savers import measure_units, saved_tensors, step_with_savers, whole_blocks
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import Simulation, StageCosts, simulate
from tidal.pipeline.split import PipelineStage, even_ranges

__all__ = ["STRATEGIES", "add_arguments", "bench_savers", "copy_rates", "run", "tables"]

STRATEGIES = ("none", "recompute", "selective", "host", "plan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=1024, help="d_model (1024)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per microbatch (8)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--budget-fraction", type=float, default=0.5,
                        help="each stage's activation budget for the plan: the least it can hold plus "
                        "this fraction of what savers could take off its peak (0.5)")  # fmt: skip
    parser.add_argument("--copy-bytes", default=256 << 20, type=int, help="bytes per copy timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results-dir", default=None, metavar="DIR")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(device: torch.device, work: Callable[[], Any], repeats: int) -> float:
    """The least wall seconds of ``repeats`` runs of ``work`` after one warm-up."""
    work()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_rates(device: torch.device, num_bytes: int, repeats: int) -> dict[str, float]:
    """Bytes per second of a copy host to device, device to host and within the device."""
    n = num_bytes // 4
    host = torch.empty(n, pin_memory=device.type == "cuda")
    host.fill_(1.0)
    on_device = torch.empty(n, device=device)
    other = torch.empty(n, device=device)

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        return num_bytes / _seconds(device, lambda: dst.copy_(src, non_blocking=True), repeats)

    return {"host_to_device": rate(on_device, host), "device_to_host": rate(host, on_device),
            "within_device": rate(other, on_device)}  # fmt: skip


def _block_seconds(block: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """A block's forward and backward seconds, and what its recompute adds to the pair."""
    from torch.utils.checkpoint import checkpoint

    device = x.device
    x = x.detach().requires_grad_()

    def forward() -> None:
        with torch.no_grad():
            block(x)

    def plain() -> None:
        block(x).sum().backward()

    def recomputed() -> None:
        checkpoint(block, x, use_reentrant=False).sum().backward()

    forward_s = _seconds(device, forward, repeats)
    pair_s = _seconds(device, plain, repeats)
    return {"forward_s": forward_s, "backward_s": pair_s - forward_s,
            "recompute_s": max(_seconds(device, recomputed, repeats) - pair_s, 0.0)}  # fmt: skip


@dataclasses.dataclass(slots=True)
class _Inputs:
    """Per microbatch, what a stage takes and the gradient its output gets."""

    inputs: list[torch.Tensor]
    output_grads: list[torch.Tensor | None]


def _stage_inputs(stages: Sequence[PipelineStage], tokens: list[torch.Tensor]) -> list[_Inputs]:
    out = []
    xs = tokens
    for stage in stages:
        grads: list[torch.Tensor | None] = [None] * len(xs)
        if not stage.is_last:
            with torch.no_grad():
                ys = [stage(x) for x in xs]
            grads = [torch.randn_like(y) * 1e-3 for y in ys]
        out.append(_Inputs(inputs=xs, output_grads=grads))
        if not stage.is_last:
            xs = ys
    return out


def _run_program(stage: PipelineStage, program: Sequence[tuple[Kind, int]], given: _Inputs,
                 targets: torch.Tensor) -> None:  # fmt: skip
    outputs: dict[int, torch.Tensor] = {}
    for kind, m in program:
        if kind is Kind.FORWARD:
            x = given.inputs[m]
            x = x.detach().requires_grad_() if x.is_floating_point() else x
            outputs[m] = stage(x, targets) if stage.is_last else stage(x)
        else:
            out = outputs.pop(m)
            grad = given.output_grads[m]
            out.backward(grad)


def _measure_stage(stage: PipelineStage, program: Sequence[tuple[Kind, int]], given: _Inputs,
                   targets: torch.Tensor, repeats: int) -> dict[str, Any]:  # fmt: skip
    device = targets.device
    params = {p.untyped_storage()._cdata for p in stage.parameters()}
    meter = SavedTensorMeter(is_model_storage=params.__contains__)
    hooks = around_forward(stage, meter.tracking)
    try:
        step_s = _seconds(device, lambda: _run_program(stage, program, given, targets), repeats)
        meter.take_peak_bytes()
        stage.zero_grad(set_to_none=True)
        allocated = None
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            resting = torch.cuda.memory_allocated(device)
        _run_program(stage, program, given, targets)
        if device.type == "cuda":
            _sync(device)
            allocated = torch.cuda.max_memory_allocated(device) - resting
        return {"step_s": step_s, "meter_peak_bytes": meter.take_peak_bytes(),
                "allocator_peak_bytes": allocated}  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()


def _links(num_stages: int, budget_bytes: tuple[int, ...], host_rate: float,
           prefetch: bool) -> Links:  # fmt: skip
    n = num_stages
    return Links(stage_rank=tuple(range(n)), budget_bytes=budget_bytes,
                 base_bytes=(0,) * n, host_link=(0,) * n, host_bandwidth=(host_rate,),
                 host_budget_bytes=(None,), host_prefetch=prefetch,
                 peer_bandwidth=tuple((0.0,) * n for _ in range(n)))  # fmt: skip


def _strategy(name: str, saved: list[Saved], links: Links) -> SaverPlan:
    """``name``'s plan: ``plan`` the planner's; ``recompute`` and ``host`` on whole blocks (as
    ``pipeline.memory`` does); ``selective`` on every block's attention."""
    if name == "plan":
        return plan_savers(saved, links)
    if name in ("recompute", "host"):
        saved = whole_blocks(saved)
        choices: list[Choice] = [(Saver.HOST if name == "host" else Saver.RECOMPUTE, None)
                                 if s.block >= 0 and not s.fixed else (Saver.KEEP, None)
                                 for s in saved]  # fmt: skip
        return evaluate(saved, choices, links, name)
    inside = {"none": set(), "selective": {TensorClass.ATTENTION}}[name]
    choices = [(Saver.RECOMPUTE if s.block >= 0 and s.tensor_class in inside else Saver.KEEP,
                None) for s in saved]  # fmt: skip
    return evaluate(saved, choices, links, name)


def _programs(
    num_stages: int, microbatches: int
) -> tuple[Simulation, list[list[tuple[Kind, int]]]]:
    schedule = make_schedule("1f1b", stages=num_stages, microbatches=microbatches)
    programs: list[list[tuple[Kind, int]]]
    programs = [[(a.kind, a.microbatch) for a in schedule.programs[schedule.rank_of(s)]
                 if a.stage == s and a.kind in (Kind.FORWARD, Kind.BACKWARD)]
                for s in range(num_stages)]  # fmt: skip
    return simulate(schedule), programs


def bench_savers(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, seq_len=args.seq_len, num_layers=args.layers,
                       num_heads=args.heads, d_model=args.width, dropout=0.0)  # fmt: skip
    model = build_gpt(config, device=device)
    stages = split_gpt(model, even_ranges(args.layers, args.stages))
    del model
    tokens = [torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), device=device)
              for _ in range(args.microbatches)]  # fmt: skip
    targets = tokens[0]
    rates = copy_rates(device, args.copy_bytes, args.repeats)
    hidden = torch.randn(args.micro_batch, args.seq_len, args.width, device=device)
    block = _block_seconds(stages[0].layers[0], hidden, args.repeats)
    given = _stage_inputs(stages, tokens)
    stage_s = [_block_free_seconds(stage, given[s], targets, args.repeats)
               for s, stage in enumerate(stages)]  # fmt: skip
    temporaries = [_temporary_bytes(stage, given[s], targets) for s, stage in enumerate(stages)]
    shape, programs = _programs(args.stages, args.microbatches)
    sim = simulate(shape.schedule, StageCosts(forward_s=tuple(f for f, _ in stage_s),
                                              backward_s=tuple(b for _, b in stage_s)))  # fmt: skip
    units = measure_units(stages, tokens[0], targets,
                          lambda s, b: block["recompute_s"] if b >= 0 else 0.0)  # fmt: skip
    weight_bytes = [sum(p.numel() * p.element_size() for p in s.parameters()) for s in stages]
    saved = saved_tensors(sim, units, weight_bytes=weight_bytes)
    host_rate = min(rates["host_to_device"], rates["device_to_host"])
    prefetch = device.type == "cuda"  # [Note: host swap prefetch]
    roomy = _links(args.stages, (1 << 62,) * args.stages, host_rate, prefetch)
    kept, least = _strategy("none", saved, roomy), least_peak_bytes(saved, roomy)
    budget = tuple(m + int((k - m) * args.budget_fraction)
                   for k, m in zip(kept.peak_bytes, least, strict=True))  # fmt: skip
    links = _links(args.stages, budget, host_rate, prefetch)
    _, host = make_tiers(device=device, device_budget=None, host_budget=None)
    rows = []
    reference_grads: dict[int, list[torch.Tensor]] = {}
    skipped: dict[str, str] = {}
    for name in STRATEGIES:
        try:
            plan = _strategy(name, saved, links)
        except ConfigError as error:  # the planner found no plan: say so, measure the rest
            skipped[name] = str(error)
            continue
        for s, stage in enumerate(stages):
            savers = {i.path: c[0] for i, c in zip(plan.saved, plan.choices, strict=True)
                      if i.stage == s and i.path and c[0] is not Saver.KEEP}  # fmt: skip
            copy = deepcopy(stage)  # a checkpoint cannot be taken off a module: a fresh one
            handles = apply_savers(copy, savers, host=host)
            measured = _measure_stage(copy, programs[s], given[s], targets, args.repeats)
            grads = [p.grad.detach().cpu() for p in copy.parameters() if p.grad is not None]
            reference = reference_grads.setdefault(s, grads)  # "none" runs first
            measured["grads_max_abs_diff"] = max(
                (float((a - b).abs().max()) for a, b in zip(grads, reference, strict=True)),
                default=0.0)  # fmt: skip
            del copy, grads
            kept_bytes = sum(i.held_under(c[0]) for i, c
                             in zip(plan.saved, plan.choices, strict=True) if i.stage == s)  # fmt: skip
            rows.append({"strategy": name, "stage": s, "fits_plan": plan.fits,
                         "predicted_kept_bytes": kept_bytes,
                         "recomputed": len(handles.recomputed), "to_host": len(handles.swapped),
                         "budget_bytes": budget[s], "predicted_saved_bytes": plan.peak_bytes[s],
                         "backward_temporary_bytes": temporaries[s],
                         "predicted_peak_bytes": plan.peak_bytes[s] + temporaries[s],
                         "predicted_added_s": plan.added_s[s], **measured})  # fmt: skip
    none_s = {r["stage"]: r["step_s"] for r in rows if r["strategy"] == "none"}
    for r in rows:
        r["measured_added_s"] = r["step_s"] - none_s[r["stage"]]
        r["meter_over_predicted"] = (r["meter_peak_bytes"] / r["predicted_saved_bytes"]
                                     if r["predicted_saved_bytes"] else None)  # fmt: skip
        r["allocator_over_predicted"] = (r["allocator_peak_bytes"] / r["predicted_peak_bytes"]
                                         if r["allocator_peak_bytes"] and r["predicted_peak_bytes"]
                                         else None)  # fmt: skip
    step_plan = None if "plan" in skipped else step_with_savers(
        sim, _strategy("plan", saved, links)).makespan_s  # fmt: skip
    return {"torch_device": str(device), "config": dataclasses.asdict(config),
            "micro_batch": args.micro_batch, "stages": args.stages,
            "microbatches": args.microbatches, "copy_bytes_per_s": rates, "block": block,
            "stage_forward_backward_s": stage_s, "budget_fraction": args.budget_fraction,
            "predicted_step_s": {"none": sim.makespan_s, "plan": step_plan}, "skipped": skipped,
            "rows": rows}  # fmt: skip


def _temporary_bytes(stage: PipelineStage, given: _Inputs, targets: torch.Tensor) -> int:
    """What one backward of ``stage`` holds for a while ([Note: backward temporaries])."""
    x = given.inputs[0]
    x = x.detach().requires_grad_() if x.is_floating_point() else x
    out = stage(x, targets) if stage.is_last else stage(x)
    grad = given.output_grads[0]
    num_bytes = backward_temporary_bytes(lambda: out.backward(grad))
    stage.zero_grad(set_to_none=True)
    return num_bytes


def _block_free_seconds(stage: PipelineStage, given: _Inputs, targets: torch.Tensor,
                        repeats: int) -> tuple[float, float]:  # fmt: skip
    """One microbatch's forward and backward seconds on ``stage``."""
    device = targets.device
    x = given.inputs[0]

    def forward() -> None:
        with torch.no_grad():
            stage(x, targets) if stage.is_last else stage(x)

    def pair() -> None:
        _run_program(stage, [(Kind.FORWARD, 0), (Kind.BACKWARD, 0)], given, targets)

    forward_s = _seconds(device, forward, repeats)
    return forward_s, max(_seconds(device, pair, repeats) - forward_s, 0.0)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per strategy and stage: saved bytes predicted, counted by the meter, and the allocator's
    peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9.0, 4.0))
    labels = [f"{r['strategy']}\ns{r['stage']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["predicted_peak_bytes"] / 2**20 for r in rows], 0.27,
           label="predicted peak (saved + backward temporaries)")  # fmt: skip
    ax.bar(list(x), [r["meter_peak_bytes"] / 2**20 for r in rows], 0.27, label="meter")
    ax.bar([i + 0.27 for i in x], [(r["allocator_peak_bytes"] or 0) / 2**20 for r in rows], 0.27,
           label="allocator peak")  # fmt: skip
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("MiB")
    ax.set_title(f"tidal bench savers on {result['device']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show

    result = bench_savers(args)
    folder = None if args.results_dir is None else Path(args.results_dir)
    rows = result.pop("rows")
    path = write_results("savers", rows, folder=folder)
    _add_header(path, result)
    data = read_results(path)
    try:
        console.print(f"plot: {plot(data, path.with_suffix('.png'))}")
    except ImportError:  # a machine without matplotlib still gets the JSON and the table
        console.print("no plot: matplotlib is not installed")
    show(console, tables(data, args))
    console.print(f"results: {path}")
    return 0


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """Each strategy and stage, predicted beside measured; the copy rates and what was not
    measured under it ([Note: one table per result] in benchmarks/tables.py)."""
    rates = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in result["copy_bytes_per_s"].items())
    block = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in result["block"].items())
    skipped = "; ".join(f"{name}: not measured: {why}" for name, why in result["skipped"].items())
    columns = ("strategy", "stage", "kept predicted", "meter", "peak predicted", "allocator peak",
               "step s", "added s predicted", "added s measured", "grads vs none")  # fmt: skip
    cells = []
    for r in result["rows"]:
        peak = r["allocator_peak_bytes"]
        cells.append([r["strategy"], str(r["stage"]), format_bytes(r["predicted_kept_bytes"]),
                      format_bytes(r["meter_peak_bytes"]), format_bytes(r["predicted_peak_bytes"]),
                      "-" if peak is None else format_bytes(peak), f"{r['step_s']:.4f}",
                      f"{r['predicted_added_s']:.4f}", f"{r['measured_added_s']:.4f}",
                      f"{r['grads_max_abs_diff']:.2g}"])  # fmt: skip
    title = (f"tidal bench savers on {result['device']} (1F1B, {result['stages']} stages, "
             f"{result['microbatches']} microbatches)")  # fmt: skip
    note = f"copies: {rates}; block: {block}" + (f". {skipped}" if skipped else "")
    return [ResultTable.of(title, columns, cells, left_columns=2, note=note)]


def _add_header(path: Path, result: dict[str, Any]) -> None:
    import json

    data = json.loads(path.read_text())
    data.update(result)
    path.write_text(json.dumps(data, indent=2) + "\n")
