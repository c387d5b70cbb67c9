"""The dashboard's one write: rolling a dataset's pointer back.

The switch is ``batch_inference.publish.rollback`` (``bi.rollback_v1``): it
takes the dataset's publish lock, refuses what cannot be rolled back and
writes the history row. A button needs one more guard: the user saw a
version as published when they clicked, and the click must not undo a
different publish that landed since. The rollback reports which version it
switched away from, inside the transaction opened here; if that is not the
version the user saw, the whole transaction is rolled back, so the check and
the switch commit together or not at all (no read-then-write window).
"""

from __future__ import annotations

from typing import Any

import psycopg

from batch_inference import publish


class Conflict(RuntimeError):
    """The pointer moved since the user looked at it; nothing was changed."""


class Refused(RuntimeError):
    """The rollback was refused (never published, nothing before it, a dropped version, no privilege)."""


class _Abort(Exception):
    pass


def rollback(conn: psycopg.Connection, dataset: str, *, actor: str, expected_current: str | None,
             reason: str | None = None) -> dict[str, Any]:
    if not expected_current:
        raise Refused("name the version you are rolling back from (expected_current)")
    out: dict[str, Any] = {}
    try:
        with conn.transaction():
            out = publish.rollback(conn, dataset, actor=actor, reason=reason)
            if out["from_version"] != expected_current:
                raise _Abort
    except _Abort:
        raise Conflict(f"dataset {dataset} was publishing {out['from_version']}, not {expected_current}; "
                       "nothing was changed (reload and decide again)") from None
    except publish.PublishRefused as exc:
        raise Refused(str(exc)) from None
    return out
