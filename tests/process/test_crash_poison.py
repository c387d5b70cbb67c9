"""Records that kill the worker (I4 for deaths; sql/schema/ledger.sql, bi.record_deaths_v1).

A record that crashes the process itself (OOM, a segfault or an abort in the
engine) used to loop: the lease expired, the next holder ran the same batch
and died the same way. These tests run real ``python -m gpu_runner``
processes, one after another as a supervisor would restart them, with an
engine that SIGKILLs its own process on one record id, and check that the
record ends dead-lettered after max_attempts deaths, that the records which
shared its batch are stored (not dead-lettered), and that the job finishes.
The engine is the only fake: there is no real model whose crash can be
ordered on one record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from batch_inference.engines.base import Engine, Outcome, Request
from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from batch_inference.status import dead_letters, job_counts
from batch_inference.exits import ExitCode
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets

ANSWER = json.dumps({"category": "billing", "summary": "charged twice"})
POISON = "t00013"          # shard 1 of shards of 10


class CrashingEngine(Engine):
    """Answers every record, except that it kills its own process on the ids
    in ``crash_ids`` (``how``: ``sigkill`` as an OOM kill would, ``exit`` as an
    abort would, ``raise`` as a lost device would). Appends each started record
    id to ``log`` with an unbuffered write, so a kill loses no line."""

    name = "crashing"
    option_names = frozenset({"crash_ids", "how", "log", "delay_s"})
    serves_models = ("noop",)   # the test specs' model (batch_inference.provenance)

    def load(self) -> None:
        self.crash_ids = set(self.option("crash_ids", []))
        self.how = self.option("how", "sigkill")
        self.delay_s = float(self.option("delay_s", 0.0))
        path = self.option("log")
        self.log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for req in requests:
            if stop.is_set():
                return
            if self.log_fd is not None:
                os.write(self.log_fd, f"{req.record_id}\n".encode())
            if self.delay_s:
                time.sleep(self.delay_s)
            if req.record_id in self.crash_ids:
                if self.how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif self.how == "exit":
                    os._exit(134)
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({req.record_id})")
            yield Outcome(req.record_id, ANSWER)

    def close(self) -> None:
        if getattr(self, "log_fd", None) is not None:
            os.close(self.log_fd)
            self.log_fd = None


def start_worker(db_url: str, job: str, log: Path, how: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.Popen(
        [sys.executable, "-m", "gpu_runner", job, "--engine", "tests.process.test_crash_poison:CrashingEngine",
         "--engine-option", f"crash_ids={json.dumps([POISON])}", "--engine-option", f"how={how}",
         "--engine-option", f"log={log}", "--careful-batch", "4", "--poll-seconds", "0.3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def computed(log: Path) -> Counter:
    return Counter(log.read_text().split())


def test_a_record_that_kills_the_worker_is_dead_lettered_and_the_job_finishes(conn, db_url, tmp_path):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(lease_seconds=2, renew_seconds=0.5, max_attempts=3)).job_version
    log = tmp_path / "computed.log"
    exits = []
    while len(exits) < 10:                       # a supervisor restarting the worker; a loop would exhaust it
        w = start_worker(db_url, job, log, "sigkill")
        out, _ = w.communicate(timeout=120)
        exits.append(w.returncode)
        if w.returncode == 0:
            break
        assert w.returncode == -signal.SIGKILL, out
    # the first death is in an ordinary batch (nothing known yet), then one in
    # a careful batch of 4, then two with the record alone: 4 deaths, then done
    assert exits == [-signal.SIGKILL] * 4 + [0]

    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"], d["stage"]) for d in dl] == [(POISON, 3, "worker")]
    assert dl[0]["raw_output"] is None
    assert "died 3 times while this record was in flight" in dl[0]["error"]
    # every other record has exactly one result; none is dead-lettered
    rows = conn.execute("SELECT record_id, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY 1",
                        (job,)).fetchall()
    assert len(rows) == 29 and all(r["n"] == 1 for r in rows) and POISON not in {r["record_id"] for r in rows}
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (29, 1, 0)
    assert c["shards"] == {"pending": 0, "leased": 0, "done": 3}
    # the innocent records of the poison's careful batch were suspects once,
    # ran alone and were stored
    crashes = {r["record_id"]: (r["attempts"], r["crashes"]) for r in conn.execute(
        "SELECT record_id, attempts, crashes FROM bi.attempts WHERE job_version = %s", (job,))}
    assert crashes == {"t00010": (0, 1), "t00011": (0, 1), "t00012": (0, 1), POISON: (0, 3)}
    shards = {r["shard_no"]: r for r in conn.execute(
        "SELECT shard_no, lost_leases, in_flight, dead FROM bi.shards WHERE job_version = %s", (job,))}
    assert shards[1]["lost_leases"] == 4 and shards[1]["dead"] == 1
    # shards 0 and 2 never lost a lease: no in-flight write at all (a mark
    # would leave the list, or '{}' once failures trimmed it; never NULL)
    assert (shards[0]["lost_leases"], shards[0]["in_flight"]) == (0, None)
    assert (shards[2]["lost_leases"], shards[2]["in_flight"]) == (0, None)
    # the engine ran the poison once per death and never again
    assert computed(log)[POISON] == 4


def test_an_engine_that_raises_on_one_record_does_not_loop_either(conn, db_url, tmp_path):
    """A lost device that raises (rather than killing the process) gives the
    shard back at once, counted like a death (bi.abandon_shard_v2)."""
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(max_attempts=3)).job_version
    cfg = WorkerConfig(job_version=job, db_url=db_url, engine="tests.process.test_crash_poison:CrashingEngine",
                       engine_options={"crash_ids": [POISON], "how": "raise"}, careful_batch=4)
    codes = []
    while len(codes) < 10:
        codes.append(run_worker(cfg))
        if codes[-1] == 0:
            break
    assert codes == [ExitCode.ENGINE] * 4 + [0]
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"]) for d in dl] == [(POISON, 3)]
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (29, 1, 0)


def test_a_shard_that_never_lost_a_lease_does_no_in_flight_writes(monkeypatch, conn, db_url):
    make_source(conn, tickets(35))
    job = submit(conn, make_spec()).job_version
    calls = Counter()
    real = Ledger.mark_in_flight

    def spy(self, lease, ids):
        calls["mark"] += 1
        return real(self, lease, ids)

    monkeypatch.setattr(Ledger, "mark_in_flight", spy)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    assert calls["mark"] == 0
    marks = conn.execute("SELECT sum(lost_leases) AS l, count(in_flight) AS f "
                         "FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert (marks["l"], marks["f"]) == (0, 0)
    assert job_counts(conn, job)["stored"] == 35


def test_a_shard_that_lost_a_lease_marks_each_careful_batch(monkeypatch, conn, db_url):
    make_source(conn, tickets(10))
    job = submit(conn, make_spec()).job_version
    dead = Ledger(conn, job, "dead-worker").claim()                 # a holder that vanished
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s", (job,))
    batches: list[list[str]] = []
    real = Ledger.mark_in_flight

    def spy(self, lease, ids):
        batches.append(list(ids))
        return real(self, lease, ids)

    monkeypatch.setattr(Ledger, "mark_in_flight", spy)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, careful_batch=4)) == 0
    assert [len(b) for b in batches] == [4, 4, 2]
    shard = conn.execute("SELECT state, epoch, lost_leases FROM bi.shards WHERE job_version = %s",
                         (job,)).fetchone()
    assert shard == {"state": "done", "epoch": dead.epoch + 1, "lost_leases": 1}
    assert job_counts(conn, job)["stored"] == 10
