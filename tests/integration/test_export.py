"""``tidal export``: a trained run's checkpoint as safetensors for plain PyTorch and Hugging Face."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tidal.train.export as export_module
from tidal.cli.main import main
from tidal.config import ConfigError
from tidal.models import GPT, GPTConfig, build_gpt
from tidal.runtime.distributed import PipelineRuntime
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import list_checkpoints, load_model_state
from tidal.train.export import check_export, export_info, export_run, to_hf_gpt2
from tidal.train.safetensors import read_safetensors, read_safetensors_metadata, write_safetensors

REPO = Path(__file__).resolve().parents[2]

COMMON = [
    "training.steps=2",
    "training.device=cpu",
    "training.val_every=0",
    "training.log_every=1",
    "checkpoint.at_end=true",
    "checkpoint.every_steps=1",
    "checkpoint.keep=2",
    "metrics.peak_tflops=1.0",
]
RUNS = {
    "reference": (),
    "chunk": ("engine=chunk", "chunk.size=128"),
    "untied": ("model.tie_embeddings=false",),
}


def _engine_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The model's weights as the engine holds them after training (a collective on a
    sharded or plan engine: every rank calls it); a runtime on stages: this rank's stages'."""
    if isinstance(engine, PipelineRuntime):
        return {name: value.cpu() for name, value in engine.model_state_dict().items()}
    return {
        name: value.detach().float().cpu() for name, value in engine.state_dict()["model"].items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny two-step run per case, checkpoints at steps 1 and 2; beside each run folder,
    the weights its engine held at the end."""
    root = tmp_path_factory.mktemp("export-runs")
    for name, extra in RUNS.items():
        trainer = Trainer("tiny", [*COMMON, f"run_dir={root / name}", *extra])
        trainer.fit()
        torch.save(_engine_weights(trainer.engine), root / f"{name}.trained.pt")
    return {name: root / name for name in RUNS}


def _trained_model(run_dir: Path, step: int) -> GPT:
    """The run's model with the weights of checkpoint ``step``, as the trainer left them."""
    config = export_module.run_model_config(run_dir)
    model = build_gpt(config, seed=123)  # a different init: every weight must come from the file
    model.load_state_dict(load_model_state(dict(list_checkpoints(run_dir))[step]), strict=True)
    return model.eval()


def _batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(vocab_size, (3, 40), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------------
# the safetensors writer and reader against the reference package


def test_safetensors_writer_and_reader_agree_with_the_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).bfloat16(),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(5, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6).t(),  # not contiguous: written row-major all the same
    }
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata={"format": "pt", "note": "x"})
    loaded = st.load_file(ours)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert read_safetensors_metadata(ours) == {"format": "pt", "note": "x"}
    assert int.from_bytes(ours.read_bytes()[:8], "little") % 8 == 0  # the header is padded

    theirs = tmp_path / "theirs.safetensors"
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata={"k": "v"})
    back = read_safetensors(theirs)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert read_safetensors_metadata(theirs) == {"k": "v"}


def test_reader_rejects_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.randn(8)})
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="bad data_offsets"):
        read_safetensors(path)


# ---------------------------------------------------------------------------------------------
# exports of trained runs


@pytest.mark.parametrize("case", RUNS)
def test_export_round_trips_to_pytorch_and_hugging_face(runs: dict[str, Path], case: str) -> None:
    run_dir = runs[case]
    out = export_run(run_dir)
    assert out == run_dir / "export" / "step_00000002"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    info = export_info(out)
    config = GPTConfig(**info["model"])
    tied = case != "untied"
    assert config.tie_embeddings is tied
    assert info["step"] == 2 and info["hf_skipped"] is None
    assert Path(info["source_checkpoint"]) == (run_dir / "checkpoints" / "step_00000002").resolve()
    assert info["tied"] == ([["tok_embed.weight", "lm_head.weight"]] if tied else [])
    trained = _trained_model(run_dir, 2)
    batch = _batch(config.vocab_size)
    with torch.no_grad():
        expected = trained(batch)

    # (a) plain PyTorch: tidal's names, tied weights under both names, a strict load.
    tensors = read_safetensors(out / "model.safetensors")
    assert tensors.keys() == trained.state_dict().keys()
    assert "lm_head.weight" in tensors and "tok_embed.weight" in tensors
    model = build_gpt(config, seed=99)
    model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        assert torch.equal(model.eval()(batch), expected)

    # (d) the safetensors package reads the same tensors.
    st = pytest.importorskip("safetensors.torch")
    for name, tensor in st.load_file(out / "model.safetensors").items():
        assert torch.equal(tensor, tensors[name]), name

    # (b) Hugging Face GPT-2 from the hf/ folder.
    transformers = pytest.importorskip("transformers")
    hf_config = json.loads((out / "hf" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is tied and hf_config["n_inner"] == config.ffn_dim
    hf_tensors = st.load_file(out / "hf" / "model.safetensors")
    assert ("lm_head.weight" in hf_tensors) is not tied
    assert hf_tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: [in, out]
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        hf_logits = hf_model(batch).logits
    torch.testing.assert_close(hf_logits, expected, atol=1e-5, rtol=0)
    if not tied:
        assert not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight)

    lines = check_export(out)
    assert any("equal to" in line for line in lines) and any(
        "GPT2LMHeadModel" in line for line in lines
    )
    _assert_exports_the_trained_weights(out, torch.load(run_dir.parent / f"{case}.trained.pt"))


def _assert_exports_the_trained_weights(out: Path, trained: dict[str, torch.Tensor]) -> None:
    """Every exported tensor is the engine's own after training, bit for bit; a name the engine
    does not list is a tied one, equal to the weight it is tied to."""
    exported = read_safetensors(out / "model.safetensors")
    aliases = {name: group[0] for group in export_info(out)["tied"] for name in group[1:]}
    assert set(trained) <= set(exported) and set(exported) - set(trained) <= set(aliases)
    for name, tensor in exported.items():
        want = trained[name] if name in trained else trained[aliases[name]]
        assert torch.equal(tensor, want.reshape(tensor.shape)), name


# ---------------------------------------------------------------------------------------------
# every engine on several ranks: one spawn of 2 ranks trains them all


def _plan_for_two_ranks() -> Any:
    from tidal.models import preset
    from tidal.models.gpt import measure_gpt
    from tidal.planner import ClusterSpec, PlannerConfig, make_plan

    graph = measure_gpt(preset("tiny"), micro_batch=1)
    # tp 2: the fused qkv's rows are reordered in the plan's layout; the export must not be.
    config = PlannerConfig(pipelines=False, tp=2, eps=10.0, pareto=(), baselines=())
    return make_plan(graph, ClusterSpec(devices=2), config).plan


MULTI_RANK = {
    "chunk-2-ranks": ("engine=chunk", "chunk.size=128"),
    "plan": (),
    "pipeline": ("pipeline.stages=2", "pipeline.microbatches=2"),
}


def _train_on_each_rank(root: str, plan: Any) -> dict[str, dict[str, torch.Tensor]]:
    weights = {}
    for name, extra in MULTI_RANK.items():
        overrides = [*COMMON, f"run_dir={Path(root) / name}", *extra]
        trainer = Trainer("tiny", overrides, plan=plan if name == "plan" else None)
        trainer.fit()
        weights[name] = _engine_weights(trainer.engine)
    return weights


def test_every_multi_rank_engine_exports_its_trained_weights(tmp_path: Path) -> None:
    """ZeRO-3 chunks, a tensor-parallel plan and a two-stage pipeline all write the one
    checkpoint format: `tidal export` gives the model each trained, whatever the layout."""
    ranks = run_on_ranks(_train_on_each_rank, world_size=2, args=(str(tmp_path), _plan_for_two_ranks()),
                         timeout_s=300)  # fmt: skip
    for name in MULTI_RANK:
        run_dir = tmp_path / name
        trained = {**ranks[1][name], **ranks[0][name]}  # a pipeline's stages: one per rank
        out = export_run(run_dir, out=tmp_path / f"{name}-export")
        _assert_exports_the_trained_weights(out, trained)
        assert any("equal to" in line for line in check_export(out)), name


def test_export_of_an_earlier_step_into_an_empty_folder(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "step1"
    out.mkdir()  # an existing empty folder is fine
    assert export_run(runs["reference"], step=1, out=out) == out
    model = build_gpt(GPTConfig(**export_info(out)["model"]))
    model.load_state_dict(read_safetensors(out / "model.safetensors"), strict=True)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model.eval()(batch), _trained_model(runs["reference"], 1)(batch))
        assert not torch.equal(model(batch), _trained_model(runs["reference"], 2)(batch))


def test_a_failed_write_leaves_no_folder(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(*args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "write_safetensors", full_disk)
    with pytest.raises(OSError, match="No space"):
        export_run(runs["reference"], out=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_model_gpt2_cannot_express_gets_no_hf_folder(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend GPT-2 had no place for dropout, and the run had set it.
    monkeypatch.setattr(
        export_module, "_HF_EXPRESSIBLE", export_module._HF_EXPRESSIBLE - {"dropout"}
    )
    monkeypatch.setattr(
        export_module, "run_model_config", lambda run_dir: GPTConfig(
            vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=64, dropout=0.1
        ),
    )  # fmt: skip
    out = export_run(runs["reference"], out=tmp_path / "out")
    assert not (out / "hf").exists()
    assert "dropout=0.1" in export_info(out)["hf_skipped"]
    assert "not written" in check_export(out)[-1]


def test_untied_biasless_gpt_with_its_own_ffn_matches_hugging_face() -> None:
    # The ModelConfig of a run cannot switch biases off; the conversion itself can.
    transformers = pytest.importorskip("transformers")
    config = GPTConfig(
        vocab_size=97, seq_len=24, num_layers=2, num_heads=2, d_model=32, d_ff=48,
        bias=False, tie_embeddings=False, layer_norm_eps=1e-6,
    )  # fmt: skip
    model = build_gpt(config, seed=3).eval()
    with torch.no_grad():  # LayerNorm weights of 1 would hide a transposed or misplaced tensor
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    hf_state = to_hf_gpt2(model.state_dict(), config)
    assert torch.equal(hf_state["transformer.h.1.mlp.c_fc.bias"], torch.zeros(48))
    hf_config = transformers.GPT2Config(**export_module.hf_gpt2_config(config))
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    hf_model.load_state_dict(hf_state, strict=True)
    batch = torch.randint(97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(batch).logits, model(batch), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# the command line


def test_cli_export_prints_what_it_wrote_and_checks_it(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert main(["export", str(runs["chunk"]), "--step", "1", "--out", str(out), "--check"]) == 0
    printed = capsys.readouterr().out
    assert f"exported step 1 of {runs['chunk']}: 120,576 parameters" in printed
    assert "model.safetensors" in printed and "hf/config.json" in printed and "KiB" in printed
    assert "check: hf/: GPT2LMHeadModel logits within" in printed


@pytest.mark.parametrize(
    ("case", "args", "fragment"),
    [
        ("no-config", (), "has no config.json"),
        ("no-checkpoints", (), "checkpoint.at_end"),
        ("reference", ("--step", "7"), "no checkpoint of step 7"),
        ("reference", ("--out", "{tmp}"), "already exists and is not empty"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    runs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    args: tuple[str, ...],
    fragment: str,
) -> None:
    run_dir = runs.get(case, tmp_path / case)
    if case not in runs:
        run_dir.mkdir()
    if case == "no-checkpoints":
        (run_dir / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}}))
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file").touch()
    args = tuple(a.replace("{tmp}", str(tmp_path / "occupied")) for a in args)
    assert main(["export", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidal: error: ") and fragment in err[0], err
    if "--step" in args:
        assert "(available: 1, 2)" in err[0]


def test_cli_export_of_an_old_format_names_it_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of an older tidal (format 1: torch.save files, a pipeline's stage files)."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}}))
    folder = tmp_path / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    (folder / "stage-0.pt").write_bytes(b"old")
    (folder / "meta.json").write_text(json.dumps({"format_version": 1, "step": 2}))
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tidal: error: checkpoint: "), err
    assert "format 1" in err[0] and "the tidal that wrote it" in err[0]


def test_cli_no_checkpoint_in_a_subprocess(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}}))
    result = subprocess.run(
        [sys.executable, "-m", "tidal", "export", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoints in" in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_library_errors_name_the_argument(runs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        export_run(runs["reference"], step=3)
    assert err.value.key == "step"
