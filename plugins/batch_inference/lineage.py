"""Datasets named as OpenLineage names PostgreSQL, S3 and Iceberg tables.

A dataset is a ``(namespace, name)`` pair: ``postgres://host:port`` and
``database.schema.table`` for a PostgreSQL table or view (OpenLineage's naming
spec), ``s3://bucket`` and the object key for S3 (``operators.lineage.s3_ident``),
and an Iceberg table by its storage location. A Unix-socket host (a directory) is the local machine, named
``localhost``. The sources name their inputs with these (``Reader.lineage``);
the submit and publish operators report them (``operators.lineage``).
"""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict

from batch_inference.db import normalize_url
Ident = tuple[str, str]   # an OpenLineage dataset: (namespace, name)

DEFAULT_PORT = 5432


def postgres_location(conninfo: str) -> tuple[str, str]:
    """(namespace, database) of a libpq conninfo or URL: ``postgres://host:port`` and the database name."""
    parts = conninfo_to_dict(normalize_url(conninfo))
    host = (parts.get("host") or parts.get("hostaddr") or "localhost").split(",")[0]
    if host.startswith("/"):  # a Unix-socket directory: this machine's server
        host = "localhost"
    port = str(parts.get("port") or DEFAULT_PORT).split(",")[0]
    database = parts.get("dbname") or parts.get("user") or "postgres"
    return f"postgres://{host}:{port}", database


def table_ident(conninfo: str, relation: str) -> Ident:
    """A table or view ``schema.table`` (or ``table``, in ``public``) of the database behind ``conninfo``.

    Names are as PostgreSQL stores them: unquoted parts folded to lower case,
    quoted ones (``published."select"``) as written, without the quotes.
    """
    namespace, database = postgres_location(conninfo)
    parts = [p[1:-1] if p.startswith('"') and p.endswith('"') else p.lower() for p in relation.split(".")]
    if len(parts) == 1:
        parts.insert(0, "public")
    return namespace, ".".join([database, *parts])


def iceberg_ident(metadata_location: str) -> Ident:
    """An Iceberg table by its storage location, as OpenLineage's naming spec names files and objects
    (``s3://bucket`` and the table's key; ``file`` and the table's path), from the metadata file a
    commit wrote (``<table location>/metadata/<n>.metadata.json``)."""
    location = metadata_location.rsplit("/metadata/", 1)[0]
    scheme, _, rest = location.partition("://")
    if scheme == "file" or not rest:
        return "file", rest or location
    bucket, _, key = rest.partition("/")
    return f"{scheme}://{bucket}", key
