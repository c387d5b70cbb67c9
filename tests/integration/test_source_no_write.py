"""A source query can never write: queries tried as an attacker would, against the real servers.

Each engine's tickets table sits beside a ``victim`` table (and, where the engine
has them, a function that empties it). Every query below is refused in one line
naming the source, and afterwards the source holds the same tables with the same
rows and the ledger holds nothing (its tables and job rows counted on both
sides). The queries use the tricks by which a generic parser and a server read
the same text differently: MariaDB's ``--`` that is a comment only before
whitespace and its executable ``/*! ... */`` comments, PostgreSQL's standard
strings where a backslash does not escape a quote, a second statement after
``COMMIT``, a write inside a CTE or a function, ``INTO OUTFILE``.

The second test runs the same queries with the friendly early check
(``sources.sql.one_select``) switched off: the refusal must then come from the
driver, the read-only transaction and the server, which is the guarantee
(docs/sources.md, "A source query cannot write"). Snowflake runs as fakesnow's
server (Snowflake itself cannot run here) behind the Snowflake provider's hook.
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import os
from contextlib import closing
from pathlib import Path

import pytest

from batch_inference.exceptions import SnapshotError
from batch_inference.plan import submit
from batch_inference.sources import sql as sql_source
from tests.fixtures.sources import TICKETS
from tests.integration.test_source_sql import sql_spec, warehouse  # noqa: F401  (warehouse: a fixture)

LEAK = Path("/tmp/bi_source_leak.txt")
ATTACHED = Path("/tmp/bi_source_attached.db")

SETUP = {
    "sqlite": ["CREATE TABLE victim (x INTEGER)", "INSERT INTO victim VALUES (1), (2)"],
    "postgres": ["DROP TABLE IF EXISTS public.victim", "CREATE TABLE public.victim (x int)",
                 "INSERT INTO public.victim VALUES (1), (2)",
                 "CREATE OR REPLACE FUNCTION public.wipe() RETURNS int LANGUAGE sql "
                 "AS 'DELETE FROM public.victim RETURNING 1'"],
    "mariadb": ["DROP TABLE IF EXISTS victim", "CREATE TABLE victim (x INT)", "INSERT INTO victim VALUES (1), (2)",
                "DROP FUNCTION IF EXISTS wipe",
                "CREATE FUNCTION wipe() RETURNS INT MODIFIES SQL DATA BEGIN DELETE FROM victim; RETURN 1; END"],
    "snowflake": ["CREATE OR REPLACE TABLE VICTIM (X INT)", "INSERT INTO VICTIM VALUES (1), (2)"],
}
TABLES = {   # the source's tables, counted before and after
    "sqlite": "SELECT group_concat(name) FROM (SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name)",
    "postgres": "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_tables WHERE schemaname = 'public'",
    "mariadb": "SELECT group_concat(table_name ORDER BY table_name) FROM information_schema.tables "
               "WHERE table_schema = DATABASE()",
    "snowflake": "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'PUBLIC'",
}
COLS = "id, subject, body, acl"

# (engine, what, query): each reads as one SELECT to at least one parser, and writes if a server ran it so.
ATTACKS = [
    ("mariadb", "dash-dash without a space is no comment to MariaDB",
     f"SELECT {COLS} FROM tickets WHERE 1 = 1 --1; DROP TABLE victim"),
    ("mariadb", "an executable comment", f"SELECT {COLS} FROM tickets /*!; DELETE FROM victim */"),
    ("mariadb", "MariaDB's own executable comment", f"SELECT {COLS} FROM tickets /*M!; DROP TABLE victim */"),
    ("mariadb", "a write after COMMIT", f"SELECT {COLS} FROM tickets; COMMIT; DELETE FROM victim"),
    ("mariadb", "a function that writes", f"SELECT {COLS} FROM tickets WHERE wipe() = 1"),
    ("mariadb", "a file written by the server", f"SELECT {COLS} FROM tickets INTO OUTFILE '{LEAK}'"),
    ("mariadb", "a hash comment", f"SELECT {COLS} FROM tickets # ;\nDELETE FROM victim"),
    ("sqlite", "a second statement", f"SELECT {COLS} FROM tickets; DROP TABLE victim"),
    ("sqlite", "a second statement after a comment", f"SELECT {COLS} FROM tickets /* ; */; DELETE FROM victim"),
    ("sqlite", "a write that returns rows", "DELETE FROM victim RETURNING x AS id, x AS subject, x AS body, "
                                            "NULL AS acl"),
    ("sqlite", "attaching a new file", f"ATTACH DATABASE '{ATTACHED}' AS leak"),
    ("postgres", "a backslash that does not escape the quote",
     f"SELECT {COLS} FROM public.tickets WHERE body <> 'a\\'; COMMIT; "
     "SET default_transaction_read_only = off; DROP TABLE public.victim; SELECT 1 -- '"),
    ("postgres", "a write inside a CTE",
     f"WITH d AS (DELETE FROM public.victim RETURNING 1) SELECT {COLS} FROM public.tickets"),
    ("postgres", "turning read-only off",
     f"SELECT {COLS} FROM public.tickets, LATERAL (SELECT set_config('transaction_read_only', 'off', true)) x"),
    ("postgres", "a function that writes", f"SELECT {COLS} FROM public.tickets WHERE public.wipe() = 1"),
    ("postgres", "a write after COMMIT", f"SELECT {COLS} FROM public.tickets; COMMIT; DELETE FROM public.victim"),
    ("snowflake", "a second statement", "SELECT ID, SUBJECT, BODY, ACL FROM TICKETS; DROP TABLE VICTIM"),
    ("snowflake", "a table created from a select", "CREATE TABLE LEAK AS SELECT ID, SUBJECT, BODY, ACL FROM TICKETS"),
    ("snowflake", "a delete", "DELETE FROM VICTIM"),
]


def _hook(fields):
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(fields["conn_id"]).get_hook()


def _source_state(engine: str, fields) -> tuple:
    """The source's tables, the victim's rows and the tickets' rows, read on one connection of the hook."""
    victim = "VICTIM" if engine == "snowflake" else "victim"
    with closing(_hook(fields).get_conn()) as c:
        cur = c.cursor()
        seen = []
        for statement in (TABLES[engine], f"SELECT count(*) FROM {victim}", f"SELECT count(*) FROM {fields['table']}"):
            cur.execute(statement)
            seen.append(cur.fetchone()[0])
    return tuple(seen)


def _ledger_state(conn) -> tuple:
    return (conn.execute("SELECT count(*) AS n FROM pg_class WHERE relkind IN ('r', 'p')").fetchone()["n"],
            conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"],
            conn.execute("SELECT count(*) AS n FROM bi.snapshot_rows").fetchone()["n"])


def _attack(conn, warehouse, query: str) -> str:
    engine, load = warehouse
    fields = load(TICKETS)
    _hook(fields).run(SETUP[engine], autocommit=True)   # one connection, a statement at a time
    source, ledger = _source_state(engine, fields), _ledger_state(conn)
    LEAK.unlink(missing_ok=True)
    ATTACHED.unlink(missing_ok=True)
    with pytest.raises(SnapshotError) as err:
        submit(conn, sql_spec({"conn_id": fields["conn_id"], "query": query}))
    line = str(err.value)
    assert "\n" not in line and fields["conn_id"] in line, line
    assert _source_state(engine, fields) == source, f"the source changed: {line}"
    assert _ledger_state(conn) == ledger, f"the ledger changed: {line}"
    assert not LEAK.exists() and not ATTACHED.exists()
    return line


@pytest.mark.parametrize("warehouse,what,query", [pytest.param(e, w, q, id=f"{e}-{w}") for e, w, q in ATTACKS],
                         indirect=["warehouse"])
def test_an_attackers_query_is_refused_in_one_line_and_nothing_changes(conn, warehouse, what, query):
    _attack(conn, warehouse, query)


@pytest.mark.parametrize("warehouse,what,query", [pytest.param(e, w, q, id=f"{e}-{w}") for e, w, q in ATTACKS],
                         indirect=["warehouse"])
def test_without_the_parser_the_driver_the_transaction_and_the_server_still_refuse(conn, warehouse, what, query,
                                                                                    monkeypatch):
    monkeypatch.setattr(sql_source, "one_select", lambda query: None)
    _attack(conn, warehouse, query)


@pytest.mark.parametrize("warehouse", ["sqlite", "mariadb", "postgres", "snowflake"], indirect=True)
def test_a_plain_select_with_one_trailing_semicolon_still_reads(conn, warehouse):
    engine, load = warehouse
    fields = load(TICKETS)
    query = f"SELECT {COLS.upper() if engine == 'snowflake' else COLS} FROM {fields.pop('table')} ;  "
    assert submit(conn, sql_spec({**fields, "query": query})).records == len(TICKETS)


def test_a_missing_sqlite_file_is_one_line_naming_it_and_is_not_created(conn, monkeypatch, tmp_path):
    import json

    path = tmp_path / "typo.db"
    monkeypatch.setenv("AIRFLOW_CONN_BI_SQLITE_TYPO", json.dumps({"conn_type": "sqlite", "host": str(path)}))
    before = _ledger_state(conn)
    with pytest.raises(SnapshotError) as err:
        submit(conn, sql_spec({"conn_id": "bi_sqlite_typo", "table": "tickets"}))
    line = str(err.value)
    assert "\n" not in line and str(path) in line and "no SQLite file" in line, line
    assert not path.exists() and not os.listdir(tmp_path)
    assert _ledger_state(conn) == before


def test_one_rule_for_a_trailing_semicolon_in_the_ledgers_own_database_too(conn):
    from tests.conftest import make_source, make_spec, tickets

    make_source(conn, tickets(3))
    m = submit(conn, make_spec(source={"table": None, "query": "SELECT id, body, acl FROM public.tickets;\n"}))
    assert m.records == 3
    with pytest.raises(SnapshotError, match="single statement"):
        submit(conn, make_spec(source={"table": None, "query": "SELECT id, body, acl FROM public.tickets;;"}))
