"""The one way from an Airflow connection id to the ledger's libpq conninfo.

Every Airflow-side entry point resolves the ledger here: the operators (through
``BatchInferenceHook``), the cutoff sensor, the cutoff trigger (the async
form), the fallback pool operator, the on-call callbacks and the dashboard.
So a connection works the same for each of them, an IAM one included: with
``"iam": true`` in its extra the password is a fresh token from
``PostgresHook.get_iam_token`` (AWS RDS/Redshift, or Azure with
``azure_conn_id``), which also gives the user and port to use.

The conninfo is built from the connection's fields, not from
``PostgresHook.get_uri()``: that URI has the SQLAlchemy scheme
``postgresql+psycopg://``, which libpq rejects, and it drops a Unix-socket
host given as ``?host=/path`` (Airflow keeps query parameters in the
connection's extra). The result holds the password: it lives in memory only,
and is never logged or serialized.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from psycopg import pq
from psycopg.conninfo import make_conninfo

from batch_inference import db

if TYPE_CHECKING:
    from airflow.sdk import Connection

DEFAULT_CONN_ID = "batch_inference_default"  # the ledger's connection (AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT)


@lru_cache(maxsize=1)
def libpq_keywords() -> frozenset[str]:
    """Every connection keyword this libpq knows, as libpq itself lists them.

    A connection's extra also holds Airflow's and other tools' keys (``iam``,
    ``cursor``, ``sqlalchemy_scheme``, UI notes...), and libpq refuses a
    conninfo with a keyword it does not know; only these pass.
    """
    return frozenset(d.keyword.decode() for d in pq.Conninfo.get_defaults())


def conninfo_from_connection(conn: "Connection", *, iam_token: tuple[str, str, int] | None = None) -> str:
    """libpq conninfo (``host=... dbname=...``) for an Airflow postgres connection.

    ``host`` may be a hostname or a Unix-socket directory, given either as the
    connection's host or as ``host`` in its extra (what a URI ``?host=/path``
    becomes); extra keys libpq knows (``sslmode``, ``options``,
    ``connect_timeout``...) pass through. ``iam_token`` (user, token, port)
    replaces the connection's user, password and port.
    """
    args: dict[str, Any] = {
        "host": conn.host or None,
        "port": conn.port or None,
        "user": conn.login or None,
        "password": conn.password or None,
        "dbname": conn.schema or None,
    }
    known = libpq_keywords()
    for key, value in (conn.extra_dejson or {}).items():
        if key in known and value not in (None, ""):
            args[key] = value
    if iam_token is not None:
        args["user"], args["password"], args["port"] = iam_token
    text = make_conninfo("", **{k: v for k, v in args.items() if v is not None})
    db.usable_url(text)  # a malformed value fails here (BadDatabaseURL, no password), not at connect
    return text


def iam_token(conn: "Connection") -> tuple[str, str, int] | None:
    """(user, token, port) from the postgres provider when the connection's extra has ``"iam": true``; else None."""
    if not (conn.extra_dejson or {}).get("iam"):
        return None
    # Imported here: the providers manager imports the hooks to list connection
    # types, and the postgres provider is only needed for a token.
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    return PostgresHook(postgres_conn_id=conn.conn_id).get_iam_token(conn)


def conninfo_for(conn: "Connection") -> str:
    """The conninfo of an Airflow connection already fetched, with its IAM token if it asks for one."""
    return conninfo_from_connection(conn, iam_token=iam_token(conn))


def ledger_conninfo(conn_id: str = DEFAULT_CONN_ID) -> str:
    """The ledger's conninfo from the Airflow connection ``conn_id`` (blocking: for tasks and the API server)."""
    from airflow.sdk import BaseHook

    return conninfo_for(BaseHook.get_connection(conn_id))


async def aledger_conninfo(conn_id: str = DEFAULT_CONN_ID) -> str:
    """``ledger_conninfo`` for the triggerer's event loop: the connection through
    ``BaseHook.aget_connection``, the IAM token (a call to the cloud's API) in a thread."""
    from airflow.sdk import BaseHook

    conn = await BaseHook.aget_connection(conn_id)
    return await asyncio.to_thread(conninfo_for, conn)
