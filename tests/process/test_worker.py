"""The worker as a real process against the real database: kill it, tell it to
leave, give it the wrong weights, feed it poison."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.status import dead_letters, job_counts
from batch_inference.engines.base import Engine, Outcome
from batch_inference.exits import ExitCode
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets

# Each database test runs directly and through PgBouncer in transaction mode (tests/conftest.py).
DB_ROUTES = ("direct", "pgbouncer")


def start_worker(db_url: str, job: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "gpu_runner", job, "--flush-every", "20", *extra],
                            env=env | {"BATCH_INFERENCE_DB": db_url}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def duplicates(conn, job: str) -> int:
    r = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                     (job,)).fetchone()
    return r["d"]


def test_worker_runs_a_job_to_the_end_in_process(conn, db_url):
    make_source(conn, tickets(35))
    job = submit(conn, make_spec()).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (35, 0, 0)
    assert c["shards"] == {"pending": 0, "leased": 0, "done": 4}
    row = conn.execute("SELECT * FROM bi.results WHERE job_version = %s LIMIT 1", (job,)).fetchone()
    assert row["model_name"] == "noop" and row["prompt_version"] == "v1" and row["transport"] == "batch"
    assert row["acl"] is not None and row["output"]["category"] == "billing"


def test_the_worker_waits_a_random_part_of_its_start_jitter_before_the_first_claim(monkeypatch, conn, db_url):
    import gpu_runner.worker as worker

    make_source(conn, tickets(35))
    job = submit(conn, make_spec()).job_version
    drawn: list[tuple[float, float]] = []
    uniform = worker.random.uniform

    def draw(a: float, b: float) -> float:
        if (a, b) == (0.0, 0.6):
            drawn.append((a, b))
            return 0.5
        return uniform(a, b)

    monkeypatch.setattr(worker.random, "uniform", draw)
    t0 = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, start_jitter_seconds=0.6)) == 0
    assert drawn == [(0.0, 0.6)]                              # once, before the first claim only
    first = conn.execute("SELECT min(first_claim_at) AS t FROM bi.shards WHERE job_version = %s",
                         (job,)).fetchone()["t"]
    assert (first - t0).total_seconds() >= 0.5                # no claim before the drawn wait was over
    assert job_counts(conn, job)["stored"] == 35


def _wait_for_stored(conn, job: str, at_least: int, timeout_s: float = 30) -> None:
    """Return once the job has ``at_least`` stored rows (an event in the ledger, not a guess at timing)."""
    deadline = time.monotonic() + timeout_s
    while job_counts(conn, job)["stored"] < at_least:
        assert time.monotonic() < deadline, f"the worker stored fewer than {at_least} rows in {timeout_s} s"
        time.sleep(0.05)


def test_sigkill_mid_job_then_a_new_worker_finishes(conn, db_url):
    make_source(conn, tickets(300))
    job = submit(conn, make_spec(shard_size=100, lease_seconds=2, renew_seconds=0.5)).job_version
    w = start_worker(db_url, job, "--engine-option", "delay_s=0.01")
    _wait_for_stored(conn, job, 100)                         # mid-job: rows stored, shards still to come
    w.send_signal(signal.SIGKILL)
    w.wait()
    mid = job_counts(conn, job)
    assert mid["outstanding"] > 0                            # it really died mid-job
    w2 = start_worker(db_url, job)
    out, _ = w2.communicate(timeout=120)
    assert w2.returncode == 0, out
    c = job_counts(conn, job)
    assert c["stored"] + c["dead_letters"] == 300 and c["outstanding"] == 0
    assert duplicates(conn, job) == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s", (job,)).fetchone()["n"] == 300


def test_sigterm_releases_the_lease_at_once(conn, db_url):
    make_source(conn, tickets(200))
    job = submit(conn, make_spec(shard_size=200, lease_seconds=600)).job_version
    w = start_worker(db_url, job, "--engine-option", "delay_s=0.05")
    _wait_for_stored(conn, job, 1)
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=30)
    assert w.returncode == 143, out
    assert "preemption notice" in out
    shard = conn.execute("SELECT state, lease_owner, epoch FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    # pending as soon as it exited, not in ten minutes when the 600 s lease would expire
    assert shard["state"] == "pending" and shard["lease_owner"] is None
    stored = job_counts(conn, job)["stored"]
    assert 0 < stored < 200                                  # in-flight work was written, the rest left
    w2 = start_worker(db_url, job)
    assert w2.wait(timeout=60) == 0
    assert job_counts(conn, job)["stored"] == 200 and duplicates(conn, job) == 0


def test_wrong_digest_refuses_to_start_and_writes_nothing(conn, db_url, tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"not the pinned weights")
    make_source(conn, tickets(5))
    job = submit(conn, make_spec(model={"name": "tiny", "digest": "a" * 64, "path": str(weights)},
                                 engine={"name": "llama-cpp"})).job_version
    w = start_worker(db_url, job)
    out, _ = w.communicate(timeout=60)
    assert w.returncode == ExitCode.DIGEST
    assert "refusing to start" in out and "a" * 12 in out
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 0
    assert conn.execute("SELECT max(epoch) AS e FROM bi.shards").fetchone()["e"] == 0   # never even claimed


def test_output_that_never_validates_is_dead_lettered_with_raw_output(conn, db_url):
    rows = tickets(12)
    rows[4] = ("t00004", "please [[invalid-output]] thanks", ["team1"])
    rows[7] = ("t00007", "[[engine-error]]", None)
    make_source(conn, rows)
    job = submit(conn, make_spec()).job_version
    cfg = WorkerConfig(job_version=job, db_url=db_url, backoff=(0.05, 0.05, 0.05))
    assert run_worker(cfg) == 0
    dl = {d["record_id"]: d for d in dead_letters(conn, job)}
    assert set(dl) == {"t00004", "t00007"}
    assert dl["t00004"]["attempts"] == 3 and dl["t00004"]["raw_output"]
    assert dl["t00007"]["attempts"] == 3
    c = job_counts(conn, job)
    assert c["stored"] == 10 and c["dead_letters"] == 2 and c["outstanding"] == 0


def test_unknown_job_is_a_clear_error(db_url):
    assert run_worker(WorkerConfig(job_version="jv_missing", db_url=db_url)) == 4


class BrokenEngine(Engine):
    """A user engine (loaded by dotted path) whose device fails mid-shard."""

    name = "broken"
    serves_models = ("noop",)   # the test specs' model (batch_inference.provenance)

    def load(self) -> None:
        pass

    def generate(self, requests, stop):
        yield Outcome(requests[0].record_id, '{"category": "bug", "summary": "ok"}')
        raise RuntimeError("CUDA error: device lost")


def test_engine_failure_releases_the_shard_and_exits_non_zero(conn, db_url):
    make_source(conn, tickets(10))
    job = submit(conn, make_spec()).job_version
    code = run_worker(WorkerConfig(job_version=job, db_url=db_url, engine="tests.process.test_worker:BrokenEngine",
                                   flush_every=1))
    assert code == ExitCode.ENGINE
    shard = conn.execute("SELECT state, epoch FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert shard["state"] == "pending" and shard["epoch"] == 1      # given back at once
    assert job_counts(conn, job)["stored"] == 1                     # what it finished is kept


def test_a_failed_attempt_whose_reply_was_lost_is_counted_once(monkeypatch, conn, db_url):
    """The connection drops after fail_records committed but before its reply:
    the worker reconnects and sends the same call again, which must not count
    the attempt twice (the poison record would be dead-lettered one engine
    call early)."""
    import psycopg

    from batch_inference.ledger import Ledger

    rows = tickets(5)
    rows[2] = ("t00002", "[[engine-error]]", None)
    make_source(conn, rows)
    job = submit(conn, make_spec()).job_version
    real = Ledger.fail
    calls = {"n": 0}

    def reply_lost_once(self, lease, failures):
        calls["n"] += 1
        got = real(self, lease, failures)             # committed on the server
        if calls["n"] == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return got

    monkeypatch.setattr(Ledger, "fail", reply_lost_once)
    cfg = WorkerConfig(job_version=job, db_url=db_url, backoff=(0.05, 0.05, 0.05), db_retries=2)
    assert run_worker(cfg) == 0
    assert calls["n"] == 4                            # three engine errors, the first call sent twice
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"]) for d in dl] == [("t00002", 3)]
    assert job_counts(conn, job)["stored"] == 4


class BatchStepEngine(Engine):
    """A batch engine's order of finishing: the records that stop early come first, and those that
    reach ``max_tokens`` all finish in the same last step, one after another (vLLM's CPU build with
    many truncations in one batch)."""

    name = "batch-step"
    serves_models = ("noop",)   # the test specs' model (batch_inference.provenance)

    def load(self) -> None:
        pass

    def generate(self, requests, stop):
        from batch_inference.engines.base import TRUNCATED

        cut = [r for r in requests if "long" in r.text]
        for r in requests:
            if r not in cut:
                yield Outcome(r.record_id, '{"category": "bug", "summary": "ok"}')
        for r in cut:
            yield Outcome(r.record_id, '{"category": "bug", "summary": "and then', error=TRUNCATED)


def test_truncations_finishing_together_after_stored_records_do_not_halt_the_job(conn, db_url):
    """Eight records in a row cut at max_tokens, after the shard's other records were stored, are
    a share of the job, not every record: each is dead-lettered on its own and the job runs on (the
    halt naming params.max_tokens is for a failure every record meets)."""
    from gpu_runner.worker import HALT_AFTER_DEAD
    from batch_inference.status import job_halt

    rows = tickets(20)
    rows[12:20] = [(rid, f"{text} long", acl) for rid, text, acl in rows[12:20]]
    make_source(conn, rows)
    job = submit(conn, make_spec(max_attempts=1)).job_version
    assert 20 - 12 > HALT_AFTER_DEAD
    cfg = WorkerConfig(job_version=job, db_url=db_url, engine="tests.process.test_worker:BatchStepEngine")
    assert run_worker(cfg) == 0
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (12, 8, 0), c
    assert job_halt(conn, job)["halted_at"] is None


def test_engine_options_given_at_run_time_go_over_the_specs(conn, db_url):
    """``--engine-option`` (WorkerConfig.engine_options) merges over the spec's engine options, as the
    launcher's do: giving one option keeps the others (a vLLM worker given max_num_seqs keeps the spec's
    enforce_eager)."""
    from gpu_runner.worker import Worker

    make_source(conn, tickets(4))
    spec = make_spec(engine={"name": "noop", "options": {"delay_s": 0.001}}, shard_size=4)
    job = submit(conn, spec).job_version
    worker = Worker(WorkerConfig(job_version=job, db_url=db_url, engine_options={"seed": 7}))
    assert worker.run() == 0
    assert worker.engine.options == {"delay_s": 0.001, "seed": 7}
    assert job_counts(conn, job)["stored"] == 4
