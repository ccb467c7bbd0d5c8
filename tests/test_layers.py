"""The package tree is the pipeline: every import inside loracc/ goes down the layers, never up.

    ir (and the base: errors, _compat, disk, options) ← capture | passes | codegen | quant ← pipeline
    ← runtime ← frontend ← api ← tools | training ← loracc/__init__.py (the public names)

Every module is parsed with ``ast`` (not imported); module-level and function-level imports both
count, ``if TYPE_CHECKING:`` ones too. Modules of one layer may import each other.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "loracc"

LAYERS = {
    "_compat": 0, "errors": 0, "disk": 0, "options": 0, "ir": 0,
    "capture": 1, "passes": 1, "codegen": 1, "quant": 1,
    "pipeline": 2,
    "runtime": 3,
    "frontend": 4,
    "api": 5,
    "tools": 6, "training": 6,
}
TOP = max(LAYERS.values()) + 1  # loracc/__init__.py: imports from every layer, imported by none

# (importing module, imported module) pairs that may go up a layer, each with the reason it must.
# Empty: keep it so.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The layer of a ``loracc...`` module: that of its first component below ``loracc``."""
    parts = module.split(".")
    if parts == ["loracc"]:
        return TOP
    return LAYERS[parts[1]]


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(module: str, is_package: bool, source: str) -> list[tuple[int, str]]:
    """``(line, loracc module)`` for every import of a loracc module in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "loracc"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "loracc":
                continue
            for alias in node.names:  # ``from . import x``: x may be a module of the package
                found.append((node.lineno, f"{target}.{alias.name}" if _exists(f"{target}.{alias.name}") else target))
    return found


def upward_imports(module: str, is_package: bool, source: str, where: str) -> list[str]:
    problems = []
    for line, target in imported_modules(module, is_package, source):
        if layer(target) > layer(module) and (module, target) not in ALLOWED:
            problems.append(f"{where}:{line}: {module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    return problems


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unknown = [str(p.relative_to(PACKAGE.parent)) for p in _modules()
               if module_name(p) != "loracc" and module_name(p).split(".")[1] not in LAYERS]
    assert not unknown, f"modules in no layer (add their folder or name to LAYERS): {unknown}"


def test_imports_only_go_down_the_layers():
    problems = []
    for path in _modules():
        problems += upward_imports(module_name(path), path.name == "__init__.py", path.read_text(),
                                   str(path.relative_to(PACKAGE.parent)))
    assert not problems, "imports going up a layer:\n" + "\n".join(problems)


def test_the_allow_list_names_only_upward_imports_that_exist():
    present = {(module_name(p), t) for p in _modules()
               for _, t in imported_modules(module_name(p), p.name == "__init__.py", p.read_text())}
    assert set(ALLOWED) <= present


@pytest.mark.parametrize("module, source", [
    ("loracc.passes.remat", "from ..runtime.region import Region\n"),
    ("loracc.codegen.triton_backend", "def f():\n    from ..runtime import cuda_graphs\n"),
    ("loracc.ir.ops", "import loracc.quant.nf4\n"),
    ("loracc.capture.trace", "from .. import pipeline\n"),
    ("loracc.training.io", "import loracc\n"),
])
def test_the_check_sees_an_upward_import(module, source):
    assert upward_imports(module, False, source, "planted.py")


def test_the_check_lets_downward_and_same_layer_imports_pass():
    assert not upward_imports("loracc.runtime.region", False, "from ..pipeline import Program\nfrom . import verify\n", "x")
    assert not upward_imports("loracc.passes.remat", False, "from ..quant import RECOMPUTABLE\nfrom .. import _compat\n", "x")


def test_pyproject_ships_every_subpackage():
    """A subpackage missing from ``[tool.setuptools] packages`` works in a checkout and is absent
    from an installed wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    repo = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(repo).parts) for p in (repo / "loracc").rglob("__init__.py")}
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def _repo_import_graph(repo: Path):
    """``{module: modules it imports}`` over the repo's packages (run-time imports: a parent package
    is implied by its submodules and not counted)."""

    def exists(name: str) -> bool:
        path = repo / name.replace(".", "/")
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    edges: dict[str, set[str]] = {}
    for root in ("loracc", "benchmarks", "examples", "tests"):
        for path in (repo / root).rglob("*.py"):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            package = parts[:-1]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            found = edges.setdefault(name, set())
            for node in ast.walk(ast.parse(path.read_text())):
                targets = []
                if isinstance(node, ast.ImportFrom):
                    base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                    source = ".".join(x for x in (base, node.module or "") if x)
                    targets = [f"{source}.{a.name}" if exists(f"{source}.{a.name}") else source for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                found.update(t for t in targets if exists(t) and t != name and not name.startswith(t + "."))
    return edges


def test_no_import_circle_anywhere_in_the_repo():
    import networkx as nx

    graph = nx.DiGraph([(a, b) for a, targets in _repo_import_graph(PACKAGE.parent).items() for b in targets])
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import circles: {cycles[:5]}"
