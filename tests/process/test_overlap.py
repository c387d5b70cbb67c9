"""Shards overlap in the worker (gpu_runner.overlap), on the real PostgreSQL: the noop engine with
``max_num_seqs`` streams across shards as vLLM does, so one worker holds several leases at once,
each renewed and fenced on its own, all released on SIGTERM, a stale one dropping only its results."""

from __future__ import annotations

import signal
import time
from collections import deque

import pytest

from batch_inference import db
from batch_inference.engines.noop import NoopEngine
from batch_inference.exits import ExitCode
from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from batch_inference.status import job_counts, shared_inputs
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_ledger import expire
from tests.process.test_worker import duplicates, start_worker

# Each database test runs directly and through PgBouncer in transaction mode (tests/conftest.py).
DB_ROUTES = ("direct", "pgbouncer")

# Shards of 10 records, an engine that keeps 16 queued: a second shard is claimed before the first is done.
STREAMING = {"name": "noop", "options": {"max_num_seqs": 16}}


def leased_by(conn, job: str) -> dict[str, list[int]]:
    """Shard numbers leased now, by owner."""
    out: dict[str, list[int]] = {}
    for r in conn.execute("SELECT shard_no, lease_owner FROM bi.shards WHERE job_version = %s AND state = 'leased' "
                          "ORDER BY shard_no", (job,)):
        out.setdefault(r["lease_owner"], []).append(r["shard_no"])
    return out


def stored_by_shard(conn, job: str) -> dict[int, int]:
    return {r["shard_no"]: r["stored"] for r in conn.execute(
        "SELECT shard_no, stored FROM bi.shards WHERE job_version = %s ORDER BY shard_no", (job,))}


@pytest.fixture
def watch(monkeypatch, db_url):
    """Every ledger write and renewal the worker makes, with the shards its owner held at that moment
    (read from the ledger on a connection of the test's own)."""
    seen: dict[str, list] = {"puts": [], "renewed": set()}
    side = db.connect(db_url)
    real_put, real_renew = Ledger.put_results, Ledger.renew

    def put_results(self, lease, ids, outputs, categories, *more):
        seen["puts"].append((lease.shard_no, lease.epoch, leased_by(side, lease.job_version).get(self.owner, [])))
        return real_put(self, lease, ids, outputs, categories, *more)

    def renew(self, lease):
        seen["renewed"].add(lease.shard_no)
        return real_renew(self, lease)

    monkeypatch.setattr(Ledger, "put_results", put_results)
    monkeypatch.setattr(Ledger, "renew", renew)
    yield seen
    side.close()


def test_one_worker_holds_two_leases_at_once_each_renewed_and_fenced(conn, db_url, watch):
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, engine={**STREAMING, "options": {"max_num_seqs": 16,
                                                                                "delay_s": 0.02}},
                                 lease_seconds=30, renew_seconds=0.2)).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=5, wait_for_leases=False)) == 0
    c = job_counts(conn, job)
    assert (c["stored"], c["outstanding"], c["shards"]["done"]) == (40, 0, 4)
    assert duplicates(conn, job) == 0
    # While it wrote shard n, it held shard n + 1 too: the next shard was claimed before the current one ended.
    assert max(len(held) for _, _, held in watch["puts"]) >= 2
    assert any(shard in held and shard + 1 in held for shard, _, held in watch["puts"])
    # Each write went under its own shard's lease (epoch 1: each shard was claimed once), and every
    # shard held across a renewal interval had its own lease renewed.
    assert {(shard, epoch) for shard, epoch, _ in watch["puts"]} == {(0, 1), (1, 1), (2, 1), (3, 1)}
    assert len(watch["renewed"]) >= 2


class OutOfOrderNoop(NoopEngine):
    """The noop engine answering its queue from both ends in turn, as vLLM finishes requests out of order:
    records of two shards are answered, and held for writing, side by side. Loaded by dotted path."""

    name = "noop-out-of-order"
    serves_models = ("noop",)
    answered: list[str] = []

    def stream(self, feed, stop):
        queue: deque = deque()
        turn = 0
        while not stop.is_set():
            cancelled = set(feed.cancelled())
            queue = deque(r for r in queue if r.record_id not in cancelled)
            if len(queue) < self.max_num_seqs:
                queue.extend(feed.refill(self.max_num_seqs - len(queue), not queue))
            if not queue:
                return
            req = queue.popleft() if turn % 2 == 0 else queue.pop()
            turn += 1
            self.answered.append(req.record_id)
            yield self._answer_for(req)


def test_a_stale_lease_drops_only_its_own_shards_results(conn, db_url, monkeypatch):
    """Shard 0's lease is taken over (expired and claimed by another worker) while the worker holds it
    and the shards after it, with answers of several of them in hand, none written yet: its write for
    shard 0 is refused and shard 0's answers are dropped; the answers it held for the other shards are
    written under their own leases, and those shards complete."""
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING, lease_seconds=30)).job_version
    shard_of = {r["record_id"]: r["shard_no"] for r in conn.execute(
        "SELECT record_id, shard_no FROM bi.snapshot_rows WHERE job_version = %s", (job,))}
    real_put = Ledger.put_results
    thief = Ledger(db.connect(db_url), job, "thief")
    taken: list = []
    in_hand: set[int] = set()
    OutOfOrderNoop.answered = []

    def put_results(self, lease, ids, outputs, categories, *more):
        if lease.shard_no == 0 and not taken:
            assert leased_by(conn, job).get(self.owner, [])[:2] == [0, 1]   # two leases (or more) held at once
            assert sum(stored_by_shard(conn, job).values()) == 0           # nothing written yet
            in_hand.update(shard_of[rid] for rid in OutOfOrderNoop.answered)
            expire(conn, job, 0)
            taken.append(thief.claim())
        return real_put(self, lease, ids, outputs, categories, *more)

    monkeypatch.setattr(Ledger, "put_results", put_results)
    # flush_every above the shard size: each shard writes once, when all its records are answered.
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=100, flush_seconds=60,
                                   engine=f"{__name__}:OutOfOrderNoop", wait_for_leases=False)) == 0
    assert taken[0].shard_no == 0 and taken[0].epoch == 2
    assert in_hand - {0}, "no other shard's answers were in hand when shard 0 went stale"
    assert stored_by_shard(conn, job) == {0: 0, 1: 10, 2: 10, 3: 10}
    shards = {r["shard_no"]: (r["state"], r["epoch"], r["lease_owner"]) for r in conn.execute(
        "SELECT shard_no, state, epoch, lease_owner FROM bi.shards WHERE job_version = %s", (job,))}
    assert shards[0] == ("leased", 2, "thief")
    assert {shards[n][:2] for n in (1, 2, 3)} == {("done", 1)}
    # The new holder finishes shard 0; one row per record.
    lease = taken[0]
    ids = [r["record_id"] for r in thief.records(lease)]
    assert len(ids) == 10
    thief.put_results(lease, ids, ['{"category": "billing", "summary": "x"}'] * len(ids), ["billing"] * len(ids))
    assert thief.complete(lease) == "done"
    assert job_counts(conn, job)["stored"] == 40 and duplicates(conn, job) == 0
    thief.conn.close()


def test_sigterm_releases_every_lease_the_worker_holds(conn, db_url):
    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600)).job_version
    w = start_worker(db_url, job, "--engine-option", "max_num_seqs=16", "--engine-option", "delay_s=0.05")
    deadline = time.monotonic() + 60
    # Two leases held at once, and answers written (what the engine had finished is kept; the rest is lost).
    while not any(len(shards) >= 2 for shards in leased_by(conn, job).values()) or not job_counts(conn, job)["stored"]:
        assert w.poll() is None and time.monotonic() < deadline, w.communicate()[0]
        time.sleep(0.02)
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=30)
    assert w.returncode == ExitCode.PREEMPTED, out
    assert "preemption notice" in out
    # Every shard it held is pending at once, not in ten minutes when the 600 s leases would expire.
    assert leased_by(conn, job) == {}
    assert out.count("released shard") >= 2, out
    stored = job_counts(conn, job)["stored"]
    assert 0 < stored < 60
    # The next worker (in this process: what is proved is the ledger's state) finishes the job.
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, engine_options={"max_num_seqs": 16},
                                   flush_every=20, wait_for_leases=False)) == 0
    assert job_counts(conn, job)["stored"] == 60 and duplicates(conn, job) == 0


def test_max_shards_counts_the_shards_held(conn, db_url, watch):
    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING)).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, max_shards=2, wait_for_leases=False)) == 0
    c = job_counts(conn, job)
    assert (c["stored"], c["shards"]["done"], c["shards"]["pending"]) == (20, 2, 4)
    assert max(len(held) for _, _, held in watch["puts"]) <= 2


def test_a_shard_whose_holder_died_runs_alone_in_careful_mode(conn, db_url, monkeypatch, caplog):
    """Shard 1 lost a lease before: the streaming worker parks it when it claims it, finishes the
    shards it holds, then runs it alone with its engine batches marked in flight."""
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING)).job_version
    conn.execute("UPDATE bi.shards SET lost_leases = 1 WHERE job_version = %s AND shard_no = 1", (job,))
    real_mark = Ledger.mark_in_flight
    held_while_careful: list[list[int]] = []

    def mark_in_flight(self, lease, ids):
        held_while_careful.append(leased_by(conn, job).get(self.owner, []))
        return real_mark(self, lease, ids)

    monkeypatch.setattr(Ledger, "mark_in_flight", mark_in_flight)
    caplog.set_level("INFO", logger="batch_inference.worker")
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, careful_batch=4, wait_for_leases=False)) == 0
    assert job_counts(conn, job)["stored"] == 40 and duplicates(conn, job) == 0
    assert "shard 1 lost its lease before: parked" in caplog.text
    assert "careful mode" in caplog.text
    assert held_while_careful and all(held == [1] for held in held_while_careful)   # alone, in batches of 4
    assert len(held_while_careful) == 3


def test_engines_that_do_not_stream_run_one_shard_at_a_time(conn, db_url, watch):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version    # noop without max_num_seqs
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=5, wait_for_leases=False)) == 0
    assert job_counts(conn, job)["stored"] == 30
    assert max(len(held) for _, _, held in watch["puts"]) == 1


def test_no_overlap_runs_a_streaming_engine_one_shard_at_a_time(conn, db_url, watch):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING)).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, flush_every=5, overlap=False,
                                   wait_for_leases=False)) == 0
    assert job_counts(conn, job)["stored"] == 30
    assert max(len(held) for _, _, held in watch["puts"]) == 1


def test_failures_are_retried_and_dead_lettered_across_overlapping_shards(conn, db_url):
    rows = tickets(30)
    rows[3] = ("t00003", "[[engine-error]]", None)
    rows[14] = ("t00014", "please [[invalid-output]]", None)
    make_source(conn, rows)
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING)).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, backoff=(0.05, 0.05, 0.05),
                                   wait_for_leases=False)) == 0
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"], c["shards"]["done"]) == (28, 2, 0, 3)
    dead = conn.execute("SELECT record_id, attempts FROM bi.dead_letters WHERE job_version = %s ORDER BY 1",
                        (job,)).fetchall()
    assert [(d["record_id"], d["attempts"]) for d in dead] == [("t00003", 3), ("t00014", 3)]


def test_a_drain_releases_every_shard_the_streaming_worker_holds(conn, db_url):
    """The cutoff fires (the job enters fallback) while one worker holds several shards: each
    renewal reports it, every held shard writes what it has and is released, and no new shard is
    claimed; the worker leaves on its own (exit 0), its in-flight answers kept."""
    from batch_inference.fallback import enter_fallback

    make_source(conn, tickets(80))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=30, renew_seconds=0.2)).job_version
    w = start_worker(db_url, job, "--engine-option", "max_num_seqs=16", "--engine-option", "delay_s=0.05")
    deadline = time.monotonic() + 60
    while not any(len(shards) >= 2 for shards in leased_by(conn, job).values()):
        assert w.poll() is None and time.monotonic() < deadline, w.communicate()[0]
        time.sleep(0.02)
    assert enter_fallback(conn, job)
    out, _ = w.communicate(timeout=60)
    assert w.returncode == 0, out
    assert out.count("cutoff fired: draining shard") >= 2 and "released shard" in out, out
    assert leased_by(conn, job) == {}
    c = job_counts(conn, job)
    assert 0 < c["stored"] < 80 and c["shards"]["pending"] > 0 and duplicates(conn, job) == 0


class BrokenStreamingNoop(NoopEngine):
    """A streaming engine whose device fails after 12 answers, with two shards of 10 held. Loaded by
    dotted path."""

    name = "noop-broken-stream"
    serves_models = ("noop",)

    def stream(self, feed, stop):
        for n, outcome in enumerate(super().stream(feed, stop)):
            if n == 12:
                raise RuntimeError("CUDA error: device lost")
            yield outcome


def test_an_engine_failure_gives_back_every_held_shard_counted_as_a_lost_lease(conn, db_url):
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING)).job_version
    code = run_worker(WorkerConfig(job_version=job, db_url=db_url, engine=f"{__name__}:BrokenStreamingNoop",
                                   flush_every=1, wait_for_leases=False))
    assert code == ExitCode.ENGINE
    shards = {r["shard_no"]: (r["state"], r["lost_leases"]) for r in conn.execute(
        "SELECT shard_no, state, lost_leases FROM bi.shards WHERE job_version = %s", (job,))}
    # Shard 0 was done; the two it held when the engine broke are pending again, each with a lost lease.
    assert shards[0] == ("done", 0) and shards[1] == ("pending", 1) and shards[2] == ("pending", 1)
    assert shards[3] == ("pending", 0) and leased_by(conn, job) == {}
    assert job_counts(conn, job)["stored"] == 12 and conn.execute(
        "SELECT coalesce(sum(attempts), 0) AS n FROM bi.attempts WHERE job_version = %s", (job,)).fetchone()["n"] == 0


def test_results_show_in_status_while_shards_run_and_sigterm_releases_during_a_long_engine_step(conn, db_url):
    """vLLM's way, slowed down: all 60 records of three shards in one batch, each engine step 4 s long
    (a model forward no signal cuts short) answering 10. The first step's answers are in the ledger
    while every shard is still leased; a SIGTERM in the second step releases every lease while that
    step still runs, having written each record the engine had finished, and loses only the ones it
    had not (the second step's, which come back to a worker whose leases are gone)."""
    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=20, lease_seconds=600)).job_version
    w = start_worker(db_url, job, "--grace-seconds", "60", *(x for o in ("max_num_seqs=64", "step_s=4", "per_step=10")
                                                             for x in ("--engine-option", o)))
    deadline = time.monotonic() + 60
    while job_counts(conn, job)["stored"] == 0:
        assert w.poll() is None and time.monotonic() < deadline, w.communicate()[0]
        time.sleep(0.05)
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 3 and 0 < c["stored"] <= 10       # stored while all three shards run
    w.send_signal(signal.SIGTERM)
    while leased_by(conn, job):
        assert w.poll() is None and time.monotonic() < deadline, w.communicate()[0]
        time.sleep(0.05)
    alive = w.poll() is None                                           # the second step is still running
    stored = job_counts(conn, job)["stored"]
    out, _ = w.communicate(timeout=60)
    assert alive and w.returncode == ExitCode.PREEMPTED, out
    assert out.count("released shard") == 3 and "preemption notice" in out, out
    # Every answer of the first step was written before the release; the second step's are lost.
    assert stored == 10 and job_counts(conn, job)["stored"] == 10
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, engine_options={"max_num_seqs": 64},
                                   flush_every=20, wait_for_leases=False)) == 0
    assert job_counts(conn, job)["stored"] == 60 and duplicates(conn, job) == 0


class CountingNoop(NoopEngine):
    """The streaming noop engine, counting every request the feed hands it (``asked``, by record id).
    ``after_first``, when set, runs once after the first refill; the stream then waits (up to 10 s)
    until the feed aborts records (a shard stopped) before it answers anything. Loaded by dotted path."""

    name = "noop-counting"
    serves_models = ("noop",)
    asked: list[str] = []
    after_first = None

    def stream(self, feed, stop):
        engine, held_back = self, []

        class Counted:
            first = True

            def refill(self, room, idle):
                requests = feed.refill(room, idle)
                engine.asked.extend(r.record_id for r in requests)
                if self.first and engine.after_first is not None:
                    self.first = False
                    engine.after_first()
                    deadline = time.monotonic() + 10
                    while not held_back and time.monotonic() < deadline:
                        held_back.extend(feed.cancelled())
                        time.sleep(0.02)
                return requests

            def cancelled(self):
                out = held_back + feed.cancelled()
                held_back.clear()
                return out

        yield from super().stream(Counted(), stop)


def shards_by_id_order(conn, job: str, shard_size: int) -> None:
    """The planner put the records in shards of ``shard_size`` in id order (the tests below rely on it)."""
    got = {r["record_id"]: r["shard_no"] for r in conn.execute(
        "SELECT record_id, shard_no FROM bi.snapshot_rows WHERE job_version = %s", (job,))}
    assert got == {rid: i // shard_size for i, rid in enumerate(sorted(got))}, got


def with_texts(rows, texts: dict[int, str]):
    return [(rid, texts.get(i, body), acl) for i, (rid, body, acl) in enumerate(rows)]


def run_counted(conn, db_url, rows, **worker) -> str:
    make_source(conn, rows)
    job = submit(conn, make_spec(shard_size=10, engine=STREAMING, lease_seconds=30, renew_seconds=0.2)).job_version
    shards_by_id_order(conn, job, 10)
    CountingNoop.asked = []
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, engine=f"{__name__}:CountingNoop",
                                   wait_for_leases=False, **worker)) == 0
    return job


def test_identical_inputs_in_a_shard_and_across_held_shards_are_generated_once(conn, db_url):
    """Three records of shard 0 ask the same thing, and one of shard 1 asks what one of shard 0 asks while that
    one is in the engine (both shards held, 16 queued): the engine gets 27 requests for 30 records, each once;
    every record id has its one row, under its own shard's lease, and status counts the 3 computed once."""
    same_a, same_b = "My card was charged twice for one order.", "The app crashes when I save a draft."
    job = run_counted(conn, db_url, with_texts(tickets(30), {1: same_a, 4: same_a, 8: same_a, 2: same_b,
                                                             11: same_b}), flush_every=4)
    asked = CountingNoop.asked
    assert len(asked) == len(set(asked)) == 27, asked
    assert not {"t00004", "t00008", "t00011"} & set(asked) and {"t00001", "t00002"} <= set(asked)
    c = job_counts(conn, job)
    assert (c["stored"], c["shards"]["done"], duplicates(conn, job)) == (30, 3, 0)
    assert stored_by_shard(conn, job) == {0: 10, 1: 10, 2: 10}
    out = {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    assert out["t00011"] == out["t00002"] and out["t00004"] == out["t00008"] == out["t00001"]
    assert shared_inputs(conn, job) == 3
    shared = {r["shard_no"]: r["records"] for r in conn.execute(
        "SELECT shard_no, records FROM bi.shared_inputs WHERE job_version = %s", (job,))}
    assert shared == {0: 2, 1: 1}


def test_a_stale_shard_aborts_the_request_another_shards_record_waited_for_which_is_then_asked_itself(
        conn, db_url):
    """Shard 1's t00011 waits for shard 0's t00002 (the same input) when shard 0's lease is taken over, before
    the engine answers anything: shard 0's requests are aborted and its results never written, t00011 is queued
    again in shard 1 and asked on its own; shard 1's own identical pair is still computed once."""
    same_b, same_c = "The app crashes when I save a draft.", "I cannot log in since the update."
    rows = with_texts(tickets(30), {2: same_b, 11: same_b, 13: same_c, 17: same_c})
    thief: list = []

    def steal():
        expire(conn, job_of[0], 0)
        thief.append(Ledger(db.connect(db_url), job_of[0], "thief"))
        thief.append(thief[0].claim())

    make_source(conn, rows)
    job_of = [submit(conn, make_spec(shard_size=10, engine=STREAMING, lease_seconds=30,
                                     renew_seconds=0.2)).job_version]
    job = job_of[0]
    shards_by_id_order(conn, job, 10)
    CountingNoop.asked, CountingNoop.after_first = [], staticmethod(steal)
    try:
        assert run_worker(WorkerConfig(job_version=job, db_url=db_url, engine=f"{__name__}:CountingNoop",
                                       wait_for_leases=False)) == 0
    finally:
        CountingNoop.after_first = None
    ledger, lease = thief
    assert (lease.shard_no, lease.epoch) == (0, 2)
    asked = CountingNoop.asked
    first = asked[:16]     # the first refill: shard 0's 10 records, t00011 waiting, shard 1's next 7
    assert "t00002" in first and "t00011" not in first and "t00017" not in first
    assert asked.count("t00011") == 1 and asked.count("t00002") == 1 and "t00017" not in asked
    assert stored_by_shard(conn, job) == {0: 0, 1: 10, 2: 10}
    # The new holder finishes shard 0: one row per record, and the count is shard 1's pair.
    ids = [r["record_id"] for r in ledger.records(lease)]
    ledger.put_results(lease, ids, ['{"category": "billing", "summary": "x"}'] * len(ids), ["billing"] * len(ids))
    assert ledger.complete(lease) == "done"
    assert job_counts(conn, job)["stored"] == 30 and duplicates(conn, job) == 0
    assert shared_inputs(conn, job) == 1
    ledger.conn.close()


def test_identical_failing_inputs_are_retried_together_and_dead_lettered_each(conn, db_url):
    """Two records of shard 0 and one of shard 1 ask the same thing, which always fails: the engine is asked
    once per attempt for shard 0's pair (shard 1's record waits for it the first time), and each of the three is
    dead-lettered after 3 attempts with the error and raw output; the other records are stored."""
    bad = "please [[invalid-output]] the same"
    job = run_counted(conn, db_url, with_texts(tickets(30), {1: bad, 4: bad, 11: bad}), backoff=(0.05, 0.05, 0.05))
    asked = CountingNoop.asked
    assert asked.count("t00001") == 3 and "t00004" not in asked
    assert "t00011" not in asked[:16] and asked.count("t00011") <= 2   # waited in its first attempt
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"], c["shards"]["done"]) == (27, 3, 0, 3)
    dead = {r["record_id"]: r for r in conn.execute(
        "SELECT record_id, attempts, reason, raw_output FROM bi.dead_letters WHERE job_version = %s", (job,))}
    assert sorted(dead) == ["t00001", "t00004", "t00011"]
    assert {(d["attempts"], d["reason"], d["raw_output"]) for d in dead.values()} == \
        {(3, dead["t00001"]["reason"], dead["t00001"]["raw_output"])}
    assert duplicates(conn, job) == 0 and shared_inputs(conn, job) == 0
