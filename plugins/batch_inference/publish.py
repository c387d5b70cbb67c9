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

Destinations besides the view (the spec's ``publish.destinations``: an
Iceberg table, ``batch_inference.destinations``) move first, each by its own
commit, after the view's guards have passed in a rolled-back switch; then the
view switches, expecting the pointer those guards saw, and records where each
destination points beside its history row. A destination that fails leaves
the view unswitched (one line); a view switch that fails restores the
destinations that moved.

Given ``expected_current`` (the version the caller saw as published), both
go through ``bi.publish_v2`` / ``bi.rollback_v2`` (sql/schema/publish.sql),
which refuse, in the switching statement itself and under the dataset's
publish lock, when the pointer has moved since: ``PointerMoved``.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from batch_inference import destinations
from batch_inference.db import q
from batch_inference.destinations import Destination, Pointed, Version, version_rows
from batch_inference.destinations.view import (  # noqa: F401 - the view's names, as callers import them
    POINTER_MOVED,
    PUBLISHED_SCHEMA,
    switch,
    view_columns,
    view_name,
)
from batch_inference.exceptions import InvalidValue, PointerMoved, PublishRefused
from batch_inference.status import UnknownJob, job_spec

log = logging.getLogger(__name__)


def _recorder(pointed: list[Pointed]):
    """``switch``'s ``after``: each destination's pointer beside the history row of the switch."""

    def record(conn: psycopg.Connection, out: dict[str, Any]) -> None:
        if not out.get("changed") or out.get("history_id") is None:
            return
        for p in pointed:
            conn.execute(q("destination_record"), {"history_id": out["history_id"], "destination": p.destination,
                                                   "job": p.job_version, "snapshot_id": p.snapshot_id,
                                                   "location": p.location})
    return record


def _move_all(targets: list[Destination], move) -> list[tuple[Destination, Pointed]]:
    """Move every destination; if one fails, restore those moved already and re-raise."""
    done: list[tuple[Destination, Pointed]] = []
    try:
        for d in targets:
            done.append((d, move(d)))
    except BaseException:
        _restore(done)
        raise
    return done


def _restore(done: list[tuple[Destination, Pointed]]) -> None:
    for d, p in reversed(done):
        try:
            d.restore(p)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report
            log.error("%s: could not restore its pointer after the view did not switch: %s", d.name,
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _with_destinations(conn: psycopg.Connection, targets: list[Destination], move, name: str,
                       params: dict[str, Any], ds: str, spec, lock_timeout: str, attempts: int,
                       seen_name: str) -> tuple[dict[str, Any], list[Pointed]]:
    """The view's guards (a rolled-back switch), then every destination, then the view's switch,
    expecting the pointer the guards saw; destinations are restored if that switch fails."""
    seen = switch(conn, name, params, ds, spec, lock_timeout, attempts, dry_run=True)
    done = _move_all(targets, lambda d: move(d, seen))
    pointed = [p for _, p in done]
    real = {**params, "expected": params.get("expected") if name.endswith("_expected") else seen[seen_name]}
    try:
        out = switch(conn, name if name.endswith("_expected") else name + "_expected", real, ds, spec,
                     lock_timeout, attempts, after=_recorder(pointed))
    except BaseException:
        _restore(done)
        raise
    return out, pointed


def _close(targets: list[Destination]) -> None:
    for d in targets:
        d.close()


def _destinations_out(pointed: list[Pointed]) -> list[dict[str, Any]]:
    return [{"destination": p.destination, "job_version": p.job_version, "snapshot_id": p.snapshot_id,
             "location": p.location, "changed": p.changed} for p in pointed]

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
    targets = destinations.for_spec(conn, spec)
    if targets:
        version = Version(job_version, spec, version_rows(conn, job_version))
        try:
            out, pointed = _with_destinations(
                conn, targets, lambda d, _seen: d.publish(version, force=force, reason=reason), name, params, ds,
                spec, lock_timeout, attempts, "from_version")
        finally:
            _close(targets)
        out["destinations"] = _destinations_out(pointed)
    else:
        out = switch(conn, name, params, ds, spec, lock_timeout, attempts)
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
    params = {"dataset": dataset, "actor": actor, "reason": reason, "expected": expected_current}
    cur = conn.execute(q("published_version"), {"dataset": dataset}).fetchone()
    targets = destinations.for_spec(conn, job_spec(conn, cur["job_version"])) if cur else []
    if targets:
        try:
            out, pointed = _with_destinations(
                conn, targets, lambda d, seen: d.point_back(seen["to_version"]), name, params, dataset, None,
                lock_timeout, attempts, "from_version")
        finally:
            _close(targets)
        out["destinations"] = _destinations_out(pointed)
    else:
        out = switch(conn, name, params, dataset, None, lock_timeout, attempts)
    log.info("rolled back dataset %s: %s -> %s", dataset, out["from_version"], out["to_version"])
    return out


def publish_history(conn: psycopg.Connection, dataset: str, n: int = 20) -> list[dict[str, Any]]:
    """The dataset's latest publishes and rollbacks, newest first, each with ``destinations``: where
    each destination besides the view pointed after it (snapshot id and metadata file)."""
    hist = [dict(h) for h in conn.execute(q("publish_history"), {"dataset": dataset, "n": n}).fetchall()]
    dests: dict[int, list[dict[str, Any]]] = {}
    for d in conn.execute(q("destination_history"), {"dataset": dataset, "ids": [h["id"] for h in hist]}):
        dests.setdefault(d["history_id"], []).append({k: d[k] for k in ("destination", "job_version",
                                                                         "snapshot_id", "location")})
    for h in hist:
        h["destinations"] = dests.get(h["id"], [])
    return hist


def rejections(conn: psycopg.Connection, *, job_version: str | None = None, dataset: str | None = None,
               limit: int = 50) -> list[dict[str, Any]]:
    """The rejections of one version or of a dataset's versions, newest first, withdrawn ones too."""
    return [dict(r) for r in conn.execute(q("rejections"), {"job": job_version, "dataset": dataset, "n": limit})]


def published(conn: psycopg.Connection, dataset: str, *, history: int = 20) -> dict[str, Any]:
    """What the dataset publishes now: the version, the view's name, the ACL default, the history and
    the reviewers' rejections of its versions (withdrawn ones too)."""
    cur = conn.execute(q("published_version"), {"dataset": dataset}).fetchone()
    view = conn.execute(q("published_view"), {"dataset": dataset}).fetchone()
    hist = publish_history(conn, dataset, history)
    null_acl = conn.execute(q("dataset_null_acl"), {"dataset": dataset}).fetchone()
    return {
        "dataset": dataset,
        "job_version": cur["job_version"] if cur else None,
        "switched_at": cur["switched_at"] if cur else None,
        "switched_by": cur["switched_by"] if cur else None,
        "view": view["view_name"] if view else None,
        "view_fields": view["fields"] if view else None,
        "null_acl": null_acl["null_acl"] if null_acl else "all_readers",
        "history": hist,
        "rejections": rejections(conn, dataset=dataset, limit=history),
    }


def set_null_acl(conn: psycopg.Connection, dataset: str, mode: str) -> str:
    """What a record without an ACL means for readers of ``dataset``: 'all_readers' (the
    default) or 'nobody'. Takes effect on the readers' next statement."""
    if mode not in ("all_readers", "nobody"):
        raise InvalidValue(f"null ACL mode must be 'all_readers' or 'nobody', not {mode!r}")
    r = conn.execute(q("set_null_acl"), {"dataset": dataset, "mode": mode}).fetchone()
    return r["null_acl"]
