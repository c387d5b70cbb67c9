"""``kind: sql``: the same two-column tickets in four real engines behind Airflow connections give
one job version, equal to the same rows in the ledger's own PostgreSQL, and run end to end.

Real servers: SQLite (a file, the sqlite provider), a second embedded PostgreSQL (its own server
and data directory, through the postgres provider's connection), Debian's MariaDB started by
tests/fixtures/warehouses.py (the mysql provider, mysqlclient). Snowflake cannot run here: the
Snowflake provider's own hook and the real snowflake-connector-python talk to fakesnow's server
mode over HTTP (fakesnow answers the connector's protocol from DuckDB); the one thing the test
adds is ``protocol: http``, which the hook has no connection field for (a real account is HTTPS).
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from batch_inference.exceptions import SnapshotError
from batch_inference.plan import submit
from batch_inference.sources import for_spec
from tests.fixtures.sources import TICKETS, expected_turn, run_end_to_end, two_column_spec
from tests.integration.test_source_columns import make_tickets

ENGINES = ["sqlite", "postgres", "mariadb", "snowflake"]


def _airflow_conn(monkeypatch, conn_id: str, **fields: Any) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))
    return conn_id


def _load_sqlite(path: Path, rows) -> None:
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE IF EXISTS tickets")
        db.execute("CREATE TABLE tickets (id TEXT, subject TEXT, body TEXT, acl TEXT, photo BLOB)")
        db.executemany("INSERT INTO tickets VALUES (?, ?, ?, ?, NULL)",
                       [(r[0], r[1], r[2], None if r[3] is None else json.dumps(r[3])) for r in rows])


def _load_pg(uri: str, rows) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS public.tickets")
        c.execute("CREATE TABLE public.tickets (id text, subject text, body text, acl text[], photo bytea)")
        with c.cursor() as cur:
            cur.executemany("INSERT INTO public.tickets VALUES (%s, %s, %s, %s, NULL)", rows)


def _load_mariadb(m: dict[str, Any], rows) -> None:
    import MySQLdb

    db = MySQLdb.connect(host=m["host"], port=m["port"], user=m["user"], password=m["password"],
                         database=m["database"], charset="utf8mb4")
    cur = db.cursor()
    cur.execute("DROP TABLE IF EXISTS tickets")
    cur.execute("CREATE TABLE tickets (id VARCHAR(64), subject TEXT, body TEXT, acl JSON, photo BLOB)")
    cur.executemany("INSERT INTO tickets VALUES (%s, %s, %s, %s, NULL)",
                    [(r[0], r[1], r[2], None if r[3] is None else json.dumps(r[3])) for r in rows])
    db.commit()
    db.close()


# The connector's settings for fakesnow beyond a real account's: HTTP (Snowflake is HTTPS), no telemetry,
# and a retry budget of one second: fakesnow answers a statement it cannot run with HTTP 500, which the
# connector retries until network_timeout has passed, so each refused query waits it out.
FAKESNOW_PARAMS: dict[str, Any] = {"protocol": "http", "network_timeout": 1,
                                   "session_parameters": {"CLIENT_OUT_OF_BAND_TELEMETRY_ENABLED": False}}


def _snowflake_connect(s: dict[str, Any]):
    import snowflake.connector

    return snowflake.connector.connect(user="fake", password="snow", account="fakesnow", host=s["host"],
                                       port=s["port"], database="BI_SRC", schema="PUBLIC", **FAKESNOW_PARAMS)


def _load_snowflake(s: dict[str, Any], rows) -> None:
    import snowflake.connector

    with snowflake.connector.connect(user="fake", password="snow", account="fakesnow", host=s["host"],
                                     port=s["port"], **FAKESNOW_PARAMS) as db:
        cur = db.cursor()
        cur.execute("CREATE DATABASE IF NOT EXISTS BI_SRC")
        cur.execute("CREATE SCHEMA IF NOT EXISTS BI_SRC.PUBLIC")
        cur.execute("CREATE OR REPLACE TABLE BI_SRC.PUBLIC.TICKETS (ID VARCHAR, SUBJECT VARCHAR, BODY VARCHAR, "
                    "ACL VARCHAR, PHOTO BINARY)")
        cur.executemany("INSERT INTO BI_SRC.PUBLIC.TICKETS (ID, SUBJECT, BODY, ACL) VALUES (%s, %s, %s, %s)",
                        [(r[0], r[1], r[2], None if r[3] is None else json.dumps(r[3])) for r in rows])


@pytest.fixture
def warehouse(request, monkeypatch, tmp_path):
    """``load(rows)`` fills the engine's tickets table and returns the source fields naming it."""
    engine = request.param
    if engine == "sqlite":
        path = tmp_path / "src.db"
        conn_id = _airflow_conn(monkeypatch, "bi_sqlite", conn_type="sqlite", host=str(path))
        return engine, lambda rows: (_load_sqlite(path, rows), {"conn_id": conn_id, "table": "tickets"})[1]
    if engine == "postgres":
        server = request.getfixturevalue("second_pg")
        uri = server.get_uri()
        p = conninfo_to_dict(uri)
        conn_id = _airflow_conn(monkeypatch, "bi_pg2", conn_type="postgres", host=p.get("host"),
                                login=p.get("user"), schema=p.get("dbname") or "postgres",
                                port=int(p.get("port") or 5432))
        return engine, lambda rows: (_load_pg(uri, rows), {"conn_id": conn_id, "table": "public.tickets"})[1]
    if engine == "mariadb":
        m = request.getfixturevalue("mariadb")
        conn_id = _airflow_conn(monkeypatch, "bi_maria", conn_type="mysql", host=m["host"], port=m["port"],
                                login=m["user"], password=m["password"], schema=m["database"],
                                extra={"charset": "utf8mb4"})
        return engine, lambda rows: (_load_mariadb(m, rows), {"conn_id": conn_id, "table": "tickets"})[1]
    s = request.getfixturevalue("fakesnow_server")
    SnowflakeHook = pytest.importorskip("airflow.providers.snowflake.hooks.snowflake").SnowflakeHook

    real = SnowflakeHook._get_conn_params

    def over_http(self):   # fakesnow serves HTTP; the hook has no field for the scheme (Snowflake is HTTPS)
        return {**real(self), **FAKESNOW_PARAMS}

    monkeypatch.setattr(SnowflakeHook, "_get_conn_params", over_http)
    conn_id = _airflow_conn(monkeypatch, "bi_snow", conn_type="snowflake", login="fake", password="snow",
                            schema="PUBLIC", extra={"account": "fakesnow", "database": "BI_SRC",
                                                    "warehouse": "WH", "host": s["host"], "port": s["port"]})
    return engine, lambda rows: (_load_snowflake(s, rows), {"conn_id": conn_id, "table": "TICKETS"})[1]


def sql_spec(fields: dict[str, Any], **over: Any):
    return two_column_spec({"kind": "sql", **fields}, **over)


@pytest.mark.parametrize("warehouse", ENGINES, indirect=True)
def test_a_two_column_job_runs_end_to_end_from_each_engine_as_one_job_version(conn, db_url, warehouse):
    engine, load = warehouse
    fields = load(TICKETS)
    in_ledger = submit(conn, two_column_spec({"table": make_tickets(conn)})).job_version
    job, seen = run_end_to_end(conn, db_url, sql_spec(fields, dataset=f"tickets_{engine}"))
    assert seen == {r[0]: expected_turn(r[1], r[2]) for r in TICKETS}
    # The same rows are the same snapshot: only the dataset differs, so compare with the same dataset.
    again = submit(conn, sql_spec(fields))
    assert again.job_version == in_ledger and not again.created


@pytest.mark.parametrize("warehouse", ENGINES, indirect=True)
def test_a_one_select_query_reads_the_same_rows(conn, warehouse):
    engine, load = warehouse
    fields = load(TICKETS)
    table = fields.pop("table")
    query = f"SELECT id, subject, body, acl FROM {table} WHERE id <> 't3'"
    in_ledger = submit(conn, two_column_spec({"query": f"SELECT * FROM {make_tickets(conn)} WHERE id <> 't3'"}))
    m = submit(conn, sql_spec({**fields, "query": query}))
    assert m.records == 2 and m.job_version == in_ledger.job_version


def _nothing_written(conn) -> bool:
    return conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0


BAD = {
    # name: (source fields over the loaded table, rows, words the one line holds)
    "unknown table": ({"table": "no_such_table"}, TICKETS, ["no_such_table"]),
    "unknown column": ({"columns": ["subject", "nope"]}, TICKETS, ["nope"]),
    "second statement": ({"table": None, "query": "SELECT * FROM tickets; DELETE FROM tickets"}, TICKETS,
                         ["single statement"]),
    "a write": ({"table": None, "query": "DELETE FROM tickets"}, TICKETS, ["one SELECT"]),
    "select into": ({"table": None, "query": "SELECT * INTO other FROM tickets"}, TICKETS, ["INTO"]),
    "null id": ({}, [*TICKETS, (None, "s", "b", None)], ["NULL id"]),
    "duplicate ids": ({}, [*TICKETS, ("t1", "s", "b", None)], ["duplicate ids", "'t1'"]),
    "binary column": ({"columns": ["subject", "photo"]}, TICKETS, ["cannot become text"]),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("warehouse", ["sqlite", "mariadb"], indirect=True)
def test_bad_input_is_one_line_naming_the_source_and_nothing_is_written(conn, warehouse, case):
    engine, load = warehouse
    over, rows, words = BAD[case]
    fields = {**load(rows), **over}
    if case == "binary column":   # a BLOB that is set: NULL is text enough
        _set_photo(engine, fields)
    spec = sql_spec(fields) if "columns" not in over else _with_columns(fields)
    with pytest.raises(SnapshotError) as err:
        submit(conn, spec)
    line = str(err.value)
    assert "\n" not in line and fields["conn_id"] in line, line
    assert all(w in line for w in words), line
    assert _nothing_written(conn)


def _with_columns(fields: dict[str, Any]):
    cols = fields.pop("columns")
    spec = two_column_spec({"kind": "sql", **fields})
    d = spec.model_dump(mode="json")
    d["source"]["columns"] = cols
    d["prompt"]["template"] = "".join("<<<\n{" + c + "}\n>>>\n" for c in cols)
    from batch_inference.spec import parse_spec

    return parse_spec(d)


def _set_photo(engine: str, fields: dict[str, Any]) -> None:
    from airflow.sdk import BaseHook

    hook = BaseHook.get_connection(fields["conn_id"]).get_hook()
    hook.run("UPDATE tickets SET photo = X'00FF' WHERE id = 't2'", autocommit=True)


def test_an_unreachable_connection_is_one_line_without_its_password(conn, monkeypatch, mariadb):
    from tests.fixtures.warehouses import free_port

    conn_id = _airflow_conn(monkeypatch, "bi_gone", conn_type="mysql", host="127.0.0.1", port=free_port(),
                            login="bi", password=mariadb["password"], schema="bi_src")
    with pytest.raises(SnapshotError) as err:
        submit(conn, sql_spec({"conn_id": conn_id, "table": "tickets"}))
    line = str(err.value)
    assert "\n" not in line and "cannot connect" in line and "bi_gone" in line
    assert mariadb["password"] not in line
    assert _nothing_written(conn)


def test_a_connection_whose_hook_is_not_sql_is_refused(conn, monkeypatch):
    conn_id = _airflow_conn(monkeypatch, "bi_http", conn_type="http", host="example.invalid")
    with pytest.raises(SnapshotError, match="not a common-sql DbApiHook"):
        submit(conn, sql_spec({"conn_id": conn_id, "table": "tickets"}))
    assert _nothing_written(conn)


LINEAGE = {   # the namespace's scheme and the name, as each provider's OpenLineage database info gives them
    "sqlite": ("sqlite://", "tickets"),
    "postgres": ("postgres://", "postgres.public.tickets"),
    "mariadb": ("mysql://127.0.0.1:", "tickets"),
    "snowflake": ("snowflake://fakesnow", "BI_SRC.PUBLIC.TICKETS"),
}


@pytest.mark.parametrize("warehouse", ENGINES, indirect=True)
def test_lineage_names_each_engine_as_its_provider_names_it_for_openlineage(warehouse):
    engine, load = warehouse
    fields = load(TICKETS[:1])
    [(namespace, name)] = for_spec(sql_spec(fields)).lineage()
    scheme, expected = LINEAGE[engine]
    assert namespace.startswith(scheme) and name.upper() == expected.upper(), (namespace, name)


@pytest.mark.parametrize("over,words", [
    ({"table": "no_such_table"}, "no_such_table"),
    ({"table": None, "query": "SELECT id, subject, body, acl FROM tickets; DROP TABLE tickets"}, "single statement"),
], ids=["unknown-table", "second-statement"])
def test_cli_submit_of_a_bad_sql_source_prints_one_line_and_writes_nothing(conn, db_url, tmp_path, over, words):
    import os
    import subprocess
    import sys

    import yaml

    path = tmp_path / "src.db"
    _load_sqlite(path, TICKETS)
    spec = sql_spec({"conn_id": "bi_sqlite_cli", "table": "tickets"}).model_dump(mode="json")
    spec["source"].update(over)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "AIRFLOW_CONN_BI_SQLITE_CLI": json.dumps({"conn_type": "sqlite", "host": str(path)})}
    p = subprocess.run([sys.executable, "-m", "batch_inference.cli", "--db", db_url, "submit",
                        str(tmp_path / "spec.yaml")], env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert len(lines) == 1 and lines[0].startswith("batch-inference submit: error:") and words in lines[0], p.stderr
    assert "bi_sqlite_cli" in lines[0]
    assert _nothing_written(conn)
    with sqlite3.connect(path) as db:   # the second statement never ran
        assert db.execute("SELECT count(*) FROM tickets").fetchone()[0] == len(TICKETS)
