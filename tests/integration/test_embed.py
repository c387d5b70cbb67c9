"""Embedding jobs end to end on llama.cpp (the SmolLM2 GGUF in its embedding mode) and the real embedded
PostgreSQL with pgvector: submit, the worker, validate, publish as a vector(n) view searched with <=>,
a second version and a rollback; and bad input, refused with one line and nothing written."""

from __future__ import annotations

import uuid

import numpy as np
import psycopg
import pytest

from batch_inference import db
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256
from batch_inference.exceptions import BatchInferenceError, SpecError
from batch_inference.plan import drop_job_version, submit
from batch_inference.publish import publish, rollback
from batch_inference.spec import parse_spec
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source

DATASET = "ticket_search"
ICEBERG = "analytics.ticket_vectors"
DIMS = 576   # SmolLM2-135M's hidden size
TOPICS = ["I was charged twice for my subscription this month.",
          "The app crashes when I open the settings page.",
          "How do I export my data to a CSV file?",
          "Please cancel my account and delete my data.",
          "The invoice shows the wrong company address."]


def records(n: int) -> list[tuple[str, str, list[str]]]:
    return [(f"t{i:03d}", f"Ticket {i}: {TOPICS[i % len(TOPICS)]}", [f"team{i % 2}"]) for i in range(n)]


def embed_spec(**over) -> dict:
    d = {"dataset": DATASET, "task": "embed",
         "source": {"table": "public.tickets", "id_column": "id", "text_column": "body", "acl_column": "acl"},
         "model": {"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
         "engine": {"name": "llama-cpp", "options": {"n_threads": 2}},
         "prompt": {"version": "e1", "template": "{text}"},
         "embedding": {"dimensions": DIMS, "instruction": "passage: "},
         "shard_size": 10, "lease_seconds": 60, "renew_seconds": 5}
    d.update(over)
    return d


def run(conn, db_url, spec_data: dict) -> str:
    m = submit(conn, parse_spec(spec_data))
    assert run_worker(WorkerConfig(job_version=m.job_version, db_url=db_url, wait_for_leases=False)) == 0
    return m.job_version


def nearest(c, record_id: str, k: int = 3) -> list[str]:
    return [r["record_id"] for r in c.execute(
        f"SELECT record_id FROM published.{DATASET} ORDER BY embedding <=> "
        f"(SELECT embedding FROM published.{DATASET} WHERE record_id = %s) LIMIT %s", (record_id, k))]


def iceberg_vectors(conn, spec_data: dict) -> dict[str, tuple[str, np.ndarray]]:
    """The Iceberg table's rows as DuckDB's iceberg extension reads them: record id -> (job version, vector);
    pyiceberg reads the same."""
    from batch_inference.destinations import for_spec
    from tests.integration.test_publish_iceberg import duck

    ice = next(d for d in for_spec(conn, parse_spec(spec_data)) if d.name.startswith("iceberg:"))
    tbl = ice.catalog().load_table(ICEBERG)
    assert tbl.metadata.properties["batch_inference.embedding.dimensions"] == str(DIMS)
    cur = duck().execute(f"SELECT record_id, job_version, embedding::FLOAT[{DIMS}] AS e FROM "
                         f"iceberg_scan('{tbl.metadata_location}') ORDER BY record_id")
    out = {r[0]: (r[1], np.array(r[2], dtype=np.float32)) for r in cur.fetchall()}
    arrow = tbl.scan().to_arrow()
    assert arrow.num_rows == len(out) and str(arrow.schema.field("embedding").type.value_type) == "float"
    for rid, vec in zip(arrow.column("record_id").to_pylist(), arrow.column("embedding").to_pylist()):
        assert np.array_equal(np.array(vec, dtype=np.float32), out[rid][1])
    ice.close()
    return out


def test_llama_cpp_embedding_job_end_to_end_with_search_and_rollback(conn, db_url, tmp_path):
    make_source(conn, records(30))
    conn.execute("CREATE TABLE public.pairs (left_id text, right_id text)")
    conn.execute("INSERT INTO public.pairs VALUES ('t000', 't005'), ('t001', 't006'), ('t002', 't007')")
    lake = {"destinations": [{"identifier": ICEBERG, "warehouse": str(tmp_path / "warehouse"),
                              "cleared_record_classes": ["internal"]}]}
    spec = embed_spec(evaluation={"pairs": {"table": "public.pairs", "k": 5, "min_recall": 0.5}}, publish=lake)
    job = run(conn, db_url, spec)

    rows = conn.execute("SELECT record_id, embedding, output, engine, category FROM bi.results "
                        "WHERE job_version = %s ORDER BY record_id", (job,)).fetchall()
    assert len(rows) == 30
    for r in rows:      # float32 bytes, unit norm, the engine that made them
        v = np.frombuffer(r["embedding"], dtype="<f4")
        assert v.shape == (DIMS,) and abs(float(np.linalg.norm(v)) - 1) < 1e-3
        assert r["engine"] == "llama-cpp" and r["output"]["dimensions"] == DIMS and r["category"] is None

    # A stored vector cut short or not finite fails the version (then put back).
    good = rows[4]["embedding"]
    conn.execute("UPDATE bi.results SET embedding = substring(embedding FROM 1 FOR 1000) "
                 "WHERE job_version = %s AND record_id = 't004'", (job,))
    conn.execute("UPDATE bi.results SET embedding = %s WHERE job_version = %s AND record_id = 't005'",
                 (np.full(DIMS, np.nan, dtype="<f4").tobytes(), job))
    bad = validate(conn, job, record=False)
    assert not bad.passed and bad["schema"]["wrong_dimension"] == 1 and bad["schema"]["not_finite"] == 1
    assert any(f.startswith("vectors: 2 of 30") for f in bad.failures), bad.failures
    for rid, data in (("t004", good), ("t005", rows[5]["embedding"])):
        conn.execute("UPDATE bi.results SET embedding = %s WHERE job_version = %s AND record_id = %s", (data, job, rid))

    report = validate(conn, job)
    assert report.passed, report.failures
    assert report["schema"]["checked"] == 30 and report["schema"]["invalid"] == report["schema"]["wrong_dimension"] == 0
    assert report["schema"]["bytes_per_vector"] <= 4 * DIMS + 4   # float32 and a 4-byte header
    assert report["evaluation"]["pairs"]["recall"] >= 0.5

    out = publish(conn, job)
    assert out["changed"] and [d["destination"] for d in out["destinations"]] == [f"search:{DATASET}",
                                                                                 f"iceberg:ledger.{ICEBERG}"]
    # The HNSW index was built before the pointer moved: the first query can use it.
    state = conn.execute("SELECT to_regclass(%s) IS NOT NULL AS idx", (f"bi.embed_{job}_hnsw",)).fetchone()
    assert state["idx"]
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
            f"EXPLAIN SELECT record_id FROM published.{DATASET} ORDER BY embedding <=> "
            f"(SELECT embedding FROM published.{DATASET} WHERE record_id = 't003') LIMIT 3"))
    assert f"embed_{job}_hnsw" in plan, plan
    first = nearest(conn, "t003")
    assert first[0] == "t003" and first[1][:2] == "t0" and int(first[1][1:]) % len(TOPICS) == 3
    assert conn.execute(f"SELECT pg_typeof(embedding)::text AS t FROM published.{DATASET} LIMIT 1"
                        ).fetchone()["t"] == "vector"
    # The Iceberg table holds the same vectors, read by DuckDB and pyiceberg.
    lake_rows = iceberg_vectors(conn, spec)
    assert len(lake_rows) == 30 and {j for j, _ in lake_rows.values()} == {job}
    for r in rows:
        assert np.array_equal(lake_rows[r["record_id"]][1], np.frombuffer(r["embedding"], dtype="<f4"))

    # A reader (bi_reader, RLS by ACL) searches the view too: only its team's rows.
    reader = f"reader_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE ROLE {reader} LOGIN")
    try:
        conn.execute(f"GRANT bi_reader TO {reader}")
        conn.execute("INSERT INTO bi.reader_principals VALUES (%s, 'team1')", (reader,))
        params = psycopg.conninfo.conninfo_to_dict(db_url)
        params["user"] = reader
        with db.connect(psycopg.conninfo.make_conninfo(**params)) as rc:
            seen = nearest(rc, "t003", 30)
        assert seen[0] == "t003" and len(seen) == 15 and all(int(s[1:]) % 2 == 1 for s in seen)
    finally:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (reader,))
        conn.execute(f"DROP OWNED BY {reader}")
        conn.execute(f"DROP ROLE {reader}")

    # Another instruction is another version (I2); its drift is measured on the records both embedded.
    spec2 = embed_spec(embedding={"dimensions": DIMS, "instruction": "query: "}, publish=lake)
    job2 = run(conn, db_url, spec2)
    assert job2 != job
    report2 = validate(conn, job2)
    assert report2["drift"]["against"] == job and report2["drift"]["shared"] == 30
    assert 0 <= report2["drift"]["distance"] <= 1 and report2["drift"]["centroid_shift"] is not None
    publish(conn, job2, force=not report2.passed, reason=None if report2.passed else "test: a new instruction")
    assert {r["job_version"] for r in conn.execute(f"SELECT job_version FROM published.{DATASET}")} == {job2}

    # Rollback moves the search back with the pointer.
    back = rollback(conn, DATASET)
    assert back["to_version"] == job
    assert {r["job_version"] for r in conn.execute(f"SELECT job_version FROM published.{DATASET}")} == {job}
    assert nearest(conn, "t003") == first
    assert {j for j, _ in iceberg_vectors(conn, spec).values()} == {job}
    # Dropping the version no longer published drops its search table too.
    assert drop_job_version(conn, job2)
    assert conn.execute("SELECT to_regclass(%s) AS t", (f"bi.embed_{job2}",)).fetchone()["t"] is None


@pytest.mark.parametrize("change, words", [
    ({"embedding": {"dimensions": 384}}, "576-dimensional"),
    ({"output_schema": {"type": "object"}}, "takes no output schema"),
    ({"engine": {"name": "noop"}}, "no embedding mode"),
])
def test_bad_embedding_spec_is_one_line_and_writes_nothing(conn, change, words):
    make_source(conn, records(5))
    with pytest.raises((SpecError, BatchInferenceError)) as err:
        submit(conn, parse_spec(embed_spec(**change)))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0
