"""The published view typed from the output schema, on the real embedded PostgreSQL: numbers,
booleans and record_id (from the source table's integer id) come out as numbers and booleans, so
`WHERE rating > 3` and a join on a bigint id work; a field added by a later version appears when
that version is published, and a rollback takes the view back to the earlier shape, each in the
transaction that moves the pointer; a publish of the same shape runs no DDL."""

from __future__ import annotations

from typing import Any

from batch_inference.plan import submit
from batch_inference.publish import publish, published, rollback
from batch_inference.validate import validate
from tests.conftest import make_spec
from tests.integration.test_validate import finish

DATASET = "product_reviews"
VIEW = f"published.{DATASET}"
SCHEMA_V1 = {"type": "object", "required": ["category", "rating", "score", "flagged"], "properties": {
    "category": {"type": "string", "enum": ["billing", "bug"]},
    "rating": {"type": "integer"},
    "score": {"type": "number"},
    "flagged": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}},
}}
SCHEMA_V2 = {**SCHEMA_V1, "properties": {**SCHEMA_V1["properties"], "sentiment": {"type": ["string", "null"]}}}


def output(rid: str, v2: bool = False) -> dict[str, Any]:
    n = int(rid)
    out = {"category": "billing", "rating": n % 5 + 1, "score": n / 4, "flagged": n % 2 == 0, "tags": ["a"]}
    return {**out, "sentiment": "positive"} if v2 else out


def source(conn) -> None:
    conn.execute("DROP TABLE IF EXISTS public.product_reviews")
    conn.execute("CREATE TABLE public.product_reviews (id bigint PRIMARY KEY, body text)")
    conn.execute("INSERT INTO public.product_reviews SELECT g, 'review ' || g FROM generate_series(1, 12) g")


def version(conn, db_url: str, schema: dict, prompt: str, v2: bool = False) -> str:
    spec = make_spec(dataset=DATASET, output_schema=schema, prompt={"version": prompt},
                     source={"table": "public.product_reviews", "acl_column": None},
                     validation={"max_drift": 1.0})
    job = submit(conn, spec).job_version
    finish(db_url, job, output_for=lambda rid: output(rid, v2))
    assert validate(conn, job).passed
    return job


def columns(conn) -> dict[str, str]:
    return {r["column_name"]: r["data_type"] for r in conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = 'published' "
        "AND table_name = %s ORDER BY ordinal_position", (DATASET,))}


def test_the_view_is_typed_from_the_output_schema_and_follows_the_published_version(conn, db_url):
    source(conn)
    v1 = version(conn, db_url, SCHEMA_V1, "v1")
    publish(conn, v1)
    cols = columns(conn)
    assert (cols["record_id"], cols["category"], cols["rating"], cols["score"], cols["flagged"], cols["tags"]) == \
        ("bigint", "text", "bigint", "double precision", "boolean", "jsonb")
    assert "sentiment" not in cols
    assert conn.execute(f"SELECT count(*) AS n FROM {VIEW} WHERE rating > 3").fetchone()["n"] == \
        sum(1 for i in range(1, 13) if i % 5 + 1 > 3)
    joined = conn.execute(f"SELECT count(*) AS n FROM {VIEW} v JOIN public.product_reviews p ON p.id = v.record_id "
                          "WHERE v.flagged AND v.score > 1").fetchone()["n"]
    assert joined == sum(1 for i in range(1, 13) if i % 2 == 0 and i / 4 > 1)
    assert published(conn, DATASET)["view_fields"]["rating"] == "bigint"

    # A later version adds a field: it appears with that version, and goes with a rollback.
    v2 = version(conn, db_url, SCHEMA_V2, "v2", v2=True)
    publish(conn, v2)
    assert columns(conn)["sentiment"] == "text"
    assert conn.execute(f"SELECT DISTINCT sentiment, job_version FROM {VIEW}").fetchall() == \
        [{"sentiment": "positive", "job_version": v2}]
    rollback(conn, DATASET)
    assert "sentiment" not in columns(conn)
    assert conn.execute(f"SELECT DISTINCT job_version FROM {VIEW}").fetchall() == [{"job_version": v1}]


def test_a_publish_of_the_same_shape_runs_no_ddl(conn, db_url):
    source(conn)
    v1 = version(conn, db_url, SCHEMA_V1, "v1")
    publish(conn, v1)
    oid = conn.execute("SELECT %s::regclass::oid AS o", (VIEW,)).fetchone()["o"]
    v1b = version(conn, db_url, SCHEMA_V1, "v1b")
    publish(conn, v1b)
    assert conn.execute("SELECT %s::regclass::oid AS o", (VIEW,)).fetchone()["o"] == oid   # the same view
