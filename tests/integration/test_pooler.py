"""Clients through PgBouncer in transaction mode (tests/fixtures/pgbouncer.py):
the migration needs no direct connection, and the cutoff's async poll, run
more often than psycopg's prepare threshold from connections the pooler
shares server connections between, never meets a missing prepared statement."""

from __future__ import annotations

import asyncio
import threading

from batch_inference import db, deadline
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets


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
