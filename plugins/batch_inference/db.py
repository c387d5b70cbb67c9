"""The one gateway to PostgreSQL: connections, migrations and named queries.

SQL lives in ``sql/``: numbered migration files applied in order, and
``queries.sql``, a list of named statements (``-- name: what it does`` then
the statement). Nothing else in the package writes SQL strings of its own for
state changes; the ledger transitions are SQL functions (sql/0002_ledger.sql).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

log = logging.getLogger(__name__)

DB_ENV = "BATCH_INFERENCE_DB"
HOME_ENV = "BATCH_INFERENCE_HOME"
_MIGRATION_LOCK = 0x62695F6D  # advisory lock key: one migrator at a time


class DatabaseUnavailable(RuntimeError):
    """The database could not be reached after retries."""


def sql_dir() -> Path:
    """``sql/`` in a source checkout, or the copy packaged inside the wheel."""
    here = Path(__file__).resolve().parent
    for cand in (here / "sql", here.parent.parent / "sql"):
        if (cand / "queries.sql").exists():
            return cand
    raise FileNotFoundError("cannot find the sql/ directory next to the batch_inference package")


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """Named statements from sql/queries.sql."""
    text = (sql_dir() / "queries.sql").read_text()
    out: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        header, _, body = block.partition("\n")
        name = header.split()[0]
        # A section header comment before the next "-- name:" belongs to no statement.
        lines = body.strip().splitlines()
        while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
            lines.pop()
        out[name] = "\n".join(lines).strip().rstrip(";")
    return out


def q(name: str) -> str:
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in sql/queries.sql") from None


def home() -> Path:
    return Path(os.environ.get(HOME_ENV, "./.batch-inference")).resolve()


def resolve_url(url: str | None = None) -> str:
    """--db, else $BATCH_INFERENCE_DB, else the embedded server (started if needed)."""
    if url:
        return url
    env = os.environ.get(DB_ENV)
    if env:
        return env
    from batch_inference.embedded import ensure_server

    return ensure_server(home())


def connect(url: str | None = None, *, autocommit: bool = True, retries: int = 0,
            retry_wait: float = 1.0, application_name: str = "batch-inference") -> psycopg.Connection:
    """Open a connection with dict rows. ``retries`` covers a database restart."""
    dsn = resolve_url(url)
    attempt = 0
    while True:
        try:
            return psycopg.connect(dsn, autocommit=autocommit, row_factory=dict_row,
                                   application_name=application_name, connect_timeout=10)
        except psycopg.OperationalError as exc:
            attempt += 1
            if attempt > retries:
                raise DatabaseUnavailable(f"database unreachable after {attempt} attempt(s): "
                                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}") from None
            wait = min(retry_wait * 2 ** (attempt - 1), 10.0)
            log.warning("database unreachable (%s); retry %d/%d in %.1fs", exc.__class__.__name__,
                        attempt, retries, wait)
            time.sleep(wait)


def migrations() -> list[Path]:
    return sorted(p for p in sql_dir().glob("[0-9][0-9][0-9][0-9]_*.sql"))


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply the numbered sql/ files not yet applied, in order, each in its own
    transaction; idempotent and safe to run from several processes at once."""
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE SCHEMA IF NOT EXISTS bi")
        conn.execute("""CREATE TABLE IF NOT EXISTS bi.schema_migrations (
                            name text PRIMARY KEY, checksum text NOT NULL,
                            applied_at timestamptz NOT NULL DEFAULT clock_timestamp())""")
        done = {r["name"]: r["checksum"] for r in conn.execute("SELECT name, checksum FROM bi.schema_migrations")}
        for path in migrations():
            body = path.read_text()
            checksum = hashlib.sha256(body.encode()).hexdigest()
            if path.name in done:
                if done[path.name] != checksum:
                    log.warning("migration %s changed since it was applied; not re-applied", path.name)
                continue
            conn.execute(body)
            conn.execute("INSERT INTO bi.schema_migrations (name, checksum) VALUES (%s, %s)", (path.name, checksum))
            applied_now.append(path.name)
    if applied_now:
        log.info("applied migrations: %s", ", ".join(applied_now))
    return applied_now


def fetch_all(conn: psycopg.Connection, name: str, params: Any = None) -> list[dict[str, Any]]:
    return conn.execute(q(name), params).fetchall()


def fetch_one(conn: psycopg.Connection, name: str, params: Any = None) -> dict[str, Any] | None:
    return conn.execute(q(name), params).fetchone()


def normalize_url(url: str) -> str:
    """A URL libpq accepts: SQLAlchemy's ``postgresql+driver://`` becomes ``postgresql://``.

    ``postgres://`` and ``postgresql://`` are both libpq URIs already; a
    ``key=value`` conninfo string passes through unchanged.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme.startswith("postgresql+"):
        return "postgresql://" + rest
    return url


def airflow_connection_json(url: str) -> str:
    """An Airflow connection (the JSON form of ``AIRFLOW_CONN_<ID>``) for a PostgreSQL URL or conninfo.

    A Unix-socket directory becomes the connection's ``host``; libpq
    parameters without an Airflow field go to ``extra``.
    """
    parts = conninfo_to_dict(normalize_url(url))
    fields = {"conn_type": "postgres", "host": parts.pop("host", None), "port": parts.pop("port", None),
              "login": parts.pop("user", None), "password": parts.pop("password", None),
              "schema": parts.pop("dbname", None)}
    if fields["port"] is not None:
        fields["port"] = int(fields["port"])
    out = {k: v for k, v in fields.items() if v not in (None, "")}
    if parts:
        out["extra"] = {k: str(v) for k, v in parts.items()}
    return json.dumps(out)
