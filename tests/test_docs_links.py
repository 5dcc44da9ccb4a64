"""The docs stand on their own: every relative link in README.md and docs/ resolves (file and
heading anchor), and no file of the repository cites a design document outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
# Built from pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ("DESIGN" + ".md", "../" + "shared")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1."""
    lines, in_code = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            lines.append((number, line))
    return lines


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for _, line in _prose_lines(path) if line.startswith("#")}


def _links(path: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in _prose_lines(path)
            for target in LINK.findall(line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for number, target in _links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{doc.name}:{number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{doc.name}:{number}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_doc_is_reachable_from_the_docs_map():
    """docs/README.md (directly, or through BENCHMARKS.md for results) links every page."""
    reachable, frontier = set(), [ROOT / "docs" / "README.md"]
    while frontier:
        page = frontier.pop()
        if page in reachable:
            continue
        reachable.add(page)
        for _, target in _links(page):
            file_part = target.partition("#")[0]
            linked = (page.parent / file_part).resolve()
            if file_part.endswith(".md") and linked.exists():
                frontier.append(linked)
    missing = [str(path.relative_to(ROOT)) for path in DOCS[1:] if path not in reachable]
    assert not missing, f"pages no link reaches from docs/README.md: {missing}"


def _repository_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
        return [ROOT / name for name in listed]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist)
        skip = {".git", "__pycache__", "build", "dist"}
        return [path for path in ROOT.rglob("*") if path.is_file()
                and not skip & set(path.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in path.parts)]


def test_no_file_cites_a_design_document_outside_the_repository():
    citing = []
    for path in _repository_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if any(reference in line for reference in OUTSIDE_REFERENCES):
                citing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not citing, ("cite docs/architecture.md instead:\n" + "\n".join(citing))


def test_architecture_lists_every_knob():
    """The knob table of docs/architecture.md ('Terms and knobs') names every declared knob and
    its flag, so a knob added to `ZipageConfig` is documented there too."""
    from zipage.config import ZipageConfig

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| `")}
    missing = [f"{knob.name} ({knob.metadata['flag']})" for knob in ZipageConfig.knobs()
               if f"`{knob.name}`" not in rows
               or f"`{knob.metadata['flag']}`" not in rows[f"`{knob.name}`"]]
    assert not missing, f"add a row to docs/architecture.md, 'Terms and knobs': {missing}"
