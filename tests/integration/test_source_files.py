"""``kind: parquet`` (local files, and objects on moto's real S3-compatible server) and ``kind: iceberg``
(pyiceberg's SQL catalog in the ledger's database, as the Iceberg destination uses): the same
two-column tickets give the ledger table's job version; what pins the input is recorded with the
job, and a resubmit of the stored spec reads the same rows or fails in one line."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_inference.exceptions import SnapshotError
from batch_inference.plan import submit
from batch_inference.spec import parse_spec
from tests.integration.test_sources import s3  # noqa: F401  (fixture: a bucket and the AWS connection bi_test_s3)
from tests.fixtures.sources import TICKETS, expected_turn, run_end_to_end, two_column_spec
from tests.integration.test_source_columns import make_tickets


def arrow(rows) -> pa.Table:
    return pa.table({"id": [r[0] for r in rows], "subject": [r[1] for r in rows], "body": [r[2] for r in rows],
                     "acl": pa.array([r[3] for r in rows], pa.list_(pa.string()))})


def stored_source(conn, job: str) -> dict:
    return conn.execute("SELECT spec FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["spec"]["source"]


def nothing_written(conn) -> bool:
    return conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0


# -- Parquet --------------------------------------------------------------------------------------

def test_local_parquet_files_are_one_job_version_with_the_ledger_table(conn, tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(arrow(TICKETS[:2]), tmp_path / "data" / "part-0.parquet")
    pq.write_table(arrow(TICKETS[2:]), tmp_path / "data" / "part-1.parquet")
    m = submit(conn, two_column_spec({"kind": "parquet", "paths": [str(tmp_path / "data")]}))
    in_ledger = submit(conn, two_column_spec({"table": make_tickets(conn)}))
    assert in_ledger.job_version == m.job_version and not in_ledger.created and m.records == 3
    pins = stored_source(conn, m.job_version)["paths"]   # each file, as listed at submit
    assert [p["path"].rsplit("/", 1)[1] for p in pins] == ["part-0.parquet", "part-1.parquet"]
    assert all(p["size"] > 0 and p["mtime_ns"] > 0 for p in pins)


def test_a_local_file_that_changed_after_it_was_listed_is_refused(conn, tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(arrow(TICKETS), path)
    spec = two_column_spec({"kind": "parquet", "paths": [str(path)]})
    from batch_inference.sources import for_spec

    pinned = for_spec(spec).pinned()        # listed and pinned (size, modification time)...
    pq.write_table(arrow(TICKETS[:1]), path)  # ...then rewritten
    with pytest.raises(SnapshotError) as err:
        submit(conn, pinned)
    assert "\n" not in str(err.value) and "changed after it was listed" in str(err.value)
    assert nothing_written(conn)


def _put_parquet(client, bucket: str, key: str, rows) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(arrow(rows), sink)
    client.put_object(Bucket=bucket, Key=key, Body=sink.getvalue().to_pybytes())


def test_parquet_on_s3_runs_end_to_end_pinned_by_etag(conn, db_url, s3):
    client, bucket = s3
    _put_parquet(client, bucket, "tickets/part-0.parquet", TICKETS[:1])
    _put_parquet(client, bucket, "tickets/part-1.parquet", TICKETS[1:])
    client.put_object(Bucket=bucket, Key="tickets/_SUCCESS", Body=b"")
    in_ledger = submit(conn, two_column_spec({"table": make_tickets(conn)}, dataset="tickets_pq")).job_version
    spec = two_column_spec({"kind": "parquet", "paths": [f"s3://{bucket}/tickets/"], "conn_id": "bi_test_s3"},
                           dataset="tickets_pq")
    job, seen = run_end_to_end(conn, db_url, spec)
    assert job == in_ledger
    assert seen == {r[0]: expected_turn(r[1], r[2]) for r in TICKETS}


def test_an_s3_file_that_changed_after_it_was_listed_is_refused(conn, s3):
    client, bucket = s3
    _put_parquet(client, bucket, "t/part-0.parquet", TICKETS)
    spec = two_column_spec({"kind": "parquet", "paths": [f"s3://{bucket}/t/"], "conn_id": "bi_test_s3"})
    m = submit(conn, spec)
    pinned = stored_source(conn, m.job_version)
    assert [p["path"] for p in pinned["paths"]] == [f"s3://{bucket}/t/part-0.parquet"]
    assert pinned["paths"][0]["etag"]
    # The stored spec, resubmitted, reads the same object or nothing.
    stored = conn.execute("SELECT spec FROM bi.jobs WHERE job_version = %s", (m.job_version,)).fetchone()["spec"]
    assert submit(conn, parse_spec(stored)).job_version == m.job_version
    _put_parquet(client, bucket, "t/part-0.parquet", TICKETS[:1])
    conn.execute("DELETE FROM bi.jobs")   # (the version exists; a resubmit would write nothing anyway)
    with pytest.raises(SnapshotError) as err:
        submit(conn, parse_spec(stored))
    assert "\n" not in str(err.value) and "changed after it was listed" in str(err.value)


# -- Iceberg --------------------------------------------------------------------------------------

@pytest.fixture
def iceberg_table(conn, tmp_path):
    """An Iceberg table in the SQL catalog in the ledger's database, as the Iceberg destination makes one."""
    from batch_inference.destinations.iceberg import IcebergTable
    from batch_inference.spec import Destination

    dest = Destination(kind="iceberg", identifier="lake.tickets", warehouse=str(tmp_path / "wh"))
    adapter = IcebergTable(dest, two_column_spec({"table": "x"}), ledger=conn)
    cat = adapter.catalog()
    cat.create_namespace_if_not_exists("lake")
    tbl = cat.create_table("lake.tickets", arrow(TICKETS).schema)
    yield tbl
    adapter.close()


def iceberg_spec(tmp_path, **source):
    return two_column_spec({"kind": "iceberg", "identifier": "lake.tickets", "warehouse": str(tmp_path / "wh"),
                            **source})


def test_an_iceberg_snapshot_is_one_job_version_and_stays_it_after_the_table_moves_on(conn, tmp_path,
                                                                                     iceberg_table):
    iceberg_table.append(arrow(TICKETS))
    first = iceberg_table.refresh().current_snapshot().snapshot_id
    in_ledger = submit(conn, two_column_spec({"table": make_tickets(conn)})).job_version
    m = submit(conn, iceberg_spec(tmp_path))
    assert m.job_version == in_ledger and not m.created
    iceberg_table.append(arrow([("t9", "Later", "A later ticket.", None)]))   # the table moves on
    moved = submit(conn, iceberg_spec(tmp_path))
    assert moved.job_version != in_ledger and moved.records == 4
    assert stored_source(conn, moved.job_version)["snapshot_id"] != first
    again = submit(conn, iceberg_spec(tmp_path, snapshot_id=first))
    assert again.job_version == in_ledger and not again.created


def test_an_iceberg_job_runs_end_to_end(conn, db_url, tmp_path, iceberg_table):
    iceberg_table.append(arrow(TICKETS))
    job, seen = run_end_to_end(conn, db_url, iceberg_spec(tmp_path))
    assert seen == {r[0]: expected_turn(r[1], r[2]) for r in TICKETS}
    assert stored_source(conn, job)["snapshot_id"] == iceberg_table.refresh().current_snapshot().snapshot_id


@pytest.mark.parametrize("case,source,words", [
    ("unknown snapshot", {"snapshot_id": 12345}, ["snapshot id 12345 does not exist"]),
    ("unknown table", {"identifier": "lake.nope"}, ["no such table lake.nope"]),
])
def test_bad_iceberg_input_is_one_line_and_nothing_is_written(conn, tmp_path, iceberg_table, case, source, words):
    iceberg_table.append(arrow(TICKETS))
    with pytest.raises(SnapshotError) as err:
        submit(conn, iceberg_spec(tmp_path, **source))
    line = str(err.value)
    assert "\n" not in line and "iceberg lake." in line and all(w in line for w in words), line
    assert nothing_written(conn)


def test_lineage_names_files_objects_and_tables_as_openlineage_does(conn, tmp_path, iceberg_table):
    from batch_inference.sources import for_spec

    local = for_spec(two_column_spec({"kind": "parquet", "paths": [str(tmp_path / "data"), "s3://lake/t/"]}))
    assert local.lineage() == [("file", str(tmp_path / "data")), ("s3://lake", "t")]
    reader = for_spec(iceberg_spec(tmp_path))
    reader.ledger = conn
    [(namespace, name)] = reader.lineage()
    location = iceberg_table.metadata_location.split("://", 1)[1].rsplit("/metadata/", 1)[0]
    assert (namespace, name) == ("file", location)
    reader.close()
