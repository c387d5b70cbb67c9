"""``kind: sql``: a table or one read-only SELECT through any Airflow connection whose hook is a
common-sql ``DbApiHook`` (postgres, mysql, sqlite, snowflake, google BigQuery, amazon Redshift,
databricks, trino, mssql providers).

The connection comes from Airflow (``source.conn_id``), so credentials never
sit in the spec; the hook makes the driver connection. The rows are streamed
with ``fetchmany`` (a server-side cursor where the driver has one: psycopg's
named cursor, MySQLdb's ``SSCursor``; Snowflake's own Arrow result chunks,
``fetch_arrow_batches``), ``ROWS_PER_FETCH`` at a time, each fetch one column
batch (``column_batch``), and read
in one consistent snapshot where the engine offers it: PostgreSQL and MySQL /
MariaDB in a read-only REPEATABLE READ transaction (MySQL's ``WITH
CONSISTENT SNAPSHOT``), SQLite in one read transaction; any engine's single
SELECT is one statement's snapshot, and ``as_of`` reads a Snowflake
(``AT(TIMESTAMP => ...)``) or BigQuery (``FOR SYSTEM_TIME AS OF``) table as it
was at that time, recorded with the job in its spec.

A read can never write, and that comes from the driver, the transaction and
the server, not from reading the query (docs/sources.md, "A source query
cannot write"):

- one statement per call, decided by the server's own parser: PostgreSQL gets
  the text through psycopg's extended protocol (a prepared statement or a
  server-side cursor: the server refuses a second command); mysqlclient turns
  multi-statements off on the connection (``set_server_option``) so the server
  reads the whole text as one statement; Python's sqlite3 refuses a second
  statement; Snowflake's connector sends ``num_statements=1``;
- a read-only transaction the text cannot end (it is one statement), and a
  read-only session where the engine has one (MySQL / MariaDB ``SET SESSION
  TRANSACTION READ ONLY``; SQLite opened with ``mode=ro`` and ``query_only``);
- before any row is read, the server resolves the statement (``source_check``).

``one_select`` reads the query first with a generic parser only to give a
friendly line early (a second statement, a write, ``SELECT ... INTO``).
Identifiers are quoted by the SQLAlchemy dialect of the hook's engine (the
spec's names are plain identifiers already, never user SQL).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from batch_inference.db import q
from batch_inference.exceptions import SnapshotError
from batch_inference.sources.base import ROWS_PER_FETCH, Ident, Reader, Records, collection_paused, column_batch

log = logging.getLogger(__name__)

# An Airflow connection type (the providers' hook conn_type) as the engine it reaches.
CONN_TYPE_DIALECTS = {"postgres": "postgresql", "mysql": "mysql", "sqlite": "sqlite", "snowflake": "snowflake",
                      "gcpbigquery": "bigquery", "google_cloud_platform": "bigquery", "redshift": "redshift",
                      "databricks": "databricks", "trino": "trino", "mssql": "mssql", "oracle": "oracle"}
# The engine as SQLAlchemy's dialect registry names it.
SQLALCHEMY_DIALECTS = {"postgres": "postgresql", "postgresql": "postgresql", "mysql": "mysql",
                       "mariadb": "mysql", "sqlite": "sqlite", "mssql": "mssql", "oracle": "oracle",
                       "snowflake": "snowflake", "redshift": "postgresql", "trino": "trino",
                       "bigquery": "bigquery", "databricks": "databricks"}
BACKTICK_DIALECTS = ("bigquery", "databricks", "spark", "hive", "mysql", "mariadb")
TIME_TRAVEL = {"snowflake": "source_as_of_snowflake", "bigquery": "source_as_of_bigquery"}   # sql/sources.sql
REFUSED_KEYWORDS = ("INTO", "FOR UPDATE", "FOR SHARE", "LOCK")
# What the drivers answer to a second statement in one call (psycopg, sqlite3, Snowflake).
SECOND_STATEMENT = ("cannot insert multiple commands", "one statement at a time", "statement count")
MYSQL_OPTION_MULTI_STATEMENTS_OFF = 1   # libmysqlclient's enum_mysql_set_option


def _first_line(exc: BaseException, *secrets: str) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else exc.__class__.__name__
    for s in secrets:
        if s:
            line = line.replace(s, "***")
    return line[:500]


def one_select(query: str) -> str | None:
    """Why ``query`` is not one read-only SELECT (None when it is), by sqlparse, before it is sent."""
    import sqlparse

    statements = [s for s in sqlparse.split(query) if s.strip().strip(";").strip()]
    if len(statements) != 1:
        return f"source.query must be a single statement (found {len(statements)})"
    stmt = sqlparse.parse(statements[0])[0]
    kind = stmt.get_type()
    if kind != "SELECT":
        return f"source.query must be one SELECT (found {kind.lower() if kind != 'UNKNOWN' else 'another statement'})"
    words = " ".join(t.normalized for t in stmt.flatten() if t.is_keyword)
    for refused in REFUSED_KEYWORDS:
        if f" {refused} " in f" {words} ":
            return f"source.query must be a read-only SELECT (found {refused})"
    return None


class SqlSource(Reader):
    """A table or one SELECT behind an Airflow common-sql connection."""

    kind = "sql"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._hook: Any = None
        self._connection: Any = None
        self._secrets: list[str] = []

    # -- the hook and its dialect
    def hook(self) -> Any:
        """The connection's hook, which must be a common-sql ``DbApiHook``."""
        if self._hook is not None:
            return self._hook
        conn_id = self.source.conn_id or ""
        try:
            from airflow.providers.common.sql.hooks.sql import DbApiHook
            from airflow.sdk import BaseHook
        except ImportError:
            raise self.refuse("a sql source needs Airflow and its common-sql provider "
                              "(pip install 'airflow-provider-batch-inference[airflow]')") from None
        try:
            connection = BaseHook.get_connection(conn_id)
        except Exception as exc:  # noqa: BLE001 - AirflowNotFoundException and friends: one line
            how = ""
            if type(exc).__name__ == "AirflowNotFoundException":   # not defined: say how one is
                how = (f"; define it as the environment variable AIRFLOW_CONN_{conn_id.upper()} (a URI or JSON, "
                       f"docs/sources.md) or with `airflow connections add {conn_id} --conn-uri URI`")
            raise self.refuse(f"Airflow connection {conn_id!r}: {_first_line(exc)}{how}") from None
        self._connection = connection
        self._secrets = [s for s in (connection.password,) if s]
        try:
            hook = connection.get_hook()
        except Exception as exc:  # noqa: BLE001 - a provider that is not installed
            raise self.refuse(f"Airflow connection {conn_id!r} (type {connection.conn_type}): no hook: "
                              f"{_first_line(exc, *self._secrets)}") from None
        if not isinstance(hook, DbApiHook):
            raise self.refuse(f"Airflow connection {conn_id!r} (type {connection.conn_type}) has a "
                              f"{type(hook).__name__}, not a common-sql DbApiHook")
        self._hook = hook
        return hook

    @property
    def dialect(self) -> str:
        """The engine: by the connection's type where this module knows it, else the hook's own
        ``dialect_name`` (from its SQLAlchemy URL)."""
        hook = self.hook()
        conn_type = str(getattr(hook, "conn_type", "") or "").lower()
        if conn_type in CONN_TYPE_DIALECTS:
            return CONN_TYPE_DIALECTS[conn_type]
        try:
            name = hook.dialect_name
        except Exception:  # noqa: BLE001 - a hook without a SQLAlchemy URL
            name = None
        return str(name or conn_type or "default").lower()

    def quote(self, name: str) -> str:
        """An identifier as the hook's SQLAlchemy dialect quotes it (only where it must be)."""
        from sqlalchemy.dialects import registry
        from sqlalchemy.engine.default import DefaultDialect

        dialect: Any = None
        target = SQLALCHEMY_DIALECTS.get(self.dialect)
        if target:
            try:
                dialect = registry.load(target)()
            except Exception:  # noqa: BLE001 - the dialect's package is not installed
                dialect = None
        if dialect is None:
            dialect = DefaultDialect()
            if self.dialect in BACKTICK_DIALECTS:
                dialect.identifier_preparer.initial_quote = dialect.identifier_preparer.final_quote = "`"
        prep = dialect.identifier_preparer
        return ".".join(prep.quote(part) for part in name.split("."))

    def _select(self) -> str:
        """The statement sent: the user's query as written, or a SELECT of the record's columns."""
        src = self.source
        if src.query:
            return src.query
        cols = [src.id_column, *src.record_columns, *([src.acl_column] if src.acl_column else [])]
        table = self.quote(src.table or "")
        if src.as_of:
            pattern = TIME_TRAVEL.get(self.dialect)
            if pattern is None:
                raise self.refuse(f"as_of reads a table in the past on Snowflake or BigQuery, not on "
                                  f"{self.dialect}")
            table = q(pattern).format(table=table, ts="'" + src.as_of.replace("'", "") + "'")
        return q("source_select").format(columns=", ".join(self.quote(c) for c in cols), table=table)

    # -- the interface
    def check(self) -> None:
        """The connection opens, the query is one read-only SELECT, the table and its columns exist:
        the server resolves the statement in the read-only session ``rows`` uses, and reads no row."""
        if self.source.query and (problem := one_select(self.source.query)):
            raise self.refuse(problem)
        if self.source.as_of:
            from datetime import datetime

            try:
                datetime.fromisoformat(self.source.as_of)
            except ValueError:
                raise self.refuse(f"as_of {self.source.as_of!r} is not an ISO 8601 timestamp") from None
        with self._session() as cur:
            self._execute(cur, q("source_check").format(statement=self._select()))
            self._fetch(cur)

    def rows(self) -> Records:
        return Records(self._batches())

    def _batches(self) -> Iterator[Any]:
        n = 0
        with self._session(stream=True) as cur:
            self._execute(cur, self._select())
            if self.dialect == "snowflake" and hasattr(cur, "fetch_arrow_batches"):
                for batch in self._snowflake_arrow(cur):
                    yield batch
                    n += batch.num_rows
                log.debug("source %s: %d row(s) read as Arrow", self.name, n)
                return
            at: dict[str, int] | None = None
            while True:
                with collection_paused():
                    batch = self._fetch(cur)
                    if not batch:
                        break
                    if at is None:   # after the first fetch: a server-side cursor describes its rows then
                        at = self._positions([d[0] for d in cur.description or ()])
                    columns = list(zip(*batch))   # the rows turned into columns in one pass
                    made = column_batch(self, {c: columns[i] for c, i in at.items()})
                    n += len(batch)
                    del batch, columns   # the rows freed while the collector is still paused
                yield made
        log.debug("source %s: %d row(s) read", self.name, n)

    def _snowflake_arrow(self, cur: Any) -> Iterator[Any]:
        """The Snowflake connector's own Arrow result chunks (``fetch_arrow_batches``), ``ROWS_PER_FETCH``
        rows at a time; a timestamp in nanoseconds is cut to microseconds, as the connector's Python
        values are."""
        import pyarrow as pa

        try:
            tables = cur.fetch_arrow_batches()
            for table in tables:
                at = self._positions(table.column_names)
                for start in range(0, table.num_rows, ROWS_PER_FETCH):
                    part = table.slice(start, ROWS_PER_FETCH)
                    columns: dict[str, Any] = {}
                    for c, i in at.items():
                        col = part.column(i).combine_chunks()
                        if pa.types.is_timestamp(col.type) and col.type.unit == "ns":
                            col = col.cast(pa.timestamp("us", col.type.tz), safe=False)
                        columns[c] = col
                    yield column_batch(self, columns)
        except SnapshotError:
            raise
        except Exception as exc:  # noqa: BLE001 - the connector's own errors: one line
            raise self.refuse(_first_line(exc, *self._secrets)) from None

    def _positions(self, names: list[str]) -> dict[str, int]:
        """Where each column the spec names is in the result (names matched as the engine folds them)."""
        src = self.source
        exact = {n: i for i, n in enumerate(names)}
        folded = {n.lower(): i for i, n in enumerate(names)}
        out: dict[str, int] = {}
        wanted = [("source.id_column", src.id_column)] + [
            ("source.columns" if src.columns else "source.text_column", c) for c in src.record_columns]
        if src.acl_column:
            wanted.append(("source.acl_column", src.acl_column))
        for field, col in wanted:
            i = exact.get(col, folded.get(col.lower()))
            if i is None:
                raise self.refuse(f"no column {col!r} ({field}) in the result (it has "
                                  f"{', '.join(names[:20]) or 'no columns'})")
            out[col] = i
        return out

    def _execute(self, cur: Any, statement: str) -> None:
        """Send one statement through the driver's single-statement path: psycopg's extended protocol
        (a prepared statement; a server-side cursor declares through it anyway), Snowflake's
        ``num_statements=1``; the session ``_begin`` opened makes every other driver refuse a second."""
        driver = type(cur).__module__.partition(".")[0]
        try:
            if driver == "psycopg" and getattr(cur, "name", None) is None:
                cur.execute(statement, prepare=True)
            elif driver == "snowflake":
                cur.execute(statement, num_statements=1)
            else:
                cur.execute(statement)
        except Exception as exc:  # noqa: BLE001 - every driver's own errors: one line
            line = _first_line(exc, *self._secrets)
            if any(words in line for words in SECOND_STATEMENT):
                line = f"source.query must be a single statement (the server refused a second: {line})"
            raise self.refuse(line) from None

    def _fetch(self, cur: Any) -> list[Any]:
        try:
            return list(cur.fetchmany(ROWS_PER_FETCH))
        except Exception as exc:  # noqa: BLE001
            raise self.refuse(_first_line(exc, *self._secrets)) from None

    # -- one consistent, read-only read
    class _Session:
        def __init__(self, reader: "SqlSource", stream: bool):
            self.reader, self.stream = reader, stream
            self.conn: Any = None
            self.cur: Any = None

        def __enter__(self) -> Any:
            r = self.reader
            hook = r.hook()
            try:
                self.conn = r._sqlite_read_only() if r.dialect == "sqlite" else hook.get_conn()
            except SnapshotError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreachable, refused, bad credentials
                raise r.refuse(f"cannot connect through Airflow connection {r.source.conn_id!r}: "
                               f"{_first_line(exc, *r._secrets)}") from None
            try:
                self.cur = r._begin(self.conn, self.stream)
            except SnapshotError:
                self.__exit__(None, None, None)
                raise
            except Exception as exc:  # noqa: BLE001
                self.__exit__(None, None, None)
                raise r.refuse(_first_line(exc, *r._secrets)) from None
            return self.cur

        def __exit__(self, *exc: Any) -> None:
            for close in (getattr(self.cur, "close", None), getattr(self.conn, "rollback", None),
                          getattr(self.conn, "close", None)):
                if close is not None:
                    try:
                        close()
                    except Exception:  # noqa: BLE001 - closing after a read: nothing left to keep
                        pass

    def _session(self, stream: bool = False) -> "SqlSource._Session":
        return SqlSource._Session(self, stream)

    def _sqlite_read_only(self) -> Any:
        """The connection's SQLite file opened read-only (``mode=ro``): a missing file is refused, never
        created, and nothing on this connection can write it."""
        import sqlite3
        from pathlib import Path
        from urllib.parse import quote

        path = str(getattr(self._connection, "host", "") or "")
        if not path or not Path(path).is_file():
            raise self.refuse(f"no SQLite file {path!r} (the host of Airflow connection "
                              f"{self.source.conn_id!r}): nothing was created")
        return sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True)

    def _begin(self, conn: Any, stream: bool) -> Any:
        """A cursor in a read-only snapshot transaction where the engine has one (server-side when
        ``stream`` and the driver has one), on a connection that sends one statement per call."""
        dialect = self.dialect
        module = type(conn).__module__
        if dialect == "postgresql" and (hasattr(conn, "set_session") or module.startswith("psycopg")):
            if hasattr(conn, "set_session"):   # psycopg2
                if self.source.query:
                    raise self.refuse("source.query on PostgreSQL needs psycopg 3 (the postgres provider's "
                                      "driver with SQLAlchemy 2): psycopg2 sends text by the simple protocol, "
                                      "where a second statement could end the read-only transaction")
                conn.set_session(isolation_level="REPEATABLE READ", readonly=True, autocommit=False)
            else:                              # psycopg 3
                conn.autocommit = False
                conn.isolation_level = 3   # psycopg.IsolationLevel.REPEATABLE_READ
                conn.read_only = True
            if stream:
                cur = conn.cursor(name="bi_source_rows")
                cur.itersize = ROWS_PER_FETCH
                return cur
            return conn.cursor()
        if dialect in ("mysql", "mariadb"):
            if module.startswith("MySQLdb"):
                conn.set_server_option(MYSQL_OPTION_MULTI_STATEMENTS_OFF)
            elif self.source.query:
                raise self.refuse(f"source.query on MySQL / MariaDB needs the mysqlclient driver (the mysql "
                                  f"provider's default client), not {module.partition('.')[0]}: it is the one "
                                  "whose multi-statement switch this reader turns off")
            cur = conn.cursor()
            cur.execute(q("source_mysql_read_only_session"))
            cur.execute(q("repeatable_read"))
            cur.execute(q("source_mysql_snapshot"))
            if stream and module.startswith("MySQLdb"):
                import MySQLdb.cursors

                cur.close()
                return conn.cursor(MySQLdb.cursors.SSCursor)
            return cur
        if dialect == "sqlite":   # opened read-only (_sqlite_read_only); sqlite3 runs one statement a call
            conn.isolation_level = None   # this module's own BEGIN below, not the driver's implicit ones
            cur = conn.cursor()
            cur.execute(q("source_sqlite_query_only"))
            cur.execute(q("source_sqlite_begin"))
            return cur
        return conn.cursor()   # one statement: the engine's own snapshot of it

    def lineage(self) -> list[Ident]:
        """The table as OpenLineage names it, from the hook's own OpenLineage database info
        (``snowflake://org-account``, ``mysql://host:port``, ``bigquery``, ...); a query's tables are not
        named here."""
        if not self.source.table:
            return []
        try:
            hook = self.hook()
            info = hook.get_openlineage_database_info(hook.get_connection(self.source.conn_id))
        except Exception:  # noqa: BLE001 - lineage is best effort: never fails a submit
            info = None
        parts = self.source.table.split(".")
        if info is None and self.dialect == "snowflake":
            return [self._snowflake_ident(parts)]
        if info is None:
            return [(f"{self.dialect}://{self.source.conn_id}", ".".join(parts))]
        namespace = f"{info.scheme}://{info.authority}" if info.authority else info.scheme
        if len(parts) < 3 and info.database and self.dialect not in ("mysql", "mariadb"):
            parts = [info.database, *(parts if len(parts) == 2 else [info.default_schema or "public", *parts])]
        return [(namespace, ".".join(parts))]

    def _snowflake_ident(self, parts: list[str]) -> Ident:
        """OpenLineage's Snowflake name (``snowflake://<account>``, ``DATABASE.SCHEMA.TABLE``), from the
        connection's own parameters: the provider's way needs snowflake-sqlalchemy, which does not run on
        SQLAlchemy 2.1."""
        try:
            params = self.hook()._get_conn_params()
        except Exception:  # noqa: BLE001
            params = {}
        account = str(params.get("account") or self.source.conn_id).lower()
        if len(parts) < 3:
            parts = [str(params.get("database") or ""), *(parts if len(parts) == 2
                                                         else [str(params.get("schema") or "PUBLIC"), *parts])]
        return f"snowflake://{account}", ".".join(p.upper() for p in parts if p)
