"""The ``tidal train`` command that trains what ``tidal plan`` chose, or why it cannot yet."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.config.configurable import ConfigError

if TYPE_CHECKING:  # the planner loads for `tidal plan`, not on the train path (test_imports.py)
    from tidal.planner.plan import Plan

__all__ = ["how_to_train", "is_hf_config", "train_argv"]


def is_hf_config(model: str) -> bool:
    """Whether ``--model`` names a Hugging Face config (a path) rather than a preset."""
    return model.endswith(".json") or "/" in model or Path(model).exists()


def how_to_train(plan: Plan, args: argparse.Namespace) -> str:
    """The line that says how to train the plan: the ``tidal train`` command, after saving it
    with ``--json`` when it was not; or why this plan cannot train yet."""
    from tidal.planner.check import not_run

    gaps = not_run(plan)
    if gaps:
        return (f"this plan {' and '.join(g.what for g in gaps)}, priced but not run by tidal "
                f"train yet: plan again without those flags for one it trains")  # fmt: skip
    recipe, settings = _recipe_for(args, plan)
    command = shlex.join(train_argv(plan, plan_path=args.json or "plan.json", recipe=recipe,
                                    settings=settings, devices_per_node=args.devices_per_node))  # fmt: skip
    wheres = []
    if "--nnodes" in command:
        wheres.append("on every machine, HOST:PORT a free port on one of them")
    if "NVME_DIR" in command:
        wheres.append("NVME_DIR a folder on the node's NVMe drive")
    where = f" ({'; '.join(wheres)})" if wheres else ""
    if args.json:
        return f"train it: {command}{where}"
    return f"train it: save it with --json plan.json, then {command}{where}"


def train_argv(plan: Plan, *, plan_path: str, recipe: str, settings: list[str],
               devices_per_node: int) -> list[str]:  # fmt: skip
    """``tidal train`` with the plan at ``plan_path``, on its pp x dp x tp ranks (over machines
    of ``devices_per_node``) with the rows and micro-batches per step it was priced with
    ([Note: global batch] in tidal/train/trainer.py: the batch is over the dp ranks; a
    pipelined plan's micro-batches are its pipeline's, the others' accumulated steps)."""
    devices = plan.pp * plan.dp * plan.tp
    argv = ["tidal", "train", "--recipe", recipe, "--plan", plan_path]
    if devices > devices_per_node:
        nodes = -(-devices // devices_per_node)
        argv += ["--nnodes", str(nodes), "--nproc", str(devices // nodes),
                 "--rdzv-endpoint", "HOST:PORT"]  # fmt: skip
    elif devices > 1:
        argv += ["--nproc", str(devices)]
    rows, m = plan.micro_batch * plan.dp, plan.num_microbatches
    # the recipe's own accumulation would multiply the batch the plan was priced for
    if plan.pipeline is not None:  # a step's micro-batches are the pipeline's (the plan's)
        settings = [*settings, f"training.batch_size={rows * m}", "training.grad_accum_steps=1"]
    else:
        settings = [*settings, f"training.batch_size={rows}", f"training.grad_accum_steps={m}"]
    # fp32: asynchronous schedules' only precision, or the one the plan was priced in
    pipemare = plan.pipeline is not None and plan.pipeline.schedule == "pipemare"
    if pipemare or plan.activation_element_bytes == 4:
        settings = [*settings, "training.precision=fp32"]
    # the optimizer's state there ([Note: the optimizer on the host])
    if any(o.nvme for o in plan.offloads()):
        settings = [*settings, "memory.nvme_dir=NVME_DIR"]
    for setting in settings:
        argv += ["--set", setting]
    return argv


def _recipe_for(args: argparse.Namespace, plan: Plan) -> tuple[str, list[str]]:
    """The shipped recipe the command starts from (the preset's own, else ``tiny``) and the
    settings that make it train the model planned, on the engine that runs plans."""
    from tidal.train.job import load_job

    if is_hf_config(args.model):
        return "tiny", [f"model.hf_config={args.model}", f"model.seq_len={plan.seq_len}"]
    recipe, settings = args.model, []
    try:
        job = load_job(recipe)
    except ConfigError:  # no recipe of that name
        job = None
    if job is None or job.model.preset != args.model:
        recipe, settings, job = "tiny", [f"model.preset={args.model}"], load_job("tiny")
        if args.model == "tiny":
            settings = []
    if job.engine != "reference":
        settings.append("engine=reference")
    if args.seq_len is not None:
        settings.append(f"model.seq_len={args.seq_len}")
    return recipe, settings
