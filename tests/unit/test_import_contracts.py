"""The map of the code, enforced: import-linter's contracts (.importlinter at the repository root) hold,
every top-level module of the package has its place in them, the graph they are checked on includes the
imports inside functions, and no class overrides another module's private method."""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import batch_inference

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".importlinter"
PACKAGE = Path(batch_inference.__file__).parent

# What is not the core: the Airflow shells, the CLI and the UI (above it), the adapters and the
# capability folders (each with its contract), and the package data.
SHELLS = {"operators", "sensors", "triggers", "hooks", "callbacks", "airflow_fixes", "commands", "cli", "ui"}
ADAPTERS = {"sources", "destinations", "hosted", "engines", "lakehouse"}
CAPABILITIES = {"estimate", "ladder", "embed", "harness", "regions", "tiers"}
DATA = {"data"}


def _contracts() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    return parser


def _listed(section: str, key: str) -> set[str]:
    return set(_contracts()[section][key].split())


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), str(CONFIG), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and ", 0 broken." in done.stdout, done.stdout[-3000:]


def test_every_top_level_module_has_its_place_on_the_map():
    """A new top-level module is either core (named in both core contracts) or one of the kinds above;
    a new folder is a shell, an adapter or a capability with its own contract."""
    top = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    core = {m.split(".", 1)[1] for m in _listed("importlinter:contract:core-below-shells", "source_modules")
            if m.startswith("batch_inference.")}
    assert core == {m.split(".", 1)[1] for m in _listed("importlinter:contract:core-without-airflow", "source_modules")
                    if m.startswith("batch_inference.")}
    assert not core & (SHELLS | ADAPTERS | CAPABILITIES | DATA)
    unplaced = top - core - SHELLS - ADAPTERS - CAPABILITIES - DATA
    assert unplaced == set(), (f"{sorted(unplaced)}: name each in .importlinter (the core's two contracts), or give "
                               "a new folder its own contract and add it to the kinds in this test")
    assert core - top == set(), "the core contracts name a module that is gone"
    sections = _contracts().sections()
    for name in ADAPTERS:
        assert f"importlinter:contract:{name}-adapter" in sections
    for name in CAPABILITIES:
        assert f"importlinter:contract:{name}-front-door" in sections


def test_the_graph_the_contracts_read_holds_imports_inside_functions():
    """grimp reads every import statement, a function's included: ``destinations.for_spec`` imports the
    Iceberg table and the search index only when called, and both edges are in the graph."""
    graph = grimp.build_graph("batch_inference")
    seen = graph.find_modules_directly_imported_by("batch_inference.destinations")
    assert {"batch_inference.destinations.iceberg", "batch_inference.destinations.search_index"} <= seen


def private_overrides(packages: dict[str, Path]) -> list[str]:
    """Each method ``_name`` of a class whose base class, defined in another module of ``packages``, has a
    method of the same name: ``path:line: Class._name overrides base.py's Base._name``. A base is found by
    its name among the classes the packages define (a name two modules define counts for both)."""
    trees = {path: ast.parse(path.read_text()) for root in packages.values() for path in sorted(root.rglob("*.py"))}
    classes: dict[str, list[tuple[Path, set[str]]]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                classes.setdefault(node.name, []).append((path, methods))
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.attr if isinstance(b, ast.Attribute) else b.id for b in node.bases
                     if isinstance(b, (ast.Name, ast.Attribute))]
            for fn in node.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if not (fn.name.startswith("_") and not fn.name.endswith("__")):
                    continue
                for base in bases:
                    for where, methods in classes.get(base, []):
                        if where != path and fn.name in methods:
                            found.append(f"{path}:{fn.lineno}: {node.name}.{fn.name} overrides {where.name}'s "
                                         f"{base}.{fn.name}")
    return found


def test_no_class_overrides_another_modules_private_method():
    packages = {"batch_inference": PACKAGE, "gpu_runner": ROOT / "gpu_runner"}
    assert private_overrides(packages) == []


def test_the_override_finder_sees_a_subclass_in_another_module(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "worker.py").write_text("class Worker:\n    def _process(self):\n        return 1\n"
                                   "    def run(self):\n        return self._process()\n")
    (pkg / "pool.py").write_text("from pkg.worker import Worker\nclass PoolWorker(Worker):\n"
                                 "    def _process(self):\n        return super()._process()\n")
    assert private_overrides({"pkg": pkg}) == [
        f"{pkg / 'pool.py'}:3: PoolWorker._process overrides worker.py's Worker._process"]
    (pkg / "pool.py").write_text("from pkg import worker\nclass PoolWorker(worker.Worker):\n"
                                 "    def run(self):\n        return 2\n    def _own(self):\n        return 3\n")
    assert private_overrides({"pkg": pkg}) == []    # a public override, a private method of its own
    (pkg / "worker.py").write_text("class Worker:\n    def _process(self):\n        return 1\n"
                                   "class Local(Worker):\n    def _process(self):\n        return 2\n")
    assert private_overrides({"pkg": pkg}) == []    # within its own module: one room


@pytest.mark.parametrize("path", ["batch_inference.operators", "batch_inference.sensors", "batch_inference.triggers",
                                  "batch_inference.hooks", "batch_inference.params"])
def test_the_public_import_paths_a_dag_uses_still_import(path):
    __import__(path)
