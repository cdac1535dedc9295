"""The library imports with torch, numpy and scipy alone (a GPU box's preinstalled torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK_OPTIONAL = textwrap.dedent(
    """
    import sys

    # None in sys.modules reads as "not installed" to both import and importlib's find_spec.
    for name in ("rich", "matplotlib", "transformers", "pytest", "hypothesis"):
        sys.modules[name] = None
    import tidal, tidal.train, tidal.models, tidal.data, tidal.testing, benchmarks
    from tidal.models import build_gpt, preset
    engine = tidal.initialize(build_gpt(preset("tiny")), {"training": {"device": "cpu"}})
    assert engine.stats()["global_step"] == 0
    print("ok")
    """
)


def test_library_needs_no_optional_package() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_OPTIONAL], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


_LOADED_BY_TRAIN = textwrap.dedent(
    """
    import sys
    import tidal.cli.main, tidal.train.build, tidal.train.trainer
    from tidal.models import build_gpt, preset
    tidal.initialize(build_gpt(preset("tiny")), {"engine": "chunk", "training": {"device": "cpu"}})
    assert tidal.cli.main.main(["train", "--recipe", "tiny", "--set", "training.stepz=3"]) == 2
    print(sorted(m for m in ("scipy", "tidal.planner", "torch.distributed.checkpoint",
                             "torch._dynamo", "sympy") if m in sys.modules))
    """
)


def test_the_train_path_loads_neither_the_planner_nor_dcp() -> None:
    """Every tidal process and rank pays for what the CLI's train path imports: the planner
    (scipy, about a second) loads for plans, DCP (DTensor, another second) for checkpoints, and
    building a GPT loads neither torch._dynamo (about 3 s) nor sympy (about 1 s); see
    ``_embedding`` and ``build_gpt`` in models/gpt.py."""
    result = subprocess.run(
        [sys.executable, "-c", _LOADED_BY_TRAIN], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
