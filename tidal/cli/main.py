"""The ``tidal`` command. argv is parsed here and nowhere else.

Exit codes: 0 success; 1 a run failed (for example a non-finite loss); 2 bad input (a config
error, a missing recipe or run folder), reported as one line without a traceback; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from tidal.cli.args import build_parser

if TYPE_CHECKING:  # the command imports the library lazily: a Ctrl-C while it does is one line
    from tidal.train import JobConfig

__all__ = ["main"]

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT

# Bytes per parameter of each kind of model data: weights alone, and everything mixed-precision
# AdamW training holds (bf16 weights and gradients, fp32 master weights and two moments).
_TRAINING_BYTES_PER_PARAM = 2 + 2 + 4 + 4 + 4


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args is None:
        return EXIT_INTERRUPTED
    try:  # the imports take a moment: Ctrl-C there is still "before anything started"
        console = Console(highlight=False)
        if not console.is_terminal:  # logs and CI: rich would fold tables at 80 columns
            console = Console(highlight=False, width=160)
        from tidal.config import ConfigError
        from tidal.distributed import leave_alike
        from tidal.distributed.launch import say_once
        from tidal.distributed.watchdog import EXIT_CODE as RANK_DIED_EXIT_CODE
        from tidal.distributed.watchdog import RankDiedError
        from tidal.memory.store import DeviceBudgetTooSmall
        from tidal.train.checkpoint import CheckpointWriteError
        from tidal.train.interrupts import Interrupted

        bad_input: tuple[type[Exception], ...] = (
            ConfigError, DeviceBudgetTooSmall, FileNotFoundError, *_plan_errors(args)
        )  # fmt: skip
    except KeyboardInterrupt:
        print("tidal: interrupted before anything started", file=sys.stderr)
        return EXIT_INTERRUPTED

    try:
        return _run_command(args, console, argv)
    # Ranks failing alike say so once ([Note: one line per run] in tidal/distributed/launch.py).
    except bad_input as err:
        say_once(f"tidal: error: {err}")
        leave_alike()  # every rank met it: they part together
        return EXIT_BAD_INPUT
    except (FloatingPointError, CheckpointWriteError) as err:
        say_once(f"tidal: run failed: {err}")
        return EXIT_FAILED
    except RankDiedError as err:  # [Note: dead ranks] in tidal/distributed/watchdog.py
        say_once(str(err))
        return RANK_DIED_EXIT_CODE
    except RuntimeError as err:  # a collective failed: a dead peer says so in one line
        verdict = _dead_peer(err)
        if verdict is None:
            raise
        say_once(str(verdict))
        return RANK_DIED_EXIT_CODE
    except Interrupted as err:  # [Note: interrupts at safe points] in tidal/train/interrupts.py
        if os.environ.get("RANK", "0") == "0":  # one line for the run, not one per rank
            print(f"tidal: interrupted by {err}; continue with --resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt as err:  # a second Ctrl-C, or one before the run could stop
        if os.environ.get("RANK", "0") == "0":
            print(f"tidal: interrupted; {err}" if str(err) else "tidal: interrupted",
                  file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED


def _run_command(args: argparse.Namespace, console: Console, argv: list[str]) -> int:
    """The command ``args`` names, run; :func:`main` turns its errors into exit codes."""
    if args.command == "train":
        from tidal.distributed.slurm import adopt_slurm

        if args.nproc == 1 and args.nnodes == 1:  # else each task launches ranks itself
            adopt_slurm()  # under srun every task is a rank ([Note: srun tasks])
        _pipeline_flags(args)
        if args.nproc != 1 or args.nnodes != 1 or args.max_restarts:
            return _launch(args, argv)
        return _train(args, console, argv)
    if args.command == "plan":
        from tidal.cli.plan import run_plan

        return run_plan(args, console)
    if args.command == "simulate":
        from tidal.cli.simulate import run as run_simulate

        return run_simulate(args, console)
    if args.command == "report":
        return _report(args.run_dir, console)
    if args.command == "checkpoints":
        return _checkpoints(args.run_dir, console)
    if args.command == "config":
        return _config_show(args)
    if args.command == "models":
        return _models(console)
    if args.command == "bench":
        return _bench(args, console)
    if args.command == "export":
        return _export(args, console)
    raise AssertionError(f"unhandled command {args.command!r}")


def _dead_peer(err: RuntimeError) -> Exception | None:
    """The watchdog's verdict behind a collective's error, None if it has another cause. While
    it waits, a SIGTERM (torchrun's agent stopping the survivors of a dead rank, which its
    launcher names: [Note: one line per run] in tidal/distributed/launch.py) ends this rank
    without a word."""
    from tidal.distributed import explain_failure

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return explain_failure(err)


def _parse(argv: list[str]) -> argparse.Namespace | None:
    """The command line; None (said in one line) when Ctrl-C or SIGTERM came while parsing it
    (the parser imports the bench programs). From here on SIGTERM ends the command as Ctrl-C
    does; a training run turns both into a stop after the step ([Note: interrupts at safe
    points] in tidal/train/interrupts.py)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("tidal: interrupted before anything started", file=sys.stderr)
        return None


def _plan_errors(args: argparse.Namespace) -> tuple[type[Exception], ...]:
    """The planner's bad-input error, for ``tidal plan`` only: importing the planner loads scipy,
    a second every other command (and every rank) would pay."""
    if args.command != "plan":
        return ()
    from tidal.planner.search import Infeasible

    return (Infeasible,)


def _pipeline_flags(args: argparse.Namespace) -> None:
    """``--mesh pp=2,dp=2`` / ``--pipeline-stages P`` (``--mesh pp=P``) and ``--schedule S``:
    overrides of ``[parallel]`` and ``[pipeline]``, and as many processes as the mesh has
    ranks ([Note: one mesh] in tidal/parallel/dims.py)."""
    import os

    from tidal.config import ConfigError
    from tidal.parallel.dims import parse_mesh

    if args.schedule is not None:
        args.overrides = [*args.overrides, f"pipeline.schedule={args.schedule}"]
    mesh = {} if args.mesh is None else parse_mesh(args.mesh)
    if args.pipeline_stages is not None:
        if args.pipeline_stages < 2:
            raise ConfigError(
                "--pipeline-stages",
                f"must be >= 2 (one process per stage), got {args.pipeline_stages}; without it "
                f"the run trains without a pipeline",
            )
        if mesh.get("pp", args.pipeline_stages) != args.pipeline_stages:
            raise ConfigError("--pipeline-stages", f"says {args.pipeline_stages} stages and "
                              f"--mesh says pp={mesh['pp']}; give one of them")  # fmt: skip
        mesh["pp"] = args.pipeline_stages
    if not mesh:
        return
    args.overrides = [*args.overrides, *(f"parallel.{k}={v}" for k, v in mesh.items())]
    under_torchrun = (
        "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
    )
    if args.nproc == 1 and not under_torchrun:
        args.nproc = mesh.get("pp", 1) * mesh.get("dp", 1) * mesh.get("tp", 1)


def _deepspeed(args: argparse.Namespace) -> dict[str, Any] | None:
    from tidal.train.deepspeed_config import load_deepspeed

    return None if args.deepspeed is None else load_deepspeed(args.deepspeed)


def _terminate_as_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _train(args: argparse.Namespace, console: Console, argv: list[str]) -> int:
    from tidal.distributed import install_watchdog
    from tidal.train import load_job

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    install_watchdog()  # [Note: watchdog opt-in] in tidal/distributed/env.py
    from tidal.train.job import find_recipe

    job = load_job(find_recipe(args.recipe), args.overrides, deepspeed=_deepspeed(args))
    with _saying_what_is_saved(job.run_path):
        return _fit(job, args, console, argv)


@contextlib.contextmanager
def _saying_what_is_saved(run_dir: Path) -> Iterator[None]:
    """A Ctrl-C that stops the run at once says what of it is saved, or that nothing is."""
    try:
        yield
    except KeyboardInterrupt:
        from tidal.train.checkpoint import latest_checkpoint

        latest = latest_checkpoint(run_dir)
        saved = ("no checkpoint was written, so there is nothing to resume; run the command "
                 "again to start over" if latest is None else
                 f"the last checkpoint, {latest}, is intact (continue with --resume)")  # fmt: skip
        raise KeyboardInterrupt(saved) from None


def _fit(job: JobConfig, args: argparse.Namespace, console: Console, argv: list[str]) -> int:
    import os

    from tidal.cli.progress import RichProgress
    from tidal.train import Trainer

    ranks = job.parallel.pp * (job.parallel.dp or 1) * job.parallel.tp
    if ranks > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        args.nproc = ranks  # a recipe's [parallel] mesh: its ranks
        return _launch(args, argv)
    trainer = Trainer(job, plan=args.plan)
    resume, overwrite = args.resume, args.overwrite
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        # An elastic restart after a rank failed: go on from the last complete checkpoint (an
        # --overwrite meant the first attempt; this one must not delete what that one saved).
        resume, overwrite = "auto" if resume is False else resume, False
        if trainer.rank == 0:
            most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
            print(f"tidal: a rank failed; restart {restart} of {most}, from the last complete "
                  f"checkpoint", file=sys.stderr)  # fmt: skip
    trainer.fit(resume=resume, overwrite=overwrite, callbacks=[RichProgress(console)])
    if trainer.distributed:
        from tidal.distributed import shutdown

        shutdown()
    if not args.no_plots and trainer.rank == 0:
        _write_plots(trainer.run_dir, console)
    return 0


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """``--nproc N [--nnodes M ...]``: check what can be checked here, then run N ranks here
    (of N x M) under torchrun's agent."""
    import os

    from tidal.config import ConfigError
    from tidal.distributed.launch import Nodes, launch_train
    from tidal.train.job import find_recipe, load_job
    from tidal.train.run_dir import check_run_dir

    if args.nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1 (processes to train on), got {args.nproc}")
    nodes = Nodes(num_nodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank)
    world_size = args.nproc * nodes.num_nodes
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "--nproc",
            "this process is already a rank started by torchrun, which chose the number of "
            "processes; drop --nproc",
        )
    # An error found here is one line, rather than one per rank above torchrun's report.
    job = load_job(find_recipe(args.recipe), args.overrides, deepspeed=_deepspeed(args),
                   world_size=world_size, log_notes=False)  # fmt: skip
    if args.plan is not None:
        from tidal.models import spec_for
        from tidal.parallel.plan_layout import load_plan
        from tidal.train.build import check_plan_job

        model = spec_for(job.model).build(device="meta")
        check_plan_job(load_plan(args.plan), job, model=model, world_size=world_size)
    else:  # [Note: one train step]: on stages; [Note: one mesh]: pp x dp x tp = N, in one line
        from tidal.train.pipeline_part import check_pipeline_job

        check_pipeline_job(job, world_size=world_size)
    if args.resume != "auto":
        check_run_dir(job.run_path, resume=args.resume is not False, overwrite=args.overwrite)
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be >= 0, got {args.max_restarts}")
    return launch_train(argv[argv.index("train") + 1 :], nproc=args.nproc, nodes=nodes,
                        max_restarts=args.max_restarts)  # fmt: skip


def _write_plots(run_dir: object, console: Console) -> None:
    from tidal.train.report import write_plots

    try:
        paths = write_plots(run_dir)  # type: ignore[arg-type]
    except RuntimeError as err:  # matplotlib missing: the run itself succeeded
        console.print(f"[yellow]no plots:[/] {err}")
        return
    console.print("plots: " + ", ".join(str(p) for p in paths))


def _report(run_dir: str, console: Console) -> int:
    from tidal.cli.progress import summary_table
    from tidal.train.report import load_summary

    summary = load_summary(run_dir)
    _write_plots(run_dir, console)
    console.print(summary_table(summary, title=f"{run_dir}"))
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from tidal.cli.config_show import render
    from tidal.train.job import find_recipe, load_job

    recipe = None if args.recipe is None else find_recipe(args.recipe)
    job = load_job(recipe, args.overrides, deepspeed=_deepspeed(args))
    print(render(job), end="")
    return 0


def _checkpoints(run_dir: str, console: Console) -> int:
    from tidal.config import format_bytes
    from tidal.train.checkpoint import list_checkpoints
    from tidal.train.integrity import describe_checkpoints

    states = describe_checkpoints(list_checkpoints(run_dir))
    if not states:
        print(f"tidal: error: no checkpoint under {run_dir}/checkpoints", file=sys.stderr)
        return EXIT_BAD_INPUT
    table = Table(title=f"{run_dir}: checkpoints, oldest first")
    for column in ("step", "folder", "size", "state"):
        table.add_column(column, justify="right" if column in ("step", "size") else "left")
    for state in states:
        verdict = "intact" if state.damage is None else f"damaged: {state.damage}"
        table.add_row(str(state.step), state.path.name, format_bytes(state.num_bytes), verdict)
    console.print(table)
    return 0 if any(state.damage is None for state in states) else EXIT_BAD_INPUT


def _bench(args: argparse.Namespace, console: Console) -> int:
    if args.bench == "offload":
        return _bench_offload(args, console)
    if args.bench == "dp":
        return _bench_dp(args, console)
    if args.bench == "plan":
        from benchmarks.plan import run as run_plan_bench

        return run_plan_bench(args, console)
    if args.bench == "pipeline":
        from benchmarks.pipeline import run as run_pipeline

        return run_pipeline(args, console)
    if args.bench == "pipemare":
        from benchmarks.pipemare import run as run_pipemare

        return run_pipemare(args, console)
    if args.bench == "mpress":
        from benchmarks.mpress import run as run_mpress

        return run_mpress(args, console)
    if args.bench == "savers":
        from benchmarks.savers import run as run_savers

        return run_savers(args, console)
    if args.bench == "plan-check":
        from benchmarks.plan_check import run as run_plan_check

        return run_plan_check(args, console)
    if args.bench == "compat":
        from benchmarks.compat import run as run_compat

        return run_compat(args, console)
    if args.bench == "compose":
        from benchmarks.compose import run as run_compose

        return run_compose(args, console)
    if args.bench == "gpu":
        from benchmarks.gpu import run as run_gpu

        return run_gpu(args, console)
    if args.bench == "make":
        from benchmarks.make import run as run_make

        return run_make(args, console)
    if args.bench == "report":  # it reads each result's command with this CLI's parser
        from benchmarks.report import run as run_report

        return run_report(args, console, build_parser())
    from benchmarks import bench_train, write_results
    from benchmarks.results import read_results
    from benchmarks.tables import show
    from benchmarks.train import tables

    rows = bench_train(
        args.recipes,
        args.overrides,
        variants=args.variants or [""],
        steps=args.steps,
        warmup_steps=args.warmup_steps,
    )
    path = write_results("train", rows, folder=Path(args.results_dir) if args.results_dir else None)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def _bench_offload(args: argparse.Namespace, console: Console) -> int:
    from benchmarks import write_results
    from benchmarks.offload import SECTIONS, OffloadSettings, bench_offload, tables
    from benchmarks.results import read_results
    from benchmarks.tables import show
    from tidal.config import parse_bytes

    settings = OffloadSettings(
        sections=tuple(args.sections or SECTIONS),
        recipe=args.recipe,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        repeats=args.repeats,
        device_budget_bytes=parse_bytes(args.device_budget, key="--device-budget"),
        host_budget_bytes=parse_bytes(args.host_budget, key="--host-budget"),
        host_recipe=args.host_recipe,
        traffic_fractions=_fractions(args.fractions),
        overrides=tuple(args.overrides),
    )
    rows = bench_offload(settings)
    folder = Path(args.results_dir) if args.results_dir else None
    path = write_results("offload", rows, folder=folder)
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def _fractions(text: str) -> tuple[float, ...]:
    from tidal.config import ConfigError

    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(
            "--fractions", f"expected numbers such as 0.25,0.5, got {text!r}"
        ) from None


def _bench_dp(args: argparse.Namespace, console: Console) -> int:
    from benchmarks.dp import SECTIONS, DpSettings, bench_dp, tables, write_dp_results
    from benchmarks.dp_systems import DP_SYSTEMS
    from benchmarks.results import read_results
    from benchmarks.tables import show
    from tidal.config import ConfigError, parse_bytes

    def names(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    try:
        nprocs = tuple(int(n) for n in names(args.nproc))
    except ValueError:
        raise ConfigError("--nproc", f"expected numbers such as 1,2, got {args.nproc!r}") from None
    settings = DpSettings(
        sections=tuple(args.sections or SECTIONS),
        recipe=args.recipe,
        systems=names(args.systems) if args.systems else DP_SYSTEMS,
        nprocs=nprocs,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        host_budgets_bytes=tuple(
            parse_bytes(size, key="--host-budget") for size in names(args.host_budget)
        ),
        overrides=tuple(args.overrides),
    )
    rows = bench_dp(settings)
    path = write_dp_results(
        settings, rows, folder=Path(args.results_dir) if args.results_dir else None
    )
    show(console, tables(read_results(path), args))
    console.print(f"results: {path}")
    return 0


def _models(console: Console) -> int:
    from tidal.config import format_bytes
    from tidal.models import PRESETS, closed_form_num_params

    table = Table(title="GPT presets (tidal train --set model.preset=NAME)", title_justify="left")
    for column in ("preset", "layers", "d_model", "heads", "seq_len", "vocab", "params"):
        table.add_column(column, justify="left" if column == "preset" else "right")
    for column in ("weights bf16", "weights fp32", "AdamW training"):
        table.add_column(column, justify="right")
    for name, cfg in PRESETS.items():
        num_params = closed_form_num_params(cfg)
        table.add_row(
            name,
            str(cfg.num_layers),
            str(cfg.d_model),
            str(cfg.num_heads),
            str(cfg.seq_len),
            str(cfg.vocab_size),
            f"{num_params:,}",
            format_bytes(2 * num_params),
            format_bytes(4 * num_params),
            format_bytes(_TRAINING_BYTES_PER_PARAM * num_params),
        )
    console.print(table)
    console.print(
        "AdamW training = bf16 weights + bf16 grads + fp32 master weights + 2 fp32 moments "
        "(16 B/param), before activations."
    )
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    from tidal.config import format_bytes
    from tidal.train.export import ExportCheckError, check_export, export_info, export_run

    out = export_run(args.run_dir, step=args.step, out=args.out)
    info = export_info(out)
    console.print(
        f"exported step {info['step']} of {args.run_dir}: {info['num_params']:,} parameters "
        f"-> {out}"
    )
    for name, size in info["files"].items():
        console.print(f"  {out / name}  {format_bytes(size)}")
    console.print(f"  {out / 'tidal.json'}  (model config, step, source checkpoint, tied names)")
    from rich.markup import escape

    kind = info.get("kind", "gpt")
    if kind == "hf":
        console.print(
            f"load: transformers.AutoModelForCausalLM.from_pretrained({str(out / 'hf')!r})"
        )
    elif kind != "gpt":
        path = str(out / info["weights"])
        console.print(f"load: model.load_state_dict(tidal.train.safetensors.read_safetensors("
                      f"{path!r})), model being {escape(info['builds'])}")  # fmt: skip
    elif info["hf_skipped"] is not None:
        console.print(f"[yellow]no hf/:[/] {escape(info['hf_skipped'])}")
    else:
        console.print(f"load: transformers.GPT2LMHeadModel.from_pretrained({str(out / 'hf')!r})")
    if args.check:
        try:
            for line in check_export(out):
                console.print(f"check: {escape(line)}")
        except ExportCheckError as err:
            print(f"tidal: export check failed: {err}", file=sys.stderr)
            return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
