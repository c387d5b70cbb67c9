"""Clients through PgBouncer in transaction mode (tests/fixtures/pgbouncer.py):
the migration needs no direct connection, the cutoff's async poll, run
more often than psycopg's prepare threshold from connections the pooler
shares server connections between, never meets a missing prepared statement,
and nothing a client sets or creates outlives its transaction: the
dashboard's statement timeout and a source.query submit's staging table."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batch_inference import db, deadline
from batch_inference.sources import postgres as postgres_source
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.pgbouncer import PgBouncer

# A setting the session would keep, read on whichever server connection runs it.
SHOW_TIMEOUT = "SELECT current_setting('statement_timeout') AS t"


def test_migrate_through_the_pooler_from_two_processes_at_once(empty_db, pgbouncer):
    """The migration's lock is a transaction-level advisory lock and the whole
    migration one transaction, so it runs through the pooler; two migrators at
    once apply each step once."""
    url = pgbouncer.url(empty_db())
    applied: list[list[str]] = []

    def run() -> None:
        with db.connect(url) as c:
            applied.append(db.migrate(c))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [p.name for p in db.migrations()]
    assert sorted(applied, key=len) == [[], every]
    with db.connect(url) as c:
        assert db.migrate(c) == []
        rows = c.execute(db.q("migrations_applied")).fetchall()
        assert sorted(r["name"] for r in rows) == every


def test_the_cutoff_poll_through_the_pooler_never_prepares(empty_db, pgbouncer):
    direct = empty_db()
    with db.connect(direct) as c:
        db.migrate(c)
        make_source(c, tickets(30))
        job = submit(c, make_spec()).job_version

    async def polls() -> list[int]:
        # Two watchers sharing one server connection (pool of 20, two clients):
        # each one's statements run more often than psycopg's prepare threshold.
        conns = [await deadline.connect_async(pgbouncer.url(direct)) for _ in range(2)]
        try:
            seen = []
            for _ in range(8):
                for a in conns:
                    seen.append((await deadline.poll_counts(a, job))["outstanding"])
            return seen
        finally:
            for a in conns:
                await a.close()

    assert asyncio.run(polls()) == [30] * 16


@pytest.fixture
def one_server(pg_server, pgbouncer):
    """A PgBouncer of its own with one server connection per database and user, so that
    consecutive transactions of different clients run on the same server connection."""
    bouncer = PgBouncer(pg_server.get_uri(), pool_size=1)
    yield bouncer
    bouncer.close()


def test_a_dashboard_request_leaves_no_statement_timeout_on_the_pooled_server_connection(db_url, one_server,
                                                                                          monkeypatch):
    from batch_inference.ui import app as appmod
    from tests.integration.test_dashboard_api import ADMIN, _client

    url = one_server.url(db_url)
    with _client(url, monkeypatch) as client:
        assert client.get("/api/jobs", headers=ADMIN).status_code == 200
    with db.connect(url) as other:                       # the next client, on the same server connection
        assert other.execute(SHOW_TIMEOUT).fetchone()["t"] == "0"
    request = appmod.ledger()                            # a request's own statements keep the limit
    dash = next(request)
    try:
        assert dash.execute(SHOW_TIMEOUT).fetchone()["t"] == "15s"
        with dash.transaction():
            assert dash.execute(SHOW_TIMEOUT).fetchone()["t"] == "15s"
    finally:
        request.close()
    with db.connect(url) as other:
        assert other.execute(SHOW_TIMEOUT).fetchone()["t"] == "0"


def test_a_source_query_submit_is_one_transaction_through_the_pooler(conn, db_url, pgbouncer, monkeypatch):
    """Another client takes the server connection the submit used last whenever the submit is
    between transactions: a staging table kept across two transactions is then not there."""
    make_source(conn, tickets(25))
    url = pgbouncer.url(db_url)
    real = postgres_source.materialize_query

    def fill_then_let_another_client_in(c, *args, **kwargs):
        out = real(c, *args, **kwargs)
        other.execute(SHOW_TIMEOUT)       # a transaction of another client, held open
        return out

    spec = make_spec(source={"table": None, "query": "SELECT id, body, acl FROM public.tickets WHERE id < 't00020'"})
    with db.connect(url, autocommit=False) as other, db.connect(url) as submitter:
        monkeypatch.setattr(postgres_source, "materialize_query", fill_then_let_another_client_in)
        manifest = submit(submitter, spec)
        other.rollback()
    assert manifest.records == 20 and manifest.created
    with db.connect(url) as c:
        assert c.execute("SELECT to_regclass('pg_temp._bi_query') AS t").fetchone()["t"] is None
