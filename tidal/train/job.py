"""The root config of a run, composed of the components' own configs, and recipe loading.

A recipe is a TOML file whose tables are the sections below (``[model]``, ``[training]``, ...).
``tidal train --recipe demo`` finds ``recipes/demo.toml`` (the current folder's, else the one
shipped in the package, ``tidal/recipes/``); ``--set training.steps=50`` overrides.
The root lives in the engine, not in ``tidal.config``: it names every component's config, and the
config layer sits below all of them.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_type_hints

from tidal.config import ConfigError, apply_overrides, from_dict, load_toml, require, to_dict
from tidal.data import DataConfig
from tidal.distributed.config import DistributedConfig
from tidal.memory.config import ChunkConfig
from tidal.models import ModelConfig
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.dims import ParallelConfig
from tidal.pipeline.config import PipelineConfig
from tidal.sharding.config import ShardingConfig
from tidal.train.config import CheckpointConfig, CustomConfig, MetricsConfig
from tidal.train.deepspeed_config import from_deepspeed, is_deepspeed_config

logger = logging.getLogger(__name__)

__all__ = ["JobConfig", "check_nvme_dir", "find_recipe", "list_recipes", "load_job"]


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything one training run needs.

    Attributes:
        name: the run's name; also the default run folder ``runs/<name>``.
        run_dir: where metrics, summary, plots and checkpoints go; ``None`` means ``runs/<name>``.
        engine: ``reference`` (plain PyTorch, all model data on the device) or ``chunk``
            (parameters in chunks that move between device and host under memory budgets;
            under torchrun with several ranks, chunks sharded across them: ZeRO-3). In a
            pipeline (``parallel.pp > 1``) each stage's parameters in chunks, sharded over its
            ``parallel.dp`` replicas ([Note: chunk stages] in tidal/parallel/chunk_stage.py).
    """

    name: str = "run"
    run_dir: str | None = None
    engine: Literal["reference", "chunk"] = "reference"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    custom: CustomConfig = field(default_factory=CustomConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        require(
            bool(self.name) and "/" not in self.name,
            "name",
            f"must be a non-empty name without '/', got {self.name!r}",
        )
        require(
            self.parallel.pp == 1 or self.engine == "reference" or self.pipeline.memory == "none",
            "pipeline.memory",
            "chunk stages hold memory.device_budget with their chunks; MPress's savers do not run "
            "on them yet: set pipeline.memory = 'none' (or engine = 'reference')",
        )
        require(
            not self.sharding.reduce_per_step or (self.parallel.pp > 1 and self.engine == "chunk"),
            "sharding.reduce_per_step",
            "reduces a pipeline step's microbatches once, in chunk stages (--mesh pp=P,dp=D --set "
            "engine=chunk); drop it elsewhere",
        )
        require(
            not self.parallel.fsdp2 or self.engine == "reference",
            "parallel.fsdp2",
            "chunk stages shard over their replicas themselves (ZeRO-3 over chunks); set "
            "parallel.fsdp2 = false, or engine = 'reference' for FSDP2 stages",
        )
        require(
            self.custom.factory is None
            or (self.model.factory is None and self.model.hf_config is None),
            "custom.factory",
            "builds the model itself: drop model.factory and model.hf_config",
        )
        seq_len = self.model.resolve().seq_len
        require(seq_len >= 2, "model.seq_len", f"must be >= 2, got {seq_len}")

    @property
    def pipelined(self) -> bool:
        return self.parallel.pp > 1

    # [Note: one train step]
    # Every run of the Trainer trains on stages. The parameters of each stage are held by a
    # transform behind the stage-parameter protocol (plain replicas, chunks, FSDP2 shards,
    # tensor-parallel shares, a plan's layout: tidal/runtime/build.py picks it) and one step
    # drives them all (tidal/runtime/executor.py: every microbatch's forward and backward;
    # tidal/runtime/update.py: each dp group's reduction once, the tied sum, the global norm
    # over the mesh, the loss scaler, the clip; then the update). A model of one stage is a
    # schedule of one stage, one process in a group of its own ([Note: a group of one] in
    # tidal/distributed/env.py), any module one block ([Note: sequential pipelines]):
    # ``engine = "reference"`` is plain replicas (your torch optimizer and scheduler
    # included), ``"chunk"`` chunks (ZeRO-3 over ``--nproc N``), ``--mesh tp=2`` and
    # ``parallel.fsdp2`` their DTensors, ``--plan`` the model the plan lays out on its ``dp x
    # tp`` mesh ([Note: plan stages] in tidal/runtime/plan_weights.py). Still owning their
    # step: the engines behind tidal.initialize, whose reference engine is the parity baseline
    # every test of a stage compares with (tidal.initialize composes stages for tp and FSDP2:
    # [Note: one model on stages] in tidal/runtime/stage_engine.py).
    @property
    def needs_stages(self) -> bool:
        """Whether the config asks for what only stages do ([Note: one train step]): a
        pipeline, a model in chunks, tensor parallelism over ``mesh["tp"]``, FSDP2 over
        ``mesh["dp"]``; a plan refuses them, and tidal.initialize composes its stage engine for
        tp and FSDP2."""
        return (
            self.pipelined or self.parallel.tp > 1 or self.parallel.fsdp2 or self.engine == "chunk"
        )

    @property
    def num_microbatches(self) -> int:
        """A pipeline step's microbatches: ``pipeline.microbatches``, else one per stage."""
        return self.pipeline.num_microbatches(self.parallel.pp)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


def _recipe_dirs() -> list[Path]:
    """A ``recipes/`` folder where the command runs (the user's own), then the package's."""
    shipped = Path(__file__).resolve().parents[1] / "recipes"
    return [Path.cwd() / "recipes", shipped]


def list_recipes() -> list[str]:
    """Names of the recipes that ``--recipe NAME`` can find."""
    names: set[str] = set()
    for folder in _recipe_dirs():
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.toml"))
    return sorted(names)


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file from a path or a bare name (``demo`` -> ``recipes/demo.toml``, see
    :func:`_recipe_dirs`)."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".json":
        raise ConfigError(
            "recipe",
            f"{str(candidate)!r} is JSON; a DeepSpeed config goes with --deepspeed "
            f"{candidate} (and --recipe NAME for the model and data, e.g. --recipe tiny)",
        )
    if candidate.suffix == ".toml" or candidate.parent != Path("."):
        if candidate.is_file():
            return candidate
        raise ConfigError("recipe", f"no recipe file at {str(candidate)!r}")
    for folder in _recipe_dirs():
        path = folder / f"{name_or_path}.toml"
        if path.is_file():
            return path
    recipes = list_recipes()
    close = difflib.get_close_matches(str(name_or_path), recipes, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    known = ", ".join(recipes) or "none found"
    raise ConfigError("recipe", f"unknown recipe {str(name_or_path)!r} (known: {known}){hint}")


def load_job(
    recipe: str | Path | Mapping[str, Any] | JobConfig | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    *,
    deepspeed: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    log_notes: bool = True,
) -> JobConfig:
    """A validated JobConfig from a recipe name, a TOML path, a dict or a JobConfig, then the
    settings of a ``deepspeed`` config on top ([Note: deepspeed keys]; each key it ignores is
    logged, by rank 0; ``world_size``: the ranks its per-GPU batch is for, else ``WORLD_SIZE``),
    then ``--set`` overrides (``["training.steps=50"]``, or a nested dict such as
    ``{"training": {"steps": 50}}`` merged key by key). A dict that is itself a DeepSpeed config
    is read as one."""
    if isinstance(overrides, Mapping):
        return load_job(_merged(to_dict(load_job(recipe, deepspeed=deepspeed, world_size=world_size,
                                                 log_notes=log_notes)), _renamed(dict(overrides))))  # fmt: skip
    if isinstance(overrides, str):
        raise ConfigError("overrides", f"expected a list of 'key=value' strings or a dict, got "
                          f"the string {overrides!r}; wrap it in a list")  # fmt: skip
    if isinstance(recipe, JobConfig):
        if not overrides and deepspeed is None:
            return recipe
        recipe = to_dict(recipe)
    if recipe is None:
        data: Mapping[str, Any] = {}
    elif isinstance(recipe, Mapping):
        data = recipe
        if deepspeed is None and is_deepspeed_config(data):
            data, deepspeed = {}, data
    else:
        path = find_recipe(recipe)
        data = _beside(load_toml(path), path.parent)
    if deepspeed is not None:
        mapped, notes = from_deepspeed(deepspeed, world_size=world_size)
        for note in notes if log_notes and os.environ.get("RANK", "0") == "0" else []:
            logger.warning("tidal: deepspeed config: %s", note)
        data = _merged(data, mapped)
    try:
        return from_dict(JobConfig, _renamed(apply_overrides(data, overrides)))
    except ConfigError as err:
        raise _elsewhere(err) from None


def _elsewhere(err: ConfigError) -> ConfigError:
    """``training.lr: unknown key ...`` with where the key lives: ``; lr is optimizer.lr``."""
    section, _, name = err.key.rpartition(".")
    if not (section and "." not in section and err.message.startswith("unknown key")):
        return err
    sections = get_type_hints(JobConfig)
    if name in sections:  # a root key (name, engine): the close match says more
        return err
    homes = [key for key, kind in sections.items()
             if is_dataclass(kind) and name in {f.name for f in fields(kind)}]  # fmt: skip
    if not homes:
        return err
    unknown = err.message.split("; did you mean")[0]  # the key's home is the better hint
    return ConfigError(err.key, f"{unknown}; {name} is {' or '.join(f'{h}.{name}' for h in homes)}")


# keys that moved: old name -> new name ([Note: one mesh] in tidal/parallel/dims.py)
_RENAMED = {("pipeline", "stages"): ("parallel", "pp")}


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    """Older recipes' keys under their new names; both given and different is refused."""
    for (old_table, old_key), (new_table, new_key) in _RENAMED.items():
        old = data.get(old_table)
        if not isinstance(old, Mapping) or old_key not in old:
            continue
        value = old[old_key]
        new = dict(data.get(new_table) or {})
        if new_key in new and str(new[new_key]) != str(value):
            raise ConfigError(
                f"{old_table}.{old_key}",
                f"is {new_table}.{new_key} now; this config sets both ({value} and "
                f"{new[new_key]}): drop {old_table}.{old_key}",
            )
        new[new_key] = value
        data = {**data, old_table: {k: v for k, v in old.items() if k != old_key},
                new_table: new}  # fmt: skip
    return data


def _beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A recipe's ``model.hf_config`` relative to the recipe's own folder where the file is
    there (a shipped recipe's config), else as written (relative to the working directory)."""
    hf_config = data.get("model", {}).get("hf_config")
    if isinstance(hf_config, str) and not Path(hf_config).is_absolute():
        beside = folder / hf_config
        if beside.exists():
            data = {**data, "model": {**data["model"], "hf_config": str(beside)}}
    return data


def _merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def check_nvme_dir(job: JobConfig, *, plan: bool) -> None:
    """Refuse ``memory.nvme_dir`` where nothing of the run would use it: the NVMe tier holds
    the chunk engine's chunks and a plan's optimizer state ([Note: the optimizer on the host]
    in tidal/runtime/host_optimizer.py), not the reference engine's model data."""
    require(
        job.memory.nvme_dir is None or job.engine == "chunk" or plan,
        "memory.nvme_dir",
        "the NVMe tier holds chunks (or a plan's optimizer state): set engine = 'chunk' (the "
        "reference engine keeps all model data on the device), or train a plan with --plan",
    )
