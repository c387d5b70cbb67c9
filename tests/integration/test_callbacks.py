"""On-call messages against the real ledger: the job version a run worked on
(created or resumed), the JSON the webhook gets, the advice read from the dead
letters' reasons, and a webhook URL that never reaches the log."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batch_inference.callbacks import OnCallNotifier, build_message, deadline_missed, message_json
from batch_inference.ledger import Failure, Ledger
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, spec_dict, tickets
from tests.integration.test_airflow_operators import CONN_ID, ledger  # noqa: F401  (ledger: a fixture)

ENDPOINT_ERROR = 'HTTP 503: {"error": "down"} (gave up after 3 attempts)'   # the openai engine's text
SCHEMA_ERROR = "output does not match the schema at category: 'urgent' is not one of ['billing', 'bug']"


class RunTI:
    """A task instance as a failure callback sees it: ids, and an XCom that may be missing."""

    def __init__(self, task_id: str, run_id: str, dag_id: str = "batch_inference_nightly", xcom=None):
        self.task_id, self.run_id, self.dag_id, self.try_number = task_id, run_id, dag_id, 1
        self.pushed: dict = {}
        self._xcom = xcom

    def xcom_push(self, key, value):
        self.pushed[key] = value

    def xcom_pull(self, task_ids, key):
        return self._xcom


class DagRun:
    def __init__(self, run_id: str, dag_id: str = "batch_inference_nightly"):
        self.dag_id, self.run_id = dag_id, run_id


def submit_in_run(run_id: str) -> dict:
    from batch_inference.operators import SubmitJobOperator

    op = SubmitJobOperator(task_id="submit", spec=spec_dict(), postgres_conn_id=CONN_ID)
    return op.execute({"ti": RunTI("submit", run_id), "dag_run": DagRun(run_id)})


class Hook(ThreadingHTTPServer):
    """A real HTTP server on loopback standing in for the chat webhook: records bodies, answers ``status``."""

    def __init__(self, status: int = 200):
        self.bodies: list[bytes] = []
        self.status = status
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                srv.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(srv.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str = "/services/T0/B0/s3cr3t-token") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


@pytest.fixture
def hook():
    srv = Hook()
    yield srv
    srv.shutdown()


# -- the job version of a run ------------------------------------------------------------

def test_the_deadline_alert_finds_a_job_version_the_run_resumed(ledger, conn, tmp_path):
    make_source(conn, tickets(9))
    first = submit_in_run("scheduled__2026-03-01T22:00:00+00:00")
    again = submit_in_run("scheduled__2026-03-02T22:00:00+00:00")       # unchanged rows: the same version
    assert first["created"] is True and again["created"] is False and again["job_version"] == first["job_version"]
    rows = conn.execute("SELECT run_id, created FROM bi.job_runs WHERE job_version = %s ORDER BY run_id",
                        (first["job_version"],)).fetchall()
    assert [r["created"] for r in rows] == [True, False]

    out = tmp_path / "oncall.jsonl"
    # What Airflow 3.3's handle_miss passes: the run in its REST form, the deadline; no task instance.
    context = {"dag_run": {"dag_id": "batch_inference_nightly", "dag_run_id": "scheduled__2026-03-02T22:00:00+00:00",
                           "conf": {}, "start_date": "2026-03-02T22:00:05+00:00"},
               "deadline": {"id": "d1", "deadline_time": "2026-03-03T06:00:00Z"}}
    asyncio.run(deadline_missed(context, dataset="tickets_triage", postgres_conn_id=CONN_ID, log_file=str(out)))
    (msg,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert msg["kind"] == "deadline missed" and msg["job_version"] == first["job_version"]
    assert f"job version: {first['job_version']}, dataset tickets_triage" in msg["text"]
    assert msg["counts"]["outstanding"] == 9
    assert "2026-03-03T06:00:00Z" in msg["text"] and "batch_inference_nightly" in msg["text"]


def test_a_run_whose_submit_never_finished_says_not_submitted(ledger, tmp_path):
    out = tmp_path / "oncall.jsonl"
    context = {"dag_run": {"dag_id": "batch_inference_nightly", "dag_run_id": "manual__never", "conf": {}},
               "deadline": {"id": "d1", "deadline_time": "2026-03-03T06:00:00Z"}}
    asyncio.run(deadline_missed(context, dataset="tickets_triage", postgres_conn_id=CONN_ID, log_file=str(out)))
    (msg,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert msg["job_version"] is None and "(none: not submitted)" in msg["text"]


def test_the_notifier_finds_the_runs_job_version_without_the_xcom(ledger, conn):
    make_source(conn, tickets(4))
    run = "manual__2026-03-02"
    job = submit_in_run(run)["job_version"]
    msg = OnCallNotifier(postgres_conn_id=CONN_ID).message(
        {"ti": RunTI("cutoff", run, xcom=None), "dag_run": DagRun(run), "exception": RuntimeError("boom")})
    assert msg["job_version"] == job and msg["counts"]["records"] == 4


# -- the webhook ---------------------------------------------------------------------------

def test_the_webhook_gets_clean_json_for_a_job_with_claims(ledger, conn, db_url, hook):
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(6))
    run = "manual__claims"
    job = submit_in_run(run)["job_version"]
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0      # claims: first_claim_at is set
    OnCallNotifier(postgres_conn_id=CONN_ID, webhook_url=hook.url()).notify(
        {"ti": RunTI("validate", run, xcom=job), "dag_run": DagRun(run), "exception": RuntimeError("x")})
    (body,) = hook.bodies
    msg = json.loads(body)
    assert msg["job_version"] == job and msg["counts"]["stored"] == 6
    assert msg["counts"]["first_claim_at"].startswith("20")                  # a datetime, as ISO 8601


def test_message_json_turns_datetimes_and_decimals_into_json():
    from datetime import datetime, timedelta, timezone
    from decimal import Decimal

    at = datetime(2026, 3, 2, 6, 0, tzinfo=timezone.utc)
    msg = json.loads(message_json({"at": at, "cost": Decimal("12.50"), "n": Decimal("3"), "lag": timedelta(minutes=2)}))
    assert msg == {"at": "2026-03-02T06:00:00+00:00", "cost": 12.5, "n": 3, "lag": 120.0}


def test_a_failing_webhook_logs_its_host_never_its_url(caplog):
    srv = Hook(status=500)
    try:
        url = srv.url()
        message = build_message(dag_id="d", run_id="r", task_id="t", job_version=None, counts=None, error="e")
        from batch_inference.callbacks import deliver

        with caplog.at_level(logging.DEBUG):
            deliver(message, webhook_url=url)
            srv.shutdown()
            srv.server_close()
            deliver(message, webhook_url=url)             # nobody listening: connection refused
    finally:
        srv.server_close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "answered HTTP 500" in logged and "failed:" in logged
    assert "s3cr3t-token" not in logged and "/services/" not in logged
    assert f"127.0.0.1:{srv.server_address[1]}/..." in logged


# -- advice from the dead letters ----------------------------------------------------------

def dead_letter_job(conn, errors: list[str]) -> str:
    """A job whose records ended as dead letters with these errors, written through the worker's ledger calls."""
    make_source(conn, tickets(len(errors)))
    job = submit(conn, make_spec(max_attempts=1, shard_size=len(errors))).job_version
    ledger_ = Ledger(conn, job, "worker-test")
    lease = ledger_.claim()
    ids = [r["record_id"] for r in ledger_.records(lease)]
    ledger_.fail(lease, [Failure(i, e) for i, e in zip(ids, errors)])
    assert ledger_.complete(lease) == "done"
    return job


def validate_failure(job: str) -> dict:
    from batch_inference.operators import ValidateOperator

    task = ValidateOperator(task_id="validate", job_version=job, postgres_conn_id=CONN_ID)
    context = {"task": task, "ti": RunTI("validate", "manual__v"), "dag_run": DagRun("manual__v"),
               "exception": RuntimeError(f"job version {job} failed validation; it stays unpublished")}
    return OnCallNotifier(postgres_conn_id=CONN_ID).message(context)


def test_endpoint_dead_letters_say_the_endpoint_was_down_and_to_rerun(ledger, conn):
    job = dead_letter_job(conn, [ENDPOINT_ERROR] * 6 + ["[Errno 111] Connection refused"] * 2 + [SCHEMA_ERROR] * 2)
    msg = validate_failure(job)
    assert msg["dead_letter_causes"]["endpoint"]["n"] == 8 and msg["dead_letter_causes"]["output"]["n"] == 2
    assert "dead letters by cause: endpoint 8, output 2" in msg["text"]
    steps = " | ".join(msg["next_steps"])
    assert "8 of 10 dead letters are endpoint errors" in steps and "the prompt is not at fault" in steps
    assert f"`batch-inference drop {job}`" in steps
    assert "prompt or schema fix" not in steps


def test_schema_dead_letters_keep_the_prompt_and_schema_advice(ledger, conn):
    job = dead_letter_job(conn, [SCHEMA_ERROR] * 7 + ["output is not valid JSON: Expecting value"] + [ENDPOINT_ERROR] * 2)
    msg = validate_failure(job)
    assert msg["dead_letter_causes"]["output"]["n"] == 8
    steps = " | ".join(msg["next_steps"])
    assert "prompt or schema fix" in steps and "endpoint" not in steps


# -- messages without the ledger ---------------------------------------------------------

def test_a_submit_failure_message_says_nothing_was_written():
    msg = build_message(dag_id="d", run_id="r", task_id="submit", try_number=1, job_version=None, counts=None,
                        error="spec field 'shard_size': Input should be greater than or equal to 1")
    assert "not submitted" in msg["text"] and "nothing was written" in msg["text"]
    assert "shard_size" in msg["text"]


def test_a_worker_digest_failure_message_points_at_the_weights():
    counts = {"records": 10, "stored": 0, "dead_letters": 0, "outstanding": 10, "mode": "batch",
              "status": "running", "shards": {"pending": 1, "leased": 0, "done": 0}}
    msg = build_message(dag_id="d", run_id="r", task_id="workers", job_version="jv_1", dataset="ds",
                        counts=counts, error="worker w0 failed fatally (exit 3): the model weights do not match")
    assert msg["next_steps"][0].startswith("the worker refused the model weights")
    assert "0/10 stored" in msg["text"] and "batch-inference rollback ds" in msg["text"]
