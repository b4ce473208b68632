"""The repository explains itself: nothing in it points outside it, and its docs' links hold.

A clone holds only what git tracks, so a file that sends the reader to a folder beside
the repository, or to a design page it does not contain, sends them nowhere. And a
relative link in the README or `docs/` that names a file no longer there is the same
dead end, found later.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Paths a clone does not have: the folder beside the repository and its design page.
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md")
# `[text](target)` and `[text]: target`, not inside code; an address with a scheme, a
# mail link and an anchor of the same page are not files.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
NOT_A_FILE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def tracked() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(markdown: str) -> list[str]:
    """The link targets of `markdown` outside code blocks and code spans."""
    prose = CODE.sub("", FENCE.sub("", markdown))
    return [inline or reference for inline, reference in LINK.findall(prose)]


def test_no_tracked_file_points_outside_the_repository() -> None:
    this = Path(__file__).resolve()
    found = []
    for path in tracked():
        if path.resolve() == this or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "these lines send the reader outside the repository:\n" + "\n".join(found)


def test_the_docs_exist() -> None:
    for name in ("architecture.md", "operations.md", "reference.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"
    assert list((ROOT / "docs" / "decisions").glob("0001-*.md")), "no decision records"


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file(document: Path) -> None:
    broken = []
    for target in links(document.read_text(encoding="utf-8")):
        if NOT_A_FILE.match(target):
            continue
        path = target.split("#", 1)[0]
        if not (document.parent / path).resolve().exists():
            broken.append(target)
    assert broken == [], f"{document.relative_to(ROOT)} links to files that do not exist"


def test_the_readme_points_to_the_docs() -> None:
    assert "](docs/" in (ROOT / "README.md").read_text(encoding="utf-8")


# The README is the first screen a newcomer reads: what agentbus is, how to start it and
# where to read next. Detail belongs in `docs/`, where it has room and a place.
README_MOST_LINES = 160


def test_the_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MOST_LINES}: move detail to docs/"
    )


def test_the_link_finder_finds_links_and_skips_code() -> None:
    sample = (
        "See [the docs](docs/a.md) and [site](https://x.org), [here](#top).\n"
        "`[not](a.md)`\n```\n[nor](b.md)\n```\n[ref]: c/d.md\n"
    )
    assert links(sample) == ["docs/a.md", "https://x.org", "#top", "c/d.md"]
