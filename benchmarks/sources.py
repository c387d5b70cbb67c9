"""Submit from each source kind against that source's own client reading the same rows, and peak memory.

    python -m benchmarks.sources                       # 100k and 1M records, every kind run here
    python -m benchmarks.sources --sizes 20000 --kinds sqlite,parquet

For each size, the same two-column tickets (id, subject, body, acl) are
written once to every source: a SQLite file (kind sql, the sqlite provider's
hook), a table of a second database reached through the postgres provider's
connection (kind sql), a MariaDB table (kind sql, the mysql provider's hook;
Debian's MariaDB started as tests/fixtures/warehouses.py starts it), a local
Parquet file and the same file on moto's S3 server (kind parquet;
tests/fixtures/moto_server.py), an Iceberg table in the SQL catalog (kind
iceberg) and a table of fakesnow's server (kind sql, the snowflake provider's
hook and snowflake-connector-python over HTTP, read by ``fetch_arrow_batches``;
tests/fixtures/warehouses.fakesnow_process). fakesnow is not Snowflake: it is
DuckDB behind an HTTP server that speaks the connector's protocol, so that
kind's figures measure fakesnow and the connector here, not a warehouse.
Then, each in its own fresh process (so its peak RSS is its own; --fork-children: see CHILD_IMPORTS):
``client`` reads every row with the source's own client (with Python's cyclic
collector paused, as the reader pauses it for each batch; sqlite3 / psycopg2 /
mysqlclient / snowflake-connector-python ``fetchmany``, over a server-side
cursor where there is one, pyarrow's
``iter_batches`` on a local file or through pyarrow's S3 filesystem,
pyiceberg's ``to_arrow_batch_reader``) and turns each row into Python values
(``to_pydict`` for the Arrow kinds); ``reader`` iterates
``sources.for_spec(spec).rows().batches()`` (the same read plus the records'
text, JSON array, ACL and checks, column-wise); ``submit`` is ``plan.submit``
end to end (read, binary COPY into the ledger, content hash, snapshot
partition, shard plan, commit). Ratios are to ``client`` in the same run.
``peak_rss_mib`` is each process's maximum RSS and ``growth_mib`` its growth
after the imports; neither should grow with the records (the rows are
streamed). ``job_version`` is each submit's: the same rows from every kind
are one job version, and at the smallest size it is checked against
``reference``, the same rows made row by row by ``sources.record`` (the rule's
reference path) and submitted as Python rows.
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

KINDS = ("sqlite", "postgres", "mariadb", "parquet", "parquet_s3", "iceberg", "snowflake")
SNOW_TABLE = "BI_SRC.PUBLIC.TICKETS"
TARGET = 1.5          # issue 37: submit of N records against the source's own client reading them
BUCKET = "bench"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
MEMORY_SLACK = 1.25   # "flat": the peak at the largest size within this factor of the smallest's
BATCH = 50_000
TEMPLATE = "Subject:\n<<<\n{subject}\n>>>\nBody:\n<<<\n{body}\n>>>"


def _rows(start: int, stop: int) -> dict[str, list[Any]]:
    ids = range(start, stop)
    return {"id": [f"t{i:09d}" for i in ids], "subject": [f"Ticket {i}" for i in ids],
            "body": [f"Ticket {i}: I was charged twice for my subscription." for i in ids],
            "acl": [[f"team{i % 3}"] for i in ids]}


def prepare(n: int, where: Path, url: str, maria: dict[str, Any] | None = None,
            s3: str | None = None, snow: dict[str, Any] | None = None,
            kinds: tuple[str, ...] | list[str] = KINDS) -> dict[str, Any]:
    """Write the same n tickets to every source of ``kinds`` (and SQLite, the reference's, and Parquet);
    return what each child needs."""
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
    tbl = cat.create_table("lake.tickets", schema) if "iceberg" in kinds else None
    my = None
    if maria:
        import MySQLdb

        my = MySQLdb.connect(host=maria["host"], port=maria["port"], user=maria["user"],
                             password=maria["password"], database=maria["database"], charset="utf8mb4")
        my.cursor().execute("DROP TABLE IF EXISTS tickets")
        my.cursor().execute("CREATE TABLE tickets (id varchar(64) PRIMARY KEY, subject text, body text, acl text)")
    with psycopg.connect(src_url, autocommit=True) as pg:
        pg.execute("CREATE TABLE public.tickets (id text, subject text, body text, acl text[])")
        for start in range(0, n, BATCH):
            d = _rows(start, min(n, start + BATCH))
            acl_json = [json.dumps(a) for a in d["acl"]]
            db.executemany("INSERT INTO tickets VALUES (?, ?, ?, ?)", zip(d["id"], d["subject"], d["body"], acl_json))
            if my is not None:
                my.cursor().executemany("INSERT INTO tickets VALUES (%s, %s, %s, %s)",
                                        list(zip(d["id"], d["subject"], d["body"], acl_json)))
                my.commit()
            if "postgres" in kinds:
                with pg.cursor().copy("COPY public.tickets FROM STDIN") as cp:
                    for row in zip(d["id"], d["subject"], d["body"], d["acl"]):
                        cp.write_row(row)
            t = pa.table(d, schema=schema)
            writer.write_table(t)
            if tbl is not None:
                tbl.append(t)
    db.commit()
    db.close()
    writer.close()
    adapter.close()
    ledger.close()
    if my is not None:
        my.close()
    if s3:
        import boto3

        client = boto3.client("s3", endpoint_url=s3, **_boto_keys())
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        client.upload_file(str(where / "tickets.parquet"), BUCKET, "tickets.parquet")
    if snow:
        _load_snowflake(snow, n)
    p = conninfo_to_dict(src_url)
    return {"sqlite": str(where / "src.db"), "parquet": str(where / "tickets.parquet"),
            "warehouse": str(where / "wh"), "s3": s3,
            "pg": {"conn_type": "postgres", "host": p.get("host"), "login": p.get("user"),
                   "password": p.get("password"), "schema": "src", "port": int(p.get("port") or 5432)},
            "maria": maria and {"conn_type": "mysql", "host": maria["host"], "port": maria["port"],
                                "login": maria["user"], "password": maria["password"],
                                "schema": maria["database"], "extra": {"charset": "utf8mb4"}},
            "snow": snow and {"conn_type": "snowflake", "login": "fake", "password": "snow", "schema": "PUBLIC",
                              "extra": {"account": "fakesnow", "database": "BI_SRC", "warehouse": "WH",
                                        "host": snow["host"], "port": snow["port"]}}}


def _snowflake_connect(snow: dict[str, Any], **kw: Any) -> Any:
    import snowflake.connector

    return snowflake.connector.connect(user="fake", password="snow", account="fakesnow", host=snow["host"],
                                       port=snow["port"], protocol="http", network_timeout=600,
                                       session_parameters={"CLIENT_OUT_OF_BAND_TELEMETRY_ENABLED": False}, **kw)


def _load_snowflake(snow: dict[str, Any], n: int) -> None:
    """The same n tickets as ``_rows`` in fakesnow, made by its server (Snowflake's GENERATOR, run by DuckDB)."""
    with _snowflake_connect(snow) as db:
        cur = db.cursor()
        cur.execute("CREATE DATABASE IF NOT EXISTS BI_SRC")
        cur.execute("CREATE SCHEMA IF NOT EXISTS BI_SRC.PUBLIC")
        cur.execute(f"CREATE OR REPLACE TABLE {SNOW_TABLE} (ID VARCHAR, SUBJECT VARCHAR, BODY VARCHAR, ACL VARCHAR)")
        cur.execute(f"""INSERT INTO {SNOW_TABLE}
                        SELECT 't' || LPAD(TO_VARCHAR(i), 9, '0'), 'Ticket ' || i,
                               'Ticket ' || i || ': I was charged twice for my subscription.',
                               '["team' || MOD(i, 3) || '"]'
                          FROM (SELECT SEQ4() AS i FROM TABLE(GENERATOR(ROWCOUNT => {int(n)})))""")


def _boto_keys() -> dict[str, str]:
    return {"aws_access_key_id": S3_KEYS["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_KEYS["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_KEYS["AWS_DEFAULT_REGION"]}


def spec(kind: str, paths: dict[str, Any] | None = None) -> Any:
    from batch_inference.spec import parse_spec
    from benchmarks.common import BENCH_SCHEMA, NOOP_DIGEST

    source: dict[str, Any] = {"kind": "sql", "conn_id": "bench_sqlite", "table": "tickets"}
    if kind == "postgres":
        source = {"kind": "sql", "conn_id": "bench_pg", "table": "public.tickets"}
    elif kind == "mariadb":
        source = {"kind": "sql", "conn_id": "bench_maria", "table": "tickets"}
    elif kind == "parquet":
        source = {"kind": "parquet", "paths": [paths["parquet"] if paths else "."]}
    elif kind == "parquet_s3":
        source = {"kind": "parquet", "paths": [f"s3://{BUCKET}/tickets.parquet"],
                  **({"s3_endpoint": paths["s3"]} if paths else {})}
    elif kind == "snowflake":
        source = {"kind": "sql", "conn_id": "bench_snow", "table": "TICKETS"}
    elif kind == "iceberg":
        source = {"kind": "iceberg", "identifier": "lake.tickets", "warehouse": paths["warehouse"] if paths else "."}
    return parse_spec({
        "dataset": "bench", "source": {**source, "id_column": "id", "columns": ["subject", "body"],
                                       "acl_column": "acl"},
        "model": {"name": "noop", "digest": NOOP_DIGEST}, "engine": {"name": "noop"},
        "prompt": {"version": "v1", "system": "Classify the ticket.", "template": TEMPLATE},
        "output_schema": BENCH_SCHEMA, "shard_size": 5000})


def client_read(kind: str, paths: dict[str, Any], url: str) -> int:
    """Every row through the source's own client, as Python values, with Python's cyclic collector paused
    as the reader pauses it for each batch (``sources.base.collection_paused``), and a local Parquet file
    read without pre-buffering, as the reader reads it: the client at its best."""
    from batch_inference.sources.base import collection_paused

    with collection_paused():
        return _client_read(kind, paths, url)


def _client_read(kind: str, paths: dict[str, Any], url: str) -> int:
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
    elif kind == "mariadb":
        import MySQLdb
        import MySQLdb.cursors

        p = paths["maria"]
        c = MySQLdb.connect(host=p["host"], port=p["port"], user=p["login"], password=p["password"],
                            database=p["schema"], charset="utf8mb4")
        cur = c.cursor(MySQLdb.cursors.SSCursor)
        cur.execute("SELECT id, subject, body, acl FROM tickets")
        while rows := cur.fetchmany(10_000):
            n += len(rows)
        c.close()
    elif kind == "snowflake":
        with _snowflake_connect(paths["snow"]["extra"], database="BI_SRC", schema="PUBLIC") as c:
            cur = c.cursor()
            cur.execute("SELECT id, subject, body, acl FROM TICKETS")
            while rows := cur.fetchmany(10_000):
                n += len(rows)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(paths["parquet"], pre_buffer=False).iter_batches(batch_size=10_000):
            n += len(batch.to_pydict()["id"])
    elif kind == "parquet_s3":
        import pyarrow.parquet as pq
        from pyarrow import fs

        host = paths["s3"].split("://", 1)[1]
        s3 = fs.S3FileSystem(endpoint_override=host, scheme="http", access_key=S3_KEYS["AWS_ACCESS_KEY_ID"],
                             secret_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"], region=S3_KEYS["AWS_DEFAULT_REGION"])
        with s3.open_input_file(f"{BUCKET}/tickets.parquet") as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=10_000):
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
    import boto3  # noqa: F401
    try:
        from airflow.providers.mysql.hooks.mysql import MySqlHook  # noqa: F401
    except ImportError:   # the warehouse extra is not installed: no mariadb kind
        pass
    if kind == "snowflake":
        from airflow.providers.snowflake.hooks.snowflake import SnowflakeHook

        real = SnowflakeHook._get_conn_params

        def over_http(self: Any) -> dict[str, Any]:   # fakesnow serves HTTP; the hook has no field for the scheme
            return {**real(self), "protocol": "http", "network_timeout": 600,
                    "session_parameters": {"CLIENT_OUT_OF_BAND_TELEMETRY_ENABLED": False}}

        SnowflakeHook._get_conn_params = over_http
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
            n = sum(batch.num_rows for batch in reader.rows().batches())
            reader.close()
    else:
        from batch_inference.plan import drop_job_version

        with ledger_db.connect(url) as ledger:
            if mode == "reference":   # the same rows made row by row by sources.record, submitted as rows
                s = spec(kind, paths)
                db = sqlite3.connect(paths["sqlite"])
                rows = (sources.record(s, r[0], [r[1], r[2]], r[3])
                        for r in db.execute("SELECT id, subject, body, acl FROM tickets"))
                m = submit(ledger, s, rows=rows)
            else:
                m = submit(ledger, spec(kind, paths))
            t = time.perf_counter() - t0
            peak = _peak_mib()
            drop_job_version(ledger, m.job_version)
            return {"n": m.records, "s": t, "peak_rss_mib": peak, "growth_mib": peak - base,
                    "job_version": m.job_version}
    return {"n": n, "s": time.perf_counter() - t0, "peak_rss_mib": _peak_mib(), "growth_mib": _peak_mib() - base}


# What every child imports before its clock starts (``child``'s shared imports: Airflow and its provider hooks,
# pyarrow, pyiceberg, boto3). With --fork-children (the quick run's) the children are forked from one process
# that imported these once (``zygote``) instead of each starting an interpreter and spending 2-3 CPU-seconds on
# them. A forked child's RSS counts the memory it shares with its parent from the fork, and the libraries' pages
# only once it touches them: its peak and growth are measured the same way at every size (the memory check
# compares sizes), but not comparable with a fresh process's (a peak some 40 MiB lower, a growth some 15 higher,
# on 20,000 Iceberg rows), which the full run's figures are.
CHILD_IMPORTS = ("pyarrow.parquet", "pyiceberg.catalog.sql", "airflow.providers.postgres.hooks.postgres",
                 "airflow.providers.sqlite.hooks.sqlite", "boto3", "airflow.providers.mysql.hooks.mysql",
                 "airflow.sdk", "batch_inference.db", "batch_inference.plan", "batch_inference.sources.iceberg",
                 "batch_inference.sources.parquet", "batch_inference.sources.sql")


def zygote() -> None:
    """Import ``CHILD_IMPORTS``, then for each request line on stdin (mode, kind, paths, url, env as JSON) fork a
    child that runs ``child`` and answer its result (or its error) as one JSON line on stdout. Ends at EOF."""
    import importlib

    for name in CHILD_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:       # an extra not installed here (mysql): its kind is not run
            pass
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                 # what the children log goes to stderr, not into the answers
    for line in sys.stdin:
        req = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                os.environ.update(req["env"])
                result = child(req["mode"], req["kind"], req["paths"], req["url"])
            except BaseException as exc:  # noqa: BLE001 - the child's failure is its answer
                result, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
            with os.fdopen(w, "w") as out:
                out.write(json.dumps(result))
            os._exit(code)
        os.close(w)
        with os.fdopen(r) as got:
            text = got.read()
        _, status = os.waitpid(pid, 0)
        answers.write((text or json.dumps({"error": f"no answer (wait status {status})"})) + "\n")
        answers.flush()


def run_child(mode: str, kind: str, paths: dict[str, Any], url: str, env: dict[str, str],
              zygote_proc: subprocess.Popen | None) -> dict[str, Any]:
    """One child's figures: a fresh interpreter with ``env``, or a fork of ``zygote_proc`` given ``env``."""
    if zygote_proc is None:
        p = subprocess.run([sys.executable, "-m", "benchmarks.sources", "--child", mode, "--kinds", kind,
                            "--paths", json.dumps(paths), "--url", url], cwd=REPO, env={**os.environ, **env},
                           capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{mode} {kind}: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
        return json.loads(lines[-1])
    zygote_proc.stdin.write(json.dumps({"mode": mode, "kind": kind, "paths": paths, "url": url, "env": env}) + "\n")
    zygote_proc.stdin.flush()
    line = zygote_proc.stdout.readline()
    result = json.loads(line) if line else {"error": f"the zygote exited ({zygote_proc.poll()})"}
    if "error" in result:
        raise RuntimeError(f"{mode} {kind}: {result['error']}")
    return result


def run(sizes: list[int], kinds: list[str], fork: bool = False) -> dict[str, Any]:
    from contextlib import ExitStack

    out: dict[str, Any] = {"benchmark": "sources", "sizes": sizes, "results": {}, "job_versions": {}}
    with ExitStack() as stack:
        url = stack.enter_context(fresh_server())
        home = stack.enter_context(tempfile.TemporaryDirectory(prefix="bi-bench-airflow-"))
        run_env = {**S3_KEYS, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
        # The children's parent with --fork-children (leaving the stack closes its stdin, which ends it, and
        # waits for it).
        zygote_proc = stack.enter_context(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.sources", "--zygote"], cwd=REPO, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, **run_env})) if fork else None
        maria = s3 = snow = None
        if "mariadb" in kinds:
            from tests.fixtures.warehouses import mariadb_server

            maria = stack.enter_context(mariadb_server())
            if isinstance(maria, str):
                out.setdefault("not_run", {})["mariadb"] = maria
                kinds, maria = [k for k in kinds if k != "mariadb"], None
        if "parquet_s3" in kinds:
            from tests.fixtures.moto_server import moto_server

            s3 = stack.enter_context(moto_server())
            if not s3.startswith("http"):
                out.setdefault("not_run", {})["parquet_s3"] = s3
                kinds, s3 = [k for k in kinds if k != "parquet_s3"], None
        if "snowflake" in kinds:
            from tests.fixtures.warehouses import fakesnow_process

            snow = stack.enter_context(fakesnow_process())
            if isinstance(snow, str):
                out.setdefault("not_run", {})["snowflake"] = snow
                kinds, snow = [k for k in kinds if k != "snowflake"], None
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix="bi-bench-src-") as d:
                paths = prepare(n, Path(d), url, maria, s3, snow, kinds)
                env = {**run_env, "AIRFLOW_CONN_BENCH_SQLITE": json.dumps({"conn_type": "sqlite", "host": paths["sqlite"]}),
                       "AIRFLOW_CONN_BENCH_PG": json.dumps(paths["pg"]),
                       "AIRFLOW_CONN_BENCH_MARIA": json.dumps(paths["maria"] or {}),
                       "AIRFLOW_CONN_BENCH_SNOW": json.dumps(paths["snow"] or {})}
                versions: dict[str, str] = {}
                if n == min(sizes):
                    versions["reference"] = run_child("reference", "sqlite", paths, url, env,
                                                      zygote_proc)["job_version"]
                for kind in kinds:
                    r = {mode: run_child(mode, kind, paths, url, env, zygote_proc)
                         for mode in ("client", "reader", "submit")}
                    assert r["client"]["n"] == r["reader"]["n"] == r["submit"]["n"] == n, r
                    versions[kind] = r["submit"]["job_version"]
                    base = r["client"]["s"]
                    out["results"][f"{kind}@{n}"] = {
                        "client_s": rnd(base), "reader_s": rnd(r["reader"]["s"]), "submit_s": rnd(r["submit"]["s"]),
                        "reader_ratio": round(r["reader"]["s"] / base, 2),
                        "submit_ratio": round(r["submit"]["s"] / base, 2),
                        "peak_rss_mib": {m: round(r[m]["peak_rss_mib"]) for m in r},
                        "growth_mib": {m: round(r[m]["growth_mib"]) for m in r}}
                    print(json.dumps({f"{kind}@{n}": out["results"][f"{kind}@{n}"], "load1": os.getloadavg()[0]}),
                          file=sys.stderr, flush=True)   # progress of a long run
                out["job_versions"][str(n)] = versions
    largest, smallest = max(sizes), min(sizes)
    res = out["results"]
    out["same_job_version"] = all(len(set(v.values())) == 1 for v in out["job_versions"].values())
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
    ap.add_argument("--fork-children", action="store_true",
                    help="fork each child from one process that did the shared imports (quick; RSS not "
                         "comparable with fresh processes')")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.kinds, json.loads(a.paths), a.url)))
        return 0
    if a.zygote:
        zygote()
        return 0
    emit(run([int(s) for s in a.sizes.split(",")], a.kinds.split(","), fork=a.fork_children))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
