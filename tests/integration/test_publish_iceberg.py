"""Publishing to an Apache Iceberg table beside the PostgreSQL view, read back by readers we did not
write: pyiceberg and DuckDB's iceberg extension (the PyPI package ``duckdb-extension-iceberg``, loaded
from its file: DuckDB cannot download extensions here).

Everything is real: the embedded PostgreSQL holds the ledger and pyiceberg's SQL catalog (schema
``iceberg_catalog``), the warehouse is a local directory or an S3 bucket, jobs run through the real
worker and are published through the CLI. The S3 (and Glue) server is moto on loopback
(tests/fixtures/moto_server.py), the one stand-in: a real HTTP server speaking S3 and Glue, not AWS.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from batch_inference import db
from batch_inference.destinations import Version, for_spec, version_rows
from batch_inference.exceptions import DestinationRefused, DestinationUnavailable, NotCleared
from batch_inference.plan import submit
from batch_inference.publish import PublishRefused, publish, published, rollback
from batch_inference.status import job_spec
from batch_inference.validate import validate
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_validate import finish


DATASET = "tickets_triage"
TABLE = "analytics.tickets"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["billing", "bug", "account"]},
        "summary": {"type": "string"},
        "priority": {"type": "integer"},
        "confidence": {"type": "number"},
        "urgent": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object", "properties": {"lang": {"type": "string"}, "words": {"type": "integer"}}},
    },
    "required": ["category", "summary", "priority", "confidence", "urgent", "tags", "meta"],
}


def output_for(tag: str):
    def out(rid: str) -> dict[str, Any]:
        n = int(rid[1:])
        return {"category": ["billing", "bug", "account"][n % 3], "summary": f"{tag} summary of {rid}",
                "priority": n % 5, "confidence": round(0.5 + (n % 7) / 20, 3), "urgent": n % 2 == 0,
                "tags": [tag, f"p{n % 5}"], "meta": {"lang": "en", "words": n}}
    return out


def destination(where: str, **over: Any) -> dict[str, Any]:
    return {"identifier": TABLE, "warehouse": where, "cleared_record_classes": ["internal"], **over}


def version(conn, db_url: str, n: int, start: int, tag: str, dest: dict[str, Any], *,
            schema: dict[str, Any] = SCHEMA, out=None) -> str:
    """A finished, validated job version of ``n`` tickets whose outputs name ``tag``."""
    make_source(conn, tickets(n, start))
    spec = make_spec(output_schema=schema, publish={"destinations": [dest]},
                     validation={"max_drift": 1.0})
    job = submit(conn, spec).job_version
    finish(db_url, job, output_for=out or output_for(tag))
    assert validate(conn, job).passed
    return job


def table(conn, dest: dict[str, Any]):
    """The Iceberg table as a reader outside the project finds it: through the catalog, with pyiceberg."""
    spec = make_spec(output_schema=SCHEMA, publish={"destinations": [dest]})
    (ice,) = for_spec(conn, spec)
    return ice, ice.catalog().load_table(TABLE)


def view_rows(conn) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT record_id, output, job_version, model_name, model_digest, prompt_version, transport, acl, "
        "created_at FROM published.tickets_triage ORDER BY record_id").fetchall()


def as_view(rows: list[dict[str, Any]], schema: dict[str, Any] = SCHEMA) -> list[tuple]:
    """Rows read from the table, in the view's shape."""
    props = list(schema["properties"])
    return [(r["record_id"], {p: r[p] for p in props}, r["job_version"], r["model_name"], r["model_digest"],
             r["prompt_version"], r["transport"], r["acl"], r["stored_at"]) for r in rows]


def from_view(rows: list[dict[str, Any]]) -> list[tuple]:
    return [(r["record_id"], r["output"], r["job_version"], r["model_name"], r["model_digest"],
             r["prompt_version"], r["transport"], r["acl"], r["created_at"]) for r in rows]


def pyiceberg_rows(tbl) -> list[dict[str, Any]]:
    return sorted(tbl.refresh().scan().to_arrow().to_pylist(), key=lambda r: r["record_id"])


@functools.cache
def duck_database():
    """One DuckDB database a process with the avro, httpfs and iceberg extensions loaded from their PyPI
    packages' files: the three LOADs cost about 0.3 CPU-s, once instead of for every reader."""
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for name in ("avro", "httpfs", "iceberg"):
        mod = importlib.import_module(f"duckdb_extension_{name}")
        path = Path(mod.__file__).parent / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
        con.execute(f"LOAD '{path}'")
    return con


def duck(s3: str | None = None):
    """A new DuckDB connection to ``duck_database()`` (a reader of its own; DuckDB checks a cached file
    against the file before it uses it), with the moto S3 server's secret when ``s3`` is given."""
    con = duck_database().cursor()
    if s3:
        con.execute(f"CREATE OR REPLACE SECRET moto (TYPE s3, KEY_ID 'test', SECRET 'test', REGION 'us-east-1', "
                    f"ENDPOINT '{s3.removeprefix('http://')}', URL_STYLE 'path', USE_SSL false)")
    return con


def duckdb_rows(tbl, s3: str | None = None) -> list[dict[str, Any]]:
    con = duck(s3)
    cur = con.execute(f"SELECT * FROM iceberg_scan('{tbl.refresh().metadata_location}') ORDER BY record_id")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def same_rows_everywhere(conn, tbl, s3: str | None = None, schema: dict[str, Any] = SCHEMA) -> int:
    want = from_view(view_rows(conn))
    assert as_view(pyiceberg_rows(tbl), schema) == want
    assert as_view(duckdb_rows(tbl, s3), schema) == want
    return len(want)


def worker_version(conn, db_url: str, n: int, start: int, tag: str, dest: dict[str, Any]) -> str:
    """A job version of ``n`` tickets (the default spec's triage schema) run by the real worker process
    on the noop engine, then validated."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(n, start))
    job = submit(conn, make_spec(publish={"destinations": [dest]}, validation={"max_drift": 1.0})).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    assert validate(conn, job).passed
    return job


def through_the_cli(db_url: str, capsys):
    """publish and rollback as a user runs them: ``batch-inference publish|rollback ... --json``."""
    from batch_inference.cli import main as cli_main

    def run(*argv: str) -> dict[str, Any]:
        capsys.readouterr()
        assert cli_main([*argv, "--db", db_url, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    return (lambda conn, job: run("publish", job)), (lambda conn, dataset: run("rollback", dataset))


def check_round_trip(conn, db_url: str, dest: dict[str, Any], s3: str | None = None, *, make=version,
                     pub=publish, back=rollback, schema: dict[str, Any] = SCHEMA) -> None:
    """Two versions published, the second again (a no-op), a rollback and a re-publish: the view and the
    table's ``main`` move together, and pyiceberg and DuckDB read exactly the view's rows each time."""
    v1 = make(conn, db_url, 30, 0, "one", dest)
    out1 = pub(conn, v1)
    assert out1["changed"] and out1["destinations"][0]["changed"]
    ice, tbl = table(conn, dest)
    assert same_rows_everywhere(conn, tbl, s3, schema) == 30
    v2 = make(conn, db_url, 40, 10, "two", dest)
    out2 = pub(conn, v2)
    assert same_rows_everywhere(conn, tbl, s3, schema) == 40
    assert {"jv": v2, "main": ice.current()} == {"jv": v2, "main": v2}
    # The tag names the version's snapshot; the history records it beside the view's switch.
    snap2 = out2["destinations"][0]["snapshot_id"]
    assert tbl.refresh().metadata.refs[v2].snapshot_id == snap2 == tbl.current_snapshot().snapshot_id
    hist = published(conn, DATASET)["history"]
    assert hist[0]["to_version"] == v2 and hist[0]["destinations"][0]["snapshot_id"] == snap2
    assert hist[0]["destinations"][0]["destination"] == f"iceberg:ledger.{TABLE}"

    # Idempotent: publishing it again changes nothing anywhere.
    again = pub(conn, v2)
    assert not again["changed"] and not again["destinations"][0]["changed"]
    assert tbl.refresh().current_snapshot().snapshot_id == snap2

    # Rollback moves both pointers back; DuckDB and pyiceberg see v1's rows again.
    moved = back(conn, DATASET)
    assert moved["to_version"] == v1 and moved["destinations"][0]["job_version"] == v1
    assert published(conn, DATASET)["job_version"] == v1 and ice.current() == v1
    assert same_rows_everywhere(conn, tbl, s3, schema) == 30
    assert published(conn, DATASET)["history"][0]["destinations"][0]["snapshot_id"] \
        == tbl.metadata.refs[v1].snapshot_id == tbl.current_snapshot().snapshot_id
    # Publishing v2 again only moves main to its tag: no new data files.
    files_before = len(tbl.refresh().inspect.all_files()) if hasattr(tbl.inspect, "all_files") else None
    pub(conn, v2)
    assert ice.current() == v2 and same_rows_everywhere(conn, tbl, s3, schema) == 40
    if files_before is not None:
        assert len(tbl.refresh().inspect.all_files()) == files_before


def test_publish_and_rollback_on_a_local_warehouse(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"))
    check_round_trip(conn, db_url, dest)
    # The typed columns.
    _, tbl = table(conn, dest)
    types = {f.name: str(f.field_type) for f in tbl.schema().fields}
    assert types["priority"] == "long" and types["confidence"] == "double" and types["urgent"] == "boolean"
    assert types["tags"].startswith("list<string>") and types["meta"].startswith("struct<")
    assert types["acl"].startswith("list<string>") and types["stored_at"] == "timestamptz"
    # The catalog is in the ledger's database, in its own schema.
    found = conn.execute("SELECT table_name FROM iceberg_catalog.iceberg_tables").fetchall()
    assert [r["table_name"] for r in found] == ["tickets"]


def test_a_job_runs_end_to_end_and_the_cli_publishes_it_to_both(conn, db_url, tmp_path, capsys):
    """The real worker (noop engine) and the CLI's publish on a local warehouse; the S3 warehouse's
    end-to-end round trip is the next-but-one test."""
    from batch_inference.data import TRIAGE_SCHEMA

    dest = destination(str(tmp_path / "warehouse"))
    pub, _ = through_the_cli(db_url, capsys)
    job = worker_version(conn, db_url, 25, 0, "one", dest)
    assert pub(conn, job)["destinations"][0]["job_version"] == job
    _, tbl = table(conn, dest)
    assert same_rows_everywhere(conn, tbl, None, schema=TRIAGE_SCHEMA) == 25
    assert {r["transport"] for r in pyiceberg_rows(tbl)} == {"batch"}


@pytest.fixture
def s3_bucket(moto_s3, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"lake-{os.urandom(4).hex()}"
    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket=name)
    return moto_s3, name


def test_a_job_runs_end_to_end_on_an_s3_warehouse_and_rolls_back(conn, db_url, s3_bucket, capsys):
    """The issue's end to end on S3: jobs run by the real worker, the SQL catalog on the embedded
    PostgreSQL, the warehouse on moto's S3 (on loopback: the stand-in for AWS), publish and rollback
    through the CLI; pyiceberg and DuckDB read exactly the view's rows before and after the rollback."""
    from batch_inference.data import TRIAGE_SCHEMA

    endpoint, bucket = s3_bucket
    dest = destination(f"s3://{bucket}/warehouse", s3_endpoint=endpoint, s3_region="us-east-1")
    pub, back = through_the_cli(db_url, capsys)
    check_round_trip(conn, db_url, dest, s3=endpoint, make=worker_version, pub=pub, back=back,
                     schema=TRIAGE_SCHEMA)
    import boto3

    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.endswith(".parquet") for k in keys) and any(k.endswith(".metadata.json") for k in keys)


GLUE_CONN = "bi_test_glue"


@pytest.fixture
def glue_connection(s3_bucket, monkeypatch):
    """An Airflow AWS connection (``AIRFLOW_CONN_BI_TEST_GLUE``) holding keys moto accepts and, in its
    extra, moto's endpoint and the region; the environment's AWS credentials are taken away, so Glue and S3
    can only be reached with the connection's. Yields (endpoint, bucket, the connection's secret key)."""
    endpoint, bucket = s3_bucket
    secret = f"bi-glue-secret-{os.urandom(8).hex()}"
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_GLUE", json.dumps({
        "conn_type": "aws", "login": "AKIABITESTGLUE", "password": secret,
        "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"}}))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                 "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return endpoint, bucket, secret


def test_publish_and_rollback_with_a_glue_catalog_through_an_airflow_connection(conn, db_url, glue_connection,
                                                                               caplog):
    """The Glue catalog through pyiceberg's GlueCatalog against moto's Glue (a stand-in for AWS: moto
    implements the calls pyiceberg makes, version checks of update_table included), its credentials,
    region and endpoint from the Airflow connection named by ``aws_conn_id`` (the amazon provider's
    hook), the S3 warehouse on the same moto server. The secret key is in no log line, the spec or the
    publish history."""
    import boto3

    endpoint, bucket, secret = glue_connection
    caplog.set_level(logging.DEBUG)
    # Every Airflow line too (the connection's is the one a secret would ride in), whatever level an
    # in-process CLI call earlier in this process left the airflow logger at.
    caplog.set_level(logging.DEBUG, logger="airflow")
    dest = destination(f"s3://{bucket}/warehouse", aws_conn_id=GLUE_CONN, catalog={"type": "glue", "name": "glue"})
    v1 = version(conn, db_url, 20, 0, "one", dest)
    v2 = version(conn, db_url, 25, 10, "two", dest)
    publish(conn, v1)
    out = publish(conn, v2)
    assert out["destinations"][0]["destination"] == f"iceberg:glue.{TABLE}"
    ice, tbl = table(conn, dest)
    assert same_rows_everywhere(conn, tbl, endpoint) == 25
    rollback(conn, DATASET)
    assert ice.current() == v1 and same_rows_everywhere(conn, tbl, endpoint) == 20
    glue = boto3.client("glue", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
                        aws_secret_access_key="x")
    assert glue.get_table(DatabaseName="analytics", Name="tickets")["Table"]["Parameters"]["metadata_location"] \
        == tbl.refresh().metadata_location
    # Without the connection's keys there are none: the environment's are gone.
    with pytest.raises(DestinationUnavailable) as err:
        submit(conn, make_spec(output_schema=SCHEMA, publish={"destinations": [{**dest, "aws_conn_id": None}]}))
    assert "\n" not in str(err.value)
    # A connection that does not exist: one line at submit, before anything is written.
    with pytest.raises(DestinationUnavailable, match="Airflow connection 'bi_no_such_conn': .*defined") as err:
        submit(conn, make_spec(output_schema=SCHEMA, publish={"destinations": [
            {**dest, "aws_conn_id": "bi_no_such_conn"}]}))
    assert "\n" not in str(err.value)

    # The secret is nowhere it could be read back: the log, the stored spec, the publish history.
    assert ice.aws()["secret_key"] == secret      # it was used, and an error line that held it would not show it
    assert secret not in ice.error_line(RuntimeError(f"signature mismatch for {secret}"))
    stored = json.dumps([job_spec(conn, v).model_dump(mode="json") for v in (v1, v2)])
    history = json.dumps(published(conn, DATASET), default=str)
    dests = json.dumps(conn.execute("SELECT * FROM bi.publish_destinations").fetchall(), default=str)
    assert caplog.text and GLUE_CONN in stored
    for where, text in {"log": caplog.text, "spec": stored, "history": history + dests}.items():
        assert secret not in text, where


def test_a_reader_never_sees_a_mix_through_30_switches(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 30, 0, "one", dest)
    v2 = version(conn, db_url, 50, 100, "two", dest)
    publish(conn, v1)
    publish(conn, v2)
    _, tbl = table(conn, dest)
    sizes = {v1: 30, v2: 50}
    seen: list[tuple[int, int, str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        with db.connect(db_url) as c:
            _, t = table(c, dest)
            while not stop.is_set():
                try:
                    rows = t.refresh().scan(selected_fields=("record_id", "job_version")).to_arrow()
                    jvs = set(rows.column("job_version").to_pylist())
                    seen.append((rows.num_rows, len(jvs), next(iter(jvs))))
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            if i % 2 == 0:
                assert rollback(conn, DATASET)["to_version"] == v1
            else:
                assert publish(conn, v2)["to_version"] == v2
    finally:
        stop.set()
        reader.join(60)
    assert not errors, errors
    assert len(seen) >= 5
    assert all(v == 1 and n == sizes[j] for n, v, j in seen), [s for s in seen if s[1] != 1 or s[0] != sizes[s[2]]]


# -- faults --------------------------------------------------------------------

KILL = """
import os, sys
from batch_inference import db
from batch_inference.destinations.iceberg import IcebergTable
from batch_inference.publish import publish

IcebergTable._commit = lambda self, tx: os._exit(137)   # killed after writing data files, before the commit
with db.connect(sys.argv[1]) as conn:
    publish(conn, sys.argv[2])
"""


def test_killed_before_the_commit_leaves_the_table_and_the_retry_cleans_the_orphans(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 30, 0, "one", dest)
    publish(conn, v1)
    v2 = version(conn, db_url, 40, 10, "two", dest)
    ice, tbl = table(conn, dest)
    before = tbl.refresh().metadata_location
    proc = subprocess.run([sys.executable, "-c", KILL, db_url, v2], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 137, proc.stderr[-2000:]
    data = Path(tbl.location().removeprefix("file://")) / "data" / v2
    orphans = list(data.rglob("*.parquet"))
    assert orphans, "the killed publish wrote no data files"
    assert tbl.refresh().metadata_location == before and ice.current() == v1 and v2 not in tbl.metadata.refs
    assert published(conn, DATASET)["job_version"] == v1
    assert same_rows_everywhere(conn, tbl) == 30

    publish(conn, v2)    # the retry
    assert ice.current() == v2 and same_rows_everywhere(conn, tbl) == 40
    left = set(data.rglob("*.parquet"))
    assert not left & set(orphans)
    referenced = {f.removeprefix("file://") for f in tbl.refresh().inspect.files().column("file_path").to_pylist()}
    assert {str(p) for p in left} == referenced


def test_two_publishers_at_once_one_commit_wins(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 20, 0, "one", dest)
    publish(conn, v1)
    v2 = version(conn, db_url, 30, 10, "two", dest)
    v3 = version(conn, db_url, 25, 50, "three", dest)
    # Both read the table before either commits: the catalog's compare-and-swap decides.
    with db.connect(db_url) as c2:
        a, _ = table(conn, dest)
        b, _ = table(c2, dest)
        ta, tb = a._table(create=False), b._table(create=False)
        wa = Version(v2, job_spec(conn, v2), version_rows(conn, v2))
        wb = Version(v3, job_spec(c2, v3), version_rows(c2, v3))
        won = a._write(ta, wa, force=False, reason=None, previous=a.main_snapshot(ta))
        from pyiceberg.exceptions import CommitFailedException

        with pytest.raises(CommitFailedException):
            b._write(tb, wb, force=False, reason=None, previous=b.main_snapshot(tb))
        with pytest.raises(DestinationRefused, match="another publisher committed first"):
            b._lost_race(v3, None, CommitFailedException("stale metadata"))
    assert won.job_version == v2 and a.current() == v2
    # The loser's files are gone; only the winner's are referenced.
    data = Path(ta.location().removeprefix("file://")) / "data"
    assert not list((data / v3).rglob("*.parquet"))

    # Through publish(): the loser is refused with one line and its view is not switched.
    with db.connect(db_url) as c2:
        a, _ = table(conn, dest)
        results: dict[str, Any] = {}
        barrier = threading.Barrier(2)
        from batch_inference.destinations.iceberg import IcebergTable

        real_commit = IcebergTable._commit

        def racing_commit(self, tx):
            if threading.current_thread().name in ("p-a", "p-b"):
                try:
                    barrier.wait(10)
                except threading.BrokenBarrierError:
                    pass
            return real_commit(self, tx)

        IcebergTable._commit = racing_commit
        try:
            def run(name: str, c, job: str) -> None:
                try:
                    results[name] = publish(c, job)
                except BaseException as exc:  # noqa: BLE001
                    results[name] = exc

            with db.connect(db_url) as c3:
                ts = [threading.Thread(target=run, args=("a", c2, v3), name="p-a"),
                      threading.Thread(target=run, args=("b", c3, v1), name="p-b")]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(120)
        finally:
            IcebergTable._commit = real_commit
    errs = [r for r in results.values() if isinstance(r, BaseException)]
    oks = [r for r in results.values() if not isinstance(r, BaseException)]
    assert len(oks) == 1 and len(errs) == 1, results
    assert isinstance(errs[0], (DestinationRefused, psycopg.Error)), repr(errs[0])
    assert "\n" not in str(errs[0])
    live = published(conn, DATASET)["job_version"]
    assert live == oks[0]["to_version"] == a.current()


def test_a_catalog_that_is_down_fails_retryably_with_nothing_half_published(conn, db_url, tmp_path, pg_server,
                                                                           empty_db):
    # The catalog on a database of its own, which the test then refuses connections to.
    cat_url = empty_db()
    name = psycopg.conninfo.conninfo_to_dict(cat_url)["dbname"]
    with psycopg.connect(cat_url, autocommit=True) as c:
        c.execute("CREATE SCHEMA iceberg_catalog")
    host = psycopg.conninfo.conninfo_to_dict(cat_url)["host"]
    uri = f"postgresql+psycopg:///{name}?host={host}&user=postgres"
    dest = destination(str(tmp_path / "warehouse"), catalog={"uri": uri, "name": "lake"})
    v1 = version(conn, db_url, 20, 0, "one", dest)
    publish(conn, v1)
    v2 = version(conn, db_url, 30, 10, "two", dest)
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        try:
            with pytest.raises(DestinationUnavailable, match="catalog unreachable") as err:
                publish(conn, v2)
            assert "\n" not in str(err.value) and "bi-test-pw" not in str(err.value)
            assert published(conn, DATASET)["job_version"] == v1
            # At submit, too: one line, before anything is written.
            make_source(conn, tickets(5, 900))
            jobs = conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"]
            with pytest.raises(DestinationUnavailable, match="catalog unreachable"):
                submit(conn, make_spec(output_schema=SCHEMA, publish={"destinations": [dest]}))
            assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == jobs
        finally:
            admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    out = publish(conn, v2)   # the retry
    assert out["changed"] and out["destinations"][0]["job_version"] == v2


def test_a_removed_or_narrowed_field_is_refused_unless_forced(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 20, 0, "one", dest)
    publish(conn, v1)
    ice, tbl = table(conn, dest)
    # Adding a field evolves the table.
    wider = {**SCHEMA, "properties": {**SCHEMA["properties"], "language": {"type": "string"}}}
    v2 = version(conn, db_url, 20, 20, "two", dest, schema=wider,
                 out=lambda rid: {**output_for("two")(rid), "language": "en"})
    publish(conn, v2)
    assert "language" in {f.name for f in tbl.refresh().schema().fields}
    # Removing one is refused, naming it, and nothing moves.
    props = {k: v for k, v in wider["properties"].items() if k != "urgent"}
    narrower = {**wider, "properties": props, "required": [r for r in SCHEMA["required"] if r != "urgent"]}
    v3 = version(conn, db_url, 20, 40, "three", dest, schema=narrower,
                 out=lambda rid: {k: v for k, v in {**output_for("three")(rid), "language": "en"}.items()
                                  if k != "urgent"})
    with pytest.raises(DestinationRefused, match="field 'urgent' is removed") as err:
        publish(conn, v3)
    assert "\n" not in str(err.value)
    assert published(conn, DATASET)["job_version"] == v2 and ice.current() == v2
    # A type that narrows (double -> long) is refused too.
    typed = {**wider, "properties": {**wider["properties"], "confidence": {"type": "integer"}}}
    v4 = version(conn, db_url, 20, 60, "four", dest, schema=typed,
                 out=lambda rid: {**output_for("four")(rid), "language": "en", "confidence": 1})
    with pytest.raises(DestinationRefused, match="field 'confidence' changes from double to long"):
        publish(conn, v4)
    # Forced, with a reason: published, the column dropped.
    with pytest.raises(PublishRefused, match="needs a reason"):
        publish(conn, v3, force=True, reason=" ")
    out = publish(conn, v3, force=True, reason="urgent moved to the priority field")
    assert out["to_version"] == v3 and ice.current() == v3
    assert "urgent" not in {f.name for f in tbl.refresh().schema().fields}
    assert len(pyiceberg_rows(tbl)) == 20


def test_an_uncleared_record_class_is_refused(conn, db_url, tmp_path):
    dest = destination(str(tmp_path / "warehouse"), cleared_record_classes=["internal"])
    make_source(conn, tickets(10))
    restricted = make_spec(output_schema=SCHEMA, record_class="restricted", publish={"destinations": [dest]})
    with pytest.raises(NotCleared, match="record class 'restricted' is not cleared for destination"):
        submit(conn, restricted)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0
    # A version of that class at the adapter's own publish (the spec changed after submit): refused there too.
    job = submit(conn, make_spec(output_schema=SCHEMA, record_class="restricted",
                                 validation={"max_drift": 1.0})).job_version
    finish(db_url, job, output_for=output_for("x"))
    assert validate(conn, job).passed
    (ice,) = for_spec(conn, restricted)
    with pytest.raises(DestinationRefused, match="not cleared"):
        ice.publish(Version(job, restricted, version_rows(conn, job)))
    assert not (tmp_path / "warehouse").exists()


def test_an_unreachable_warehouse_fails_at_submit(conn, moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    make_source(conn, tickets(5))
    spec = make_spec(output_schema=SCHEMA, publish={"destinations": [
        destination("s3://no-such-bucket/wh", s3_endpoint=moto_s3, s3_region="us-east-1")]})
    with pytest.raises(DestinationUnavailable, match="no such bucket") as err:
        submit(conn, spec)
    assert "\n" not in str(err.value)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0


# -- Airflow -------------------------------------------------------------------

def test_the_publish_operator_reports_the_table_as_asset_event_and_lineage(conn, db_url, tmp_path, monkeypatch):
    from collections import defaultdict
    from types import SimpleNamespace

    from batch_inference.hooks.batch_inference import airflow_connection_json
    from batch_inference.operators.publish import PublishOperator, RollbackOperator, dataset_asset, iceberg_asset

    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_ICEBERG", airflow_connection_json(db_url))
    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 10, 0, "one", dest)
    v2 = version(conn, db_url, 12, 10, "two", dest)
    outlets = [dataset_asset(DATASET), iceberg_asset(TABLE)]
    events: dict[Any, Any] = defaultdict(lambda: SimpleNamespace(extra={}))
    for job in (v1, v2):
        op = PublishOperator(task_id="publish", job_version=job, postgres_conn_id="bi_test_iceberg", outlets=outlets)
        op.execute({"outlet_events": events})
    _, tbl = table(conn, dest)
    snap = tbl.refresh().current_snapshot().snapshot_id
    assert events[outlets[1]].extra["snapshot_id"] == snap and events[outlets[1]].extra["to_version"] == v2
    assert events[outlets[0]].extra["destinations"] == [
        {"destination": f"iceberg:ledger.{TABLE}", "job_version": v2, "snapshot_id": snap}]
    _, outputs = op.lineage_datasets()
    location = tbl.location().removeprefix("file://")
    assert outputs[1] == ("file", location)       # OpenLineage's naming for a local file system path
    lineage = op.get_openlineage_facets_on_complete(None)
    assert [(d.namespace, d.name) for d in lineage.outputs] == outputs
    back = RollbackOperator(task_id="rollback", dataset=DATASET, postgres_conn_id="bi_test_iceberg", outlets=outlets)
    back.execute({"outlet_events": events})
    assert events[outlets[1]].extra["to_version"] == v1
    assert events[outlets[1]].extra["snapshot_id"] == tbl.refresh().metadata.refs[v1].snapshot_id


def test_the_dashboard_history_shows_each_snapshot_and_its_rollback_moves_the_table(conn, db_url, tmp_path,
                                                                                   monkeypatch):
    from tests.integration.test_dashboard_api import ADMIN, _client

    dest = destination(str(tmp_path / "warehouse"))
    v1 = version(conn, db_url, 10, 0, "one", dest)
    v2 = version(conn, db_url, 12, 10, "two", dest)
    publish(conn, v1)
    publish(conn, v2)
    ice, tbl = table(conn, dest)
    with _client(db_url, monkeypatch) as client:
        hist = client.get(f"/api/datasets/{DATASET}/history", headers=ADMIN).json()["history"]
        assert [(h["to_version"], h["destinations"][0]["snapshot_id"]) for h in hist] == [
            (v2, tbl.refresh().metadata.refs[v2].snapshot_id), (v1, tbl.metadata.refs[v1].snapshot_id)]
        r = client.post(f"/api/datasets/{DATASET}/rollback", json={"expected_current": v2, "reason": "bad"},
                        headers=ADMIN)
        assert r.status_code == 200, r.text
        assert ice.current() == v1
        assert r.json()["history"][0]["destinations"][0]["job_version"] == v1


# -- the spec ------------------------------------------------------------------

def test_destinations_do_not_join_the_job_version_and_hold_no_credentials():
    from batch_inference.exceptions import SpecError

    plain = make_spec(output_schema=SCHEMA)
    with_dest = make_spec(output_schema=SCHEMA, publish={"destinations": [destination("/tmp/wh")]})
    assert plain.spec_hash == with_dest.spec_hash and plain.job_version("x") == with_dest.job_version("x")
    for bad, field in [({"catalog": {"uri": "postgresql+psycopg://bi:secret@db/lake"}}, "catalog.uri"),
                       ({"catalog": {"uri": "postgresql+psycopg:///lake?password=secret"}}, "catalog.uri"),
                       ({"warehouse": "s3://AKIA:secret@bucket/wh"}, "warehouse"),
                       ({"identifier": "tickets"}, "identifier")]:
        with pytest.raises(SpecError, match=field.replace(".", r"\.")) as err:
            make_spec(output_schema=SCHEMA, publish={"destinations": [destination("/tmp/wh", **bad)]})
        assert "secret" not in str(err.value)
    # aws_conn_id names a connection: a setting, not part of the job version; without it Airflow is not loaded.
    with_conn = make_spec(output_schema=SCHEMA, publish={"destinations": [destination("/tmp/wh", aws_conn_id="lake")]})
    assert with_conn.spec_hash == plain.spec_hash
    with pytest.raises(SpecError, match="aws_conn_id"):
        make_spec(output_schema=SCHEMA, publish={"destinations": [destination("/tmp/wh", aws_conn_id="a b")]})
    no_airflow = ("import sys; from batch_inference.destinations.iceberg import IcebergTable; "
                  "from tests.conftest import make_spec; s = make_spec(publish={'destinations': [{'identifier': "
                  "'a.b', 'warehouse': 's3://b/w', 's3_endpoint': 'http://127.0.0.1:1'}]}); "
                  "t = IcebergTable(s.publish.destinations[0], s); t.io_properties(); t.filesystem(); "
                  "assert not [m for m in sys.modules if m.startswith('airflow')], 'airflow imported'")
    proc = subprocess.run([sys.executable, "-c", no_airflow], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(SpecError, match="each destination may be named once"):
        make_spec(output_schema=SCHEMA, publish={"destinations": [destination("/a"), destination("/b")]})


def test_readers_enforce_the_acl_column_with_a_row_filter(conn, db_url, tmp_path):
    """The ACL travels as a column; a reader's engine filters on it (docs/publish.md): DuckDB here."""
    dest = destination(str(tmp_path / "warehouse"))
    publish(conn, version(conn, db_url, 30, 0, "one", dest))
    _, tbl = table(conn, dest)
    rows = duck().execute(f"SELECT record_id FROM iceberg_scan('{tbl.metadata_location}') "
                          "WHERE list_has_any(acl, ['team1']) ORDER BY record_id").fetchall()
    want = conn.execute("SELECT record_id FROM published.tickets_triage WHERE acl && ARRAY['team1'] "
                        "ORDER BY record_id").fetchall()
    assert [r[0] for r in rows] == [r["record_id"] for r in want] and len(rows) == 10
