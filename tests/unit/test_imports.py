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
