"""The dashboard's one write: rolling a dataset's pointer back.

The switch is ``batch_inference.publish.rollback`` with ``expected_current``,
i.e. ``bi.rollback_v2`` (sql/schema/publish.sql): it takes the dataset's
publish lock, refuses what cannot be rolled back and writes the history row.
A button needs one more guard: the user saw a version as published when they
clicked, and the click must not undo a different publish that landed since.
That check is in the same SQL statement as the switch, under the same lock,
so nothing can move the pointer between the two (``Conflict``, HTTP 409).
"""

from __future__ import annotations

from typing import Any

import psycopg

from batch_inference import publish
from batch_inference.exceptions import BatchInferenceError


class Conflict(BatchInferenceError, RuntimeError):
    """The pointer moved since the user looked at it; nothing was changed."""


class Refused(BatchInferenceError, RuntimeError):
    """The rollback was refused (never published, nothing before it, a dropped version, no privilege)."""


def rollback(conn: psycopg.Connection, dataset: str, *, actor: str, expected_current: str | None,
             reason: str | None = None) -> dict[str, Any]:
    if not expected_current:
        raise Refused("name the version you are rolling back from (expected_current)")
    try:
        return publish.rollback(conn, dataset, actor=actor, reason=reason, expected_current=expected_current)
    except publish.PointerMoved as exc:
        raise Conflict(f"{exc} (reload and decide again)") from None
    except publish.PublishRefused as exc:
        raise Refused(str(exc)) from None
