"""The fallback pool against ``cost.budget``: a night where meeting the deadline needs more than the budget.

The ledger is the real embedded PostgreSQL, the batch rows are stored by a real batch worker (noop
engine), the pool's threads and the openai engine are the real ones; the endpoint is the loopback
chat-completions server (``batch_inference.harness.loopback``), which stands in for a hosted API and
counts every request it receives. Every fourth answer is a 503, so the pool retries without the
breaker tripping; the budget counts rows, as the bill does, so a retried request spends nothing twice.

The job: 60 records in shards of 10; the batch stores 20 at $0.005 ($0.10 spent); the other 40 at the
fallback's $0.01 would bring the night to $0.50, over a $0.30 budget, which affords 20 more rows.
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import threading

import pytest

from batch_inference import db
from batch_inference.exceptions import NotReady
from batch_inference.fallback import run_fallback
from batch_inference.plan import submit
from batch_inference.status import job_counts
from batch_inference.validate import validate
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer, completion

PRICES = {"batch_per_row": 0.005, "fallback_per_row": 0.01}
ARITHMETIC = "budget $0.30: spent $0.10 so far + 40 rows outstanding x $0.01/row = $0.50 projected"
QUICK = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}


class Flaky(ChatServer):
    """Answers every fourth request with HTTP 503 (a transport failure: retried, no attempt spent)."""

    def __init__(self):
        self.n = 0
        self.n_lock = threading.Lock()
        super().__init__(self.answer)

    def answer(self, body: dict) -> tuple[int, dict, dict]:
        with self.n_lock:
            self.n += 1
            n = self.n
        if n % 4 == 0:
            return 503, {}, {"error": {"message": "busy"}}
        return 200, {}, completion()


@pytest.fixture
def endpoint():
    srv = Flaky()
    yield srv
    srv.close()


def night(conn, db_url, on_budget: str, budget: float = 0.30) -> str:
    """60 records, 20 of them stored by a real batch worker: $0.10 spent."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10, cost={**PRICES, "budget": budget, "on_budget": on_budget})).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, max_shards=2)) == 0
    assert job_counts(conn, job)["stored_batch"] == 20
    return job


def cli_bill(db_url: str, job: str, capsys) -> dict:
    """The bill as ``batch-inference cost JOB --json`` reports it."""
    from batch_inference.cli import main

    capsys.readouterr()
    assert main(["--db", db_url, "cost", job, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["so_far"]


def rows_sent(endpoint) -> set[str]:
    """The distinct records whose request reached the endpoint (a retry sends the same messages)."""
    return {json.dumps(b["messages"], sort_keys=True) for b in endpoint.bodies}


def attempts(conn, job: str) -> int:
    return conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s", (job,)).fetchone()["n"]


def test_on_budget_page_keeps_the_pool_within_the_budget(conn, db_url, endpoint, capsys):
    job = night(conn, db_url, "page")
    pages: list[str] = []
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, concurrency=4, parallel_shards=2,
                     extra_engine_options=QUICK, on_page=pages.append)
    # One page, before the pool started, with the arithmetic in one line.
    assert pages == [r.budget_page] and "\n" not in r.budget_page
    assert ARITHMETIC in r.budget_page, r.budget_page
    assert "stops at the budget (on_budget: page)" in r.budget_page and "at most 20 row(s)" in r.budget_page
    assert "cannot be validated nor published" in r.budget_page
    # The allowance: 20 rows reached the endpoint, and not one more; their retries spent nothing more
    # (before: 20 requests, retries included, so a 503 wasted budget the bill never spent).
    assert (r.allowance, r.budget_stop, r.stopped) == (20, True, True)
    assert len(rows_sent(endpoint)) == 20 and len(endpoint.hits) > 20
    c = job_counts(conn, job)
    stored = c["stored_fallback"]
    # Rows waiting for a retry when the allowance ran out stay pending (at most one per request in flight).
    assert 20 - 4 <= stored <= 20 and r.stored == stored
    # Stopped as pool.stop() stops: in-flight written, leases released, the rest pending, no attempt spent.
    assert (c["outstanding"], c["dead_letters"], c["shards"]["leased"]) == (40 - stored, 0, 0), c
    assert attempts(conn, job) == 0
    assert r.outstanding == 40 - stored
    # The bill afterwards, by the `batch-inference cost` path, is within the budget.
    bill = cli_bill(db_url, job, capsys)
    assert bill["fallback_rows"] == stored and bill["total"] <= 0.30, bill
    # Not publishable: validate refuses a version with rows still to do (I3).
    with pytest.raises(NotReady):
        validate(conn, job)


def test_on_budget_spend_redrives_everything_and_pages(conn, db_url, endpoint, capsys):
    job = night(conn, db_url, "spend")
    pages: list[str] = []
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, concurrency=4, parallel_shards=2,
                     extra_engine_options=QUICK, on_page=pages.append)
    assert pages == [r.budget_page] and ARITHMETIC in r.budget_page, pages
    assert "past the budget (on_budget: spend)" in r.budget_page and "$0.20 over" in r.budget_page
    assert (r.allowance, r.budget_stop, r.outstanding, r.stored) == (None, False, 0, 40)
    assert len(endpoint.hits) > 40                     # every row, and the retries of the 503s
    c = job_counts(conn, job)
    assert (c["stored_fallback"], c["outstanding"]) == (40, 0)
    assert attempts(conn, job) == 0
    assert cli_bill(db_url, job, capsys)["total"] == 0.50


def test_a_budget_already_spent_sends_nothing(conn, db_url, endpoint, capsys):
    from batch_inference.cli import main

    job = night(conn, db_url, "page", budget=0.10)
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, extra_engine_options=QUICK)
    assert (r.allowance, r.budget_stop, r.outstanding) == (0, True, 40)
    assert "at most 0 row(s)" in r.budget_page and "budget $0.10: spent $0.10 so far" in r.budget_page
    assert endpoint.hits == []
    c = job_counts(conn, job)
    assert (c["stored"], c["shards"]["leased"], c["mode"]) == (20, 0, "fallback"), c
    assert conn.execute("SELECT sum(claims) AS n FROM bi.shards WHERE job_version = %s AND state = 'pending'",
                        (job,)).fetchone()["n"] == 0          # nothing claimed
    assert attempts(conn, job) == 0
    # The CLI: one line on stderr with the page, exit 1.
    capsys.readouterr()
    assert main(["--db", db_url, "fallback", job, "--base-url", endpoint.base_url]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("batch-inference fallback: stopped at the budget with 40 record(s) outstanding: ")
    assert "budget $0.10: spent $0.10 so far" in line and endpoint.hits == []


def test_within_the_budget_nothing_is_capped_and_nothing_pages(conn, db_url, endpoint):
    job = night(conn, db_url, "page", budget=0.50)     # exactly the projected bill: within it
    pages: list[str] = []
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, concurrency=4, extra_engine_options=QUICK,
                     on_page=pages.append)
    assert (pages, r.budget_page, r.allowance, r.budget_stop, r.outstanding) == ([], None, None, False, 0)


def test_the_operator_pages_once_and_fails_without_a_retry_at_the_budget(conn, db_url, endpoint, monkeypatch,
                                                                            tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.callbacks import OnCallNotifier
    from batch_inference.operators.fallback import FallbackPoolOperator

    job = night(conn, db_url, "page")
    oncall = tmp_path / "oncall.jsonl"
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    monkeypatch.setenv("BATCH_INFERENCE_ONCALL_FILE", str(oncall))
    op = FallbackPoolOperator(task_id="fallback", job_version=job, base_url=endpoint.base_url, rate=200,
                              concurrency=4, parallel_shards=2, engine_options=QUICK)
    with pytest.raises(AirflowFailException) as info:
        op.execute({})
    assert "stopped at the budget" in str(info.value) and ARITHMETIC in str(info.value)
    (msg,) = [json.loads(line) for line in oncall.read_text().splitlines()]
    assert msg["kind"] == "over the budget" and msg["job_version"] == job and ARITHMETIC in msg["error"]
    assert any("larger cost.budget" in step for step in msg["next_steps"]), msg["next_steps"]
    assert len(rows_sent(endpoint)) == 20 and attempts(conn, job) == 0
    # The DAG's failure callback (the pipeline's default_args) sends nothing more for it: one message per
    # budget stop (before: a second one, kind "task failed", with the same page as its error).
    OnCallNotifier().notify({"exception": info.value, "task": op})
    assert len(oncall.read_text().splitlines()) == 1
    # Any other failure still goes out.
    OnCallNotifier().notify({"exception": RuntimeError("boom"), "task": op})
    assert len(oncall.read_text().splitlines()) == 2


def test_the_draining_batch_workers_gpu_time_is_reserved_before_the_pool_spends(conn, db_url, endpoint, capsys):
    """Our own workers billed by the GPU-hour: two still run when the pool starts. Their drain (the
    spec's lease + renewal: 630 s) is reserved first, so the pool affords fewer rows, and the bill
    with their drain recorded stays within the budget (before: the allowance was the whole rest and
    the drain came on top)."""
    from batch_inference import autopilot

    make_source(conn, tickets(60))
    spec = make_spec(shard_size=10, lease_seconds=600, renew_seconds=30,
                     cost={"gpu_hour_spot": 3.6, "fallback_per_row": 0.01, "budget": 0.90, "on_budget": "page"})
    job = submit(conn, spec).job_version
    autopilot.observe(conn, job, "test", 2)         # a launcher runs two workers: billed from now
    pages: list[str] = []
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, concurrency=4, parallel_shards=2,
                     extra_engine_options=QUICK, on_page=pages.append)
    # Two workers x 630 s at $3.60/h = $1.26 reserved... over the budget by itself: nothing is sent.
    assert autopilot.drain_s(spec) == 630.0
    assert "+ $1.26 for 2 draining batch worker(s) (630 s at the GPU-hour price)" in r.budget_page, r.budget_page
    assert (r.allowance, r.budget_stop) == (0, True) and endpoint.hits == []


def test_a_drain_within_the_budget_leaves_the_rest_to_the_pool(conn, db_url, endpoint, capsys):
    from batch_inference import autopilot

    make_source(conn, tickets(60))
    spec = make_spec(shard_size=10, lease_seconds=60, renew_seconds=10,
                     cost={"gpu_hour_spot": 3.6, "fallback_per_row": 0.01, "budget": 0.40, "on_budget": "page"})
    job = submit(conn, spec).job_version
    autopilot.observe(conn, job, "test", 2)
    r = run_fallback(db_url, job, endpoint.base_url, rate=200, concurrency=4, parallel_shards=2,
                     extra_engine_options=QUICK)
    # 2 x 70 s at $3.60/h = $0.14 reserved; (0.40 - spent - 0.14) / 0.01 rows: 25 at most (spent is the GPU
    # time so far: a fraction of a cent, a cent on a slow machine).
    assert "+ $0.14 for 2 draining batch worker(s) (70 s" in r.budget_page, r.budget_page
    assert 24 <= r.allowance <= 25 and r.budget_stop
    autopilot.observe(conn, job, "test", 0)          # the drain ends (well within its 70 s here)
    bill = cli_bill(db_url, job, capsys)
    assert bill["total"] <= 0.40 and bill["fallback_rows"] <= r.allowance, bill
