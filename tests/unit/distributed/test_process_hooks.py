"""The library takes no process-wide hook; only a program opts in ([Note: watchdog opt-in])."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Records the hooks before tidal is first imported, so an import-time install is caught too.
_SCRIPT = textwrap.dedent(
    """
    import signal, sys

    before = (signal.getsignal(signal.SIGINT), sys.excepthook)
    import torch
    import tidal
    from tidal.models import build_gpt, preset

    engine = tidal.initialize(build_gpt(preset("tiny")), {"training": {"device": "cpu"}})
    tokens = torch.zeros(2, 8, dtype=torch.long)
    engine.backward(engine(tokens, tokens))
    engine.step()
    after = (signal.getsignal(signal.SIGINT), sys.excepthook)
    assert after == before, (before, after)
    print("ok")
    """
)


def test_importing_tidal_and_building_an_engine_takes_no_process_hook() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
