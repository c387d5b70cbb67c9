"""Publishing to an Apache Iceberg table: its cost against pyarrow's Parquet writer, and a rollback's time.

    python -m benchmarks.lakehouse                       # 1,000,000 rows; rollback at 10,000 and 1,000,000
    python -m benchmarks.lakehouse --records 20000 --rollback-sizes 1000,20000 --repeats 1

Both arms read the same version's rows from the ledger through the same query
and convert them with the same code (``destinations.iceberg.arrow_batches``):

* ``parquet``: pyarrow's ``ParquetWriter`` writes them to one local file
  (zstd), nothing else: the floor for writing those rows as Parquet;
* ``iceberg``: ``IcebergTable.publish`` of the version to a fresh table of a
  local warehouse (SQL catalog on the same PostgreSQL): the same writes, then
  the one catalog commit that replaces the table, tags the snapshot and moves
  ``main``.

``ratio`` is iceberg / parquet, medians over alternating repeats (goal 1.5).
``parquet_write_only_s`` is the writer alone over the rows already in Arrow,
for scale. The rollback is ``publish.rollback`` (the view and ``main`` moved
back) alternated with ``publish.publish`` of the newer version (``main``
moved to its tag), at two table sizes; ``rollback_size_ratio`` is the large
table's median over the small one's (goal: about 1, independent of size).

The results are written straight into the ledger by one INSERT ... SELECT
over the snapshot, not by a worker: the benchmark measures publishing, and
that is not where results come from.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from batch_inference import db, publish
from batch_inference.destinations import Version, version_rows
from batch_inference.destinations.iceberg import IcebergTable, arrow_batches, table_schema
from batch_inference.plan import submit
from batch_inference.spec import Destination
from benchmarks.common import bench_spec, emit, fresh_server, machine, make_tickets, median, rnd

TARGET_RATIO = 1.5
TARGET_ROLLBACK_RATIO = 2.0


def make_version(conn: psycopg.Connection, dataset: str, n: int, text_len: int, dest: dict[str, Any]) -> str:
    """A finished job version of ``n`` rows, its results written in one statement."""
    make_tickets(conn, n, text_len=text_len)
    spec = bench_spec(dataset=dataset, publish={"destinations": [dest]}, shard_size=50_000)
    job = submit(conn, spec).job_version
    conn.execute(
        """INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                                   prompt_version, transport, engine, endpoint, acl, content_hash)
           SELECT s.job_version, s.record_id,
                  jsonb_build_object('category', (ARRAY['billing','bug','account','other'])[1 + abs(hashtext(s.record_id)) %% 4],
                                     'summary', 'The customer reports ' || repeat('a double charge ', 16) || s.record_id),
                  (ARRAY['billing','bug','account','other'])[1 + abs(hashtext(s.record_id)) %% 4],
                  'noop', %(digest)s, 'v1', 'batch', 'noop', 'local', s.acl, s.content_hash
             FROM bi.snapshot_rows s WHERE s.job_version = %(job)s""",
        {"job": job, "digest": spec.model.digest})
    conn.execute("UPDATE bi.shards SET state = 'done', stored = records WHERE job_version = %(job)s", {"job": job})
    conn.execute("ANALYZE bi.results")
    return job


def parquet_arm(conn: psycopg.Connection, job: str, spec: Any, out: Path) -> float:
    import pyarrow.parquet as pq

    schema, convs = table_schema(spec)
    arrow_schema = schema.as_arrow()
    t0 = time.perf_counter()
    with pq.ParquetWriter(str(out), arrow_schema, compression="zstd") as w:
        for batch in arrow_batches(Version(job, spec, version_rows(conn, job)), arrow_schema, convs):
            w.write_table(batch)
    return time.perf_counter() - t0


def write_only(conn: psycopg.Connection, job: str, spec: Any, out: Path) -> float:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, convs = table_schema(spec)
    arrow_schema = schema.as_arrow()
    table = pa.concat_tables(arrow_batches(Version(job, spec, version_rows(conn, job)), arrow_schema, convs))
    t0 = time.perf_counter()
    pq.write_table(table, str(out), compression="zstd")
    return time.perf_counter() - t0


def iceberg_arm(conn: psycopg.Connection, job: str, spec: Any, dest: dict[str, Any], name: str) -> float:
    ice = IcebergTable(Destination.model_validate({**dest, "identifier": f"bench.{name}"}), spec, ledger=conn)
    version = Version(job, spec, version_rows(conn, job))
    t0 = time.perf_counter()
    pointed = ice.publish(version)
    took = time.perf_counter() - t0
    assert pointed.changed and pointed.job_version == job
    return took


def rollback_times(conn: psycopg.Connection, dataset: str, n: int, dest: dict[str, Any], repeats: int
                   ) -> dict[str, Any]:
    a = make_version(conn, dataset, n, 60, dest)
    b = make_version(conn, dataset, n, 80, dest)
    publish.publish(conn, a, force=True, reason="benchmark")
    publish.publish(conn, b, force=True, reason="benchmark")
    back, forward = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert publish.rollback(conn, dataset)["to_version"] == a
        back.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert publish.publish(conn, b, force=True, reason="benchmark")["to_version"] == b
        forward.append(time.perf_counter() - t0)
    return {"rows": n, "rollback_s": rnd(median(back)), "republish_s": rnd(median(forward))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--rollback-sizes", default="10000,1000000", help="two table sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    small, large = (int(x) for x in a.rollback_sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="bi-lake-") as tmp, fresh_server() as url, db.connect(url) as conn:
        dest = {"identifier": "bench.results", "warehouse": str(Path(tmp) / "warehouse"),
                "cleared_record_classes": ["internal"]}
        job = make_version(conn, "bench", a.records, 60, dest)
        spec = bench_spec(dataset="bench", publish={"destinations": [dest]}, shard_size=50_000)
        pq_s, ice_s = [], []
        for i in range(a.repeats):       # alternating arms: a load change hits both
            pq_s.append(parquet_arm(conn, job, spec, Path(tmp) / f"baseline_{i}.parquet"))
            ice_s.append(iceberg_arm(conn, job, spec, dest, f"run_{i}"))
        only = write_only(conn, job, spec, Path(tmp) / "write_only.parquet")
        rb = {str(n): rollback_times(conn, f"bench_rb{j}", n, {**dest, "identifier": f"bench.rollback_{j}"},
                                     a.repeats) for j, n in enumerate((small, large))}
        ratio = median(ice_s) / median(pq_s)
        rb_ratio = rb[str(large)]["rollback_s"] / rb[str(small)]["rollback_s"]
        emit({
            "benchmark": "lakehouse",
            "target": f"iceberg publish <= {TARGET_RATIO}x pyarrow's Parquet writer; rollback time independent "
                      "of table size",
            "met": ratio <= TARGET_RATIO and rb_ratio <= TARGET_ROLLBACK_RATIO,
            "records": a.records,
            "parquet_s": rnd(median(pq_s)),
            "iceberg_s": rnd(median(ice_s)),
            "ratio": rnd(ratio),
            "parquet_write_only_s": rnd(only),
            "rollback": rb,
            "rollback_size_ratio": rnd(rb_ratio),
            "repeats": a.repeats,
            "machine": machine(),
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
