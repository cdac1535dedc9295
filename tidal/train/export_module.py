"""Export a run of a model that is not tidal's GPT: a Hugging Face decoder, a ``[model]
factory`` model, or your own module given to ``Trainer(model, ...)``.

``tidal export RUN_DIR`` writes, into ``<run_dir>/export/step_NNNNNNNN/``::

    model.safetensors     the model's state dict under its own names (parameters and buffers,
                          fp32 as trained; tied weights under each name), so that
                          ``model.load_state_dict(read_safetensors(path))`` is strict
    hf/config.json        instead, for a Hugging Face run: its config and those weights, which
    hf/model.safetensors  ``AutoModelForCausalLM.from_pretrained(".../hf")`` loads
    tidal.json            kind (``hf``, ``factory`` or ``module``), what builds the model, the
                          step, the source checkpoint, the parameter count, the file sizes

The folder appears whole or not at all (:func:`~tidal.train.export_folder.write_folder`).
:func:`check_module_export` reads it back: the file equals the checkpoint bit for bit, a
factory model loads it strictly, and a Hugging Face model loaded by ``transformers`` gives the
logits of the model tidal trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tidal.config import from_dict
from tidal.models import ModelConfig, spec_for
from tidal.train.checkpoint import load_model_state, write_json_durable
from tidal.train.export_folder import (
    EXPORT_FORMAT_VERSION,
    MODEL_FILE,
    TIDAL_JSON,
    ExportCheckError,
    compare_with_source,
    default_out,
    select_checkpoint,
    write_folder,
)
from tidal.train.safetensors import read_safetensors, write_safetensors

__all__ = ["check_module_export", "export_module_run", "module_kind"]

_HF_DIR = "hf"


def module_kind(job: dict[str, Any]) -> str | None:
    """``hf``, ``factory`` or ``module`` for a run of a model that is not tidal's GPT."""
    model = job.get("model") or {}
    if job.get("user_model"):
        return "module"
    if model.get("hf_config"):
        return "hf"
    if model.get("factory"):
        return "factory"
    return None


def export_module_run(
    run_dir: Path, job: dict[str, Any], *, step: int | None, out: str | Path | None
) -> Path:
    """Export checkpoint ``step`` (default: the latest) of a run ``module_kind`` names."""
    kind = module_kind(job)
    assert kind is not None, "export_run sends only such runs here"
    model = from_dict(ModelConfig, job.get("model"), path="model") if kind != "module" else None
    hf_file = None
    if kind == "hf":
        assert model is not None and model.hf_config is not None
        hf_file = Path(model.resolve().path)  # type: ignore[union-attr]
    step, source = select_checkpoint(run_dir, step)
    out = Path(out) if out is not None else default_out(run_dir, step)
    state = load_model_state(source)
    info: dict[str, Any] = {
        "format_version": EXPORT_FORMAT_VERSION,
        "kind": kind,
        "builds": _builds(kind, job),
        "model": job.get("model"),
        "step": step,
        "source_checkpoint": str(source.resolve()),
        "num_params": sum(t.numel() for t in state.values() if t.is_floating_point()),
        "hf_skipped": None if kind == "hf" else f"not a Hugging Face model ({kind})",
    }

    # A Hugging Face run's weights go into hf/ only: the same names, so one copy serves both.
    weights = f"{_HF_DIR}/{MODEL_FILE}" if hf_file is not None else MODEL_FILE
    info["weights"] = weights

    def write(folder: Path) -> None:
        metadata = {"format": "pt", "tidal_step": str(step)}
        files = {}
        if hf_file is not None:
            (folder / _HF_DIR).mkdir()
            shutil.copyfile(hf_file, folder / _HF_DIR / "config.json")
            files[f"{_HF_DIR}/config.json"] = hf_file.stat().st_size
        files[weights] = write_safetensors(folder / weights, state, metadata=metadata)
        info["files"] = files
        write_json_durable(folder / TIDAL_JSON, info, indent=2)

    return write_folder(out, write)


def _builds(kind: str, job: dict[str, Any]) -> str:
    """What builds the model the weights load into, in a few words."""
    model = job.get("model") or {}
    if kind == "hf":
        return f"transformers.AutoModelForCausalLM from {_HF_DIR}/config.json"
    if kind == "factory":
        return f"the recipe's factory {model['factory']}"
    return f"your own {job['user_model']}, as given to tidal.Trainer"


@torch.no_grad()
def check_module_export(out: Path, info: dict[str, Any]) -> list[str]:
    """One line per check of a non-GPT export (``check_export`` sends them here); raises
    :class:`~tidal.train.export_folder.ExportCheckError` on a mismatch."""
    tensors = read_safetensors(out / info["weights"])
    lines = compare_with_source(out / info["weights"], tensors, Path(info["source_checkpoint"]))
    if info["kind"] == "module":
        return [*lines, f"{info['weights']}: load it into {info['builds']} with load_state_dict"]
    config = from_dict(ModelConfig, info["model"], path="model")
    spec = spec_for(config)
    model = spec.build(device="cpu")
    model.load_state_dict(tensors, strict=True)
    lines.append(f"{info['weights']}: loads strictly into the model of {info['builds']}")
    if info["kind"] != "hf":
        return lines
    return [*lines, _check_hf(out, model.eval(), config)]


def _check_hf(out: Path, model: torch.nn.Module, config: ModelConfig) -> str:
    import transformers

    progress_bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            out / _HF_DIR, attn_implementation="sdpa"
        ).eval()
    finally:
        if progress_bar:
            transformers.utils.logging.enable_progress_bar()
    vocab = json.loads((out / _HF_DIR / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(vocab, (2, min(config.resolve().seq_len, 32)), generator=generator)
    diff = (hf_model(batch).logits - model(batch).logits).abs().max().item()
    if not diff <= 1e-4:
        raise ExportCheckError(
            f"{out / _HF_DIR}: logits differ from the trained model's by {diff:.3g}"
        )
    return f"{_HF_DIR}/: AutoModelForCausalLM logits within {diff:.2g} of the trained model's"
