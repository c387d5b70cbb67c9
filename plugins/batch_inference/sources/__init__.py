"""Where the records come from: one reader per source kind, behind one interface.

Every reader can do three things: refuse now, in one line, what reading
would refuse for every record (``check``: an unreachable connection, an
unknown table or column, a statement that is not one SELECT); stream the rows
in bounded memory (``rows``); and say what pins the input (``pin``: an
Iceberg snapshot id, each Parquet file's ETag or version id, a time-travel
timestamp), recorded with the job in its stored spec. ``postgres.py`` (a table
or query in the ledger's database, read in SQL) and ``s3_manifest.py`` (JSON
Lines objects listed in a manifest) were the first; ``sql.py`` reads any
Airflow connection whose hook is a common-sql ``DbApiHook``; ``parquet.py``
and ``iceberg.py`` read files and lakehouse tables.

The snapshot, shards and workers never learn where the rows came from: a
reader gives ``Records``, column batches of ``{"record_id", "text", "acl",
"reject"}`` built column-wise where they were read (``column_batch``), and
``plan.submit`` copies them into the ledger by binary COPY (``snapshot.stage_from_rows``),
whose content hash is the snapshot identity in the job version. The same rows
read from two sources are the same snapshot, hence the same job version, as
long as their values become the same text (``to_text``, the rule in
docs/sources.md).
"""

from __future__ import annotations

from batch_inference.sources.base import (ROWS_PER_FETCH, Ident, Reader, Records, batch_records, column_batch,
                                          read_columns, record, to_acl, to_text)
# The S3 helpers other modules use (hosted batch transports, lineage), where they always were.
from batch_inference.sources.s3_manifest import parse_s3_url, s3_client, s3_manifest_rows
from batch_inference.spec import JobSpec


def for_spec(spec: JobSpec, *, s3_endpoint_url: str | None = None, aws_conn_id: str | None = None) -> Reader:
    """The reader of ``spec.source`` (its module is imported only for its kind)."""
    kw = {"s3_endpoint_url": s3_endpoint_url, "aws_conn_id": aws_conn_id}
    kind = spec.source.kind
    if kind == "postgres":
        from batch_inference.sources.postgres import PostgresSource as cls
    elif kind == "s3_manifest":
        from batch_inference.sources.s3_manifest import S3Manifest as cls   # type: ignore[assignment]
    elif kind == "sql":
        from batch_inference.sources.sql import SqlSource as cls   # type: ignore[assignment]
    elif kind == "parquet":
        from batch_inference.sources.parquet import ParquetFiles as cls   # type: ignore[assignment]
    else:
        from batch_inference.sources.iceberg import IcebergSnapshot as cls   # type: ignore[assignment]
    return cls(spec, **kw)


__all__ = ["ROWS_PER_FETCH", "Ident", "Reader", "Records", "batch_records", "column_batch", "for_spec",
           "parse_s3_url", "read_columns", "record", "s3_client", "s3_manifest_rows", "to_acl", "to_text"]
