"""Snapshot: copy the source rows into a staging table and check them.

The staging table lives for one transaction. A PostgreSQL source in the same
database is copied server-side (INSERT ... SELECT); anything else (an object
store manifest, another database) arrives as Python rows and goes in by COPY.
Records that cannot be processed (NUL bytes, broken Unicode, empty text) are
kept with a reject reason so they end in dead letters, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg import errors, sql

from batch_inference.db import q
from batch_inference.spec import Source


class SnapshotError(ValueError):
    """The source cannot be snapshotted; one line naming what is wrong."""


def stage_from_postgres(conn: psycopg.Connection, source: Source) -> None:
    """Server-side copy of a table or query in the ledger's own database."""
    src = (sql.SQL("({})").format(sql.SQL(source.query)) if source.query
           else sql.Identifier(*source.table.split(".")))  # type: ignore[union-attr]
    acl = (sql.SQL("(src.{})::text[]").format(sql.Identifier(source.acl_column)) if source.acl_column
           else sql.SQL("NULL::text[]"))
    stmt = sql.SQL(q("stage_from_source")).format(
        id=sql.SQL("src.{}").format(sql.Identifier(source.id_column)),
        text=sql.SQL("src.{}").format(sql.Identifier(source.text_column)),
        acl=acl, source=src)
    where = source.table or "the source query"
    try:
        with conn.transaction():  # a savepoint: the error message below is ours, not a dead transaction
            conn.execute(stmt)
    except errors.UndefinedColumn as exc:
        raise SnapshotError(f"source {where}: {_first_line(exc)} (check source.id_column, "
                            f"source.text_column and source.acl_column)") from None
    except errors.UndefinedTable as exc:
        raise SnapshotError(f"source {where}: {_first_line(exc)}") from None
    except (errors.SyntaxError, errors.CannotCoerce, errors.DatatypeMismatch, errors.InvalidTextRepresentation) as exc:
        raise SnapshotError(f"source {where}: {_first_line(exc)}") from None


def clean_text(value: Any) -> tuple[str | None, str | None]:
    """(text safe to store, reject reason or None) for text read outside PostgreSQL."""
    if value is None:
        return None, None
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
    """COPY rows of {'record_id', 'text', 'acl'} into the staging table."""
    with conn.cursor() as cur, cur.copy(q("stage_copy")) as copy:
        for row in rows:
            text, reject = clean_text(row.get("text"))
            acl = row.get("acl")
            if acl is not None and not isinstance(acl, (list, tuple)):
                acl = [acl]
            copy.write_row((_clean_id(row.get("record_id")), text,
                            [str(a) for a in acl] if acl is not None else None, reject))


def check_stage(conn: psycopg.Connection, source_name: str, id_column: str) -> int:
    """Refuse an empty source, NULL ids and duplicate ids; return the row count."""
    counts = conn.execute(q("stage_checks")).fetchone()
    assert counts is not None
    if counts["n"] == 0:
        raise SnapshotError(f"source {source_name} is empty: nothing to snapshot")
    if counts["null_ids"]:
        raise SnapshotError(f"source {source_name} has {counts['null_ids']} row(s) with a NULL id "
                            f"(column {id_column!r})")
    dups = conn.execute(q("stage_duplicates")).fetchall()
    if dups:
        shown = ", ".join(f"{d['record_id']!r} x{d['n']}" for d in dups)
        raise SnapshotError(f"source {source_name} has duplicate ids in column {id_column!r}: {shown}")
    return int(counts["n"])


def snapshot_identity(conn: psycopg.Connection) -> str:
    """Content identity of the staged rows: the same rows give the same identity."""
    r = conn.execute(q("stage_identity")).fetchone()
    assert r is not None
    return f"{r['n']}:{r['a']}:{r['b']}"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
