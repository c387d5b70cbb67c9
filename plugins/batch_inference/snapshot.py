"""Snapshot: read the source, check it, and name its content.

A PostgreSQL source in the ledger's database is read server-side, twice in
one REPEATABLE READ transaction (a scan for the checks and the identity, then
the bulk load into the snapshot partition); ``sources.postgres`` names it. A
``source.query`` is first run once, read-only and as a single statement,
into a table of that same transaction, which is then read the same way.
Anything else (an object store manifest, another database, Parquet files, an
Iceberg snapshot: the other modules of ``batch_inference.sources``) arrives as
Python rows and goes by COPY into a per-transaction staging table, read the
same way too.
Records that cannot be processed (NUL bytes, broken Unicode, empty text) are
kept with a reject reason so they end in dead letters, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors, sql

from batch_inference.db import q
from batch_inference.exceptions import SnapshotError


STAGE = sql.Identifier("_bi_stage")


@contextmanager
def source_errors(source_name: str, *, any_refusal: bool = False) -> Iterator[None]:
    """The database's refusals of a source, as one-line ``SnapshotError``s; with
    ``any_refusal`` (the user's own query) every error but a lost connection."""
    try:
        yield
    except errors.UndefinedColumn as exc:
        raise SnapshotError(f"source {source_name}: {_first_line(exc)} (check source.id_column, "
                            f"source.text_column and source.acl_column)") from None
    except errors.ReadOnlySqlTransaction as exc:
        raise SnapshotError(f"source {source_name}: {_first_line(exc)} (source.query runs read-only: "
                            "one SELECT)") from None
    except errors.SyntaxError as exc:
        # A ';' inside the user's query ends it where the subquery wrapping it expects ')': a second
        # statement (or a trailing ';'), refused as such rather than as a syntax error.
        if "multiple commands" in str(exc) or (any_refusal and 'at or near ";"' in str(exc)):
            raise SnapshotError(f"source {source_name}: source.query must be a single statement: a second "
                                "statement is refused (leave out the ';')") from None
        raise SnapshotError(f"source {source_name}: {_first_line(exc)}") from None
    except (errors.UndefinedTable, errors.CannotCoerce, errors.DatatypeMismatch, errors.InvalidTextRepresentation,
            errors.UndefinedFunction, errors.InsufficientPrivilege, errors.FeatureNotSupported) as exc:
        raise SnapshotError(f"source {source_name}: {_first_line(exc)}") from None
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:
        if not any_refusal:
            raise
        raise SnapshotError(f"source {source_name}: {_first_line(exc)}") from None


def scan(conn: psycopg.Connection, relation: sql.Composable, source_name: str, id_column: str) -> tuple[int, str]:
    """One pass over the source: refuse an empty source and NULL ids; return
    (rows, content identity). Duplicate ids are caught when the snapshot's
    primary key is built (see ``duplicates_error``)."""
    # a savepoint, so the error below is ours, not a dead transaction
    with source_errors(source_name), conn.transaction():
        r = conn.execute(sql.SQL(q("snapshot_scan")).format(relation=relation)).fetchone()
    assert r is not None
    if r["n"] == 0:
        raise SnapshotError(f"source {source_name} is empty: nothing to snapshot")
    if r["null_ids"]:
        raise SnapshotError(f"source {source_name} has {r['null_ids']} row(s) with a NULL id "
                            f"(column {id_column!r})")
    return int(r["n"]), f"{r['n']}:{r['a']}:{r['b']}"


def duplicates_error(conn: psycopg.Connection, relation: sql.Composable, source_name: str,
                     id_column: str) -> SnapshotError:
    """The one-line error for a source whose ids are not unique."""
    dups = conn.execute(sql.SQL(q("source_duplicates")).format(relation=relation)).fetchall()
    shown = ", ".join(f"{d['record_id']!r} x{d['n']}" for d in dups) or "(see the source)"
    return SnapshotError(f"source {source_name} has duplicate ids in column {id_column!r}: {shown}")


def long_id_error(conn: psycopg.Connection, relation: sql.Composable, source_name: str,
                  id_column: str) -> SnapshotError:
    """The one-line error for a source with a record id too long to key a result."""
    r = conn.execute(sql.SQL(q("source_longest_id")).format(relation=relation)).fetchone()
    shown = f"{r['head']!r}... ({r['bytes']:,} bytes)" if r else "(see the source)"
    return SnapshotError(f"source {source_name} has a record id too long to key a result in column "
                         f"{id_column!r}: {shown}")


def clean_text(value: Any) -> tuple[str | None, str | None]:
    """(text safe to store, reject reason or None) for text read outside PostgreSQL."""
    if value is None:
        return None, None
    if type(value) is str and value.isascii() and "\x00" not in value:   # most text: nothing to check further
        return value, None
    if not isinstance(value, str):
        value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return (value.encode("utf-8", "replace").decode("utf-8"),
                "text is not valid Unicode (lone surrogate)")
    if "\x00" in value:
        return value.replace("\x00", "\ufffd"), "text contains NUL bytes"
    return value, None


def _clean_id(value: Any) -> str | None:
    if value is None:
        return None
    text, bad = clean_text(value)
    if bad:
        raise SnapshotError(f"record id {text!r}: {bad}")
    return text


def stage_from_rows(conn: psycopg.Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    """COPY rows of {'record_id', 'text', 'acl'} into the staging table; a row's own 'reject'
    (a record of several columns, judged where it was read: ``sources.record``) is kept."""
    with conn.cursor() as cur, cur.copy(q("stage_copy")) as copy:
        for row in rows:
            if "reject" in row:   # judged where it was read (sources.record): its text is clean already
                text, reject = row["text"], row["reject"]
            else:
                text, reject = clean_text(row.get("text"))
            acl = row.get("acl")
            if acl is not None and not isinstance(acl, (list, tuple)):
                acl = [acl]
            copy.write_row((_clean_id(row.get("record_id")), text,
                            [str(a) for a in acl] if acl is not None else None, reject))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
