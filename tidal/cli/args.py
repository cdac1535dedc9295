"""The command line's flags: one small function per command, shared flags defined once."""

from __future__ import annotations

import argparse
import platform
from importlib import metadata

from tidal.cli.plan import add_parser as add_plan_parser
from tidal.cli.plan import add_search_arguments

__all__ = ["build_parser"]

_RECIPE_HELP = (
    "a recipe name (e.g. demo, tiny: ./recipes/NAME.toml, else the one tidal ships) or a path "
    "to a TOML file"
)


def version_line() -> str:
    """tidal's version and what it runs on, as a bug report wants them, read from the packages'
    metadata (no import)."""
    return (f"tidal {_installed('tidal')} (torch {_installed('torch')}, "
            f"Python {platform.python_version()})")  # fmt: skip


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # on sys.path without being installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidal",
        description="Train PyTorch models larger than the accelerator's memory.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_report(sub)
    _add_checkpoints(sub)
    _add_config(sub)
    add_plan_parser(sub)
    _add_simulate(sub)
    _add_bench(sub)
    _add_models(sub)
    _add_export(sub)
    return parser


def _add_recipe(parser: argparse.ArgumentParser, *, many: bool) -> None:
    if many:
        parser.add_argument(
            "--recipe", dest="recipes", action="append", required=True,
            metavar="NAME_OR_PATH", help=_RECIPE_HELP + " (repeat to compare several)",
        )  # fmt: skip
    else:
        parser.add_argument("--recipe", required=True, metavar="NAME_OR_PATH", help=_RECIPE_HELP)
    _add_overrides(parser)


def _add_overrides(parser: argparse.ArgumentParser, *, scope: str = "") -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one setting, e.g. --set training.steps=50 --set run_dir=runs/x "
        "(repeatable; sizes take units such as 512MiB)" + scope,
    )  # fmt: skip


def _step(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a checkpoint's step is a positive number, not {text!r}")
    return int(text)


def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        help="train a model from a recipe",
        description="Train the recipe's model; writes metrics.jsonl, summary.json, plots and "
        "checkpoints into the run folder (runs/<name> unless run_dir is set).",
    )
    _add_recipe(train, many=False)
    mode = train.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", nargs="?", const=True, default=False, type=_step, metavar="STEP",
        help="continue from the run folder's newest intact checkpoint (a damaged one is named "
        "and passed over), or from checkpoint STEP; `tidal checkpoints RUN_DIR` lists them. "
        "auto: resume if the folder holds a checkpoint, else start (what a restart does)",
    )  # fmt: skip
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run folder that already holds checkpoints (deletes them)",
    )
    train.add_argument(
        "--deepspeed", default=None, metavar="JSON",
        help="a DeepSpeed config: its batch sizes, accumulation, clipping, precision, optimizer, "
        "scheduler and ZeRO/offload settings on top of the recipe; each key it ignores is named",
    )  # fmt: skip
    train.add_argument("--no-plots", action="store_true", help="do not write PNG plots at the end")
    train.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=int, default=1, metavar="N",
        help="train on N processes (ranks) of this machine, started through torchrun's agent; "
        "training.batch_size is the global batch, split over all ranks (default 1: this process)",
    )  # fmt: skip
    train.add_argument(
        "--nnodes", type=int, default=1, metavar="M",
        help="machines in the job: run the same command on each, with the same --rdzv-endpoint "
        "(the ranks are M x --nproc; run_dir must be on a filesystem they share)",
    )  # fmt: skip
    train.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT",
        help="with --nnodes: where the machines meet (one of them, a free port; torchrun's c10d "
        "rendezvous); --node-rank R fixes each machine's place instead of first come",
    )  # fmt: skip
    train.add_argument(
        "--max-restarts", type=int, default=0, metavar="K",
        help="restart every rank up to K times when one fails (torchrun's); each restart "
        "resumes from the last complete checkpoint by itself (--resume auto)",
    )  # fmt: skip
    train.add_argument(
        "--node-rank", type=int, default=None, metavar="R",
        help="with --nnodes and --rdzv-endpoint: this machine's index, 0..M-1 (0 at the endpoint)",
    )  # fmt: skip
    train.add_argument(
        "--pipeline-stages", type=int, default=None, metavar="P",
        help="train as a pipeline of P stages, one process each (--mesh pp=P); the [pipeline] "
        "section holds microbatches, partition and PipeMare's knobs",
    )  # fmt: skip
    train.add_argument(
        "--mesh", default=None, metavar="pp=P,dp=D,tp=T",
        help="the ranks' grid ([parallel] pp, dp, tp; unnamed ones are 1, dp the rest): "
        "--mesh pp=2,dp=2 is 2 pipeline stages, each replicated on 2 ranks, 4 processes "
        "(--nproc defaults to the product)",
    )  # fmt: skip
    train.add_argument(
        "--schedule", default=None,
        choices=("gpipe", "1f1b", "interleaved", "pipedream", "2bw", "pipemare", "pipemarew"),
        help="the pipeline schedule (sets pipeline.schedule; default 1f1b): gpipe, 1f1b and "
        "interleaved are synchronous, the rest update weights with microbatches in flight",
    )  # fmt: skip
    train.add_argument(
        "--plan", default=None, metavar="PATH",
        help="train as the plan `tidal plan --json PATH` wrote says (tensor / sequence "
        "parallel, ZeRO, recompute), on its dp x tp ranks (with --nproc dp*tp)",
    )  # fmt: skip


def _add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser(
        "report",
        help="plot a finished run and print its summary",
        description="Write loss.png and memory.png into RUN_DIR and print the summary table.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. runs/demo")


def _add_config(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser(
        "config",
        help="show the resolved config of a recipe, each key with its doc line",
        description="`tidal config show [--recipe R] [--deepspeed JSON] [--set K=V ...]`: the "
        "config a run would use, as a recipe (TOML) with a comment on every key.",
    )
    actions = config.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved config as TOML with doc lines")
    show.add_argument("--recipe", default=None, metavar="NAME_OR_PATH",
                      help=_RECIPE_HELP + " (default: the built-in defaults)")  # fmt: skip
    show.add_argument("--deepspeed", default=None, metavar="JSON",
                      help="a DeepSpeed config read on top (see tidal train --help)")  # fmt: skip
    _add_overrides(show)


def _add_checkpoints(sub: argparse._SubParsersAction) -> None:
    checkpoints = sub.add_parser(
        "checkpoints",
        help="list a run's checkpoints and check each against what was written",
        description="Each checkpoint of RUN_DIR with its size and whether every file still "
        "matches the size and checksum recorded when it was written; exit 2 if none is intact.",
    )
    checkpoints.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. runs/demo")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="measure throughput, FLOP/s, MFU and memory; writes benchmarks/results/*.json",
        description="Benchmark programs. Each writes a JSON file (command, commit, torch "
        "version, device, figures) under benchmarks/results/ of the current folder (or "
        "--results-dir) and prints a table; the same options have the same names in each "
        "(--steps, --warmup-steps, --results-dir, --set).",
    )
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    train = benches.add_parser(
        "train",
        help="train recipes for a few steps each and compare their steady-state figures",
        description="Train each recipe for --steps steps in its own process (no checkpoints, "
        "no validation) and report the median step after --warmup-steps.",
    )
    _add_recipe(train, many=True)
    train.add_argument(
        "--variant", dest="variants", action="append", default=None, metavar="K=V[,K=V...]",
        help="run every recipe once per variant, e.g. --variant training.precision=fp32 "
        "--variant training.precision=bf16 (compared side by side)",
    )  # fmt: skip
    train.add_argument("--steps", type=int, default=30, help="steps per recipe (30)")
    train.add_argument(
        "--warmup-steps", type=int, default=5, help="leading steps left out of the figures (5)"
    )
    train.add_argument(
        "--results-dir", default=None, metavar="DIR",
        help="write the JSON file here instead of benchmarks/results/ under the current folder",
    )  # fmt: skip
    _add_bench_offload(benches)
    _add_bench_dp(benches)
    _add_bench_plan(benches)
    _add_bench_pipemare(benches)
    _add_bench_mpress(benches)
    _add_bench_savers(benches)
    _add_bench_pipeline(benches)
    _add_bench_compat(benches)
    _add_bench_make(benches)
    _add_bench_compose(benches)
    _add_bench_gpu(benches)
    from benchmarks.plan_check import add_parser as add_plan_check
    from benchmarks.report import add_parser as add_report

    add_plan_check(benches)
    add_report(benches)


def _add_bench_make(benches: argparse._SubParsersAction) -> None:
    from benchmarks.make import add_arguments

    make = benches.add_parser(
        "make",
        help="time `make run` and `make test` in a fresh clone, as a new user meets them",
        description="Clone this checkout's HEAD into a temporary folder and run each make target "
        "there in turn (the first pays the set-up of .venv); wall time, exit status, the last "
        "progress line and summary of `make run`, the pytest totals of `make test`. Writes "
        "benchmarks/results/make-*.json.",
    )
    add_arguments(make)


def _add_bench_compose(benches: argparse._SubParsersAction) -> None:
    from benchmarks.compose import add_arguments

    compose = benches.add_parser(
        "compose",
        help="tidal's compositions (dp, pp, pp x dp chunks, NVMe, pp x tp) against DeepSpeed and "
        "FSDP2 offload on 4 ranks: largest model, bytes moved, memory",
        description="On 4 gloo ranks under one per-rank host budget (judged by each rank's peak "
        "RSS): dp4 chunk ZeRO-3, pp4, pp2 x dp2 chunk, pp2 x dp2 chunk + NVMe, pp2 x tp2, "
        "DeepSpeed ZeRO-3 offload and FSDP2 CPU offload. scale: the deepest GPT each trains "
        "(doubling then bisecting the depth). fixed: all at one depth they all fit: step, "
        "bytes each rank all-gathers, reduce-scatters and sends per step (tidal's counters, the "
        "peers' by the ZeRO-3 formula), peak RSS beside tidal's own figure. targets: the "
        "issue's, those that miss beside those that hold. A configuration tidal refuses is a "
        "row saying so. Writes benchmarks/results/compose-*.json.",
    )
    add_arguments(compose)


def _add_bench_offload(benches: argparse._SubParsersAction) -> None:
    offload = benches.add_parser(
        "offload",
        help="the chunk engine against plain PyTorch, DeepSpeed ZeRO-3 offload and the optimum",
        description="Four sections, each case in its own process (so peak RSS is its own). "
        "overhead: median steady step of plain PyTorch, the chunk engine with no device budget "
        "and DeepSpeed ZeRO-3 with CPU offload on --recipe (about 1.5 min on 2 CPU cores for "
        "demo). traffic: the chunk engine at device budgets of 25/50/75% of its parameter-chunk "
        "bytes, bytes moved per step (steps after the first) against optimal_traffic, "
        "traffic_lower_bound and static offload on its own trace (under a minute). scale: the "
        "deepest GPT (the recipe's width, more blocks, batch 1 of 64 tokens, synthetic data) "
        "the chunk engine trains for 2 steps under --device-budget + --host-budget, by "
        "bisection, against (device + host - activations) / model-data bytes per parameter "
        "(a few minutes). host: peak RSS of the three systems on "
        "--host-recipe for 3 steps, batch 1, fp32, synthetic data (about 3 min for gpt2-small). "
        "DeepSpeed rows need the baselines extra (pip install -e .[baselines]); without it they "
        "say so. Writes benchmarks/results/offload-*.json.",
    )
    offload.add_argument(
        "--section", dest="sections", action="append", default=None,
        choices=("overhead", "traffic", "scale", "host"),
        help="run only this section (repeatable; default: all four)",
    )  # fmt: skip
    offload.add_argument(
        "--recipe", default="demo", metavar="NAME_OR_PATH",
        help=_RECIPE_HELP + "; for overhead, traffic and scale (default demo)",
    )  # fmt: skip
    offload.add_argument(
        "--steps", type=int, default=20,
        help="steps per overhead case, and per traffic case (20)",
    )  # fmt: skip
    offload.add_argument(
        "--warmup-steps", type=int, default=5,
        help="leading overhead steps left out of the median (5); traffic always leaves out "
        "the first step, which records the trace and places the optimizer state",
    )  # fmt: skip
    offload.add_argument(
        "--repeats", type=int, default=3,
        help="overhead rounds, the systems in turn each round; each keeps its median round (3)",
    )  # fmt: skip
    offload.add_argument(
        "--fractions", default="0.25,0.5,0.75", metavar="F[,F...]",
        help="traffic's device budgets, as fractions of the parameter-chunk bytes (0.25,0.5,0.75)",
    )  # fmt: skip
    offload.add_argument(
        "--device-budget", default="128MiB", metavar="SIZE",
        help="device budget of the scale search (128MiB)",
    )  # fmt: skip
    offload.add_argument(
        "--host-budget", default="1GiB", metavar="SIZE",
        help="host budget of the scale search (1GiB)",
    )  # fmt: skip
    offload.add_argument(
        "--host-recipe", default="gpt2-small", metavar="NAME_OR_PATH",
        help="the recipe whose peak RSS the host section compares (gpt2-small)",
    )  # fmt: skip
    _add_overrides(offload, scope="; applies to every case of every section")
    offload.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="write the JSON file here instead of benchmarks/results/",
    )


def _add_bench_plan(benches: argparse._SubParsersAction) -> None:
    plan = benches.add_parser(
        "plan",
        help="the planner against Megatron-LM and ZeRO-3 on GPT-3 sizes (cost model, no training)",
        description="For each model and device count: the flat and the pipelined plan with "
        "the least memory within --eps of the fastest, their memory-time frontiers, Megatron-LM's "
        "layouts on the same mesh and ZeRO-3 priced by the same cost model, Megatron-LM at its "
        "best over its whole grid, the savings and the solve time. Writes "
        "benchmarks/results/plan-*.json and a Pareto plot beside it.",
    )
    plan.add_argument("--models", default="gpt3-1.3b,gpt3-13b,gpt3-175b", metavar="A,B")
    plan.add_argument("--devices", default="8,64,512", metavar="N,M")
    plan.add_argument("--devices-per-node", type=int, default=8)
    plan.add_argument("--device-memory", default="80GiB", metavar="SIZE")
    plan.add_argument("--eps", type=float, default=0.05)
    add_search_arguments(plan)
    plan.add_argument(
        "--largest", action="store_true",
        help="instead: the most layers at each model's width whose least-memory plan fits, for "
        "tidal and for Megatron-LM's grid (writes plan-largest-*.json)",
    )  # fmt: skip
    plan.add_argument("--results-dir", default=None, metavar="DIR")


def _add_bench_pipemare(benches: argparse._SubParsersAction) -> None:
    from benchmarks.pipemare import add_arguments

    pipemare = benches.add_parser(
        "pipemare",
        help="PipeMare against synchronous and naive asynchronous pipelines: loss curves",
        description="Train a GPT cut into fine-grained pipeline stages (one process simulates "
        "the stages' weight delays) with sync (1F1B), naive async, PipeMare (LR rescheduling), "
        "PipeMare (LR + discrepancy correction) and PipeMareW; writes "
        "benchmarks/results/pipemare-*.json and a loss-curve PNG beside it.",
    )
    add_arguments(pipemare)


def _add_bench_mpress(benches: argparse._SubParsersAction) -> None:
    from benchmarks.mpress import add_arguments

    mpress = benches.add_parser(
        "mpress",
        help="MPress's saver plan against recompute-, host- and peer-only: largest model, step",
        description="For a GPT family on a DGX-class server (predicted by the simulator and the "
        "saver planner, nothing trained): under 1F1B and PipeDream, the largest model each "
        "strategy fits and its step at the largest model recompute-only fits. Writes "
        "benchmarks/results/mpress-*.json.",
    )
    add_arguments(mpress)


def _add_bench_gpu(benches: argparse._SubParsersAction) -> None:
    from benchmarks.gpu import add_arguments

    gpu = benches.add_parser(
        "gpu",
        help="offload at GPU speed: tidal, FSDP2 CPU offload and DeepSpeed ZeRO-3 offload on a "
        "model that needs offload under an emulated smaller GPU",
        description="A 3B-shaped GPT (on CUDA; --size tiny on a CPU) trained a few steps in "
        "bf16 with every block recomputed under --device-budget (20GiB on CUDA, each system's "
        "process held to it) by tidal's chunk engine, FSDP2 with CPUOffloadPolicy and DeepSpeed "
        "ZeRO-3 offload (where it imports): tokens/s, TFLOPS, MFU, peak device and host bytes, "
        "host-device bytes a step (tidal's counted beside its prediction), and with --largest "
        "the deepest model each trains. About 8 minutes on one H100. Writes "
        "benchmarks/results/gpu-*.json.",
    )
    add_arguments(gpu)


def _add_bench_savers(benches: argparse._SubParsersAction) -> None:
    from benchmarks.savers import add_arguments

    savers = benches.add_parser(
        "savers",
        help="MPress's savers measured on this device: copy rates, recompute cost, stage peaks",
        description="Measure host-device and in-device copy rates and a block's recompute cost, "
        "feed them to the saver planner, then run each stage of a GPT pipeline alone (1F1B order) "
        "with no saver, recompute, selective recompute, host swap and the planner's plan, and "
        "compare saved bytes and the allocator's peak with the memory model. Writes "
        "benchmarks/results/savers-*.json and a PNG beside it.",
    )
    add_arguments(savers)


def _add_bench_pipeline(benches: argparse._SubParsersAction) -> None:
    from benchmarks.pipeline import add_arguments

    pipeline = benches.add_parser(
        "pipeline",
        help="GPipe, 1F1B and PipeMare on gloo ranks: measured step time against the simulator",
        description="Run a GPT split into --stages stages, one gloo process each (one thread "
        "per process), with each schedule at m = p; calibrate the simulator from the same "
        "ranks' stage and point-to-point timings and compare its predicted step time with the "
        "measured one. Writes benchmarks/results/pipeline-*.json.",
    )
    add_arguments(pipeline)


def _add_bench_compat(benches: argparse._SubParsersAction) -> None:
    from benchmarks.compat import add_arguments

    compat = benches.add_parser(
        "compat",
        help="the chunk engine on models tidal did not write (the zoo), against plain PyTorch",
        description="For each zoo family (Hugging Face decoders, encoders, encoder-decoders, "
        "ViT, a CNN with BatchNorm, mixtures of experts, frozen parts, outside uses, ...) train "
        "--steps steps with the chunk engine and the reference engine on the same seeds: fp32 "
        "with no budget, and fp32, bf16 and gradient accumulation 2 at the least budget an "
        "unlimited run measured; with --ranks N also the sharded engine on N gloo ranks. Each "
        "family runs in a worker process, so an exception or a signal is a row, not the end "
        "of the run (every family: about 1 min on 2 CPU cores, 6 min with --ranks 2). Writes "
        "benchmarks/results/compat-*.json.",
    )
    add_arguments(compat)


def _add_bench_dp(benches: argparse._SubParsersAction) -> None:
    dp = benches.add_parser(
        "dp",
        help="tidal's sharded chunks against DeepSpeed ZeRO-3 offload and FSDP2 offload on N ranks",
        description="Each configuration (system, N ranks) runs in N fresh processes (gloo on the "
        "CPU, cores // N threads per rank), all systems on the same GPT, seed, global batches "
        "(split equally over the ranks), AdamW, schedule and clipping. perf: median step after "
        "--warmup, tokens/s, final loss, peak RSS and RSS after warm-up per rank, ratios against "
        "tidal at the same N (about 2 min on 2 CPU cores for demo). scale: on the largest --nproc "
        "ranks, the deepest GPT (the recipe's width, batch of one 64-token sequence per rank, "
        "synthetic data, 2 steps) each system trains with every rank's peak RSS within "
        "--host-budget, by doubling then bisecting the depth (five or six probes per system, "
        "about 4 min). nvme: tidal alone on the largest --nproc ranks, the recipe's width at the "
        "smallest depth whose AdamW data is twice what the ranks' --host-budget holds, built on "
        "the meta device and trained through the NVMe tier: peak RSS per rank against the "
        "budget, tokens/s, disk bytes per step and rate. DeepSpeed rows need the baselines extra "
        "(pip install -e .[baselines]); without it they say so. Writes "
        "benchmarks/results/dp-*.json.",
    )
    dp.add_argument(
        "--section", dest="sections", action="append", default=None,
        choices=("perf", "scale", "nvme"),
        help="run only this section (repeatable; default: all three)",
    )  # fmt: skip
    dp.add_argument(
        "--recipe", default="demo", metavar="NAME_OR_PATH",
        help=_RECIPE_HELP + " (default demo); scale keeps its width and varies its depth",
    )  # fmt: skip
    dp.add_argument("--steps", type=int, default=10, help="steps per perf configuration (10)")
    dp.add_argument(
        "--warmup-steps", "--warmup", dest="warmup_steps", type=int, default=3,
        help="leading perf steps left out of the median (3)",
    )  # fmt: skip
    dp.add_argument(
        "--nproc", default="1,2", metavar="N[,N...]",
        help="rank counts for perf; scale runs on the largest (default 1,2)",
    )  # fmt: skip
    dp.add_argument(
        "--systems", default=None, metavar="NAME[,NAME...]",
        help="a subset of tidal,deepspeed-zero3-offload,fsdp2-cpu-offload (default: all)",
    )  # fmt: skip
    dp.add_argument(
        "--host-budget", default="1GiB", metavar="SIZE[,SIZE...]",
        help="per-rank host budget(s) of the scale search, judged by each rank's peak RSS (1GiB)",
    )  # fmt: skip
    _add_overrides(dp, scope="; applies to every configuration of every section")
    dp.add_argument(
        "--results-dir", "--out", dest="results_dir", default=None, metavar="DIR",
        help="write the JSON file here instead of benchmarks/results/",
    )  # fmt: skip


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from tidal.cli.simulate import add_arguments

    simulate = sub.add_parser(
        "simulate",
        help="time a pipeline schedule: makespan, bubble, activations, weight versions, delay",
        description="Run a pipeline schedule (gpipe, 1f1b, interleaved, pipedream, 2bw, "
        "pipemare, pipemarew) through the discrete-event simulator with per-stage forward, "
        "backward and point-to-point costs; print per-stage figures, optionally write JSON and "
        "draw the timeline.",
    )
    add_arguments(simulate)


def _add_models(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "models",
        help="list the model presets with parameter counts and memory",
        description="List the GPT presets: shape, exact parameter count, and model-data bytes "
        "(weights in bf16 and fp32; mixed-precision AdamW training at 16 bytes/param).",
    )


def _add_export(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's checkpoint as safetensors for plain PyTorch and Hugging Face",
        description="Write checkpoint --step (default: the latest) of RUN_DIR as one model: "
        "model.safetensors with tidal's names (build_gpt(cfg).load_state_dict) and tidal.json, "
        "plus hf/ (config.json + model.safetensors) that transformers.GPT2LMHeadModel."
        "from_pretrained loads. Default folder: RUN_DIR/export/step_NNNNNNNN.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. runs/demo")
    export.add_argument(
        "--step", type=int, default=None, metavar="N",
        help="export the checkpoint of step N (default: the latest)",
    )  # fmt: skip
    export.add_argument(
        "--out", default=None, metavar="DIR",
        help="write here instead of RUN_DIR/export/step_NNNNNNNN (must not exist, or be empty)",
    )  # fmt: skip
    export.add_argument(
        "--check", action="store_true",
        help="read the files back: tidal's must equal the checkpoint, Hugging Face's logits "
        "must match tidal's (needs transformers)",
    )  # fmt: skip
