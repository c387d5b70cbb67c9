"""Publish: make a whole job version visible at once, and take it back.

Downstream reads ``published.<dataset>``, a view that shows the rows of the
version named in the dataset's row of ``bi.publish_pointer``. Publishing and
rolling back are one UPDATE of that row, inside ``bi.publish_v1`` and
``bi.rollback_v1`` (sql/schema/publish.sql), which also hold every guard:
right dataset, every shard done, validated unless forced with a reason. A
reader's statement sees the old version or the new one, never a mix, and
never waits: nothing on this path takes a lock a reader conflicts with.

The view is created once, at the dataset's first publish. That is DDL, so it
runs with a short lock_timeout and is retried rather than allowed to queue
behind (and in front of) other sessions.

Given ``expected_current`` (the version the caller saw as published), both
go through ``bi.publish_v2`` / ``bi.rollback_v2`` (sql/schema/publish.sql),
which refuse, in the switching statement itself and under the dataset's
publish lock, when the pointer has moved since: ``PointerMoved``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg import errors

from batch_inference.db import q
from batch_inference.exceptions import InvalidValue, PointerMoved, PublishRefused
from batch_inference.spec import JobSpec
from batch_inference.status import UnknownJob, job_spec

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


def _switch(conn: psycopg.Connection, name: str, params: dict[str, Any], dataset: str,
            spec: JobSpec | None, lock_timeout: str, attempts: int) -> dict[str, Any]:
    """One transaction: create the view if this is the first publish, then the
    guarded pointer switch. Retried only on a lock timeout (the DDL)."""
    wait = 0.2
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction():
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


def _record_load_time(conn: psycopg.Connection, job_version: str) -> None:
    """The warehouse load of the job's fallback run, if it had one: from nothing
    outstanding to the pointer switch just made (``fallback.add_load_time``).
    The pointer has switched already, so a failure here is logged, not raised."""
    from batch_inference.fallback import add_load_time

    try:
        with conn.transaction():
            overhead = add_load_time(conn, job_version)
    except psycopg.Error as exc:
        log.warning("published %s, but its fallback run's load time was not recorded: %s", job_version,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return
    if overhead is not None:
        log.info("%s: fallback run overhead with the load is now %.1f s", job_version, overhead)


def publish(conn: psycopg.Connection, job_version: str, *, actor: str | None = None, force: bool = False,
            reason: str | None = None, dataset: str | None = None, expected_current: str | None = None,
            lock_timeout: str = "2s", attempts: int = 5) -> dict[str, Any]:
    """Make ``job_version`` the published version of its dataset.

    :param actor: who publishes, for the history (default: the database's current_user).
    :param force: publish although the version is not validated; needs ``reason``.
    :param reason: why; recorded in bi.publish_history (required with ``force``).
    :param dataset: the dataset the caller expects; a version of another dataset is refused.
    :param expected_current: the version the caller saw as published; if the pointer is elsewhere
        (and not already at ``job_version``) the publish is refused with ``PointerMoved``;
        ``""`` expects that nothing is published yet (a first publish that must stay first).
    :returns: dataset, from_version, to_version, action, forced, changed (False when the
        version was already published: a retry is a no-op), history_id, view.
    :raises PublishRefused: a guard refused (not validated, not finished, wrong dataset, ...).
    :raises PointerMoved: ``expected_current`` is not what is published.
    :raises UnknownJob: no such version.
    """
    job = conn.execute(q("validate_job"), {"job": job_version}).fetchone()
    if job is None:
        raise UnknownJob(f"no job version {job_version!r}")
    ds = dataset or job["dataset"]
    spec = job_spec(conn, job_version)
    params = {"dataset": ds, "job": job_version, "actor": actor, "force": force, "reason": reason,
              "expected": expected_current or None}   # "": expect that nothing is published yet
    name = "publish" if expected_current is None else "publish_expected"
    out = _switch(conn, name, params, ds, spec, lock_timeout, attempts)
    if out["changed"]:
        log.info("published %s for dataset %s (was %s)%s", job_version, ds, out["from_version"] or "nothing",
                 f"; FORCED: {reason}" if out["forced"] else "")
        _record_load_time(conn, job_version)
    else:
        log.info("%s is already the published version of %s; nothing changed", job_version, ds)
    return out


def rollback(conn: psycopg.Connection, dataset: str, *, actor: str | None = None, reason: str | None = None,
             expected_current: str | None = None, lock_timeout: str = "2s", attempts: int = 5) -> dict[str, Any]:
    """Switch ``dataset`` back to the version the current one replaced.

    Repeated rollbacks walk back through earlier publishes.
    :param expected_current: the version the caller saw as published and means to roll back from;
        refused with ``PointerMoved`` if another publish or rollback moved the pointer since.
    :raises PublishRefused: never published, nothing before the current version, or that version was dropped.
    :raises PointerMoved: the pointer is not at ``expected_current``; nothing was changed.
    """
    name = "rollback" if expected_current is None else "rollback_expected"
    out = _switch(conn, name, {"dataset": dataset, "actor": actor, "reason": reason, "expected": expected_current},
                  dataset, None, lock_timeout, attempts)
    log.info("rolled back dataset %s: %s -> %s", dataset, out["from_version"], out["to_version"])
    return out


def published(conn: psycopg.Connection, dataset: str, *, history: int = 20) -> dict[str, Any]:
    """What the dataset publishes now: the version, the view's name, the ACL default and the history."""
    cur = conn.execute(q("published_version"), {"dataset": dataset}).fetchone()
    view = conn.execute(q("published_view"), {"dataset": dataset}).fetchone()
    hist = conn.execute(q("publish_history"), {"dataset": dataset, "n": history}).fetchall()
    null_acl = conn.execute(q("dataset_null_acl"), {"dataset": dataset}).fetchone()
    return {
        "dataset": dataset,
        "job_version": cur["job_version"] if cur else None,
        "switched_at": cur["switched_at"] if cur else None,
        "switched_by": cur["switched_by"] if cur else None,
        "view": view["view_name"] if view else None,
        "view_fields": view["fields"] if view else None,
        "null_acl": null_acl["null_acl"] if null_acl else "all_readers",
        "history": [dict(h) for h in hist],
    }


def set_null_acl(conn: psycopg.Connection, dataset: str, mode: str) -> str:
    """What a record without an ACL means for readers of ``dataset``: 'all_readers' (the
    default) or 'nobody'. Takes effect on the readers' next statement."""
    if mode not in ("all_readers", "nobody"):
        raise InvalidValue(f"null ACL mode must be 'all_readers' or 'nobody', not {mode!r}")
    r = conn.execute(q("set_null_acl"), {"dataset": dataset, "mode": mode}).fetchone()
    return r["null_acl"]
