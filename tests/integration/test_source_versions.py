"""Existing specs keep their job versions: the values below were computed on the code before the
``sources/`` package (commit d131555) and are pinned here, so a change to how a source is read, a
record is made or the snapshot is hashed that moves an existing job version fails this test."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import os

import pytest

from batch_inference.plan import submit
from tests.conftest import make_source, make_spec

# Computed by this file's tests on d131555 (BI_PRINT_VERSIONS=1 prints them).
PINNED = {
    "table": "jv_27a4fbbfc55b3019",
    "table_no_acl": "jv_9d94781ec850bd8d",
    "query": "jv_36512cce66cbbd1c",
    "rows": "jv_7d3d774e088121cc",
    "rows_capped": "jv_238d88cdc0952628",
}

ROWS = [
    ("t1", "Refund please: charged twice", ["support", "billing"]),
    ("t2", "App crashes ✓ «ünïcode» {text} >>> <<<", ["support"]),
    ("t3", "   ", None),
    ("t4", "x" * 300, ["a"]),
    ("t5", 'quotes " and \\ backslash\nnew line\ttab', []),
]


def _check(name: str, job_version: str) -> None:
    if os.environ.get("BI_PRINT_VERSIONS"):
        print(f"PINNED {name} {job_version}")
        return
    assert job_version == PINNED[name], f"{name}: the job version moved ({job_version} != {PINNED[name]})"


def test_a_table_keeps_its_job_version(conn):
    make_source(conn, ROWS)
    _check("table", submit(conn, make_spec(max_input_chars=200)).job_version)


def test_a_table_without_acl_keeps_its_job_version(conn):
    make_source(conn, ROWS, acl=False)
    spec = make_spec(source={"acl_column": None})
    _check("table_no_acl", submit(conn, spec).job_version)


def test_a_query_keeps_its_job_version(conn):
    make_source(conn, ROWS)
    spec = make_spec(source={"table": None, "query": "SELECT id, body, acl FROM public.tickets WHERE id <> 't3'"})
    _check("query", submit(conn, spec).job_version)


@pytest.mark.parametrize("cap", [20_000, 100])
def test_rows_read_in_python_keep_their_job_version(conn, cap):
    """Rows as the S3 manifest reader yields them (``{"record_id", "text", "acl"}``), staged by COPY."""
    rows = [{"record_id": r[0], "text": r[1], "acl": r[2]} for r in ROWS]
    rows.append({"record_id": 6, "text": 42, "acl": "one"})
    spec = make_spec(max_input_chars=cap)
    _check("rows" if cap == 20_000 else "rows_capped", submit(conn, spec, rows=rows).job_version)
