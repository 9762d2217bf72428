"""Every relative link in README.md and docs/*.md names a file that exists in the repository,
so the documents work in a clone (not only on a web page that rewrites links)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# [text](target) with an optional "title"; images too. Code spans are dropped first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:", "#")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Targets of the markdown links in `text` that point into the repository."""
    return [t for t in LINK.findall(CODE.sub("", text)) if not t.startswith(EXTERNAL)]


def test_relative_links_are_found_outside_code():
    text = "see [a](docs/A.md) and [b](https://x.org) `[c](no.md)` [d](#top) ![e](img/e.png \"t\")"
    assert relative_links(text) == ["docs/A.md", "img/e.png"]


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    missing = [t for t in relative_links(doc.read_text(encoding="utf-8"))
               if not (doc.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_links_the_design_document():
    assert "docs/DESIGN.md" in relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
