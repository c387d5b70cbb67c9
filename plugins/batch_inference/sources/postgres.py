"""``kind: postgres``: a table or one SELECT in the ledger's own database, read in SQL.

The rows never pass through Python: the submit reads the relation twice in
its REPEATABLE READ transaction (``snapshot.scan``, then the bulk load), so
what pins the input is that transaction's snapshot. A ``source.query`` is
first run once, read-only and as a single statement, into a table of the same
transaction (``materialize_query``).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from batch_inference.db import q
from batch_inference.snapshot import source_errors
from batch_inference.sources.base import Reader
from batch_inference.spec import JobSpec, Source

QUERY_STAGE = sql.Identifier("pg_temp", "_bi_query")


def source_relation(source: Source, cap: int) -> sql.Composable:
    """A PostgreSQL table or query in the ledger's database, as (record_id, text, acl, reject).

    A record of several columns (``source.columns``) is their JSON array as
    text, judged whole against ``cap`` (``source_columns_relation``); one
    ``text_column`` is read as it always was."""
    src = (sql.SQL("({})").format(sql.SQL(source.query)) if source.query
           else sql.Identifier(*source.table.split(".")))  # type: ignore[union-attr]
    acl = (sql.SQL("(src.{})::text[]").format(sql.Identifier(source.acl_column)) if source.acl_column
           else sql.SQL("NULL::text[]"))
    rid = sql.SQL("src.{}").format(sql.Identifier(source.id_column))
    if source.columns:
        cols = sql.SQL(", ").join(sql.SQL("(src.{})::text").format(sql.Identifier(c)) for c in source.columns)
        return sql.SQL(q("source_columns_relation")).format(id=rid, columns=cols, acl=acl, source=src,
                                                          cap=sql.Literal(cap))
    return sql.SQL(q("source_relation")).format(
        id=rid, text=sql.SQL("src.{}").format(sql.Identifier(source.text_column)), acl=acl, source=src)


def materialize_query(conn: psycopg.Connection, spec: JobSpec, source_name: str = "query") -> sql.Composable:
    """Run ``source.query`` once, read-only, into a table of the caller's transaction and return its name.

    Called inside the submit's REPEATABLE READ transaction, so the query reads
    the submit's snapshot, and the table is dropped when that transaction ends
    (``ON COMMIT DROP``): nothing outlives it, so a transaction pooler may
    give the next transaction any server connection. The query runs in a
    subtransaction set ``READ ONLY``, so it cannot write, create or drop
    anything, whatever functions it calls (and cannot turn that off inside
    it); the submit writes again once the subtransaction is released. It is
    sent in pipeline mode, which uses the extended query protocol: the server
    parses exactly one statement and refuses text that holds two
    (``SELECT ...; DROP ...``)."""
    conn.execute(q("query_stage_create"))
    with source_errors(source_name, any_refusal=True), conn.transaction():
        conn.execute(q("read_only_transaction"))  # a temporary table may be written in a read-only transaction
        with conn.pipeline():
            conn.execute(sql.SQL(q("query_stage_fill")).format(
                relation=source_relation(spec.source, spec.max_input_chars)))
    return QUERY_STAGE


def relation(conn: psycopg.Connection, spec: JobSpec, source_name: str) -> sql.Composable:
    """What the submit reads: the query's table of this transaction, or the table itself."""
    if spec.source.query:
        return materialize_query(conn, spec, source_name)
    return source_relation(spec.source, spec.max_input_chars)


class PostgresSource(Reader):
    """A table or query of the ledger's database: the submit reads it in SQL, so ``rows`` is None."""

    kind = "postgres"

    def rows(self) -> None:   # type: ignore[override]
        return None

    def pin(self) -> dict[str, object]:
        return {}
