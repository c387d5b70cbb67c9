"""The first destination: the PostgreSQL view ``published.<dataset>``.

Readers of the view see the rows of the version named in the dataset's row
of ``bi.publish_pointer``; pointing them at a version, or back, is one
UPDATE of that row inside ``bi.publish_v1`` / ``bi.rollback_v1`` (or their
``_v2`` forms that expect the pointer where the caller saw it;
sql/schema/publish.sql), which hold every guard and write the history. The
view is the pointer of record: the other destinations
(``batch_inference.destinations``) move before it and are restored if it
does not follow.

The view is created at the dataset's first publish, and created again when
the pointer moves to a version of another shape (its columns are typed from
the version's output schema, record_id from the source's id column). That is
DDL, so it runs with a short lock_timeout and is retried rather than allowed
to queue behind (and in front of) other sessions; a publish of the same shape
runs none.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors

from batch_inference.db import q
from batch_inference.destinations.base import json_type
from batch_inference.exceptions import PointerMoved, PublishRefused, UnknownJob
from batch_inference.spec import JobSpec
from batch_inference.status import job_spec

log = logging.getLogger(__name__)

PUBLISHED_SCHEMA = "published"


# The SQLSTATE bi.assert_pointer_at_v1 raises (sql/schema/publish.sql).
POINTER_MOVED = "BI409"


def view_name(dataset: str) -> str:
    """The qualified name of the dataset's view. Dataset names are lower-case
    identifiers; one that is also an SQL keyword ("user") is quoted by the
    database, and ``published()`` returns that exact form."""
    return f"{PUBLISHED_SCHEMA}.{dataset}"


# An output field's JSON type as the view's column type, as the Iceberg table types it (long, double,
# boolean, string); anything else (objects, arrays, unions) is jsonb.
VIEW_TYPES = {"string": "text", "integer": "bigint", "number": "double precision", "boolean": "boolean"}


def view_columns(spec: JobSpec) -> list[list[str]]:
    """The output's top-level fields as the view's columns: ``[name, type]`` in the schema's order."""
    return [[name, VIEW_TYPES.get(json_type(sub) or "", "jsonb")]
            for name, sub in (spec.output_schema.get("properties") or {}).items()]


def id_type(conn: psycopg.Connection, spec: JobSpec) -> str:
    """The view's record_id type: the source id column's, when the source is a table of this database
    with an integer or uuid id (bigint or uuid), else text (a query, another database, an object
    store, a table gone since). Read from the catalog, never from the rows."""
    src = spec.source
    if src.kind != "postgres" or not src.table or getattr(src, "conn_id", None):
        return "text"
    r = conn.execute(q("source_id_type"), {"table": src.table, "column": src.id_column}).fetchone()
    return r["id_type"] if r else "text"


def ensure_view(conn: psycopg.Connection, dataset: str, spec: JobSpec, job_version: str | None = None) -> str:
    """The dataset's view shaped like ``spec``'s version (``bi.ensure_published_view_v2``): no DDL when
    it is already, else dropped and created again in the caller's transaction. An embedding job's
    view reads ``job_version``'s search table (``destinations.search_index``)."""
    if spec.task == "embed":
        from batch_inference.destinations.search_index import ensure_view as ensure_search_view

        return ensure_search_view(conn, dataset, spec, job_version, id_type(conn, spec))
    return conn.execute(q("ensure_published_view"), {"dataset": dataset, "id_type": id_type(conn, spec),
                                                     "columns": json.dumps(view_columns(spec))}
                        ).fetchone()["view_name"]


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
                row = conn.execute(q(name), params).fetchone()
                assert row is not None
                out = dict(row)
                # The view follows the version the pointer now names, in this transaction (DDL only when
                # its shape changes); a dry run leaves it alone.
                target = out.get("to_version")
                if dry_run or target is None:
                    known = conn.execute(q("published_view"), {"dataset": dataset}).fetchone()
                    view = known["view_name"] if known else view_name(dataset)
                else:
                    view = ensure_view(conn, dataset, spec if spec is not None and params.get("job") == target
                                       else job_spec(conn, target), target)
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
