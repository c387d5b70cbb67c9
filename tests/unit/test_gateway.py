"""One SQL gateway: every statement the package runs is a named statement in
sql/ (``batch_inference.db.QUERY_FILES``), read by the one loader, and no
Python file writes SQL of its own.

Pure: the Python sources are parsed with ``ast``, the SQL files read as text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from batch_inference import db

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("plugins", "gpu_runner", "dags")
# Modules that write SQL by construction, with why. Keep this short.
ALLOWED = {
    "plugins/batch_inference/schema_sql.py": "the JSON-Schema-to-SQL compiler: it builds predicate expressions "
                                             "(psycopg.sql parts) from a spec, which no file can hold",
    "plugins/batch_inference/data/make_tickets.py": "sample ticket texts: one is the SQL injection a customer "
                                                    "might paste into a ticket (data for the model, never run)",
}
# A statement: an SQL command word in capitals at the start (a subquery's
# parenthesis allowed), then more text; or a call of a ledger function.
_STATEMENT = re.compile(r"^\s*\(?\s*(SELECT|INSERT|UPDATE|DELETE|MERGE|CREATE|ALTER|DROP|GRANT|REVOKE|SET|RESET|SHOW|"
                        r"WITH|COPY|TRUNCATE|LOCK|DO|CALL|VACUUM|ANALYZE|EXPLAIN|LISTEN|NOTIFY|BEGIN|COMMIT|"
                        r"ROLLBACK)\s+\S")
_LEDGER_CALL = re.compile(r"\bbi\.\w+_v\d+\s*\(")


def looks_like_sql(text: str) -> bool:
    return bool(_STATEMENT.match(text) or _LEDGER_CALL.search(text))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose, not statements)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def sql_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal in ``path`` that looks like an SQL statement;
    an f-string counts with its placeholders as ``{}``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    inner: set[int] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            inner.update(id(v) for v in node.values)
            if looks_like_sql(text):
                found.append((node.lineno, text))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                and id(node) not in inner and looks_like_sql(node.value)):
            found.append((node.lineno, node.value))
    return sorted(found)


def python_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_detector_sees_statements_and_not_prose(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(conn, t, fn):\n'
                      '    """SELECT-free prose: Drop a job version."""\n'
                      '    conn.execute("SELECT 1")\n'
                      '    conn.execute(f"TRUNCATE {t}")\n'
                      '    conn.execute("(SELECT count(*) FROM x)")\n'
                      '    conn.execute(f"select * from bi.{fn}_v1(%s)".upper())\n'
                      '    print("do this", "Drop it", "SET", "grant")\n'
                      '    conn.execute(f"x {fn} bi.enter_fallback_v1(%s)")\n')
    assert [line for line, _ in sql_strings(sample)] == [3, 4, 5, 8]


def test_no_sql_outside_the_gateway():
    for allowed in ALLOWED:
        assert (ROOT / allowed).exists(), f"{allowed} is allowed SQL but no longer exists: update ALLOWED"
    found = [f"{p.relative_to(ROOT)}:{line}: {text[:70]!r}" for p in python_files()
             if str(p.relative_to(ROOT)) not in ALLOWED for line, text in sql_strings(p)]
    assert not found, ("SQL written in Python; make it a named statement in sql/ "
                       "(db.q(name), or db.composed(name, ...) for identifiers):\n" + "\n".join(found))


def test_every_query_file_loads_with_unique_names():
    names: dict[str, str] = {}
    for file in db.QUERY_FILES:
        text = (db.sql_dir() / file).read_text()
        parsed = db.parse_queries(text)
        assert parsed, f"sql/{file} has no named statements"
        declared = re.findall(r"^-- name: (\w+)", text, flags=re.M)
        assert len(declared) == len(set(declared)) == len(parsed), f"sql/{file} names a statement twice"
        for name, statement in parsed.items():
            assert name not in names, f"{name} is in sql/{names[name]} and sql/{file}"
            names[name] = file
            last = statement.splitlines()[-1].strip()
            assert statement and not last.startswith("--") and not statement.endswith(";"), (file, name)
    assert set(db.queries()) == set(names)


def test_a_trailing_comment_belongs_to_no_statement():
    parsed = db.parse_queries("-- name: a  one\nSELECT 1;\n\n-- a section header\n\n-- name: b  two\nSELECT 2;\n")
    assert parsed == {"a": "SELECT 1", "b": "SELECT 2"}


def _named_uses() -> set[tuple[str, str]]:
    """(where, name) of every ``q("name")`` / ``db.q("name")`` / ``db.composed("name", ...)`` in the sources."""
    uses: set[tuple[str, str]] = set()
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else None
            if called == "composed" or (called == "q" and owner in (None, "db")):
                uses.add((f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0].value))
    return uses


def test_every_statement_the_code_names_exists():
    known = db.queries()
    uses = _named_uses()
    assert len(uses) > 50                                  # the walk found the package's calls
    missing = sorted(f"{where}: {name}" for where, name in uses if name not in known)
    assert not missing, "no such named statement:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["reader_role_set", "chaos_worker_role", "demo_tickets_reset", "published_view_head"])
def test_identifiers_are_composed_not_formatted(name):
    from psycopg import sql

    placeholders = set(re.findall(r"\{(\w+)\}", db.q(name)))
    assert placeholders, name
    text = db.composed(name, **{p: sql.Identifier("x y") for p in placeholders}).as_string(None)
    assert '"x y"' in text and "{" not in text
