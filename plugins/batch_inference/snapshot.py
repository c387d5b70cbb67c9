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
        raise null_ids_error(source_name, r["null_ids"], id_column)
    return int(r["n"]), f"{r['n']}:{r['a']}:{r['b']}"


def null_ids_error(source_name: str, n: int, id_column: str) -> SnapshotError:
    """The one-line error for a source with ``n`` rows without an id (submit's and estimate's)."""
    return SnapshotError(f"source {source_name} has {n} row(s) with a NULL id (column {id_column!r})")


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


ROWS_PER_BATCH = 10_000   # dict rows turned into one column batch at a time (the readers' batches are their own)
COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)   # binary COPY: signature, flags, no header extension
COPY_TRAILER = b"\xff\xff"
_TEXT_OID = 25


def stage_schema() -> Any:
    """The staging table's columns as an Arrow schema: what a reader's column batch holds."""
    import pyarrow as pa

    return pa.schema([("record_id", pa.string()), ("text", pa.string()), ("acl", pa.list_(pa.string())),
                      ("reject", pa.string())])


def staged_columns(rows: Iterable[Mapping[str, Any]]) -> Any:
    """Rows of {'record_id', 'text', 'acl'[, 'reject']} as one column batch of ``stage_schema``: the text
    cleaned (``clean_text``) unless the row was judged where it was read (it has its own 'reject')."""
    import pyarrow as pa

    ids: list[str | None] = []
    texts: list[str | None] = []
    acls: list[list[str] | None] = []
    rejects: list[str | None] = []
    for row in rows:
        if "reject" in row:   # judged where it was read (sources.record): its text is clean already
            text, reject = row["text"], row["reject"]
        else:
            text, reject = clean_text(row.get("text"))
        acl = row.get("acl")
        if acl is not None and not isinstance(acl, (list, tuple)):
            acl = [acl]
        ids.append(_clean_id(row.get("record_id")))
        texts.append(text)
        acls.append([str(a) for a in acl] if acl is not None else None)
        rejects.append(reject)
    return pa.RecordBatch.from_arrays([pa.array(ids, pa.string()), pa.array(texts, pa.string()),
                                       pa.array(acls, pa.list_(pa.string())), pa.array(rejects, pa.string())],
                                      schema=stage_schema())


def _chunks(rows: Iterable[Mapping[str, Any]]) -> Iterator[Any]:
    chunk: list[Mapping[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == ROWS_PER_BATCH:
            yield staged_columns(chunk)
            chunk = []
    if chunk:
        yield staged_columns(chunk)


def stage_from_rows(conn: psycopg.Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    """COPY the records into the staging table in binary, one column batch at a time.

    ``rows`` is a reader's ``sources.Records`` (column batches of
    ``stage_schema``, built where they were read) or any iterable of
    {'record_id', 'text', 'acl'[, 'reject']} rows (``staged_columns``)."""
    batches = rows.batches() if hasattr(rows, "batches") else _chunks(rows)
    with conn.cursor() as cur, cur.copy(q("stage_copy")) as copy:
        copy.write(COPY_SIGNATURE)
        for batch in batches:
            if batch.num_rows:
                copy.write(copy_rows(batch))
        copy.write(COPY_TRAILER)


# -- binary COPY, column-wise -----------------------------------------------------

def _be32(values: Any) -> Any:
    """Each integer as its 4 big-endian bytes, a large_binary array."""
    import numpy as np
    import pyarrow as pa

    data = np.ascontiguousarray(values, dtype=">i4")
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(4), len(data), [None, pa.py_buffer(data.tobytes())]
                                                ).cast(pa.large_binary())


def _lengths(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.fill_null(pc.binary_length(values), -1).to_numpy(zero_copy_only=False)


def _field_parts(values: Any) -> tuple[Any, Any]:
    """Text values as binary COPY fields, in two parts: each value's byte length (a NULL's -1) and
    its bytes (a NULL's none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    data = values.cast(pa.large_binary())
    return _be32(_lengths(data)), (pc.fill_null(data, _b(b"")) if data.null_count else data)


def _field(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.binary_join_element_wise(*_field_parts(values), _b(b""))


def _text_array_field(acl: Any) -> Any:
    """A list<string> array as binary COPY fields of ``text[]`` (PostgreSQL's array_send: dimensions,
    no-NULLs flag, element type, then each element's length and bytes), a NULL list length -1."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    offsets = np.asarray(acl.offsets, dtype=np.int64)
    values = acl.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    elements = pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()), _field(values))
    joined = pc.binary_join(elements, _b(b""))
    sizes = np.diff(offsets).astype(np.int32)
    one_dim = pc.binary_join_element_wise(_b(b"\0\0\0\1\0\0\0\0" + _TEXT_OID.to_bytes(4, "big")),
                                          _be32(sizes), _b(b"\0\0\0\1"), _b(b""))
    empty = _b(b"\0" * 8 + _TEXT_OID.to_bytes(4, "big"))
    body = pc.binary_join_element_wise(pc.if_else(pa.array(sizes == 0), empty, one_dim), joined, _b(b""))
    lengths = np.where(np.asarray(acl.is_null()), -1, _lengths(body))
    return pc.binary_join_element_wise(_be32(lengths), pc.if_else(acl.is_null(), _b(b""), body), _b(b""))


def _b(value: bytes) -> Any:
    import pyarrow as pa

    return pa.scalar(value, pa.large_binary())


def copy_rows(batch: Any) -> memoryview:
    """A column batch of ``stage_schema`` as binary COPY tuples (without the signature and trailer)."""
    import numpy as np
    import pyarrow.compute as pc

    rows = pc.binary_join_element_wise(
        _b(b"\0\4"), *_field_parts(batch.column(0)), *_field_parts(batch.column(1)),
        _text_array_field(batch.column(2)), *_field_parts(batch.column(3)), _b(b""))
    offsets = np.frombuffer(rows.buffers()[1], dtype=np.int64)[rows.offset:rows.offset + len(rows) + 1]
    return memoryview(rows.buffers()[2])[int(offsets[0]):int(offsets[-1])]


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
