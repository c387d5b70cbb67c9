"""The worker's results written behind its generation (``Worker.flush``): a put in flight on the
writer thread while the engine goes on, its answer (rows stored, results refused as data, a stale
epoch) taken at the next write, every put answered before the shard completes, and the results made
while a put is in flight held for the next put, up to ``HOLD_WHILE_IN_FLIGHT`` flushes' worth."""

from __future__ import annotations

import threading

import psycopg

from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from batch_inference.status import dead_letters, job_counts
from gpu_runner.worker import HOLD_WHILE_IN_FLIGHT, Worker, WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets


def test_the_put_is_written_while_the_engine_goes_on_and_answered_before_the_shard_completes(monkeypatch, conn,
                                                                                                db_url):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=30)).job_version
    real_put, real_take, real_complete, real_write = Ledger.put_results, Worker.take, Ledger.complete, Worker._write
    went_on = threading.Event()
    seen = {"takes": 0, "puts": [], "puts_answered": 0, "overlapped": None, "in_flight_at_complete": [],
            "held_over": []}

    def take(self, shard, outcome):
        real_take(self, shard, outcome)
        seen["takes"] += 1
        if seen["takes"] == 25:          # the first put in flight: the results past the flush size are held
            seen["held_over"].append(shard.held_over)
        if seen["takes"] == 30:          # every record, past the first flush of 10 and the second's 20
            went_on.set()

    def put(self, lease, ids, *args, **kw):
        seen["puts"].append(len(ids))
        if len(seen["puts"]) == 1:
            # A worker that waits for its put would never reach record 30 while this one waits.
            seen["overlapped"] = went_on.wait(10)
        try:
            return real_put(self, lease, ids, *args, **kw)
        finally:
            seen["puts_answered"] += 1

    def complete(self, lease):
        seen["in_flight_at_complete"].append(len(seen["puts"]) - seen["puts_answered"])
        return real_complete(self, lease)

    def write(self, shard, *args):
        try:
            return real_write(self, shard, *args)
        finally:
            seen["held_over"].append(shard.held_over)  # a retry round's flushes come at flush_every again

    monkeypatch.setattr(Worker, "take", take)
    monkeypatch.setattr(Ledger, "put_results", put)
    monkeypatch.setattr(Ledger, "complete", complete)
    monkeypatch.setattr(Worker, "_write", write)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=10)) == 0
    assert seen["overlapped"] is True
    # The results made while the first put was in flight were held, not waited on: the next put took them all.
    assert seen["puts"] == [10, 20] and seen["puts_answered"] == 2
    assert seen["held_over"][0] > 0 and seen["held_over"][-1] == 0
    assert seen["in_flight_at_complete"] == [0]
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (30, 0, 0)
    assert c["shards"] == {"pending": 0, "leased": 0, "done": 1}


def test_the_engine_waits_on_a_put_in_flight_once_it_holds_the_most_results_held(monkeypatch, conn, db_url):
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=40)).job_version
    real_put, real_take = Ledger.put_results, Worker.take
    seen = {"takes": 0, "puts": [], "takes_at_answer": []}
    never = threading.Event()

    def take(self, shard, outcome):
        real_take(self, shard, outcome)
        seen["takes"] += 1

    def put(self, lease, ids, *args, **kw):
        seen["puts"].append(len(ids))
        if len(seen["puts"]) == 1:
            never.wait(1.0)              # a slow put: the engine goes on until it holds the most it may
        seen["takes_at_answer"].append(seen["takes"])
        return real_put(self, lease, ids, *args, **kw)

    monkeypatch.setattr(Worker, "take", take)
    monkeypatch.setattr(Ledger, "put_results", put)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=5)) == 0
    held = HOLD_WHILE_IN_FLIGHT * 5
    # The first put's 5, then the engine held up to 20 more and waited there for the put in flight.
    assert seen["takes_at_answer"][0] == 5 + held
    assert seen["puts"][:2] == [5, held] and sum(seen["puts"]) == 40
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (40, 0, 0)


def test_a_stale_epoch_met_by_a_put_behind_drops_the_shard_and_a_new_claim_finishes_it(monkeypatch, conn, db_url):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=30)).job_version
    real = Ledger.put_results
    calls = {"n": 0}

    def stolen_before_the_second_put(self, lease, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            # while the worker goes on, its lease lapses and another worker claims the shard (whose lease lapses too)
            conn.execute("UPDATE bi.shards SET epoch = epoch + 1, lease_owner = 'other', "
                         "lease_expires_at = clock_timestamp() - interval '1 second' "
                         "WHERE job_version = %s AND shard_no = %s", (job, lease.shard_no))
        return real(self, lease, *args, **kw)

    monkeypatch.setattr(Ledger, "put_results", stolen_before_the_second_put)
    stats: dict[str, int] = {}
    real_run = Worker._run

    def keep_stats(self):
        try:
            return real_run(self)
        finally:
            stats.update(self.stats)

    monkeypatch.setattr(Worker, "_run", keep_stats)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=10, poll_seconds=0.2)) == 0
    assert stats["stale"] == 1                   # the refused put's answer, taken at the next write
    ops = [r["op"] for r in conn.execute("SELECT op FROM bi.fence_events WHERE job_version = %s", (job,))]
    assert ops == ["put_results"]
    s = conn.execute("SELECT state, epoch FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert (s["state"], s["epoch"]) == ("done", 3)
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (30, 0, 0)
    d = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                     (job,)).fetchone()
    assert d["d"] == 0


def test_a_result_refused_as_data_in_a_put_behind_is_a_failed_attempt_of_its_record(monkeypatch, conn, db_url):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=30)).job_version
    real = Ledger.put_results

    def refuse_one(self, lease, ids, *args, **kw):
        if "t00004" in ids:
            raise psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence")
        return real(self, lease, ids, *args, **kw)

    monkeypatch.setattr(Ledger, "put_results", refuse_one)
    cfg = WorkerConfig(job_version=job, db_url=db_url, flush_every=10, backoff=(0.05, 0.05, 0.05))
    assert run_worker(cfg) == 0
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"]) for d in dl] == [("t00004", 3)]
    assert dl[0]["error"].startswith("output cannot be stored: unsupported Unicode escape sequence")
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (29, 1, 0)
