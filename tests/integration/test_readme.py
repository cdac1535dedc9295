"""The README's library examples run as they are written (issue 17: its snippet used names it
never defined)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _library_blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Library") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_library_examples_run_and_the_chunks_move() -> None:
    own_model, gpt = _library_blocks()[:2]
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(own_model, "README.md (own model)", "exec"), namespace)
        exec(compile(gpt, "README.md (GPT)", "exec"), namespace)
    steps, evictions = map(int, out.getvalue().split())
    assert steps == 2 and evictions > 0  # what the comment in the example says
    assert float(namespace["loss"].item()) > 0  # type: ignore[attr-defined]
