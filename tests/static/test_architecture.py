"""The layout is the architecture (docs/architecture.md): the import-linter
contracts in pyproject.toml, no import cycles, the package list that
pyproject installs, lazy build/cloud imports in the CLI, and file and
folder sizes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"cosyedge_daemon": "daemon", "cosyedge_models": "models", "cosyedge_build": "edge_build",
           "cosyedge_cloud": "cloud_bridge"}


def test_import_contracts_hold() -> None:
    result = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph.modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*FOLDERS, exclude_type_checking_imports=True)
    # a package's __init__ importing its own modules is no cycle of roles
    for module in list(graph.modules):
        for imported in list(graph.find_modules_directly_imported_by(module)):
            if imported.startswith(module + "."):
                graph.remove_import(importer=module, imported=imported)
    assert _cycles(graph) == []


def test_pyproject_installs_every_package_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == FOLDERS
    on_disk = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).as_posix()
            on_disk.add(name if rel == "." else f"{name}.{rel.replace('/', '.')}")
    assert set(config["packages"]) == on_disk


def _lazy_only(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    """Imports of `forbidden` packages at module level (outside any function)."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue  # for annotations only, never imported at run time
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                else ():
            names = [a.name for a in sub.names] if isinstance(sub, ast.Import) else \
                [sub.module or ""] if isinstance(sub, ast.ImportFrom) else []
            bad += [f"{path.name}: {n}" for n in names if n.startswith(forbidden)]
    return bad


def test_cli_reaches_build_and_cloud_sides_lazily() -> None:
    """`cosyedge run` on a board without the build extra must not import the
    build side (torch) or the bridge (tritonclient) at all."""
    bad = []
    for path in sorted((ROOT / "daemon" / "cli").glob("*.py")):
        bad += _lazy_only(path, ("cosyedge_build", "cosyedge_cloud.bridge", "cosyedge_cloud.triton",
                                 "cosyedge_cloud.tools"))
    assert bad == []


def test_files_and_folders_stay_small() -> None:
    too_long = []
    crowded = []
    for folder in FOLDERS.values():
        for path in (ROOT / folder).rglob("*.py"):
            if "model_repository" in path.parts:
                continue
            n = len(path.read_text().splitlines())
            if n >= 500:
                too_long.append(f"{path.relative_to(ROOT)}: {n} lines")
        for d in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            modules = [p for p in d.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > 22:
                crowded.append(f"{d.relative_to(ROOT)}: {len(modules)} modules")
    assert too_long == [] and crowded == []


def test_no_code_uses_the_folder_names_as_import_names() -> None:
    """The folders are importable from a checkout's root by their bare names;
    code that did so would load a second copy of a module beside the
    installed `cosyedge_*` one."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+(daemon|models|edge_build|cloud_bridge)(\.|\s|$)", re.M)
    bad = []
    for folder in [*FOLDERS.values(), "tests"]:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            bad += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in pattern.finditer(text)]
    assert bad == []
