"""The chaos harness: the default run (16 worker processes, at least 100
faults, database restarts) must pass every check, and so must the CLI's small
run; and the checks themselves must see the failures they are there to catch,
or a green run means nothing. The run with overlapping shards through PgBouncer
is in test_chaos_pgbouncer.py, the ladder's and the embedding job's in
test_chaos_jobs.py: files of their own, so that scripts/test.sh's workers (a
file to a worker) run them side by side."""

from __future__ import annotations

import json
import shutil
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from batch_inference import chaos, db
from batch_inference.chaos import ChaosConfig, CountingEngine, run_chaos
from batch_inference.engines.base import Request
from batch_inference.harness.database import WORKER_ROLE, Admin, EmbeddedServer
from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, tickets

OUT = {"category": "billing", "summary": "charged twice"}
# Each database test runs directly and through PgBouncer in transaction mode (tests/conftest.py).
DB_ROUTES = ("direct", "pgbouncer")


@pytest.mark.chaos
def test_default_chaos_run_passes():
    cfg = ChaosConfig()
    assert (cfg.workers, cfg.faults, cfg.db_restart) == (16, 100, True)
    report = run_chaos(cfg)
    print(report.table())
    f = report.figures
    assert report.passed, report.table()
    # every kind of fault was injected, and enough of them
    assert f["faults"]["total"] >= 100
    assert all(f["faults"]["by_kind"].get(k, 0) > 0 for k in chaos.FAULT_KINDS), f["faults"]
    assert f["faults"]["by_kind"]["db_restart"] == 2
    # the design's promises
    assert f["duplicates"] == 0
    assert f["stale_writes_accepted"] == {"never_held": 0, "after_epoch_ended": 0}
    assert f["stalls"]["shard_moved_on"] > 0
    assert f["stalls"]["refused_after"] == f["stalls"]["shard_moved_on"]
    assert f["fenced_total"] >= f["stalls"]["refused_after"]
    cov = f["coverage"]
    assert cov["stored"] + cov["dead"] == cov["snapshot"] == f["records"] == cfg.n_records()
    assert cov["missing"] == 0 and cov["stored_and_dead"] == 0
    assert f["counter_drift_shards"] == 0
    for rid, d in f["poison_dead_letters"].items():
        want = ("plan", 0) if d["kind"] == "oversized" else ("worker", cfg.max_attempts)
        assert (d["stage"], d["attempts"]) == want, rid
    assert f["healthy_dead_letters"] == 0
    comp = f["computations"]
    # every healthy record was computed, but one the harness's deaths took with it in flight three times
    assert comp["records"] >= f["records"] - f["poison"] - len(f["healthy_dead_for_injected_deaths"])
    assert comp["extra"] <= comp["bound"] == f["handoffs"]["handoffs"] * cfg.flush_every
    # workers ran with worker credentials, not the owner's
    assert f["worker_role"] == WORKER_ROLE
    assert f["job_s"] < cfg.duration


@pytest.mark.chaos
def test_cli_small_run_prints_json_and_exits_0(tmp_path):
    p = subprocess.run([sys.executable, "-m", "batch_inference.cli", "chaos", "--workers", "3", "--records", "600",
                        "--shard-size", "100", "--faults", "8", "--no-db-restart", "--seed", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["passed"] is True
    assert report["figures"]["faults"]["total"] >= 8
    assert report["figures"]["faults"]["by_kind"].get("db_restart", 0) == 0
    assert report["config"]["workers"] == 3


def test_counting_engine_streams_when_its_inner_engine_does(tmp_path):
    spec = make_spec()
    eng = CountingEngine(spec, {"inner": "noop", "count_dir": str(tmp_path), "delay_s": 0, "max_num_seqs": 2})
    eng.load()
    reqs = [Request(r, [{"role": "user", "content": "hello"}]) for r in ("a", "b", "c")]

    class Feed:
        def refill(self, room, idle):
            out = reqs[:room]
            del reqs[:room]
            return out

        def cancelled(self):
            return []

    outs = list(eng.stream(Feed(), threading.Event()))
    eng.close()
    assert eng.queue_depth() == 2 and [o.record_id for o in outs] == ["a", "b", "c"]
    (log,) = tmp_path.glob("*.log")
    assert log.read_text().splitlines() == ["a\tvalid", "b\tvalid", "c\tvalid"]


def test_renew_must_be_shorter_than_the_lease():
    with pytest.raises(ValueError, match="renew_seconds"):
        run_chaos(ChaosConfig(lease_seconds=2, renew_seconds=2))


def test_counting_engine_writes_one_line_per_outcome(tmp_path):
    spec = make_spec()
    eng = CountingEngine(spec, {"inner": "noop", "count_dir": str(tmp_path), "delay_s": 0})
    eng.load()
    reqs = [Request("a", [{"role": "user", "content": "hello"}]),
            Request("b", [{"role": "user", "content": "[[engine-error]]"}]),
            Request("c", [{"role": "user", "content": "[[invalid-output]]"}])]
    outs = list(eng.generate(reqs, threading.Event()))
    eng.close()
    assert [o.record_id for o in outs] == ["a", "b", "c"] and outs[1].error
    (log,) = tmp_path.glob("*.log")
    assert log.read_text() == "a\tvalid\nb\terror\nc\tinvalid\n"
    with pytest.raises(ValueError, match="count_dir"):
        CountingEngine(spec, {"inner": "noop"})
    with pytest.raises(ValueError, match="unknown option"):
        CountingEngine(spec, {"inner": "noop", "count_dir": str(tmp_path), "dleay_s": 1})


# -- the checks catch what they claim to ------------------------------------------

@pytest.fixture
def audited_job(conn):
    conn.execute(db.q("chaos_install"))
    make_source(conn, tickets(20))
    return submit(conn, make_spec(lease_seconds=1, renew_seconds=0.5)).job_version


def _forge_result(conn, job: str, rid: str, worker: str, epoch: int) -> None:
    """What a broken fence would let through: a row written straight into results."""
    conn.execute("""INSERT INTO bi.results (job_version, record_id, output, model_name, model_digest, prompt_version,
                                            transport, worker_id, epoch)
                    VALUES (%s, %s, '{}', 'noop', 'x', 'v1', 'batch', %s, %s)""", (job, rid, worker, epoch))


def test_stale_write_check_counts_a_write_after_the_epoch_ended(conn, db_url, audited_job):
    job = audited_job
    a = Ledger(conn, job, "a", lease_seconds=1)
    la = a.claim()
    assert a.put_results(la, ["t00000"], [OUT], ["billing"]) == 1        # in time: fine
    time.sleep(1.2)
    lb = Ledger(conn, job, "b").claim()
    assert lb.shard_no == la.shard_no and lb.epoch == 2
    admin = Admin(db_url)
    assert admin.one("chaos_stale_writes", {"job": job}) == {"never_held": 0, "after_epoch_ended": 0}
    _forge_result(conn, job, "t00001", "a", 1)                          # a's epoch ended before this
    _forge_result(conn, job, "t00002", "mallory", 2)                    # epoch 2 belongs to b
    assert admin.one("chaos_stale_writes", {"job": job}) == {"never_held": 1, "after_epoch_ended": 1}
    admin.close()


def test_stale_write_check_counts_a_write_after_release_or_completion(conn, db_url, audited_job):
    job = audited_job
    a = Ledger(conn, job, "a")
    la = a.claim()
    assert a.release(la)
    _forge_result(conn, job, "t00003", "a", la.epoch)
    admin = Admin(db_url)
    assert admin.one("chaos_stale_writes", {"job": job})["after_epoch_ended"] == 1
    h = admin.one("chaos_handoffs", {"job": job})
    assert (h["claims"], h["handoffs"]) == (1, 0)
    lb = Ledger(conn, job, "b").claim()
    assert lb.shard_no == la.shard_no
    h = admin.one("chaos_handoffs", {"job": job})
    assert (h["claims"], h["handoffs"], h["after_release"], h["after_expiry"]) == (2, 1, 1, 0)
    admin.close()


def test_coverage_and_counter_checks_see_missing_and_uncounted_rows(conn, db_url, audited_job):
    job = audited_job
    admin = Admin(db_url)
    cov = admin.one("chaos_coverage", {"job": job})
    assert (cov["snapshot"], cov["stored"], cov["missing"]) == (20, 0, 20)
    _forge_result(conn, job, "t00004", "a", 1)            # a row the shard counter never saw
    assert admin.one("chaos_counter_drift", {"job": job})["shards"] == 1
    assert admin.one("chaos_coverage", {"job": job})["missing"] == 19
    admin.close()


# -- regressions the chaos run found --------------------------------------------------

def _cut(admin, conn, db_route: str) -> None:
    """End ``conn`` the way a restart reaches a worker. Directly: the server
    terminates its backend. Through PgBouncer in transaction mode a server
    restart between transactions never reaches the client (the pooler takes a
    fresh server connection), so what does is the pooler's own restart: the
    client's socket closes under it."""
    if db_route == "pgbouncer":
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    else:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (conn.info.backend_pid,))


def _drop_connection_on_first_call(monkeypatch, admin, name: str, db_route: str) -> dict[str, int]:
    """Make the worker's first call of ``name`` meet a connection the server
    has just terminated, as a database restart does."""
    import gpu_runner.worker as worker_mod

    real = getattr(worker_mod, name)
    calls = {"n": 0}

    def flaky(conn, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            _cut(admin, conn, db_route)
        return real(conn, *args)

    monkeypatch.setattr(worker_mod, name, flaky)
    return calls


def test_worker_reconnects_when_the_database_restarts_before_its_first_query(monkeypatch, conn, db_url, db_route):
    """A worker started during a database restart crashed with a traceback
    (exit 1) at its first query instead of reconnecting."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(15))
    job = submit(conn, make_spec()).job_version
    calls = _drop_connection_on_first_call(monkeypatch, conn, "job_spec", db_route)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, db_retries=2)) == 0
    assert calls["n"] == 2
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 15


def test_worker_reconnects_when_the_database_restarts_while_it_waits(monkeypatch, conn, db_url, db_route):
    """Between shards the worker passed its connection to the retried call:
    after a reconnect it retried on the closed one and crashed (exit 1)."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(5))
    job = submit(conn, make_spec()).job_version
    calls = _drop_connection_on_first_call(monkeypatch, conn, "job_mode", db_route)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, db_retries=2)) == 0
    assert calls["n"] == 2
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 5


def _drop_put_results(monkeypatch, admin, times: int, db_route: str) -> dict[str, int]:
    from batch_inference.ledger import Ledger as L

    real = L.put_results
    calls = {"n": 0}

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] <= times:
            _cut(admin, self.conn, db_route)
        return real(self, *args)

    monkeypatch.setattr(L, "put_results", flaky)
    return calls


def test_worker_survives_a_connection_lost_again_right_after_reconnecting(monkeypatch, conn, db_url, db_route):
    """Two database restarts in a row (or a stalled worker waking into a
    second one) failed the single retry and crashed the worker (exit 1)."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(5))
    job = submit(conn, make_spec()).job_version
    calls = _drop_put_results(monkeypatch, conn, times=2, db_route=db_route)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, db_retries=3)) == 0
    assert calls["n"] == 3
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 5


def test_worker_whose_database_keeps_failing_exits_2_not_with_a_traceback(monkeypatch, conn, db_url, db_route):
    from batch_inference.exits import ExitCode
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(5))
    job = submit(conn, make_spec()).job_version
    _drop_put_results(monkeypatch, conn, times=1000, db_route=db_route)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, db_retries=2)) == ExitCode.DB
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 0


def test_worker_whose_lease_went_stale_just_before_completing_moves_on(monkeypatch, conn, db_url):
    """A worker stopped between its last write and its completion woke to a
    refused completion, which escaped as a traceback (exit 1) instead of
    dropping the shard like any other refusal."""
    from batch_inference.ledger import Ledger as L
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(5))
    job = submit(conn, make_spec()).job_version
    real = L.complete
    calls = {"n": 0}

    def stale_first(self, lease):
        calls["n"] += 1
        if calls["n"] == 1:
            # what happens while the worker is stopped: its lease expires and
            # another worker claims the shard (whose lease then lapses too)
            conn.execute("UPDATE bi.shards SET epoch = epoch + 1, lease_owner = 'other', "
                         "lease_expires_at = clock_timestamp() - interval '1 second' "
                         "WHERE job_version = %s AND shard_no = %s", (job, lease.shard_no))
        return real(self, lease)

    monkeypatch.setattr(L, "complete", stale_first)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, poll_seconds=0.2)) == 0
    assert calls["n"] == 2                       # refused, then completed under a new claim
    ops = [r["op"] for r in conn.execute("SELECT op FROM bi.fence_events WHERE job_version = %s", (job,))]
    assert ops == ["complete"]
    c = conn.execute("SELECT state, epoch FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert (c["state"], c["epoch"]) == ("done", 3)


def _claim_once_free(lg: Ledger):
    """The next claim of the job's only shard: as soon as its lease has lapsed (or at once when pending)."""
    for _ in range(300):
        lease = lg.claim()
        if lease is not None:
            return lease
        time.sleep(0.05)
    pytest.fail("the shard's lease never lapsed")


def test_a_lease_that_lapses_over_a_database_restart_charges_its_records_no_death():
    """The healthy record dead-lettered under load: a database restart cuts every worker's
    connections, lease renewals included, so leases lapse while their holders reconnect, and
    the next claim charged each record of the holder's in-flight batch a death; two restarts
    over one careful batch dead-lettered healthy records. A lapse over a restart charges none
    now; one without a restart still does, and the chaos report fails a run whose healthy
    records were dead-lettered for deaths, whatever the engine."""
    work = Path(tempfile.mkdtemp(prefix="bi-rst-", dir="/tmp"))    # short: the socket lives in it
    server = EmbeddedServer(work / "pg")
    try:
        url = server.url
        with db.connect(url) as c:
            db.migrate(c)
            c.execute(db.q("chaos_install"))
            make_source(c, tickets(4))
            job = submit(c, make_spec(shard_size=4, max_attempts=2, lease_seconds=2, renew_seconds=1)).job_version
        ids = [rid for rid, _, _ in tickets(4)]

        def hold(owner: str) -> None:
            """Claim the shard (a takeover once the last lease lapsed) and mark the batch in flight."""
            with db.connect(url, retries=30, retry_wait=0.2) as c:
                lg = Ledger(c, job, owner)
                lg.mark_in_flight(_claim_once_free(lg), ids)

        def state() -> tuple[list[int], int]:
            with db.connect(url, retries=30, retry_wait=0.2) as c:
                crashes = [r["crashes"] for r in c.execute(
                    "SELECT crashes FROM bi.attempts WHERE job_version = %s ORDER BY record_id", (job,))]
                dead = c.execute("SELECT count(*) AS n FROM bi.dead_letters WHERE job_version = %s",
                                 (job,)).fetchone()["n"]
            return crashes, dead

        hold("w0")
        for owner in ("w1", "w2"):       # the holder alive, the server restarted under it, the lease lapsed
            server.restart()
            hold(owner)
        assert state() == ([], 0)
        hold("w3")                       # w2 vanished with no restart: a death for each record in flight
        assert state() == ([1] * 4, 0)
        hold("w4")                       # and another: dead-lettered at max_attempts
        assert state() == ([2] * 4, 4)
        admin = Admin(url)
        died = {r["record_id"] for r in admin.rows("chaos_death_dead_letters", {"job": job})}
        assert died == set(ids)
        # The lease log names the holders whose lost lease charged the deaths (w2, w3; not w0 or w1,
        # lapsed over a restart): deaths the harness caused explain the dead letters, and only those.
        q = lambda name, **p: admin.rows(name, {"job": job, **p})  # noqa: E731
        assert chaos.injected_deaths(q, died, {"w2", "w3"}, 2) == died
        assert chaos.injected_deaths(q, died, {"w0", "w1", "w2"}, 2) == set()
        assert chaos.injected_deaths(q, died, {"w2", "w3"}, 3) == set()
        admin.close()
        assert not chaos.healthy_dead_check(4, len(died), noisy_engine=True).ok
        assert chaos.healthy_dead_check(4, 0, noisy_engine=True).ok      # failed attempts of a noisy engine
        assert not chaos.healthy_dead_check(4, 0, noisy_engine=False).ok
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
