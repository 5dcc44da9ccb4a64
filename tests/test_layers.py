"""The layers import one way (docs/architecture.md, 'Layers'): read every import statement of the
product code, wherever it sits (module top, function body, TYPE_CHECKING block), and check that
no module imports a layer above its own or a sibling beside it, and that no modules import each
other in a circle. There is no list of exceptions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's sources live: sim/, kernels/ and analysis/ sit at the top of the
# repository and install as zipage.sim, zipage.kernels and zipage.analysis (pyproject.toml).
SOURCES = {"zipage": "zipage", "zipage.sim": "sim", "zipage.kernels": "kernels",
           "zipage.analysis": "analysis"}
REMAPPED = {"sim", "kernels", "analysis"}

# Lowest first. A module may import its own layer and any layer of a lower rank; layers of one
# rank are siblings and import neither each other (kernels and core; the simulator and the
# engine).
LAYERS = {
    "foundation": 0,  # zipage/*.py: errors, config, shape, presets, hardware, trace, rundir, ...
    "kernels": 1,
    "core": 1,
    "sim": 2,
    "engine": 2,
    "analysis": 3,
    "serve": 4,  # the server, and the package's public API (`zipage.LLM`)
    "cli": 5,
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module == "zipage":
        return "serve"
    if len(parts) == 2 and (ROOT / "zipage" / f"{parts[1]}.py").is_file():
        return "foundation"
    return parts[1]


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in SOURCES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            relative = path.relative_to(ROOT / directory).with_suffix("").parts
            if relative[-1] == "__init__":
                relative = relative[:-1]
            found[".".join((package, *relative))] = path
    return found


MODULES = modules()


def resolve(name: str) -> str | None:
    """The product module an imported name lands in (None: not ours)."""
    head, _, rest = name.partition(".")
    if head in REMAPPED:
        name = f"zipage.{name}"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path) -> list[tuple[int, str, str]]:
    """(line, name as written, module it resolves to) for every import of a product module."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # `from package import submodule` imports the submodule.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name)
            if target is not None and target != module:
                found.append((node.lineno, name, target))
    return found


GRAPH = {module: imports(module, path) for module, path in MODULES.items()}


def test_the_graph_is_read():
    """The reader sees the imports it must judge (a broken reader passes everything)."""
    assert len(MODULES) > 80
    targets = {target for module in ("zipage.cli.parser", "zipage.engine.runner")
               for _, _, target in GRAPH[module]}
    assert {"zipage.cli.replay", "zipage.engine.sampler", "zipage.kernels.attention"} <= targets
    # the judge itself: an upward edge and a sibling edge are refused
    assert not allowed("zipage.core.scheduler", "zipage.sim.simulator")
    assert not allowed("zipage.sim.simulate", "zipage.engine.llm")
    assert not allowed("zipage.kernels.compress_ref", "zipage.core.scheduler")
    assert allowed("zipage.engine.runner", "zipage.kernels.attention")


def allowed(source: str, target: str) -> bool:
    mine, theirs = layer_of(source), layer_of(target)
    return mine == theirs or LAYERS[theirs] < LAYERS[mine]


def test_every_module_has_a_layer():
    unknown = sorted({layer_of(module) for module in MODULES} - set(LAYERS))
    assert not unknown, f"packages without a layer: {unknown}; add them to LAYERS and to " \
                        "docs/architecture.md, 'Layers'"


def test_no_import_goes_up_or_sideways():
    wrong = [f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({layer_of(module)}) imports "
             f"{name} ({layer_of(target)})"
             for module, edges in GRAPH.items() for line, name, target in edges
             if not allowed(module, target)]
    assert not wrong, "\n".join(wrong)


def test_product_code_names_the_installed_packages():
    """`import sim...` works from a checkout's root only; installed, the package is zipage.sim."""
    bare = [f"{MODULES[module].relative_to(ROOT)}:{line}: {name}"
            for module, edges in GRAPH.items() for line, name, _ in edges
            if name.partition(".")[0] in REMAPPED]
    assert not bare, "\n".join(bare)


def test_no_circles():
    circles = strongly_connected({module: {target for _, _, target in edges}
                                  for module, edges in GRAPH.items()})
    assert not circles, "modules that import each other:\n" + "\n".join(
        " <-> ".join(sorted(circle)) for circle in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("graph, circles", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [{"a", "b"}]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_circle_finder(graph, circles):
    assert strongly_connected(graph) == circles
