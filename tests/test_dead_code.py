"""Code nothing uses is code nobody tests: every user-facing error class is raised somewhere, and
every property of the core's data classes is read somewhere outside its definition."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import zipage.errors

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [path for folder in ("zipage", "sim", "analysis", "bench", "kernels", "tests")
           for path in (ROOT / folder).rglob("*.py") if ".venv" not in path.parts]


def _text_without(path: Path) -> str:
    return "\n".join(source.read_text() for source in SOURCES if source != path)


def test_every_error_class_is_raised_or_subclassed():
    text = "\n".join(source.read_text() for source in SOURCES
                     if source.name != "errors.py" and source.parent.name != "tests")
    for name, value in vars(zipage.errors).items():
        if isinstance(value, type) and issubclass(value, zipage.errors.ZipageError) \
                and name != "ZipageError":
            assert re.search(rf"\b{name}\(", text), f"errors.py: {name} is never raised"


def test_every_core_property_is_read_somewhere():
    for path in sorted((ROOT / "zipage" / "core").glob("*.py")):
        tree = ast.parse(path.read_text())
        others = _text_without(path)
        own = path.read_text()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(decorator, ast.Name) and decorator.id == "property"
                    for decorator in node.decorator_list):
                uses = len(re.findall(rf"\.{node.name}\b", own)) + len(
                    re.findall(rf"\.{node.name}\b", others))
                assert uses, f"{path.relative_to(ROOT)}: property {node.name} is never read"
