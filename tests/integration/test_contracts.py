"""Each contract stated once: the exceptions base, the exit codes, the worker's
flags, the command list, and drift (the validator's and the dashboard's)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import batch_inference
from batch_inference import cli, drift, publish, validate
from batch_inference.commands import COMMANDS
from batch_inference.exceptions import BatchInferenceError, InvalidValue
from batch_inference.exits import FATAL, HALTING, ExitCode, describe
from batch_inference.plan import submit
from gpu_runner import worker
from gpu_runner.worker import WorkerConfig, add_arguments, config_from_args, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_dashboard_api import _relabel


def _package_modules():
    """Every module of the package and the worker that imports without Airflow's UI extras."""
    names = ["gpu_runner.worker"] + [m.name for m in pkgutil.walk_packages(batch_inference.__path__, "batch_inference.")]
    for name in names:
        try:
            yield importlib.import_module(name)
        except ImportError:   # an optional extra (vLLM, llama.cpp) that is not installed here
            continue


def test_every_exception_the_package_defines_derives_from_the_base():
    strays = []
    for mod in _package_modules():
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                    and not issubclass(obj, BatchInferenceError)):
                strays.append(f"{mod.__name__}.{name}")
    assert strays == []


# The contracts layer (docs/architecture.md): it may import nothing of the project but each other.
CONTRACTS = ("batch_inference.exceptions", "batch_inference.exits", "batch_inference.spec")


PACKAGES = {"batch_inference": Path(batch_inference.__file__).parent, "gpu_runner": Path(worker.__file__).parent}


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` its source imports, at the top or inside a function, read
    from the files (nothing is imported). ``from P import N`` is an edge to ``P.N`` when that is a module,
    else to ``P``. An ``if TYPE_CHECKING:`` block never runs, so its imports (names for annotations) are
    no edge."""
    files: dict[str, Path] = {}
    for top, root in packages.items():
        for path in root.rglob("*.py"):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        tree = ast.parse(path.read_text())
        for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING")]:
            block.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        edges.add(f"{base}.{alias.name}")
                    elif base in files:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (Tarjan), each
    sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


@pytest.mark.parametrize("module", CONTRACTS)
def test_the_contracts_layer_imports_nothing_above_it(module):
    assert import_graph(PACKAGES)[module] - set(CONTRACTS) == set()


def test_no_module_of_the_package_or_the_worker_is_in_an_import_circle():
    assert import_circles(import_graph(PACKAGES)) == []


def test_the_circle_finder_sees_a_circle_through_a_function_level_or_relative_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nB = 1\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.a"] == {"pkg.sub.b"}
    assert import_circles(graph) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\nB = 1\n")
    assert import_circles(import_graph({"pkg": pkg})) == []        # an annotation's import never runs


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_reaches(packages: dict[str, Path]) -> list[str]:
    """Each place a module uses another module's private function or method (``obj._name`` where
    ``_name`` is defined by ``def`` in another module of ``packages`` and nowhere in this one, or
    ``from M import _name``): ``path:line: text``. ``self._name``, ``cls._name`` and ``super()._name``
    are a class's own (inherited) business and not counted."""
    trees = {path: ast.parse(path.read_text()) for root in packages.values() for path in sorted(root.rglob("*.py"))}
    defined = {path: {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _private(n.name)} for path, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        own = set(defined[path])
        for node in ast.walk(tree):     # names this module binds itself (attributes and variables)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    own |= {t.attr if isinstance(t, ast.Attribute) else t.id for t in ast.walk(target)
                            if isinstance(t, (ast.Attribute, ast.Name))}
        elsewhere = set().union(*(names for other, names in defined.items() if other != path)) - own
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in elsewhere and _private(node.attr):
                base = node.value
                if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                        isinstance(base, ast.Call) and ast.unparse(base.func) == "super"):
                    continue
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                found += [f"{path}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if _private(a.name) and a.name in elsewhere]
    return found


def test_no_module_calls_another_modules_private_methods():
    assert private_reaches(PACKAGES) == []


def test_the_private_reach_finder_sees_a_call_an_import_and_a_passed_method(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "worker.py").write_text("class W:\n    def _flush(self):\n        return self._take()\n"
                                   "    def _take(self):\n        return 1\n")
    (pkg / "stream.py").write_text("class S:\n    def __init__(self, w):\n        self.w = w\n"
                                   "    def run(self):\n        return self.w._flush()\n")
    assert private_reaches({"pkg": pkg}) == [f"{pkg / 'stream.py'}:5: self.w._flush"]
    (pkg / "stream.py").write_text("from pkg.worker import _helper\ndef run(w, go):\n    return go(w._take)\n")
    (pkg / "worker.py").write_text("def _helper():\n    pass\nclass W:\n    def _take(self):\n        return 1\n")
    assert private_reaches({"pkg": pkg}) == [f"{pkg / 'stream.py'}:1: from pkg.worker import _helper",
                                             f"{pkg / 'stream.py'}:3: w._take"]
    (pkg / "stream.py").write_text("class S:\n    def _take(self):\n        return 2\n"
                                   "    def run(self, other):\n        return other._take()\n")
    assert private_reaches({"pkg": pkg}) == []      # a method of its own name: its own business


def test_each_builtin_engine_reads_its_result_options_from_the_spec():
    from batch_inference.engines import BUILTIN_ENGINES, engine_class
    from batch_inference.spec import ENGINE_RESULT_OPTIONS

    assert set(ENGINE_RESULT_OPTIONS) == set(BUILTIN_ENGINES)
    for name, options in ENGINE_RESULT_OPTIONS.items():
        assert engine_class(name).result_options == frozenset(options), name


def test_the_cli_turns_the_base_into_one_line_and_leaves_other_errors_alone(capsys, monkeypatch):
    def refuse(args):
        raise InvalidValue("no such\nthing")

    def crash(args):
        raise ValueError("a bug")

    parser = cli.build_parser()
    for func, expect in ((refuse, 2), (crash, None)):
        monkeypatch.setattr(cli, "build_parser", lambda func=func: _with_func(parser, func))
        if expect is None:
            with pytest.raises(ValueError, match="a bug"):
                cli.main(["status", "jv_x"])
        else:
            assert cli.main(["status", "jv_x"]) == expect
            assert capsys.readouterr().err == "batch-inference status: error: no such thing\n"


def _with_func(parser: argparse.ArgumentParser, func):
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:   # the subcommands set func too
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_exit_codes_are_one_table():
    assert {c.value for c in ExitCode} == {0, 2, 3, 4, 5, 6, 143}
    assert HALTING <= FATAL and ExitCode.ENGINE not in FATAL and ExitCode.PREEMPTED not in FATAL
    for code in ExitCode:
        assert describe(code) and describe(int(code)) == describe(code)
    assert "endpoint is unavailable" in describe(6)
    assert describe(-9) == "killed by SIGKILL" and describe(99) == "exit 99"
    assert not [n for n in vars(worker) if n.startswith("EXIT_")]


def test_worker_flags_come_from_worker_config(monkeypatch):
    monkeypatch.delenv("BATCH_INFERENCE_GRACE_SECONDS", raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["jv_x"]))
    assert cfg == WorkerConfig(job_version="jv_x")
    flags = {f.name for f in dataclasses.fields(WorkerConfig) if "flag" in f.metadata}
    assert flags == {"engine", "engine_options", "worker_id", "transport", "grace_seconds", "lease_seconds",
                     "flush_every", "flush_seconds", "max_shards", "wait_for_leases", "poll_seconds",
                     "db_retries", "careful_batch", "start_jitter_seconds", "overlap", "region", "result_files",
                     "steal"}
    cfg = config_from_args(p.parse_args(["jv_x", "--no-wait", "--engine-option", "delay_s=0.5", "--flush-every",
                                         "7", "--transport", "fallback", "--lease-seconds", "30", "--no-overlap"]))
    assert (cfg.wait_for_leases, cfg.engine_options, cfg.flush_every, cfg.transport, cfg.lease_seconds, cfg.overlap) \
        == (False, {"delay_s": 0.5}, 7, "fallback", 30, False)
    monkeypatch.setenv("BATCH_INFERENCE_GRACE_SECONDS", "7")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["jv_x"])).grace_seconds == 7.0


def test_the_worker_entrypoint_and_the_cli_worker_have_the_same_flags():
    env = {k: v for k, v in os.environ.items() if k != "BATCH_INFERENCE_GRACE_SECONDS"}

    def options(*argv: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, timeout=60,
                             env={**env, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        return out.stdout.split("options:", 1)[1].splitlines()

    runner = options("gpu_runner")
    assert [line for line in runner if not line.startswith("  --db DB ")] == options("batch_inference.cli", "worker")
    text = "\n".join(runner)
    for f in ("--engine ENGINE", "--engine-option KEY=VALUE", "--transport {batch,fallback}", "--no-wait",
              "write results at least every N (default 1000)", "... or every S seconds (default 2)",
              "releasing (default 20)", "this often (default 5)", "database (default 8)", "died (default 32)"):
        assert f in text


def test_every_command_is_registered_from_the_one_list():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["db", "submit", "status", "dead-letters", "redrive", "drop", "worker", "grant",
                                 "estimate", "capacity", "cutoff", "cost", "validate", "calibrate", "ladder", "review",
                                 "publish", "rollback", "published",
                                 "chaos", "nights", "fallback", "regions", "demo"]
    assert all(m.__name__.startswith("batch_inference.commands.") for m in COMMANDS)


def test_the_dashboard_shows_the_drift_the_validator_computed(conn, db_url):
    from batch_inference.ui import data

    gates = {"max_dead_letter_rate": 0.2, "max_drift": 0.9}
    fast = dict(backoff=(0.0, 0.0, 0.0), flush_seconds=0.2)
    make_source(conn, tickets(40))
    v1 = submit(conn, make_spec(validation=gates)).job_version
    assert run_worker(WorkerConfig(job_version=v1, db_url=db_url, **fast)) == 0
    _relabel(conn, v1, [("bug", 8), ("account", 4)])
    conn.execute("UPDATE bi.results SET category = NULL WHERE job_version = %s AND record_id = 't00039'", (v1,))
    assert validate.validate(conn, v1, sample_dir=tempfile.mkdtemp()).passed
    publish.publish(conn, v1, actor="test")

    v2 = submit(conn, make_spec(validation=gates, prompt={"version": "v2"})).job_version
    assert run_worker(WorkerConfig(job_version=v2, db_url=db_url, **fast)) == 0
    _relabel(conn, v2, [("bug", 3), ("other", 5)])
    report = validate.validate(conn, v2, sample_dir=tempfile.mkdtemp())
    shown = data.drift(conn, v2)
    assert shown["baseline_version"] == report["drift"]["against"] == v1
    assert shown["tv_distance"] == report["drift"]["distance"] > 0
    assert shown["max_drift"] == report["drift"]["threshold"] == 0.9
    assert {c["category"]: c["current"] for c in shown["categories"]} == \
        {k: v["current"] for k, v in report["drift"]["per_category"].items()}
    assert {c["category"]: c["baseline"] for c in shown["categories"]} == \
        {k: v["published"] for k, v in report["drift"]["per_category"].items()}
    # One key for a NULL category, in the report's counts and in the dashboard's.
    assert drift.NO_CATEGORY in report["drift"]["per_category"]
    counted, source = drift.category_counts(conn, v1)
    assert source == "results" and counted[drift.NO_CATEGORY] == 1
