"""``BatchInferenceHook``: an Airflow connection id -> the core's ledger connection.

The warehouse (the ledger's PostgreSQL) is reached through an ordinary
Airflow connection of type ``postgres`` (or this provider's
``batch_inference`` type, the same fields). The conninfo comes from
:func:`batch_inference.hooks.connection.ledger_conninfo`, the resolver every
entry point shares (IAM tokens included). Everything past the connection is
the core: ``batch_inference.db.connect`` (dict rows, autocommit) and
``batch_inference.db.migrate``.
"""

from __future__ import annotations

from typing import Any

import psycopg
from airflow.sdk import BaseHook

from batch_inference import db
from batch_inference.db import airflow_connection_json, normalize_url, redact  # noqa: F401 (the hook's API)
from batch_inference.exceptions import BatchInferenceError
from batch_inference.hooks.connection import DEFAULT_CONN_ID, ledger_conninfo


class LedgerWorkCancelled(BatchInferenceError, RuntimeError):
    """The hook was cancelled (the task's ``on_kill``): no new ledger connection is opened."""


class LedgerTask:
    """For operators whose work is statements on the ledger: ``self.ledger_hook()`` opens the hook they
    use, and ``on_kill`` cancels what it is running, so the task fails instead of finishing its work."""

    def ledger_hook(self, postgres_conn_id: str, **kwargs: Any) -> "BatchInferenceHook":
        hook = BatchInferenceHook(postgres_conn_id, **kwargs)
        self.__dict__.setdefault("_ledger_hooks", []).append(hook)
        return hook

    def on_kill(self) -> None:
        for hook in self.__dict__.get("_ledger_hooks", []):
            hook.cancel()


class BatchInferenceHook(BaseHook):
    """The ledger database behind an Airflow postgres connection.

    :param postgres_conn_id: an Airflow connection of type ``postgres`` or
        ``batch_inference`` (host may be a Unix-socket directory).
    :param migrate: apply the core's pending migrations on the first connect
        (idempotent; one advisory-locked transaction).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "batch_inference"
    hook_name = "Batch inference ledger (PostgreSQL)"

    def __init__(self, postgres_conn_id: str = default_conn_name, *, migrate: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.postgres_conn_id = postgres_conn_id
        self.migrate = migrate
        self._conninfo: str | None = None
        self._opened: list[psycopg.Connection] = []
        self.cancelled = False

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": [],
            "relabeling": {"schema": "Database", "host": "Host or Unix-socket directory"},
            "placeholders": {"extra": '{"sslmode": "require"}'},
        }

    def get_conninfo(self) -> str:
        """libpq conninfo for the connection (contains the password: never log it)."""
        if self._conninfo is None:
            self._conninfo = ledger_conninfo(self.postgres_conn_id)
        return self._conninfo

    def get_conn(self) -> psycopg.Connection:
        """A core connection (dict rows, autocommit), migrated on first use."""
        info = self.get_conninfo()
        self.log.info("connecting to the batch-inference ledger: %s", redact(info))
        if self.cancelled:
            raise LedgerWorkCancelled("the task was stopped from outside; no new ledger work is started")
        conn = db.connect(info, retries=2)
        self._opened = [c for c in self._opened if not c.closed] + [conn]
        if self.migrate:
            applied = db.migrate(conn)
            if applied:
                self.log.info("applied ledger migrations: %s", ", ".join(applied))
            self.migrate = False
        return conn

    def cancel(self) -> None:
        """Cancel the statement each open connection is running (its transaction rolls back) and refuse
        new connections. An operator's ``on_kill`` calls it: Airflow calls ``on_kill`` from the task's
        SIGTERM handler (the task was marked failed or cleared, or timed out) and then returns into
        ``execute``, which the cancelled statement then fails."""
        self.cancelled = True
        for conn in self._opened:
            if not conn.closed:
                conn.cancel_safe()

    def test_connection(self) -> tuple[bool, str]:
        """The UI's "Test" button."""
        try:
            with db.connect(self.get_conninfo()) as conn:
                version = conn.execute(db.q("server_version")).fetchone()
        except Exception as exc:  # noqa: BLE001 - the message goes back to the UI
            return False, str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        return True, f"connected (PostgreSQL {version['server_version'] if version else '?'})"
