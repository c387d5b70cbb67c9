"""Submit from each source kind against that source's own client reading the same rows, and peak memory.

    python -m benchmarks.sources                       # 100k and 1M records, every kind run here
    python -m benchmarks.sources --sizes 20000 --kinds sqlite,parquet

For each size, the same two-column tickets (id, subject, body, acl) are
written once to every source: a SQLite file (kind sql, the sqlite provider's
hook), a table of a second database reached through the postgres provider's
connection (kind sql), a local Parquet file (kind parquet) and an Iceberg
table in the SQL catalog (kind iceberg). Then, each in its own fresh process
(so its peak RSS is its own): ``client`` reads every row with the source's
own client (sqlite3 / psycopg2 ``fetchmany`` over a server-side cursor,
pyarrow's ``iter_batches``, pyiceberg's ``to_arrow_batch_reader``) and turns
each row into Python values, the least any reader must do; ``reader`` iterates
``sources.for_spec(spec).rows()`` (the same read plus the record's text and
checks); ``submit`` is ``plan.submit`` end to end (read, COPY into the
ledger, content hash, snapshot partition, shard plan, commit). Ratios are to
``client`` in the same run. ``peak_rss_mib`` is each process's maximum RSS and
``growth_mib`` its growth after the imports; neither should grow with the
records (the rows are streamed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO, emit, fresh_server, machine, rnd  # noqa: E402

KINDS = ("sqlite", "postgres", "parquet", "iceberg")
TARGET = 1.3          # issue 30: submit of N records against the source's own client reading them
MEMORY_SLACK = 1.25   # "flat": the peak at the largest size within this factor of the smallest's
BATCH = 50_000
TEMPLATE = "Subject:\n<<<\n{subject}\n>>>\nBody:\n<<<\n{body}\n>>>"


def _rows(start: int, stop: int) -> dict[str, list[Any]]:
    ids = range(start, stop)
    return {"id": [f"t{i:09d}" for i in ids], "subject": [f"Ticket {i}" for i in ids],
            "body": [f"Ticket {i}: I was charged twice for my subscription." for i in ids],
            "acl": [[f"team{i % 3}"] for i in ids]}


def prepare(n: int, where: Path, url: str) -> dict[str, Any]:
    """Write the same n tickets to every source; return what each child needs."""
    import psycopg
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("subject", pa.string()), ("body", pa.string()),
                        ("acl", pa.list_(pa.string()))])
    db = sqlite3.connect(where / "src.db")
    db.execute("CREATE TABLE tickets (id TEXT, subject TEXT, body TEXT, acl TEXT)")
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    src_url = make_conninfo(url, dbname="src")
    with psycopg.connect(make_conninfo(url, dbname="postgres"), autocommit=True) as c:
        c.execute("DROP DATABASE IF EXISTS src")
        c.execute("CREATE DATABASE src")
    writer = pq.ParquetWriter(where / "tickets.parquet", schema)
    from batch_inference import db as ledger_db
    from batch_inference.destinations.iceberg import IcebergTable
    from batch_inference.spec import Destination

    ledger = ledger_db.connect(url)
    adapter = IcebergTable(Destination(identifier="lake.tickets", warehouse=str(where / "wh")), spec("x"),
                           ledger=ledger)
    cat = adapter.catalog()
    cat.create_namespace_if_not_exists("lake")
    try:
        cat.drop_table("lake.tickets")
    except Exception:  # noqa: BLE001 - not there yet
        pass
    tbl = cat.create_table("lake.tickets", schema)
    with psycopg.connect(src_url, autocommit=True) as pg:
        pg.execute("CREATE TABLE public.tickets (id text, subject text, body text, acl text[])")
        for start in range(0, n, BATCH):
            d = _rows(start, min(n, start + BATCH))
            db.executemany("INSERT INTO tickets VALUES (?, ?, ?, ?)",
                           zip(d["id"], d["subject"], d["body"], (json.dumps(a) for a in d["acl"])))
            with pg.cursor().copy("COPY public.tickets FROM STDIN") as cp:
                for row in zip(d["id"], d["subject"], d["body"], d["acl"]):
                    cp.write_row(row)
            t = pa.table(d, schema=schema)
            writer.write_table(t)
            tbl.append(t)
    db.commit()
    db.close()
    writer.close()
    adapter.close()
    ledger.close()
    p = conninfo_to_dict(src_url)
    return {"sqlite": str(where / "src.db"), "parquet": str(where / "tickets.parquet"),
            "warehouse": str(where / "wh"),
            "pg": {"conn_type": "postgres", "host": p.get("host"), "login": p.get("user"),
                   "password": p.get("password"), "schema": "src", "port": int(p.get("port") or 5432)}}


def spec(kind: str, paths: dict[str, Any] | None = None) -> Any:
    from batch_inference.spec import parse_spec
    from benchmarks.common import BENCH_SCHEMA, NOOP_DIGEST

    source: dict[str, Any] = {"kind": "sql", "conn_id": "bench_sqlite", "table": "tickets"}
    if kind == "postgres":
        source = {"kind": "sql", "conn_id": "bench_pg", "table": "public.tickets"}
    elif kind == "parquet":
        source = {"kind": "parquet", "paths": [paths["parquet"] if paths else "."]}
    elif kind == "iceberg":
        source = {"kind": "iceberg", "identifier": "lake.tickets", "warehouse": paths["warehouse"] if paths else "."}
    return parse_spec({
        "dataset": "bench", "source": {**source, "id_column": "id", "columns": ["subject", "body"],
                                       "acl_column": "acl"},
        "model": {"name": "noop", "digest": NOOP_DIGEST}, "engine": {"name": "noop"},
        "prompt": {"version": "v1", "system": "Classify the ticket.", "template": TEMPLATE},
        "output_schema": BENCH_SCHEMA, "shard_size": 5000})


def client_read(kind: str, paths: dict[str, Any], url: str) -> int:
    """Every row through the source's own client, as Python values."""
    n = 0
    if kind == "sqlite":
        db = sqlite3.connect(paths["sqlite"])
        cur = db.execute("SELECT id, subject, body, acl FROM tickets")
        while rows := cur.fetchmany(10_000):
            n += len(rows)
        db.close()
    elif kind == "postgres":
        import psycopg2

        p = paths["pg"]
        c = psycopg2.connect(host=p["host"], user=p["login"], password=p["password"], dbname="src", port=p["port"])
        c.set_session(isolation_level="REPEATABLE READ", readonly=True)
        cur = c.cursor(name="bench")
        cur.itersize = 10_000
        cur.execute("SELECT id, subject, body, acl FROM public.tickets")
        while rows := cur.fetchmany(10_000):
            n += len(rows)
        c.close()
    elif kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(paths["parquet"]).iter_batches(batch_size=10_000):
            n += len(batch.to_pydict()["id"])
    else:
        from batch_inference import db as ledger_db
        from batch_inference.destinations.iceberg import IcebergTable
        from batch_inference.spec import Destination

        with ledger_db.connect(url) as ledger:
            adapter = IcebergTable(Destination(identifier="lake.tickets", warehouse=paths["warehouse"]),
                                   spec("x"), ledger=ledger)
            for batch in adapter.catalog().load_table("lake.tickets").scan().to_arrow_batch_reader():
                n += len(batch.to_pydict()["id"])
            adapter.close()
    return n


def _peak_mib() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss carries the parent's peak over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, kind: str, paths: dict[str, Any], url: str) -> dict[str, Any]:
    """One mode over one source; the clock and the memory count start after the imports every mode shares
    (Airflow and its provider hooks, pyarrow, pyiceberg: a process's fixed cost, not a row's)."""
    import pyarrow.parquet  # noqa: F401
    import pyiceberg.catalog.sql  # noqa: F401
    from airflow.providers.postgres.hooks.postgres import PostgresHook  # noqa: F401
    from airflow.providers.sqlite.hooks.sqlite import SqliteHook  # noqa: F401
    from airflow.sdk import BaseHook  # noqa: F401

    from batch_inference import db as ledger_db
    from batch_inference import sources
    from batch_inference.plan import submit
    from batch_inference.sources import iceberg, parquet, sql  # noqa: F401

    base = _peak_mib()
    t0 = time.perf_counter()
    if mode == "client":
        n = client_read(kind, paths, url)
    elif mode == "reader":
        with ledger_db.connect(url) as ledger:
            reader = sources.for_spec(spec(kind, paths))
            reader.ledger = ledger
            reader.check()
            n = sum(1 for _ in reader.rows())
            reader.close()
    else:
        with ledger_db.connect(url) as ledger:
            m = submit(ledger, spec(kind, paths))
            n = m.records
            from batch_inference.plan import drop_job_version

            t = time.perf_counter() - t0
            drop_job_version(ledger, m.job_version)
            return {"n": n, "s": t, "peak_rss_mib": _peak_mib(), "growth_mib": _peak_mib() - base}
    return {"n": n, "s": time.perf_counter() - t0, "peak_rss_mib": _peak_mib(), "growth_mib": _peak_mib() - base}


def run_child(mode: str, kind: str, paths: dict[str, Any], url: str, env: dict[str, str]) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "benchmarks.sources", "--child", mode, "--kinds", kind,
                        "--paths", json.dumps(paths), "--url", url], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} {kind}: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def run(sizes: list[int], kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "sources", "sizes": sizes, "results": {}}
    with fresh_server() as url:
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix="bi-bench-src-") as d:
                paths = prepare(n, Path(d), url)
                env = {**os.environ, "AIRFLOW_HOME": str(Path(d) / "airflow"),
                       "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                       "AIRFLOW_CONN_BENCH_SQLITE": json.dumps({"conn_type": "sqlite", "host": paths["sqlite"]}),
                       "AIRFLOW_CONN_BENCH_PG": json.dumps(paths["pg"])}
                for kind in kinds:
                    r = {mode: run_child(mode, kind, paths, url, env) for mode in ("client", "reader", "submit")}
                    assert r["client"]["n"] == r["reader"]["n"] == r["submit"]["n"] == n, r
                    base = r["client"]["s"]
                    out["results"][f"{kind}@{n}"] = {
                        "client_s": rnd(base), "reader_s": rnd(r["reader"]["s"]), "submit_s": rnd(r["submit"]["s"]),
                        "reader_ratio": round(r["reader"]["s"] / base, 2),
                        "submit_ratio": round(r["submit"]["s"] / base, 2),
                        "peak_rss_mib": {m: round(r[m]["peak_rss_mib"]) for m in r},
                        "growth_mib": {m: round(r[m]["growth_mib"]) for m in r}}
    largest, smallest = max(sizes), min(sizes)
    res = out["results"]
    out["target"] = f"submit <= {TARGET}x the client's read; peak RSS at {largest} within {MEMORY_SLACK}x of {smallest}"
    out["memory_flat"] = all(res[f"{k}@{largest}"]["peak_rss_mib"]["submit"]
                             <= MEMORY_SLACK * res[f"{k}@{smallest}"]["peak_rss_mib"]["submit"] for k in kinds)
    out["met"] = out["memory_flat"] and all(res[f"{k}@{largest}"]["submit_ratio"] <= TARGET for k in kinds)
    out["machine"] = machine()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.kinds, json.loads(a.paths), a.url)))
        return 0
    emit(run([int(s) for s in a.sizes.split(",")], a.kinds.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
