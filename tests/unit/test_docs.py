"""README.md and docs/*.md: every link they make reaches a file (and a heading or anchor in it),
the README stays short enough to read in five minutes, and figures link to their runs, not to a
hand-kept table of claims."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)"></a>', text))
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", text).splitlines():
        if line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def links(path: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", path.read_text()))
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_its_file_and_anchor(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such anchor in {path.name})")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_a_doc_names_is_in_the_tree(doc: Path) -> None:
    """Runs that later runs replaced leave the tree (``tidal bench report --prune``); a doc
    names only those that stay, in a link or in code."""
    named = set(re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png|md))", doc.read_text()))
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / "results" / n).exists())
    assert not missing, f"{doc.name} names results no longer in the tree: {missing}"


def test_the_readme_reads_in_five_minutes_and_no_doc_keeps_a_claims_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make run" in "".join(readme.splitlines(True)[:20])
    assert "make test" in "".join(readme.splitlines(True)[:20])
    for doc in DOCS:
        assert "claims.md" not in doc.read_text(), doc.name
        assert "not a claim" not in doc.read_text(), doc.name
    assert not (ROOT / "docs" / "claims.md").exists()
