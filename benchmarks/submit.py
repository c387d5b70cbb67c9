"""Snapshot + plan (``batch_inference.plan.submit``) and validate at 1M records,
beside a raw ``CREATE TABLE ... AS SELECT`` copy of the same source rows.

The raw copy is the floor for any snapshot: it reads the source once and
writes every row once. The keyed copy is the raw copy plus its primary key,
the one index a snapshot the ledger puts against cannot do without (a put
looks each record up by id); ``keyed_ratio`` is submit against it.

Submit reads the source into a staging table, checks
ids, hashes the snapshot, classifies every record (content hash, rejects,
shard number) and writes the snapshot rows (with their primary key and shard
index) and the shard table, in one transaction. The breakdown times each
named statement of that real submit (the connection is wrapped, the code is
not changed), so the steps add up to the measured total; ``commit`` is the
rest (the transaction's end).

Through the CLI, as a user runs it: ``batch-inference submit SPEC`` in a
process of its own, timed from its start to its exit (interpreter start-up,
imports, the spec file, the connection and its migration check, the weights
check and the counts it prints included), a new job version over the same
source in the same repeat; ``cli_keyed_ratio`` is it against a keyed copy run
just before it (the median of the repeats' ratios: the load on a shared machine
moves within a repeat), ``cli_fixed_s`` what the CLI adds to the in-process submit,
``cli_keyed_cpu_ratio`` the CLI's process and server CPU against that keyed copy's
server CPU. ``cpu`` names the CPU beside the ratios.

Validate runs over the same job version after its results have been written
directly with SQL (one result per record, as a finished job has), because the
validator reads results: its time is measured, the result writing is not.

CPU is reported two ways. ``*_cpu_s`` is the CPU of the connection's own
backend (what the per-step figures are). ``*_server_cpu_s`` is every
PostgreSQL process of the benchmark's private server: parallel query and
index-build workers, the I/O workers that do PostgreSQL 18's reads, the WAL
writer and checkpointer. The backend alone misses the work those do (a
parallel join in validate, reads), so the server figure is the one to judge.

    python -m benchmarks.submit [--records N] [--repeats R] [--ids ordered,random]

Each order of record ids runs on its own server: ids written in id order
(``t000000001``, ...), and UUID text written in no order (the common case).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql as pgsql

from batch_inference import db
from batch_inference.plan import submit
from benchmarks.common import (PYTHON, REPO, ServerCpu, bench_spec, cpu_name, emit, fresh_server, machine,
                               make_tickets, median, pg_version, rnd, worker_env)

TARGET = 1.5  # submit time / raw copy time
# The source rows every copy writes: what submit snapshots, unchecked and unclassified
SOURCE_ROWS = "SELECT id, body, acl FROM public.tickets"


def _ratio(a: float, b: float) -> float | None:
    """None when the baseline is below the CPU clock's resolution (tiny --quick runs)."""
    return round(a / b, 2) if b > 0 else None


class TimedConnection:
    """Delegates to a psycopg connection and times every ``execute``, wall and
    server CPU, under the name of its statement in sql/queries.sql.

    Composed statements (``sql.SQL(q(name)).format(...)``) lose their text, so
    the name is taken from the last ``q(name)`` call, which the code makes just
    before it executes (``q`` is wrapped while the benchmark runs).
    Statements not in queries.sql are labelled by the SQL function they call
    or their first words.
    """

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn
        self._names = {text: name for name, text in db.queries().items()}
        self._backend = psutil.Process(conn.info.backend_pid)
        self.pending: str | None = None
        self.steps: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._server = ServerCpu(conn)
        self.whole: dict[str, float] = {}   # CPU of the whole server per step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def server_cpu(self) -> float:
        t = self._backend.cpu_times()
        return t.user + t.system

    def _label(self, query: Any) -> str:
        if isinstance(query, str) and query in self._names:
            return self._names[query]
        if isinstance(query, str):
            m = re.search(r"bi\.(\w+)\(", query)
            return m.group(1) if m else " ".join(query.split()[:3]).lower()
        return self.pending or "composed"

    def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
        t0, c0, s0 = time.perf_counter(), self.server_cpu(), self._server()
        try:
            return self._conn.execute(query, params, **kw)
        finally:
            label = self._label(query)
            self.pending = None
            self.steps[label] = self.steps.get(label, 0.0) + time.perf_counter() - t0
            self.cpu[label] = self.cpu.get(label, 0.0) + self.server_cpu() - c0
            self.whole[label] = self.whole.get(label, 0.0) + self._server() - s0

    def cursor(self, *a: Any, **kw: Any) -> Any:  # COPY of rows read in Python
        return self._conn.cursor(*a, **kw)


@contextmanager
def named_queries(timed: TimedConnection) -> Iterator[None]:
    """Wrap ``q`` where submit and validate look it up, so composed statements get their names."""
    from batch_inference import plan, snapshot
    from batch_inference import validate as validate_module

    originals = {m: m.q for m in (plan, snapshot, validate_module) if hasattr(m, "q")}

    def q(name: str) -> str:
        timed.pending = name
        return db.q(name)

    for m in originals:
        m.q = q  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, f in originals.items():
            m.q = f  # type: ignore[attr-defined]


def raw_copy(conn: psycopg.Connection, n: int) -> tuple[float, float, float]:
    """(wall seconds, backend CPU seconds, server CPU seconds) of an unindexed copy of the source."""
    backend, server = psutil.Process(conn.info.backend_pid), ServerCpu(conn)
    c0, s0 = sum(backend.cpu_times()[:2]), server()
    t0 = time.perf_counter()
    conn.execute(f"CREATE TABLE public.raw_copy_{n} AS {SOURCE_ROWS}")
    elapsed = time.perf_counter() - t0
    cpu, server_cpu = sum(backend.cpu_times()[:2]) - c0, server() - s0
    conn.execute(f"DROP TABLE public.raw_copy_{n}")
    return elapsed, cpu, server_cpu


def keyed_copy(conn: psycopg.Connection, n: int) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of the raw copy plus the one index any
    keyed snapshot needs, its primary key, built the way submit builds it."""
    server = ServerCpu(conn)
    s0, t0 = server(), time.perf_counter()
    with conn.transaction():
        conn.execute(db.q("plan_work_mem"))  # submit's index-build settings
        conn.execute(f"CREATE TABLE public.keyed_copy_{n} AS {SOURCE_ROWS}")
        conn.execute(f"ALTER TABLE public.keyed_copy_{n} ADD PRIMARY KEY (id)")
    elapsed, server_cpu = time.perf_counter() - t0, server() - s0
    conn.execute(f"DROP TABLE public.keyed_copy_{n}")
    return elapsed, server_cpu


def cli_submit(url: str, conn: psycopg.Connection, shard_size: int, version: str) -> tuple[float, float, float]:
    """(wall seconds, the process's CPU seconds, server CPU seconds) of ``batch-inference submit SPEC`` in
    its own process, start to exit, for a new job version (prompt version ``version``) over the same
    source; the version is dropped after."""
    spec = bench_spec(shard_size=shard_size, prompt={"version": version, "system": "Classify the support ticket."})
    cli = str(Path(PYTHON).with_name("batch-inference"))
    server = ServerCpu(conn)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        f.write(json.dumps(spec.model_dump(mode="json", exclude_none=True)))   # JSON is YAML
        f.flush()
        s0, t0 = server(), time.perf_counter()
        proc = subprocess.Popen([cli, "submit", f.name], cwd=REPO, env=worker_env(url), stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed, server_cpu = time.perf_counter() - t0, server() - s0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"batch-inference submit exited {proc.returncode}: {err.read()[-2000:]}")
        job = json.loads(out.read().strip().splitlines()[-1])["job_version"]
    conn.execute("SELECT bi.drop_job_version_v1(%s)", (job,))
    conn.execute("CHECKPOINT")
    return elapsed, usage.ru_utime + usage.ru_stime, server_cpu


def write_results(conn: psycopg.Connection, job: str) -> None:
    """One stored result per leased record, as a finished batch job leaves them."""
    conn.execute("""
        INSERT INTO bi.results (job_version, record_id, output, category, model_name, model_digest,
                                prompt_version, transport, worker_id, epoch, acl, content_hash)
        SELECT sr.job_version, sr.record_id,
               jsonb_build_object('category', (ARRAY['billing','bug','account','other'])[1 + abs(hashtext(sr.record_id)) %% 4],
                                  -- valid for the bench schema (summary of 240 to 400 characters)
                                  'summary', rpad('A customer reports a duplicate charge.', 250, ' x')),
               (ARRAY['billing','bug','account','other'])[1 + abs(hashtext(sr.record_id)) %% 4],
               j.model_name, j.model_digest, j.prompt_version, 'batch', 'bench', 1, sr.acl, sr.content_hash
          FROM bi.snapshot_rows sr JOIN bi.jobs j ON j.job_version = sr.job_version
         WHERE sr.job_version = %s AND sr.shard_no IS NOT NULL""", (job,))
    conn.execute("""UPDATE bi.shards SET state = 'done', stored = records, epoch = 1, claims = 1,
                           first_claim_at = clock_timestamp(), done_at = clock_timestamp()
                     WHERE job_version = %s""", (job,))


def validate_fn():
    """``batch_inference.validate.validate`` once it exists, else None."""
    try:
        mod = importlib.import_module("batch_inference.validate")
    except ModuleNotFoundError:
        return None
    return getattr(mod, "validate", None)


def run(records: int = 1_000_000, repeats: int = 3, shard_size: int = 5000, text_len: int = 0,
        id_orders: tuple[str, ...] = ("ordered", "random")) -> dict[str, Any]:
    """``run_order`` for each order of record ids, each on its own server; the first order's figures
    are the line's, and ``by_id_order`` holds each order's submit beside its own keyed copy."""
    outs = {order: run_order(records, repeats, shard_size, text_len, order) for order in id_orders}
    out = dict(outs[id_orders[0]])
    out["by_id_order"] = {order: {k: o[k] for k in ("raw_copy_s", "keyed_copy_s", "submit_s", "ratio", "keyed_ratio",
                                                     "cli_submit_s", "cli_keyed_ratio", "cli_keyed_cpu_ratio",
                                                     "keyed_server_cpu_ratio", "cpu",
                                                     "steps_s")}
                          for order, o in outs.items()}
    out["keyed_target"] = f"<= {TARGET} (submit / keyed copy, every id order)"
    out["keyed_met"] = all(o["keyed_ratio"] <= TARGET for o in outs.values())
    out["cli_keyed_met"] = all(o["cli_keyed_ratio"] <= TARGET for o in outs.values())
    return out


def run_order(records: int, repeats: int, shard_size: int, text_len: int, ids: str) -> dict[str, Any]:
    validate = validate_fn()
    copies: list[float] = []
    copy_cpus: list[float] = []
    copy_server: list[float] = []
    keyed: list[float] = []
    keyed_server: list[float] = []
    submit_server: list[float] = []
    validate_server: list[float] = []
    submit_cpus: list[float] = []
    step_cpus: dict[str, list[float]] = {}
    step_server: dict[str, list[float]] = {}
    vstep_server: dict[str, list[float]] = {}
    submits: list[float] = []
    clis: list[float] = []
    cli_cpus: list[float] = []
    cli_ratios: list[float] = []       # each repeat's CLI submit against the keyed copy run just before it
    cli_cpu_ratios: list[float] = []
    validates: list[float] = []
    analyzes: list[float] = []
    vsteps: dict[str, list[float]] = {}
    validate_cpus: list[float] = []
    steps: dict[str, list[float]] = {}
    with fresh_server() as url, db.connect(url) as conn:
        make_tickets(conn, records, text_len=text_len, ids=ids)
        # Hint bits and the visibility map set now, not by whichever repeat
        # reads the source first; autovacuum has nothing left to do on it.
        conn.execute("VACUUM (ANALYZE) public.tickets")
        for rep in range(repeats):
            wall, cpu, server_cpu = raw_copy(conn, rep)
            copies.append(wall)
            copy_cpus.append(cpu)
            copy_server.append(server_cpu)
            keyed_wall, keyed_server_cpu = keyed_copy(conn, rep)
            keyed.append(keyed_wall)
            keyed_server.append(keyed_server_cpu)
            server = ServerCpu(conn)
            spec = bench_spec(shard_size=shard_size,
                              prompt={"version": f"r{rep}", "system": "Classify the support ticket."})
            timed = TimedConnection(conn)
            t0, c0, s0 = time.perf_counter(), timed.server_cpu(), server()
            with named_queries(timed):
                m = submit(timed, spec)  # type: ignore[arg-type]
            total = time.perf_counter() - t0
            submit_cpus.append(timed.server_cpu() - c0)
            submit_server.append(server() - s0)
            assert m.created and m.records == records, m
            submits.append(total)
            timed.steps["commit"] = total - sum(timed.steps.values())
            for k, v in timed.steps.items():
                steps.setdefault(k, []).append(v)
            for k, v in timed.cpu.items():
                step_cpus.setdefault(k, []).append(v)
            for k, v in timed.whole.items():
                step_server.setdefault(k, []).append(v)
            # Not part of submit today: what ANALYZE of the new snapshot partition
            # would add (it gives the planner row counts for the shard index).
            suffix = conn.execute("SELECT substr(md5(%s), 1, 16) AS s", (m.job_version,)).fetchone()["s"]  # type: ignore[index]
            # The server CPU figures count every process: keep autovacuum's
            # background work on this job's new tables out of validate's window.
            # (Storage parameters go on leaves: a job's results partition is itself partitioned.)
            for table in ("snapshot_rows", "results"):
                for leaf in conn.execute("SELECT relid::regclass::text AS leaf FROM pg_partition_tree(%s::regclass) "
                                         "WHERE isleaf", (f"bi.{table}_{suffix}",)).fetchall():
                    conn.execute(pgsql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(
                        pgsql.SQL(leaf["leaf"])))  # type: ignore[index]
            t0 = time.perf_counter()
            conn.execute(pgsql.SQL("ANALYZE bi.{}").format(pgsql.Identifier(f"snapshot_rows_{suffix}")))
            analyzes.append(time.perf_counter() - t0)
            if validate is not None:
                write_results(conn, m.job_version)
                conn.execute("ANALYZE bi.results")
                backend = psutil.Process(conn.info.backend_pid)
                vtimed = TimedConnection(conn)
                with tempfile.TemporaryDirectory() as samples, named_queries(vtimed):
                    t0, c0, s0 = time.perf_counter(), sum(backend.cpu_times()[:2]), server()
                    report = validate(vtimed, m.job_version, sample_dir=samples)  # type: ignore[arg-type]
                    validates.append(time.perf_counter() - t0)
                    validate_cpus.append(sum(backend.cpu_times()[:2]) - c0)
                    validate_server.append(server() - s0)
                assert report["passed"], report["failures"]
                for k, v in (report.get("timings") or {}).items():
                    vsteps.setdefault(k, []).append(v)
                for k, v in vtimed.whole.items():
                    vstep_server.setdefault(k, []).append(v)
            # Keep the database the same size for every repeat.
            conn.execute("SELECT bi.drop_job_version_v1(%s)", (m.job_version,))
            conn.execute("CHECKPOINT")
            # The CLI's baseline is a keyed copy run just before it: the two arms of one ratio meet the
            # same load (on a shared machine it moves within a repeat).
            near_keyed, near_keyed_server = keyed_copy(conn, rep)
            cli_wall, cli_cpu, cli_server = cli_submit(url, conn, shard_size, f"cli{rep}")
            clis.append(cli_wall)
            cli_cpus.append(cli_cpu + cli_server)
            cli_ratios.append(cli_wall / near_keyed)
            if near_keyed_server > 0:   # not below the CPU clock's resolution (tiny --quick runs)
                cli_cpu_ratios.append((cli_cpu + cli_server) / near_keyed_server)
        version = pg_version(conn)
    copy_s, submit_s = median(copies), median(submits)
    out: dict[str, Any] = {
        "benchmark": "submit", "records": records, "text_len": text_len or 50, "shard_size": shard_size, "ids": ids,
        "repeats": repeats,
        "raw_copy_s": rnd(copy_s), "submit_s": rnd(submit_s), "ratio": round(submit_s / copy_s, 2),
        # On a shared machine wall time swings with the load, the work done much
        # less: compare the CPU ratios too (backend only, and the whole server).
        "raw_copy_cpu_s": rnd(median(copy_cpus)), "submit_cpu_s": rnd(median(submit_cpus)),
        "cpu_ratio": _ratio(median(submit_cpus), median(copy_cpus)),
        "raw_copy_server_cpu_s": rnd(median(copy_server)), "submit_server_cpu_s": rnd(median(submit_server)),
        "server_cpu_ratio": _ratio(median(submit_server), median(copy_server)),
        # The floor of any keyed snapshot: the raw copy and its primary key.
        "keyed_copy_s": rnd(median(keyed)), "keyed_copy_server_cpu_s": rnd(median(keyed_server)),
        "keyed_ratio": round(submit_s / median(keyed), 2), "cpu": cpu_name(),
        # Through the CLI, start-up included, and what the CLI adds to the in-process submit.
        # Each ratio the median of the repeats' own, the CLI's against the keyed copy run just before it.
        "cli_submit_s": rnd(median(clis)), "cli_keyed_ratio": round(median(cli_ratios), 2),
        "cli_fixed_s": rnd(median(clis) - submit_s),
        # The same in CPU, which the load moves less: the CLI's process and the server against the keyed copy's server.
        "cli_cpu_s": rnd(median(cli_cpus)),
        "cli_keyed_cpu_ratio": round(median(cli_cpu_ratios), 2) if cli_cpu_ratios else None,
        "keyed_server_cpu_ratio": _ratio(median(submit_server), median(keyed_server)),
        "steps_s": {k: rnd(median(v)) for k, v in sorted(steps.items(), key=lambda kv: -median(kv[1]))},
        "steps_cpu_s": {k: rnd(median(v)) for k, v in sorted(step_cpus.items(), key=lambda kv: -median(kv[1]))},
        "steps_server_cpu_s": {k: rnd(median(v)) for k, v in sorted(step_server.items(),
                                                                    key=lambda kv: -median(kv[1])) if median(v) >= 0.005},
        "analyze_snapshot_s": rnd(median(analyzes)),
    }
    if validates:
        validate_s = median(validates)
        out.update({"validate_s": rnd(validate_s), "validate_steps_s": {k: rnd(median(v)) for k, v in vsteps.items()},
                    "validate_ratio": round(validate_s / copy_s, 2), "validate_cpu_s": rnd(median(validate_cpus)),
                    "validate_cpu_ratio": _ratio(median(validate_cpus), median(copy_cpus)),
                    "validate_server_cpu_s": rnd(median(validate_server)),
                    "validate_steps_server_cpu_s": {k: rnd(median(v)) for k, v in sorted(
                        vstep_server.items(), key=lambda kv: -median(kv[1])) if median(v) >= 0.005},
                    "validate_server_cpu_ratio": _ratio(median(validate_server), median(copy_server)),
                    "submit_plus_validate_ratio": round((submit_s + validate_s) / copy_s, 2)})
    else:
        out["validate_s"] = None
        out["validate_todo"] = "batch_inference.validate is not in this checkout yet"
    out.update({"target": f"<= {TARGET}", "met": out["ratio"] <= TARGET
                and (not validates or out["validate_ratio"] <= TARGET),
                "postgres": version, "machine": machine()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text-len", type=int, default=0,
                    help="pad each record's text to about this many characters (default: ~50)")
    ap.add_argument("--ids", default="ordered,random",
                    help="orders of record ids to run, comma-separated: ordered (t000000001, ...), random (UUID text)")
    a = ap.parse_args(argv)
    emit(run(a.records, a.repeats, a.shard_size, a.text_len, tuple(a.ids.split(","))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
