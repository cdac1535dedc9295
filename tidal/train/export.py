"""Export a run's checkpoint as a consolidated model that plain PyTorch and Hugging Face load.

``tidal export runs/demo`` (or :func:`export_run`) writes, by default into
``<run_dir>/export/step_NNNNNNNN/``::

    model.safetensors     the GPT's state dict with tidal's names and shapes, fp32; tied weights
                          under each of their names as separate tensors, so that
                          ``build_gpt(cfg).load_state_dict(read_safetensors(path))`` is strict
    tidal.json            the GPTConfig (``GPTConfig(**tidal_json["model"])``), the step, the
                          source checkpoint, the tied names, the parameter count, file sizes
    hf/config.json        the same weights as a Hugging Face ``GPT2LMHeadModel``
    hf/model.safetensors  (``transformers.GPT2LMHeadModel.from_pretrained(".../hf")``)

The checkpoint is read through :func:`tidal.train.checkpoint.load_model_state`, so an export is
the same whichever engine and world size wrote it. The folder appears whole or not at all: it is
written into a hidden temporary sibling and renamed into place, as checkpoints are ([Note: atomic
checkpoints] in checkpoint.py). Safetensors are written by tidal's own small writer
(:mod:`tidal.train.safetensors`), so exporting needs neither ``safetensors`` nor
``transformers``; only :func:`check_export`'s Hugging Face comparison imports transformers.

[Note: GPT-2 name map]
tidal's GPT is GPT-2's architecture under other names. Per block ``i`` (``blocks.{i}.`` ->
``transformer.h.{i}.``): ``ln_1``, ``ln_2`` keep their names; ``attn.qkv`` -> ``attn.c_attn``
(both split their output into q, k, v in that order, then heads as ``view(B, T, H, D/H)``);
``attn.proj`` -> ``attn.c_proj``; ``mlp.fc`` -> ``mlp.c_fc``; ``mlp.proj`` -> ``mlp.c_proj``.
Outside the blocks: ``tok_embed`` -> ``transformer.wte``, ``pos_embed`` -> ``transformer.wpe``,
``ln_f`` -> ``transformer.ln_f``, ``lm_head`` -> ``lm_head``. GPT-2's linear layers are
``Conv1D`` modules, which compute ``x @ W + b`` with ``W`` of shape ``[in, out]``: the transpose
of ``nn.Linear``'s ``[out, in]``. GPT-2 always has biases, so ``bias=False`` exports zeros (an
exact no-op). Its ``gelu_new`` is the tanh GELU tidal uses, and it scales attention scores by
``1/sqrt(head_dim)`` as ``scaled_dot_product_attention`` does. A tied LM head is left out of the
file and ``tie_word_embeddings`` set, which is how Hugging Face itself stores GPT-2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from tidal.config import ConfigError, from_dict, to_dict
from tidal.models import GPT, GPTConfig, ModelConfig, spec_for
from tidal.train.checkpoint import fsync_dir, load_model_state, write_json_durable
from tidal.train.export_folder import (
    EXPORT_FORMAT_VERSION,
    MODEL_FILE,
    TIDAL_JSON,
    ExportCheckError,
    check_out,
    compare_with_source,
    default_out,
    read_run_job,
    select_checkpoint,
    write_folder,
)
from tidal.train.export_module import check_module_export, export_module_run, module_kind
from tidal.train.safetensors import read_safetensors, write_safetensors

__all__ = [
    "ExportCheckError",
    "check_export",
    "export_info",
    "export_run",
    "hf_gpt2_config",
    "hf_unsupported_reason",
    "load_export",
    "run_model_config",
    "select_checkpoint",
    "tied_groups",
    "to_hf_gpt2",
]

log = logging.getLogger(__name__)

_TIDAL_JSON = TIDAL_JSON
_MODEL_FILE = MODEL_FILE
_HF_DIR = "hf"

# tidal name -> (Hugging Face GPT-2 name, transpose?); see [Note: GPT-2 name map].
_HF_TOP = {
    "tok_embed.weight": ("transformer.wte.weight", False),
    "pos_embed.weight": ("transformer.wpe.weight", False),
    "ln_f.weight": ("transformer.ln_f.weight", False),
    "ln_f.bias": ("transformer.ln_f.bias", False),
    "lm_head.weight": ("lm_head.weight", False),
}
_HF_BLOCK = {  # names under blocks.{i}. -> names under transformer.h.{i}.
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
# GPTConfig fields that GPT-2's config expresses; any other field must keep its default.
_HF_EXPRESSIBLE = frozenset(
    ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff", "tie_embeddings",
     "bias", "dropout", "layer_norm_eps")
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the run's model and checkpoint


def run_model_config(run_dir: str | Path) -> GPTConfig:
    """The GPT architecture of a run, from the ``model`` section of its ``config.json``."""
    run_dir = Path(run_dir)
    job = read_run_job(run_dir)
    kind = module_kind(job)
    if kind is not None:
        what = {
            "hf": "a Hugging Face model",
            "factory": "a factory model",
            "module": "your own model",
        }
        raise ConfigError(
            "run_dir",
            f"{run_dir} trained {what[kind]}, not tidal's GPT; export_run exports it as such "
            f"(model.safetensors under its own names)",
        )
    model = from_dict(ModelConfig, job.get("model"), path="model")
    config = model.resolve_structured()
    assert isinstance(config, GPTConfig), "a model config without hf_config resolves to a GPT's"
    return config


def tied_groups(config: GPTConfig) -> list[list[str]]:
    """Names that share one tensor in ``GPT(config)``, e.g. ``[["tok_embed.weight", "lm_head.weight"]]``."""
    model = spec_for(config).build(device="meta")
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _checked_state(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict:
    """``state`` in ``GPT(config).state_dict()`` order, after checking names, shapes and ties."""
    expected = spec_for(config).build(device="meta").state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = [n for n in expected if n in state and state[n].shape != expected[n].shape]
    if missing or unexpected or wrong:
        raise ConfigError(
            "run_dir",
            f"checkpoint {source} does not fit the run's config.json model "
            f"(missing {missing or 'none'}, unexpected {unexpected or 'none'}, "
            f"other shapes {wrong or 'none'})",
        )
    for group in tied_groups(config):
        first = state[group[0]]
        if not all(torch.equal(first, state[name]) for name in group[1:]):
            raise ConfigError("run_dir", f"checkpoint {source}: tied weights {group} differ")
    return {name: state[name].detach().contiguous() for name in expected}


# ---------------------------------------------------------------------------------------------
# Hugging Face GPT-2


def hf_unsupported_reason(config: GPTConfig) -> str | None:
    """Why GPT-2 cannot express ``config``, or None when it can."""
    for field in dataclasses.fields(config):
        if field.name not in _HF_EXPRESSIBLE and getattr(config, field.name) != field.default:
            return f"GPT-2 has no equivalent of {field.name}={getattr(config, field.name)!r}"
    state = spec_for(config).build(device="meta").state_dict()
    unmapped = [n for n in state if _hf_name(n) is None]
    if unmapped:
        return f"GPT-2 has no place for {', '.join(unmapped)}"
    return None


def _hf_name(name: str) -> tuple[str, bool] | None:
    if name in _HF_TOP:
        return _HF_TOP[name]
    prefix, _, rest = name.partition(".")
    index, _, local = rest.partition(".")
    if prefix == "blocks" and index.isdigit() and local in _HF_BLOCK:
        hf_local, transpose = _HF_BLOCK[local]
        return f"transformer.h.{index}.{hf_local}", transpose
    return None


def hf_gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face ``GPT2LMHeadModel`` equal to ``GPT(config)``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.d_model,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.ffn_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_embeddings,
        # tidal trains on bytes or synthetic tokens, not GPT-2's BPE: no <|endoftext|> to name.
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }


def to_hf_gpt2(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """``GPT(config)``'s state dict under GPT-2's names and layouts ([Note: GPT-2 name map])."""
    reason = hf_unsupported_reason(config)
    assert reason is None, reason
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # Hugging Face ties it to transformer.wte.weight on load
        mapped = _hf_name(name)
        assert mapped is not None, name  # hf_unsupported_reason checked every name
        hf_name, transpose = mapped
        out[hf_name] = tensor.t().contiguous() if transpose else tensor
        if not config.bias and hf_name.startswith(("transformer.h.", "transformer.ln_f.")):
            # GPT-2's LayerNorm and Conv1D always add a bias: zeros, of the output's size.
            bias_name = hf_name.removesuffix(".weight") + ".bias"
            out[bias_name] = torch.zeros(out[hf_name].shape[-1], dtype=tensor.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# writing


def _write_json(path: Path, data: dict[str, Any]) -> int:
    return write_json_durable(path, data, indent=2)


def _write_files(folder: Path, state: dict, config: GPTConfig, info: dict[str, Any]) -> None:
    """Everything an export holds, into ``folder``; tidal.json last, with the file sizes."""
    metadata = {"format": "pt", "tidal_step": str(info["step"])}
    files = {_MODEL_FILE: write_safetensors(folder / _MODEL_FILE, state, metadata=metadata)}
    if info["hf_skipped"] is None:
        hf = folder / _HF_DIR
        hf.mkdir()
        files[f"{_HF_DIR}/config.json"] = _write_json(hf / "config.json", hf_gpt2_config(config))
        files[f"{_HF_DIR}/{_MODEL_FILE}"] = write_safetensors(
            hf / _MODEL_FILE, to_hf_gpt2(state, config), metadata=metadata
        )
        fsync_dir(hf)
    info["files"] = files
    _write_json(folder / _TIDAL_JSON, info)


def export_run(
    run_dir: str | Path, *, step: int | None = None, out: str | Path | None = None
) -> Path:
    """Export checkpoint ``step`` (default: the latest) of ``run_dir``; returns the folder.

    ``out`` defaults to ``<run_dir>/export/step_NNNNNNNN``; it must not exist or be empty.
    A model GPT-2 cannot express gets no ``hf/`` folder; ``tidal.json["hf_skipped"]`` says why.
    A run of a model that is not tidal's GPT is exported by :func:`export_module_run`.
    """
    run_dir = Path(run_dir)
    job = read_run_job(run_dir)
    if module_kind(job) is not None:
        return export_module_run(run_dir, job, step=step, out=out)
    config = run_model_config(run_dir)
    step, source = select_checkpoint(run_dir, step)
    out = Path(out) if out is not None else default_out(run_dir, step)
    check_out(out)
    spec = spec_for(config)
    model = spec.build(device="meta")
    checked = _checked_state(load_model_state(source), config, source)
    state = spec.export_adapter(model).to_export(checked)
    hf_skipped = hf_unsupported_reason(config)
    if hf_skipped is not None:
        log.warning("no Hugging Face export (hf/): %s", hf_skipped)
    info = {
        "format_version": EXPORT_FORMAT_VERSION,
        "kind": "gpt",
        "model": to_dict(config),
        "step": step,
        "source_checkpoint": str(source.resolve()),
        "tied": tied_groups(config),
        "num_params": spec.num_params(model),
        "hf_skipped": hf_skipped,
    }
    return write_folder(out, lambda folder: _write_files(folder, state, config, info))


# ---------------------------------------------------------------------------------------------
# reading back


def export_info(out: str | Path) -> dict[str, Any]:
    """The ``tidal.json`` of an export folder."""
    return json.loads((Path(out) / _TIDAL_JSON).read_text())


def load_export(out: str | Path) -> GPT:
    """The exported model as a tidal GPT (strict load), in eval mode."""
    config = GPTConfig(**export_info(out)["model"])
    spec = spec_for(config)
    model = spec.build(device="cpu")
    state = spec.export_adapter(model).from_export(read_safetensors(Path(out) / _MODEL_FILE))
    model.load_state_dict(state, strict=True)
    assert isinstance(model, GPT), "the spec of a GPTConfig builds tidal's GPT"
    return model.eval()


def _sample_batch(config: GPTConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(config.vocab_size, (2, min(config.seq_len, 32)), generator=generator)


@torch.no_grad()
def check_export(out: str | Path, *, atol: float = 1e-4) -> list[str]:
    """Read an export back and compare it with its source; one line per check that passed.

    The tidal file must equal the source checkpoint (when it still exists) bit for bit and load
    strictly into ``build_gpt``; Hugging Face's logits must be within ``atol`` of tidal's (when
    transformers is installed). Raises :class:`ExportCheckError` on a mismatch.
    """
    out = Path(out)
    info = export_info(out)
    if info.get("kind", "gpt") != "gpt":
        return check_module_export(out, info)
    tensors = read_safetensors(out / _MODEL_FILE)
    lines = compare_with_source(out / _MODEL_FILE, tensors, Path(info["source_checkpoint"]))
    model = load_export(out)
    logits = model(_sample_batch(model.config))
    lines.append(f"{_MODEL_FILE}: loads strictly into build_gpt")
    if info["hf_skipped"] is not None:
        return [*lines, f"{_HF_DIR}/: not written ({info['hf_skipped']})"]
    try:
        import transformers
    except ImportError:
        return [*lines, f"{_HF_DIR}/: not checked (transformers is not installed: the hf extra)"]
    progress_bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        hf_model = transformers.GPT2LMHeadModel.from_pretrained(out / _HF_DIR).eval()
    finally:
        if progress_bar:
            transformers.utils.logging.enable_progress_bar()
    diff = (hf_model(_sample_batch(model.config)).logits - logits).abs().max().item()
    if not diff <= atol:
        raise ExportCheckError(f"{out / _HF_DIR}: logits differ from tidal's by {diff:.3g}")
    return [*lines, f"{_HF_DIR}/: GPT2LMHeadModel logits within {diff:.2g} of tidal's"]
