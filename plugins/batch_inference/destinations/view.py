"""The first destination: the PostgreSQL view ``published.<dataset>``.

Readers of the view see the rows of the version named in the dataset's row
of ``bi.publish_pointer``; pointing them at a version, or back, is one
UPDATE of that row inside ``bi.publish_v1`` / ``bi.rollback_v1`` (or their
``_v2`` forms that expect the pointer where the caller saw it;
sql/schema/publish.sql), which hold every guard and write the history. The
view is the pointer of record: the other destinations
(``batch_inference.destinations``) move before it and are restored if it
does not follow.

The view is created once, at the dataset's first publish. That is DDL, so it
runs with a short lock_timeout and is retried rather than allowed to queue
behind (and in front of) other sessions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors

from batch_inference.db import q
from batch_inference.exceptions import PointerMoved, PublishRefused, UnknownJob
from batch_inference.spec import JobSpec

log = logging.getLogger(__name__)

PUBLISHED_SCHEMA = "published"


# The SQLSTATE bi.assert_pointer_at_v1 raises (sql/schema/publish.sql).
POINTER_MOVED = "BI409"


def view_name(dataset: str) -> str:
    """The qualified name of the dataset's view. Dataset names are lower-case
    identifiers; one that is also an SQL keyword ("user") is quoted by the
    database, and ``published()`` returns that exact form."""
    return f"{PUBLISHED_SCHEMA}.{dataset}"


def view_fields(spec: JobSpec) -> tuple[list[str], list[str]]:
    """Top-level output fields exposed as view columns: (text fields, jsonb fields).

    Strings come out as text and everything else as jsonb: extracting never
    casts, so no later version's output can make a read of the view fail."""
    text: list[str] = []
    other: list[str] = []
    for name, sub in (spec.output_schema.get("properties") or {}).items():
        if isinstance(sub, dict) and sub.get("type") == "string":
            text.append(name)
        else:
            other.append(name)
    return text, other


def _refused(exc: psycopg.Error) -> PublishRefused:
    return PublishRefused(exc.diag.message_primary or str(exc).splitlines()[0])


def switch(conn: psycopg.Connection, name: str, params: dict[str, Any], dataset: str,
           spec: JobSpec | None, lock_timeout: str, attempts: int, *, dry_run: bool = False,
           after: Callable[[psycopg.Connection, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One transaction: create the view if this is the first publish, then the
    guarded pointer switch, then ``after`` (which records the other
    destinations beside the history row). Retried only on a lock timeout (the
    DDL). ``dry_run``: every guard runs and the answer is what the switch would
    do, but the transaction is rolled back."""
    wait = 0.2
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction(force_rollback=dry_run):
                conn.execute(q("set_lock_timeout"), {"timeout": lock_timeout})
                if spec is not None:
                    text, other = view_fields(spec)
                    view = conn.execute(q("ensure_published_view"), {
                        "dataset": dataset, "text_fields": text, "json_fields": other}).fetchone()["view_name"]
                else:
                    known = conn.execute(q("published_view"), {"dataset": dataset}).fetchone()
                    view = known["view_name"] if known else view_name(dataset)
                row = conn.execute(q(name), params).fetchone()
                assert row is not None
                out = dict(row)
                out["view"] = view      # as SQL writes it: quoted if the dataset name is a keyword
                if after is not None and not dry_run:
                    after(conn, out)
                return out
        except errors.LockNotAvailable:
            if attempt == attempts:
                raise PublishRefused(f"{name} of dataset {dataset}: could not get a lock within {lock_timeout} "
                                     f"after {attempts} attempts (a long transaction holds bi.results?)") from None
            log.warning("%s of %s: lock timeout (attempt %d/%d); retrying in %.1fs", name, dataset, attempt,
                        attempts, wait)
            time.sleep(wait)
            wait = min(wait * 2, 5.0)
        except errors.NoDataFound as exc:
            raise UnknownJob(exc.diag.message_primary or str(exc)) from None
        except (errors.ObjectNotInPrerequisiteState, errors.InsufficientPrivilege) as exc:
            raise _refused(exc) from None
        except psycopg.DatabaseError as exc:
            if exc.sqlstate != POINTER_MOVED:
                raise
            raise PointerMoved(_refused(exc).args[0], dataset=dataset, expected=params.get("expected"),
                               actual=exc.diag.message_detail or None) from None
    raise AssertionError("unreachable")
