"""docs/ARCHITECTURE.md stays a map of the repository: every path it names exists, every link of
its contents lands on a heading, and every citation of it from the code names a heading it has.

A citation reads `ARCHITECTURE, "Section name"` (also accepted: `docs/ARCHITECTURE.md, "Section
name"`, `ARCHITECTURE.md ("Section name")`, `ARCHITECTURE.md#anchor`), the name being a heading's
text exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"
# The top-level folders a path named in the doc starts from.
TOP_LEVEL = ("api", "bench", "clients", "deploy", "docker", "docs", "launch", "migrations", "scheduler",
             "sluice", "tests", "workers")
SCANNED_SUFFIXES = {".py", ".md", ".lua", ".toml", ".yaml", ".yml", ".js", ".html", ".css", ".cfg", ".ini", ".sh"}
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "artifacts", "results", "build", "dist"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(rf"^(?:{'|'.join(TOP_LEVEL)})/[A-Za-z0-9_./-]*$")
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.MULTILINE)
CONTENTS_LINK = re.compile(r"\]\(#([^)]+)\)")
# A quoted name after ARCHITECTURE[.md], past a comma, an opening parenthesis or a line break
# (a comment's `#` or a docstring's indentation included).
CITED_NAME = re.compile(r"ARCHITECTURE(?:\.md)?[ \t]*(?:,|\()?[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?\"([^\"\n]+)\"")
CITED_ANCHOR = re.compile(r"ARCHITECTURE\.md#([A-Za-z0-9_-]+)")


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _headings(text: str) -> list[str]:
    return [match.group(2) for match in HEADING.finditer(_without_code_blocks(text))]


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, code marks and punctuation dropped, spaces
    as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def named_paths(text: str) -> list[str]:
    """Repository paths in backticks: `sluice/wire/streams.py`, `api/static/`, and a test's file
    in `tests/x.py::test_y`."""
    found: list[str] = []
    for span in CODE_SPAN.findall(text):
        path = span.split("::", 1)[0].rstrip(",.;:")
        if REPO_PATH.match(path) and path not in found:
            found.append(path)
    return found


def _scanned_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        relative = path.relative_to(REPO)
        if any(part in SKIPPED_DIRS or part.startswith(".") for part in relative.parts[:-1]):
            continue
        if path.suffix in SCANNED_SUFFIXES and path.is_file() and path not in (DOC, Path(__file__).resolve()):
            files.append(path)
    return sorted(files)


def citations() -> list[tuple[str, str]]:
    """Every (file, cited section name or #anchor) in the repository outside the doc itself."""
    cited: list[tuple[str, str]] = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if "ARCHITECTURE" not in text:
            continue
        where = str(path.relative_to(REPO))
        cited.extend((where, name) for name in CITED_NAME.findall(text))
        cited.extend((where, f"#{name}") for name in CITED_ANCHOR.findall(text))
    return cited


def test_the_doc_says_how_to_cite_it() -> None:
    assert 'Code cites a section as `ARCHITECTURE, "Section name"`' in _doc()


def test_headings_are_unique() -> None:
    headings = _headings(_doc())
    assert sorted({h for h in headings if headings.count(h) > 1}) == []


def test_every_contents_link_lands_on_a_heading() -> None:
    anchors = {anchor(heading) for heading in _headings(_doc())}
    assert sorted(set(CONTENTS_LINK.findall(_doc())) - anchors) == []


def test_the_doc_names_no_issue_numbers() -> None:
    doc = _doc()
    assert not re.search(r"DESIGN §|\bissue (?:item )?\d+", doc)


@pytest.mark.parametrize("path", named_paths(_doc()))
def test_every_path_the_doc_names_exists(path: str) -> None:
    assert (REPO / path).exists(), f"docs/ARCHITECTURE.md names `{path}`, which is not in the repository"


def test_citations_are_found() -> None:
    # The scanner itself: the README cites two sections in two of the accepted forms.
    assert {name for where, name in citations() if where == "README.md"} >= {"Precision per host", "Redis Cluster"}


@pytest.mark.parametrize(("where", "name"), citations())
def test_every_citation_names_a_heading(where: str, name: str) -> None:
    headings = _headings(_doc())
    if name.startswith("#"):
        assert name[1:] in {anchor(heading) for heading in headings}, f"{where} links to a missing {name}"
    else:
        assert name in headings, f'{where} cites ARCHITECTURE, "{name}", which is no heading of it'
