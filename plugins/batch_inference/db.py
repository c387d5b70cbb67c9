"""The one gateway to PostgreSQL: connections, migrations and named queries.

SQL lives in ``sql/``: ``schema/``, the current definition of the ledger,
one file per area; ``migrations/``, the numbered steps that build it from an
empty database (never edited once added); and the named statements
(``QUERY_FILES``: ``-- name: NAME  what it does``, then the statement), which
``q(name)`` and ``composed(name, ...)`` return. Nothing else in the package
writes SQL (tests/unit/test_gateway.py checks); the ledger transitions are SQL
functions (sql/schema/ledger.sql).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import time
from functools import lru_cache
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from batch_inference.exceptions import BadDatabaseURL, DatabaseUnavailable, MigrationRefused

log = logging.getLogger(__name__)

DB_ENV = "BATCH_INFERENCE_DB"
HOME_ENV = "BATCH_INFERENCE_HOME"
_MIGRATION_LOCK = 0x62695F6D  # advisory lock key: one migrator at a time


def sql_dir() -> Path:
    """``sql/`` in a source checkout, or the copy packaged inside the wheel."""
    here = Path(__file__).resolve().parent
    for cand in (here / "sql", here.parent.parent / "sql"):
        if (cand / "queries.sql").exists():
            return cand
    raise FileNotFoundError("cannot find the sql/ directory next to the batch_inference package")


# The named statements, one file per reader: the package's own, the dashboard's
# reads, the chaos harness's audit, the evaluation's, the hosted batch
# transports' and the nights harness's. Names are unique across the files.
QUERY_FILES = ("queries.sql", "dashboard.sql", "chaos.sql", "evaluation.sql", "hosted.sql", "nights.sql",
               "sources.sql", "fleet.sql", "embed.sql", "ladder.sql", "regions.sql", "tiers.sql")


def parse_queries(text: str) -> dict[str, str]:
    """``-- name: NAME  what it does`` blocks: NAME -> the statement, without its
    final ``;`` and without the comments and blank lines that follow it (a
    section header before the next block belongs to no statement)."""
    out: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        header, _, body = block.partition("\n")
        lines = body.strip().splitlines()
        while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
            lines.pop()
        out[header.split()[0]] = "\n".join(lines).strip().rstrip(";")
    return out


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """Every named statement of the ``QUERY_FILES`` in sql/: the package's one SQL gateway."""
    out: dict[str, str] = {}
    where: dict[str, str] = {}
    for file in QUERY_FILES:
        for name, statement in parse_queries((sql_dir() / file).read_text()).items():
            if name in out:
                raise ValueError(f"query {name!r} is named in both sql/{where[name]} and sql/{file}")
            out[name], where[name] = statement, file
    return out


def q(name: str) -> str:
    """The named statement ``name``."""
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in sql/ ({', '.join(QUERY_FILES)})") from None


def composed(name: str, /, **parts: sql.Composable) -> sql.Composed:
    """The named statement ``name`` with its ``{placeholders}`` filled by psycopg.sql
    parts (``sql.Identifier`` for a table, ``sql.Literal``...), never by string formatting."""
    return sql.SQL(q(name)).format(**parts)


def home() -> Path:
    return Path(os.environ.get(HOME_ENV, "./.batch-inference")).resolve()


def resolve_url(url: str | None = None) -> str:
    """--db, else $BATCH_INFERENCE_DB, else the embedded server (started if needed),
    as a string libpq accepts (``usable_url``)."""
    given = url or os.environ.get(DB_ENV)
    if given:
        return usable_url(given)
    from batch_inference.embedded import ensure_server

    return ensure_server(home())


def usable_url(url: str) -> str:
    """``url`` normalized (``normalize_url``) and parsed as libpq would;
    BadDatabaseURL, one line without the password, if libpq cannot use it."""
    dsn = normalize_url(url)
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise BadDatabaseURL(f"unusable database URL {redact(url)}: {scrub(first_line(exc), url)}") from None
    return dsn


def first_line(exc: BaseException) -> str:
    """An exception's first line (its class name if it has no message)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


# psycopg prepares a statement server-side after it has run five times; behind
# PgBouncer in transaction mode (1.18 has no protocol-level prepared
# statements) the next transaction may run on a server connection that lacks
# it. None: never prepare. The ledger's calls are SELECTs of SQL functions,
# whose own plans PostgreSQL caches either way, so preparing bought nothing
# measurable (docs/capacity.md).
PREPARE_THRESHOLD: int | None = None


def backoff(attempt: int, base: float = 1.0) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...) on a lost database: doubling from ``base``
    up to 10 s, jittered, so clients cut off by the same restart come back spread over the interval
    instead of all at once."""
    return min(base * 2 ** (attempt - 1), 10.0) * random.uniform(0.5, 1.0)


def connect(url: str | None = None, *, autocommit: bool = True, retries: int = 0,
            retry_wait: float = 1.0, application_name: str = "batch-inference",
            connection_class: type[psycopg.Connection] = psycopg.Connection) -> psycopg.Connection:
    """Open a connection with dict rows. ``retries`` covers a database restart.

    Never server-side prepared statements (``PREPARE_THRESHOLD``), so the
    connection works through a transaction pooler (docs/capacity.md)."""
    dsn = resolve_url(url)
    attempt = 0
    while True:
        try:
            return connection_class.connect(dsn, autocommit=autocommit, row_factory=dict_row,
                                            application_name=application_name, connect_timeout=10,
                                            prepare_threshold=PREPARE_THRESHOLD)
        except psycopg.ProgrammingError as exc:   # a value libpq refuses only at connect (sslmode=...)
            raise BadDatabaseURL(f"unusable database URL {redact(dsn)}: {scrub(first_line(exc), dsn)}") from None
        except psycopg.OperationalError as exc:
            attempt += 1
            if attempt > retries:
                raise DatabaseUnavailable(f"database unreachable after {attempt} attempt(s): "
                                          f"{scrub(first_line(exc), dsn)}") from None
            wait = backoff(attempt, retry_wait)
            log.warning("database unreachable (%s); retry %d/%d in %.1fs", exc.__class__.__name__,
                        attempt, retries, wait)
            time.sleep(wait)


def migrations() -> list[Path]:
    return sorted(p for p in (sql_dir() / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql"))


# The first migration; a database whose record lacks it was built by the
# migrations that came before the schema was squashed into it.
_INITIAL = "0001_initial.sql"


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply the sql/migrations/ files not yet applied, in order, in one
    transaction; idempotent and safe to run from several processes at once.

    MigrationRefused, one line, when an applied migration's file changed or
    the database predates the squashed first migration; nothing is applied.
    """
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute(q("migration_lock"), {"key": _MIGRATION_LOCK})
        conn.execute(q("migrations_table"))
        done = {r["name"]: r["checksum"] for r in conn.execute(q("migrations_applied"))}
        if done and _INITIAL not in done:
            raise MigrationRefused(
                f"this ledger database predates the schema squash (it was built by {min(done)} and "
                f"{len(done) - 1} more migrations of the old series) and cannot be upgraded: rebuild it "
                "(DROP SCHEMA bi, published CASCADE, or a new database), then run `batch-inference db migrate`")
        for path in migrations():
            body = path.read_text()
            checksum = hashlib.sha256(body.encode()).hexdigest()
            if path.name in done:
                if done[path.name] != checksum:
                    raise MigrationRefused(
                        f"migration {path.name} changed after it was applied to this database (recorded "
                        f"sha256 {done[path.name][:12]}, file {checksum[:12]}); applied migrations are never "
                        "edited: restore the file and add a new migration")
                continue
            conn.execute(body)
            conn.execute(q("migration_record"), {"name": path.name, "checksum": checksum})
            applied_now.append(path.name)
    if applied_now:
        log.info("applied migrations: %s", ", ".join(applied_now))
    return applied_now


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def normalize_url(url: str) -> str:
    """A URL libpq accepts: SQLAlchemy's ``postgresql+DRIVER://`` (``+psycopg2``,
    ``+psycopg``, ``+asyncpg``...) and ``postgres+DRIVER://``, in any case,
    become ``postgresql://``.

    ``postgres://`` and ``postgresql://`` are libpq URIs already; a
    ``key=value`` conninfo string passes through unchanged; a URL of any
    other scheme is a BadDatabaseURL.
    """
    m = _SCHEME.match(url)
    if m is None:
        return url
    scheme = m.group(1)
    if scheme in ("postgresql", "postgres"):
        return url
    if scheme.lower().partition("+")[0] in ("postgresql", "postgres"):
        return "postgresql://" + url[m.end():]
    raise BadDatabaseURL(f"not a PostgreSQL database URL: {redact(url)} (expected postgresql://, "
                         "postgresql+DRIVER://, postgres:// or a key=value conninfo)")


# Where a password sits: a URL's userinfo, with or without its scheme
# (from its first ':' to the last '@', so a raw '@' or '/' in the password
# is covered too); a URL's ?password= / ?sslpassword= (or an HTTP API's
# ?key=, ?token=, ?sig=...) parameter; a conninfo's password= value (quoted
# or not, an unterminated quote running to the end).
_URL_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^@/?#:]*:)(.*)@", re.S)
_BARE_USERINFO = re.compile(r"^([^@/?#:=\s]*:)(.*)@", re.S)   # user:password@host, the scheme left out
_URL_PARAM = re.compile(r"([?&](?:ssl)?password=|[?&](?:api[-_]?)?key=|[?&](?:access[-_]?)?token=|[?&]secret=|"
                        r"[?&]sig(?:nature)?=)([^&#]*)", re.I)
_CONNINFO_PARAM = re.compile(r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*(?:'|$)|[^\s']\S*|)", re.I)


def _passwords(url: str) -> list[str]:
    """The password-like values in ``url``, as written and percent-decoded."""
    from urllib.parse import unquote

    found: list[str] = []
    m = (_URL_USERINFO if _SCHEME.match(url) else _BARE_USERINFO).match(url)
    if m:
        found.append(m.group(2))
    found += [p.group(2) for p in _URL_PARAM.finditer(url)]
    if not _SCHEME.match(url):
        found += [p.group(2).strip("'") for p in _CONNINFO_PARAM.finditer(url)]
    return [v for p in found if p for v in {p, unquote(p)}]


def redact(url: str) -> str:
    """A database URL or conninfo with its password replaced by ``***``, for
    every log line, error and report that names a database. Textual: it never
    fails, whatever ``url`` holds."""
    if _SCHEME.match(url):
        url = _URL_USERINFO.sub(lambda m: m.group(1) + "***@", url, count=1)
        return _URL_PARAM.sub(lambda m: m.group(1) + "***", url)
    url = _BARE_USERINFO.sub(lambda m: m.group(1) + "***@", url, count=1)
    return _CONNINFO_PARAM.sub(lambda m: m.group(1) + "***", url)


def pasteable(url: str) -> tuple[str, bool]:
    """``url`` as printed for a person to paste (psql, ``BATCH_INFERENCE_DB``): whole when it holds no
    password (the embedded server's), else redacted; the flag says whether it was redacted."""
    hidden = bool(_passwords(url))
    return (redact(url) if hidden else url), hidden


def scrub(message: str, url: str) -> str:
    """``message`` (say, a libpq error about ``url``) with ``url`` and any of its passwords redacted."""
    message = message.replace(url, redact(url))
    for secret in _passwords(url):
        message = message.replace(secret, "***")
    return message


def airflow_connection_json(url: str) -> str:
    """An Airflow connection (the JSON form of ``AIRFLOW_CONN_<ID>``) for a PostgreSQL URL or conninfo.

    A Unix-socket directory becomes the connection's ``host``; libpq
    parameters without an Airflow field go to ``extra``.
    """
    parts = conninfo_to_dict(normalize_url(url))
    fields = {"conn_type": "postgres", "host": parts.pop("host", None), "port": parts.pop("port", None),
              "login": parts.pop("user", None), "password": parts.pop("password", None),
              "schema": parts.pop("dbname", None)}
    if fields["port"] is not None:
        fields["port"] = int(fields["port"])
    out = {k: v for k, v in fields.items() if v not in (None, "")}
    if parts:
        out["extra"] = {k: str(v) for k, v in parts.items()}
    return json.dumps(out)
