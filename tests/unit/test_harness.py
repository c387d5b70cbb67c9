"""The harnesses read on their own: what the chaos run, the nights and the tests share lives in
``batch_inference.harness`` under public names, and no module imports another module's private one
(nights.py imported ``_EmbeddedServer``, ``_Admin``, ``_make_source`` and ``_worker_url`` from chaos.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import batch_inference

PACKAGE = Path(batch_inference.__file__).parent


def _private_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("batch_inference",
                                                                                          "gpu_runner")):
            out += [f"{path.relative_to(PACKAGE.parent)}: from {node.module} import {a.name}"
                    for a in node.names if a.name.startswith("_")]
    return out


def test_no_module_imports_another_modules_private_names():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _private_imports(path)]
    assert found == []


def test_the_nights_and_the_chaos_run_share_the_harness_and_not_each_other():
    for name in ("nights.py", "chaos.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "batch_inference.harness" in modules, name
        assert not modules & {"batch_inference.chaos", "batch_inference.nights"}, name
