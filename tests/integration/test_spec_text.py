"""The spec comes back exactly as submitted: property order decides the order
in which structured decoding makes the model write the fields."""

from __future__ import annotations

import psycopg
import pytest

from batch_inference.plan import submit
from batch_inference.status import job_spec
from tests.conftest import make_source, make_spec, tickets


def test_worker_reads_the_schema_in_the_order_it_was_written(conn):
    make_source(conn, tickets(5))
    spec = make_spec()
    # "category" is longer than "summary": jsonb alone would hand them back reversed.
    assert list(spec.output_schema["properties"]) == ["category", "summary"]
    job = submit(conn, spec).job_version

    back = job_spec(conn, job)
    assert list(back.output_schema["properties"]) == ["category", "summary"]
    assert back.output_schema["required"] == ["category", "summary"]
    assert back == spec
    # The queryable jsonb copy is the same document.
    row = conn.execute("SELECT spec_text::jsonb = spec AS same, spec->>'dataset' AS ds FROM bi.jobs "
                       "WHERE job_version = %s", (job,)).fetchone()
    assert row["same"] and row["ds"] == spec.dataset


def test_text_that_disagrees_with_the_jsonb_copy_is_refused(conn):
    make_source(conn, tickets(3))
    job = submit(conn, make_spec()).job_version
    with pytest.raises(psycopg.errors.CheckViolation, match="jobs_spec_text_matches"):
        with conn.transaction():
            conn.execute("UPDATE bi.jobs SET spec_text = '{\"dataset\": \"other\"}' WHERE job_version = %s", (job,))


def test_versions_from_before_the_column_still_load(conn):
    make_source(conn, tickets(3))
    spec = make_spec()
    job = submit(conn, spec).job_version
    conn.execute("UPDATE bi.jobs SET spec_text = NULL WHERE job_version = %s", (job,))
    back = job_spec(conn, job)
    assert back.spec_hash == spec.spec_hash
    assert sorted(back.output_schema["properties"]) == ["category", "summary"]
