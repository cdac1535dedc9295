"""A pipeline's stages in the one checkpoint format ([Note: checkpoint keys] in checkpoint.py).

The engines give their own :class:`~tidal.parallel.protocol.CheckpointTensors`; a pipeline's
stages are not an engine: :class:`PipelineStages` writes each rank's stages' tensors under the
model's own names (see [Note: pipeline checkpoints]).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.parallel.chunk_stage import ChunkStageParams
from tidal.parallel.flat_state import flat_optimizer_state, index_names, unflatten_optimizer_state
from tidal.parallel.protocol import CheckpointTensors, LoadTensors

__all__ = ["PipelineStages"]


# [Note: pipeline checkpoints]
# A pipeline's checkpoint is the whole model, whatever the split: each rank writes its stages'
# parameters and optimizer state under the model's names (a stage's ``source_names``), so
# ``tidal export`` and every engine read it as any other. A weight two stages hold (a tied
# embedding) is written by both, equal, and DCP keeps one; its optimizer state only by the
# owner, the first of the pair (under an asynchronous schedule the second copy's is not the
# matrix's: [Note: tied matrices without a flush] in tidal/runtime/tied.py). A persistent
# buffer (BatchNorm's statistics, which only a model of one stage may have: [Note: sequential
# pipelines]) goes under ``buffer/<name>``, as an engine's. What only a stage has, its weight
# versions and measured delays (PipeMare), is one opaque tensor per stage,
# ``pipeline/stage-<s>``. The extras record the schedule and split; a synchronous pipeline
# resumes on any other ([Note: resuming on another split]), an asynchronous one on its own
# only. A synchronous pipeline resumes from an engine's checkpoint (written by tidal.initialize's
# engines, or by a Trainer before every run was on stages) as from another split; an
# asynchronous one refuses it, having no weight versions to resume its stages from.


def _buffers_of(module: nn.Module) -> dict[str, str]:
    """A stage's persistent buffers: its name -> the model's."""
    return cast(dict[str, str], getattr(module, "source_buffers", {}))


class PipelineStages:
    """A :class:`~tidal.runtime.distributed.PipelineRuntime`'s stages in the one format; see
    [Note: pipeline checkpoints]. ``layout``: :func:`~tidal.parallel.flat_state.model_layout` of the whole model."""

    def __init__(self, runtime: Any, layout: dict[str, Any], split: dict[str, Any], *,
                 schedulers: Sequence[Any] = ()) -> None:  # fmt: skip
        """``schedulers``: your learning-rate schedulers, one per stage of this rank, all in
        the same state (built alike, stepped alike), saved once as the engines save theirs."""
        self.runtime = runtime
        self.layout = layout
        self.split = split  # schedule, stages and block ranges: resuming needs the same
        self.schedulers = list(schedulers)

    def _stages(self) -> Iterable[tuple[int, nn.Module, Any, dict[str, str]]]:
        for s, module in self.runtime.modules.items():
            weights = self.runtime.weights[s]
            yield s, module, weights, module.source_names

    def checkpoint_state(self) -> CheckpointTensors:
        tensors: dict[str, Any] = {}
        for s, module, weights, source in self._stages():
            if isinstance(weights, ChunkStageParams):  # read from the chunks (gathered: ZeRO-3)
                state = weights.engine.state_dict()
                for name, _ in module.named_parameters():
                    tensors[f"model/{source[name]}"] = state["model"][name].reshape(-1)
                by_source = {source[n]: saved for n, saved in state["optimizer"].items()}
                optim, steps = flat_optimizer_state(by_source)
            else:  # FSDP2 and tensor-parallel stages' DTensors whole, in the model's order
                from tidal.parallel.stage_params import whole  # DTensor: imported when used
                from tidal.parallel.tensor_stage import model_order

                for name, param in module.named_parameters():
                    value = model_order(module, name, whole(param.detach()))
                    tensors[f"model/{source[name]}"] = value.reshape(-1)
                index_of = index_names(module, weights.optimizer)
                names = {i: source[n] for i, n in index_of.items()}
                state = {i: {k: model_order(module, index_of[i], whole(v)) for k, v in saved.items()}
                         for i, saved in weights.optimizer.state_dict()["state"].items()}  # fmt: skip
                optim, steps = flat_optimizer_state(state, names)
            buffers = dict(module.named_buffers())  # a one-stage model's (BatchNorm's statistics)
            for name, key in _buffers_of(module).items():
                tensors[f"buffer/{key}"] = buffers[name].detach().reshape(-1)
            followers = {source[n] for n in self.runtime.rules.second_copies(s)}
            tensors.update((k, v) for k, v in optim.items()
                           if k[len("optim/") :].rsplit("/", 1)[0] not in followers)  # fmt: skip
            tensors[f"pipeline/stage-{s}"] = _to_bytes({
                "weights": weights.state_dict(),
                "optimizer_steps": steps,
                "loss_scale": self.runtime.scaler.state_dict(),  # fp16's, the same on every rank
            })  # fmt: skip
        extras = {"global_step": self.runtime.step, "split": self.split}
        if self.schedulers:
            extras["lr_scheduler"] = self.schedulers[0].state_dict()
        return CheckpointTensors(tensors=tensors, extras=extras, meta=dict(self.layout))

    def _targets(self, meta: dict[str, Any], *, every_stage: bool) -> dict[str, torch.Tensor]:
        """This rank's stages' keys: parameters, their optimizer state, each stage's own (of
        every stage of the checkpoint's split, ``every_stage``: another split's stages)."""
        numels = meta["numels"]
        names = {source for _, _, _, sources in self._stages() for source in sources.values()}
        keys = [k for k in numels if k.startswith("optim/")
                and k[len("optim/") :].rsplit("/", 1)[0] in names]  # fmt: skip
        keys += [f"model/{name}" for name in names]
        keys += [key for _, module, _, _ in self._stages() for key in
                 (f"buffer/{name}" for name in _buffers_of(module).values()) if key in numels]  # fmt: skip
        targets = {key: torch.empty(numels[key]) for key in keys}
        stages = [k for k in numels if k.startswith("pipeline/stage-")] if every_stage else [
            f"pipeline/stage-{s}" for s in self.runtime.modules]  # fmt: skip
        for key in stages:
            targets[key] = torch.empty(numels[key], dtype=torch.uint8)
        return targets

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        self._restore_schedulers(extras.get("lr_scheduler"))
        if "split" not in extras:  # an engine's: [Note: resuming on another split]
            if not _flushes(self.split):
                raise ConfigError(
                    "pipeline",
                    f"the checkpoint was trained without a pipeline, this run is "
                    f"{_split(self.split)}, whose stages would need weight versions it does not "
                    f"have; resume it with a synchronous schedule (gpipe, 1f1b, interleaved) or "
                    f"without --pipeline-stages (and [parallel] pp = 1)",
                )
            extras = _from_engine(extras)
        resplit = extras["split"] != self.split
        if resplit and not (_flushes(extras["split"]) and _flushes(self.split)):
            raise ConfigError(
                "pipeline",
                f"the checkpoint was trained as {_split(extras['split'])}, this run is "
                f"{_split(self.split)}; an asynchronous pipeline resumes with the same [pipeline] "
                f"settings (or without --pipeline-stages, or export it with `tidal export "
                f"RUN_DIR`)",
            )
        from tidal.parallel.stage_params import like
        from tidal.parallel.tensor_stage import rank_order  # DTensor: a checkpoint's import

        targets = self._targets(meta, every_stage=resplit)
        load(targets)  # one collective read for all this rank's stages
        shared = (extras["stages"] if "stages" in extras
                  else _merged_stages(targets) if resplit else None)  # fmt: skip
        for s, module, weights, source in self._stages():
            own = _from_bytes(targets[f"pipeline/stage-{s}"]) if shared is None else shared
            buffers = dict(module.named_buffers())
            with torch.no_grad():
                for name, key in _buffers_of(module).items():
                    if f"buffer/{key}" in targets:
                        buffers[name].copy_(targets[f"buffer/{key}"].view(buffers[name].shape))
            self.runtime.scaler.load_state_dict(own.get("loss_scale"))  # fp16's, every stage's
            if isinstance(weights, ChunkStageParams):
                _restore_chunk_stage(module, weights, source, targets, own, meta)
                continue
            params = dict(module.named_parameters())
            with torch.no_grad():
                for name, param in params.items():
                    value = targets[f"model/{source[name]}"].view(param.shape)
                    param.copy_(like(param, rank_order(module, name, value)))
            by_name = unflatten_optimizer_state(
                targets, own["optimizer_steps"], meta["model_shapes"]
            )
            index_of = index_names(module, weights.optimizer)
            # an asynchronous second copy of a tied matrix keeps no optimizer state for it
            skip = self.runtime.rules.second_copies(s) if self.runtime.asynchronous else ()
            state = {i: {k: like(params[n], rank_order(module, n, v)) if k != "step" else v
                         for k, v in by_name[source[n]].items()}
                     for i, n in index_of.items() if source[n] in by_name and n not in skip}  # fmt: skip
            groups = weights.optimizer.state_dict()["param_groups"]
            weights.optimizer.load_state_dict({"state": state, "param_groups": groups})
            if own.get("resplit"):  # nothing of the old stage's own but its update count
                weights.version = own["weights"]["version"]
            else:
                weights.load_state_dict(own["weights"])
        self.runtime.step = int(extras["global_step"])

    def _restore_schedulers(self, state: dict[str, Any] | None) -> None:
        if state is None or not self.schedulers:  # a run's own notes say if they differ
            return
        for scheduler, weights in zip(self.schedulers, self.runtime.weights.values(),
                                      strict=True):  # fmt: skip
            scheduler.load_state_dict(state)
            # torch's schedulers compute from the groups' current rates, which loading leaves
            # as they were built: set them to where the saved run was
            groups = weights.optimizer.param_groups
            for group, lr in zip(groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr


# [Note: resuming on another split]
# A synchronous pipeline flushes every step, so at a checkpoint no stage holds anything but its
# weights, optimizer state and update count: the model's names say where each weight goes,
# whatever stages wrote them. A checkpoint of one synchronous split (stages, schedule, mesh)
# therefore resumes on another: each rank reads its new stages' keys by name, the optimizer step
# counts of every old stage merged, and starts its stages' versions at the global step. An
# asynchronous pipeline's stages hold versions, delays and correction buffers of their own
# blocks, which another split cannot take: it resumes on the same split only. An engine's
# checkpoint (no pipeline) is a synchronous split of one stage: it resumes as any synchronous
# pipeline, the other way as well.
_FLUSHED = ("gpipe", "1f1b", "interleaved", "engine")  # an engine's checkpoint: one flushed stage


def _flushes(split: dict[str, Any]) -> bool:
    return split["schedule"] in _FLUSHED


def _from_engine(extras: dict[str, Any]) -> dict[str, Any]:
    """An engine's checkpoint as one synchronous stage of the whole model: its optimizer step
    counts by name, its update count. A loss scale is an engine's own (torch's ``GradScaler``
    state), so an fp16 pipeline starts its scale afresh."""
    step = int(extras["global_step"])
    own = {"optimizer_steps": extras["optimizer_steps"], "loss_scale": None,
           "weights": {"version": step}, "resplit": True}  # fmt: skip
    return {"global_step": step, "split": {"schedule": "engine"}, "stages": own}


def _merged_stages(targets: dict[str, torch.Tensor]) -> dict[str, Any]:
    """[Note: resuming on another split]: what the old stages' own tensors say that holds for
    any split: the optimizer step counts by name, the loss scale, the update count."""
    stages = [_from_bytes(t) for k, t in targets.items() if k.startswith("pipeline/stage-")]
    steps: dict[str, float] = {}
    for own in stages:
        steps.update(own["optimizer_steps"])
    versions = {int(own["weights"]["version"]) for own in stages}
    assert len(versions) == 1, f"a synchronous pipeline's stages at versions {versions}"
    return {"optimizer_steps": steps, "loss_scale": stages[0].get("loss_scale"),
            "weights": {"version": versions.pop()}, "resplit": True}  # fmt: skip


def _restore_chunk_stage(module: nn.Module, weights: ChunkStageParams, source: dict[str, str],
                         targets: dict[str, torch.Tensor], own: dict[str, Any],
                         meta: dict[str, Any]) -> None:  # fmt: skip
    """A chunk stage's parameters and optimizer state written into its chunks (every rank of a
    ZeRO-3 stage takes its shards of them)."""
    by_source = unflatten_optimizer_state(targets, own["optimizer_steps"], meta["model_shapes"])
    engine = weights.engine
    model = {name: value.detach().clone() for name, value in engine.model_state_dict().items()}
    first: dict[int, str] = {}  # a weight one stage holds under two names (tied in the stage)
    for name, param in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
        model[name] = targets[f"model/{source[first[id(param)]]}"].view(param.shape)
    optimizer = {n: by_source[source[n]] for n, _ in module.named_parameters()
                 if source[n] in by_source}  # fmt: skip
    step = own["weights"]["version"]
    engine.load_state_dict({"model": model, "optimizer": optimizer, "global_step": step,
                            "micro_step": 0})  # fmt: skip
    weights.load_state_dict(own["weights"])


def _split(split: dict[str, Any]) -> str:
    ranges = ", ".join(f"[{a}, {b})" for a, b in split["block_ranges"])
    return (
        f"a {split['schedule']} pipeline of {len(split['block_ranges'])} stages (blocks {ranges})"
    )


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(tensor: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)
