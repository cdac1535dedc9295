"""``tidal bench gpu``: offload at GPU speed, one command, tidal beside FSDP2 and DeepSpeed.

A model whose model data needs offload under a device budget that emulates a smaller GPU (the
default on CUDA: a 3B-shaped GPT, 26 blocks of 3200 with a 8640-wide MLP and a 32000-token
vocabulary, about 2.7e9 parameters, 43 GB of bf16 weights, fp32 masters and AdamW state, twice
the default ``--device-budget 20GiB`` of an 80 GB part; ``--size 7b``: 5.3e9, 85 GB), trained a
few steps in bf16 with every block recomputed by:

- ``tidal``: the chunk engine under ``memory.device_budget`` (a tenth of the budget kept back
  for the allocator's temporaries, which the store does not meter), its host optimizer and
  device-aware placement;
- ``fsdp2-cpu-offload``: ``fully_shard`` per block and on the root with ``CPUOffloadPolicy`` and
  bf16 ``MixedPrecisionPolicy``, ``torch.optim.AdamW`` over the host's shards (torchtitan's
  recipe for CPU offload);
- ``deepspeed-zero3-offload``: ZeRO-3 with parameters and optimizer on the CPU and
  DeepSpeedCPUAdam (:func:`benchmarks.baselines.build_deepspeed_deferred`), where DeepSpeed
  imports (a row says so where it does not).

Each system runs in a process of its own (spawned), so its peak resident set is its own; on
CUDA every process is held to the budget by ``torch.cuda.set_per_process_memory_fraction``, so a
system that needs more fails as it would on the smaller GPU. Per system: tokens/s, TFLOPS (the
model's matmul FLOPs per token times tokens/s) and MFU against the device's datasheet peak,
peak device bytes (the allocator's on CUDA; on a CPU tidal's device tier alone), peak host bytes
(``VmHWM``), and host-device bytes a step: tidal's counted by its store beside its prediction
(its policy replayed on its own trace, [Note: like-for-like traffic] in benchmarks/offload.py),
the peers' by their formula (FSDP2 copies each fp32 shard up for the forward and again for the
recomputing backward and each fp32 gradient down; DeepSpeed the same in bf16 up). With
``--largest``: the deepest model of the same width each trains for one step under the same
budgets (doubling, then bisecting the depth, within ``--largest-time-s`` a system); on a CPU
nothing holds FSDP2's or DeepSpeed's device memory, so it is measured on CUDA only.

``--size tiny`` (the default without CUDA) runs the same code on the CPU in seconds, the budget a
third of the model data; the suite runs it so the command cannot rot. On a machine too small
for the size asked it prints what it would need and exits 2 before building anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.offload import in_own_process
from benchmarks.tables import ResultTable
from tidal.config import ConfigError, format_bytes, parse_bytes
from tidal.models.gpt import GPTConfig

__all__ = [
    "SIZES",
    "SYSTEMS",
    "add_arguments",
    "bench_gpu",
    "largest_depth",
    "needs",
    "run",
    "tables",
]

TIDAL, FSDP2, DEEPSPEED = "tidal", "fsdp2-cpu-offload", "deepspeed-zero3-offload"
SYSTEMS = (TIDAL, FSDP2, DEEPSPEED)
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, num_layers=4, num_heads=4, d_model=64,
                      d_ff=176, tie_embeddings=False, bias=False, dropout=0.0),
    "3b": GPTConfig(vocab_size=32000, seq_len=2048, num_layers=26, num_heads=32, d_model=3200,
                    d_ff=8640, tie_embeddings=False, bias=False, dropout=0.0),
    "7b": GPTConfig(vocab_size=32000, seq_len=2048, num_layers=32, num_heads=32, d_model=4096,
                    d_ff=11008, tie_embeddings=False, bias=False, dropout=0.0),
}  # fmt: skip
MODEL_DATA_BYTES_PER_PARAM = 16  # bf16 weight and gradient, fp32 master and AdamW's two moments
ALLOCATOR_SHARE = 0.1  # of the budget tidal leaves to what its store does not meter (CUDA)
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default="3b" if cuda else "tiny",
                        help="the model's shape (3b on CUDA, tiny elsewhere)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="blocks (the size's own)")
    parser.add_argument("--device-budget", default=None,
                        help="the smaller GPU emulated (20GiB on CUDA, half the 3b model data; "
                        "elsewhere a third of the model data)")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences a step (4 on CUDA, 2 elsewhere)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--system", dest="systems", action="append", choices=SYSTEMS,
                        default=None, help="run only this system (repeatable; default: all)")  # fmt: skip
    parser.add_argument(
        "--largest",
        action="store_true",
        help="also the deepest model each trains under the budgets (CUDA)",
    )
    parser.add_argument("--largest-time-s", type=float, default=60.0)
    parser.add_argument("--results-dir", default=None)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Settings:
    device: str
    config: GPTConfig
    device_budget_bytes: int
    micro_batch: int
    steps: int
    warmup_steps: int


def _settings(args: argparse.Namespace) -> Settings:
    config = SIZES[args.size]
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    cuda = args.device.startswith("cuda")
    if args.device_budget is not None:
        budget = parse_bytes(args.device_budget, key="--device-budget")
    elif cuda:
        budget = 20 * 2**30
    else:
        budget = _num_params(config) * MODEL_DATA_BYTES_PER_PARAM // 3
    assert budget is not None
    micro_batch = args.micro_batch or (4 if cuda else 2)
    return Settings(device=args.device, config=config, device_budget_bytes=budget,
                    micro_batch=micro_batch, steps=args.steps, warmup_steps=args.warmup_steps)  # fmt: skip


def _num_params(config: GPTConfig) -> int:
    from tidal.models.gpt import closed_form_num_params

    return closed_form_num_params(config)


def needs(settings: Settings) -> list[str]:
    """What this machine lacks for ``settings``, one line each (none: it can run)."""
    lacks = []
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # every system keeps the whole model data on the host, and one at a time runs
    need = int(1.25 * _num_params(settings.config) * MODEL_DATA_BYTES_PER_PARAM) + 2**30
    if need > host_bytes:
        lacks.append(f"host memory: {format_bytes(need)} (this machine has "
                     f"{format_bytes(host_bytes)}); try --size tiny or fewer --layers")  # fmt: skip
    if settings.device.startswith("cuda"):
        if not torch.cuda.is_available():
            lacks.append("a CUDA device (none here); --device cpu --size tiny runs on a CPU")
        else:
            total = torch.cuda.get_device_properties(0).total_memory
            if settings.device_budget_bytes > total:
                lacks.append(f"a device of {format_bytes(settings.device_budget_bytes)} "
                             f"(this one has {format_bytes(total)}); lower --device-budget")  # fmt: skip
    return lacks


def run(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show

    settings = _settings(args)
    lacks = needs(settings)
    if lacks:
        for line in lacks:
            console.print(f"tidal bench gpu: this machine is too small: it needs {line}")
        return 2
    rows = bench_gpu(settings, systems=tuple(args.systems or SYSTEMS), largest=args.largest,
                     largest_time_s=args.largest_time_s)  # fmt: skip
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("gpu", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def bench_gpu(settings: Settings, *, systems: tuple[str, ...], largest: bool = False,
              largest_time_s: float = 60.0) -> list[dict[str, Any]]:  # fmt: skip
    """One ``train`` row per system, and with ``largest`` one ``largest`` row per system."""
    base = {"size_params": _num_params(settings.config), "layers": settings.config.num_layers,
            "width": settings.config.d_model, "seq_len": settings.config.seq_len,
            "micro_batch": settings.micro_batch,
            "device_budget_bytes": settings.device_budget_bytes,
            "model_data_bytes": _num_params(settings.config) * MODEL_DATA_BYTES_PER_PARAM}  # fmt: skip
    rows = [{"section": "train", "system": s, **base, **in_own_process(_train, s, settings)}
            for s in systems]  # fmt: skip
    if not largest:
        return rows
    for system in systems:
        row = {"section": "largest", "system": system, **base}
        if not settings.device.startswith("cuda"):
            rows.append({**row, "why": "measured on CUDA only: on a CPU nothing holds the peers' "
                         "device memory to the budget"})  # fmt: skip
            continue
        found = _largest(system, settings, largest_time_s)
        rows.append({**row, **found})
    return rows


def largest_depth(trains: Callable[[int], bool], *, start: int, limit: int) -> tuple[int, int]:
    """The most blocks in ``[1, limit]`` that ``trains``, doubling from ``start`` and then
    bisecting; and how many depths it tried. 0: not even one block."""
    tried = 0
    low, high = 0, limit + 1  # trains at low (0: vacuously), not at high
    depth = max(1, min(start, limit))
    while depth < high:
        tried += 1
        if not trains(depth):
            high = depth
            break
        low = depth
        depth = min(2 * depth, limit) if depth < limit else high
    while high - low > 1:
        middle = (low + high) // 2
        tried += 1
        if trains(middle):
            low = middle
        else:
            high = middle
    return low, tried


def _largest(system: str, settings: Settings, time_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_block = (_num_params(dataclasses.replace(settings.config, num_layers=2))
                 - _num_params(dataclasses.replace(settings.config, num_layers=1)))  # fmt: skip
    limit = max(1, int(0.8 * host_bytes / (per_block * MODEL_DATA_BYTES_PER_PARAM)))
    errors: dict[int, str] = {}

    def trains(layers: int) -> bool:
        if time.perf_counter() - start > time_s:
            errors[layers] = "out of time"
            return False
        config = dataclasses.replace(settings.config, num_layers=layers)
        one = dataclasses.replace(settings, config=config, steps=1, warmup_steps=0)
        out = in_own_process(_train, system, one)
        if "error" in out:
            errors[layers] = out["error"]
        return "error" not in out

    layers, tried = largest_depth(trains, start=settings.config.num_layers, limit=limit)
    config = dataclasses.replace(settings.config, num_layers=layers)
    return {"largest_layers": layers, "largest_params": _num_params(config) if layers else 0,
            "depths_tried": tried, "host_limit_layers": limit,
            "first_failure": min(errors.items(), default=None)}  # fmt: skip


# -- one system, in its own process ---------------------------------------------------------


def _train(system: str, settings: Settings) -> dict[str, Any]:
    from benchmarks.baselines import deepspeed_missing_reason
    from benchmarks.dp_systems import rss_figures

    if system == DEEPSPEED and (reason := deepspeed_missing_reason()) is not None:
        return {"error": reason, "missing": True}
    device = torch.device(settings.device)
    torch.manual_seed(SEED)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.device_budget_bytes / total))
    try:
        engine, model = _build(system, settings, device)
        return _steps(system, engine, model, settings, device) | rss_figures()
    except (torch.cuda.OutOfMemoryError, ConfigError, RuntimeError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}


def _job(settings: Settings, device: torch.device) -> Any:
    from tidal.train.job import load_job

    tidal_budget = settings.device_budget_bytes
    if device.type == "cuda":
        tidal_budget = int((1 - ALLOCATOR_SHARE) * tidal_budget)
    return load_job({
        "engine": "chunk",
        "model": {"preset": "tiny", **{k: v for k, v in dataclasses.asdict(settings.config).items()
                                       if k not in ("bias", "layer_norm_eps")}},
        "training": {"device": settings.device, "precision": "bf16", "steps": settings.steps,
                     "batch_size": settings.micro_batch, "grad_clip_norm": 1.0},
        "optimizer": {"lr": 1e-4, "warmup_steps": 1},
        "memory": {"device_budget": tidal_budget},
    })  # fmt: skip


def _recompute_blocks(model: Any) -> None:
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)


def _build(system: str, settings: Settings, device: torch.device) -> tuple[Any, Any]:
    from tidal.models.gpt import build_gpt, gpt_init

    job = _job(settings, device)
    if system == TIDAL:
        from tidal.train.build import build_engine

        model = build_gpt(settings.config, device="meta")
        _recompute_blocks(model)
        return build_engine(model, job, init=gpt_init(model, SEED)), model
    _join(device)
    if system == DEEPSPEED:
        from benchmarks.baselines import build_deepspeed_deferred

        model, engine = build_deepspeed_deferred(settings.config, job, seed=SEED)
        _recompute_blocks(model)
        return engine, model
    return _fsdp2(settings, device, job)


def _join(device: torch.device) -> None:
    """A process group of one, which FSDP2's mesh and DeepSpeed need."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")  # fmt: skip
    dist.init_process_group(backend, rank=0, world_size=1)


def _fsdp2(settings: Settings, device: torch.device, job: Any) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from benchmarks.dp_systems import init_fsdp2_shards
    from tidal.models.gpt import build_gpt
    from tidal.parallel.reference import build_optimizer

    model = build_gpt(settings.config, device="meta")
    _recompute_blocks(model)
    mesh = init_device_mesh(device.type, (1,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu")
    init_fsdp2_shards(model, SEED)
    # the optimizer tidal's reference engine and bench dp's FSDP2 build: torch's fused AdamW
    # where the parameters' device has it (the host's shards here), decay on matrices only
    optimizer = build_optimizer(model, job.optimizer, job.optimizer.lr)
    return _Fsdp2Step(model, optimizer), model


class _Fsdp2Step:
    """FSDP2's model and optimizer behind the engines' calling convention."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _steps(system: str, engine: Any, model: Any, settings: Settings,
           device: torch.device) -> dict[str, Any]:  # fmt: skip
    from tidal.distributed.device import peak_flops
    from tidal.models import spec_for

    config = settings.config
    generator = torch.Generator().manual_seed(SEED)
    step_s, before = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(settings.steps):
        if step == settings.warmup_steps:
            before = _traffic(system, engine)
        tokens = torch.randint(0, config.vocab_size, (settings.micro_batch, config.seq_len + 1),
                               generator=generator).to(device)  # fmt: skip
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)
    steady = step_s[settings.warmup_steps :] or step_s
    median_s = statistics.median(steady)
    tokens_per_s = settings.micro_batch * config.seq_len / median_s
    flops = spec_for(config).flops_per_token(model) * tokens_per_s
    peak = peak_flops(device, "bf16")
    measured_steps = len(steady) if before is not None else 0
    out: dict[str, Any] = {
        "step_s": median_s,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu": None if peak is None else flops / 1e12 / peak.tflops,
        "peak_tflops": None if peak is None else peak.tflops,
        "final_loss": float(loss.detach().float().item()),
        "peak_device_bytes": _peak_device_bytes(system, engine, device),
        **_per_step(system, engine, before, measured_steps, settings),
    }
    return out


def _peak_device_bytes(system: str, engine: Any, device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(engine.stats()["peak_device_bytes"]) if system == TIDAL else None


def _traffic(system: str, engine: Any) -> dict[str, int] | None:
    if system != TIDAL:
        return None
    stats = engine.stats()
    return {"up": int(stats["bytes_to_device"]), "down": int(stats["bytes_to_host"])}


def _per_step(system: str, engine: Any, before: dict[str, int] | None, steps: int,
              settings: Settings) -> dict[str, Any]:  # fmt: skip
    """Host-device bytes a step: counted (tidal) beside its prediction, or by formula."""
    num_params = _num_params(settings.config)
    if system == FSDP2:  # fp32 shards up for the forward and the recomputing backward
        return {"h2d_bytes_per_step": 2 * 4 * num_params, "d2h_bytes_per_step": 4 * num_params,
                "traffic_source": "formula"}  # fmt: skip
    if system == DEEPSPEED:  # bf16 partitions up twice, fp32 gradients down
        return {"h2d_bytes_per_step": 2 * 2 * num_params, "d2h_bytes_per_step": 4 * num_params,
                "traffic_source": "formula"}  # fmt: skip
    after = _traffic(system, engine)
    if before is None or after is None or not steps:
        return {"traffic_source": "counted", "h2d_bytes_per_step": None}
    return {
        "traffic_source": "counted",
        "h2d_bytes_per_step": (after["up"] - before["up"]) / steps,
        "d2h_bytes_per_step": (after["down"] - before["down"]) / steps,
        "predicted_h2d_bytes_per_step": _predicted_h2d(engine, settings),
    }


def _predicted_h2d(engine: Any, settings: Settings) -> int | None:
    """tidal's own prediction of a step's host-to-device bytes: its policy replayed on its trace
    from an empty device, the pinned chunks apart ([Note: like-for-like traffic])."""
    from benchmarks.offload import streaming_problem
    from tidal.memory.policy import simulate

    store = engine.store
    if store.trace is None:
        return None
    pinned = store.pinned
    state_bytes = sum(engine.optimizer.state_bytes_of(i) for i in pinned)
    budget = int(engine.stats()["device_budget"])
    streamed, room = streaming_problem(store.trace, pinned, state_bytes, budget)
    try:
        result = simulate(streamed, device_budget_bytes=room, policy="belady", iterations=1)
    except (AssertionError, ValueError):
        return None
    return int(sum(result.fetched_bytes))


# -- the table -------------------------------------------------------------------------------


def tables(result: dict[str, Any], args: argparse.Namespace) -> list[ResultTable]:
    """The systems side by side, and (``--largest``) the deepest model each trained."""
    rows = result["rows"]
    train = [r for r in rows if r["section"] == "train"]
    out = []
    if train:
        first = train[0]
        title = (f"tidal bench gpu: {first['size_params']:,} parameters "
                 f"({first['layers']} x {first['width']}, {format_bytes(first['model_data_bytes'])}"
                 f" of model data) under a {format_bytes(first['device_budget_bytes'])} device "
                 f"budget, bf16, {first['micro_batch']} x {first['seq_len']} tokens a step")  # fmt: skip
        columns = ("system", "tokens/s", "TFLOPS", "MFU", "step s", "peak device", "peak host",
                   "H2D a step (predicted)", "D2H a step", "tokens/s over tidal's")  # fmt: skip
        ours = next((r.get("tokens_per_s") for r in train if r["system"] == TIDAL), None)
        out.append(ResultTable.of(title, columns, [_train_cells(r, ours) for r in train]))
    largest = [r for r in rows if r["section"] == "largest"]
    if largest:
        cells = [[r["system"], str(r.get("largest_layers", "-")),
                  f"{r['largest_params']:,}" if r.get("largest_params") else "-",
                  r.get("why") or str(r.get("first_failure") or "-")] for r in largest]  # fmt: skip
        out.append(ResultTable.of("the deepest model each trains under the same budgets",
                                  ("system", "blocks", "parameters", "note"), cells))  # fmt: skip
    return out


def _train_cells(r: dict[str, Any], ours: float | None) -> list[str]:
    if "error" in r:
        return [r["system"], "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:80]]

    def size(key: str) -> str:
        return "-" if r.get(key) is None else format_bytes(int(r[key]))

    predicted = r.get("predicted_h2d_bytes_per_step")
    h2d = size("h2d_bytes_per_step") + (f" ({format_bytes(int(predicted))})" if predicted
                                        else " (formula)" if r.get("traffic_source") == "formula"
                                        else "")  # fmt: skip
    ratio = "-" if not ours else f"{r['tokens_per_s'] / ours:.2f}x"
    return [r["system"], f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.3g}",
            "-" if r.get("mfu") is None else f"{r['mfu']:.1%}", f"{r['step_s']:.3g}",
            size("peak_device_bytes"), size("hwm_rss_bytes"), h2d, size("d2h_bytes_per_step"),
            ratio]  # fmt: skip
