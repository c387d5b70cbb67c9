"""The fallback pool: hosted refusal, bookkeeping, and the whole cutoff night end to end.

The end-to-end test runs a real batch worker (noop engine, slowed down) in
a subprocess, the real ``CutoffSensor`` and ``FallbackPoolOperator`` through
Airflow's ``dag.test()`` (which runs the trigger inline), and the re-drive
through a real llama.cpp OpenAI-compatible server with SmolLM2.

The faster pool tests talk to a small local HTTP server that answers like an
OpenAI-compatible endpoint. It stands in for a hosted API, which cannot be
reached from here, and it lets the tests count requests and their timing
exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from batch_inference import db
from batch_inference.fallback import FallbackEndpointUnavailable, FallbackIncomplete, FallbackRefused, run_fallback
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.fixtures import execute_in_thread
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer, completion
from tests.fixtures.llama_server import JSON_SCHEMA_REFUSAL, free_port

REPO = Path(__file__).resolve().parents[2]
# One short answer per record: SmolLM2 rambles past any token cap when asked
# for a free-text summary, and this test is about the transport, not labels.
CATEGORY_ONLY = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]}},
    "required": ["category"],
    "additionalProperties": False,
}


# -- a small OpenAI-compatible endpoint ------------------------------------------


class Endpoint(ChatServer):
    """Answers ``content`` to every request, or ``error`` with ``status`` when that is not 200."""

    def __init__(self):
        super().__init__(self.answer)
        self.status = 200
        self.error: dict = {}
        self.content = '{"category": "bug", "summary": "x"}'

    def answer(self, body: dict) -> tuple[int, dict, dict]:
        return self.status, {}, self.error if self.status != 200 else completion(self.content)

    @property
    def times(self) -> list[float]:
        return [t for t, _, _ in self.hits]


@pytest.fixture
def endpoint():
    srv = Endpoint()
    yield srv
    srv.close()


def mode_of(conn, job: str) -> str:
    return conn.execute("SELECT mode FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["mode"]


# -- refusals ------------------------------------------------------------------


def test_hosted_endpoint_is_refused_for_an_uncleared_record_class(conn, db_url, endpoint, capsys):
    from batch_inference.cli import main

    make_source(conn, tickets(20))
    job = submit(conn, make_spec(record_class="customer_pii")).job_version
    with pytest.raises(FallbackRefused) as exc:
        run_fallback(db_url, job, endpoint.base_url, hosted=True)
    message = str(exc.value)
    assert "\n" not in message and "customer_pii" in message and "not cleared for hosted APIs" in message
    # Same refusal from the CLI: one line on stderr, exit 2.
    assert main(["--db", db_url, "fallback", job, "--base-url", endpoint.base_url, "--hosted"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not cleared for hosted APIs" in err[0]
    # Nothing was sent, nothing was claimed, the job is as it was.
    assert endpoint.hits == []
    assert mode_of(conn, job) == "batch"
    assert conn.execute("SELECT sum(claims) AS n FROM bi.shards WHERE job_version = %s", (job,)).fetchone()["n"] == 0
    # Cleared, the same hosted endpoint is allowed.
    job2_spec = make_spec(record_class="public_docs", cleared_for_hosted=True, shard_size=20)
    make_source(conn, tickets(5, start=100))
    job2 = submit(conn, job2_spec).job_version
    assert run_fallback(db_url, job2, endpoint.base_url, hosted=True, rate=50).stored == 5


def test_nothing_outstanding_is_a_no_op(conn, db_url, endpoint):
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(12))
    job = submit(conn, make_spec()).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    r = run_fallback(db_url, job, endpoint.base_url)
    assert r.skipped == "nothing outstanding" and r.records == 0 and endpoint.hits == []
    assert mode_of(conn, job) == "batch"         # the complete path does not flip the job
    assert conn.execute("SELECT count(*) AS n FROM bi.fallback_runs").fetchone()["n"] == 0


# -- the pool --------------------------------------------------------------------


def test_pool_rate_limit_spans_the_pool_and_the_run_is_measured(conn, db_url, endpoint):
    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10)).job_version    # 6 shards: several held at once
    store_some = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'batch-w', 'batch', 60)", (job,)).fetchone()
    conn.execute("SELECT bi.release_shard_v2(%s, %s, %s, 'batch-w')", (job, store_some["shard_no"], store_some["epoch"]))
    rate = 20.0
    r = run_fallback(db_url, job, endpoint.base_url, rate=rate, concurrency=8, parallel_shards=4)
    assert r.entered_fallback and mode_of(conn, job) == "fallback"
    assert (r.records, r.stored, r.outstanding, r.workers) == (60, 60, 0, 4)
    # One bucket for four threads: 60 requests at 20/s take at least (60 - burst) / 20 s.
    hits = sorted(endpoint.times)
    span = hits[-1] - hits[0]
    assert len(hits) == 60 and span >= (60 - 10) / rate - 0.25, span     # arrival times jitter a little
    # No one-second window holds more than the burst plus a second of tokens.
    assert max(sum(1 for h in hits if t <= h < t + 1.0) for t in hits) <= 10 + rate + 2
    c = job_counts(conn, job)
    assert (c["stored_fallback"], c["stored_batch"], c["outstanding"]) == (60, 0, 0)
    assert conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND transport = 'fallback'",
                        (job,)).fetchone()["n"] == 60
    run = conn.execute("SELECT * FROM bi.fallback_runs WHERE id = %s", (r.fallback_run_id,)).fetchone()
    assert run["records"] == 60 and run["dataset"] == "tickets_triage"
    # the measured sustained rate includes the bucket's initial burst of 10: at most 60 / ((60 - 10) / rate)
    assert run["rate"] == pytest.approx(r.rate) and run["rate"] <= 60 / ((60 - 10) / rate) * 1.1
    # The equation the cutoff solves backwards holds for what was recorded.
    wall = (run["finished_at"] - run["started_at"]).total_seconds()
    assert wall == pytest.approx(run["overhead_s"] + run["records"] / run["rate"], abs=0.01)
    assert run["overhead_s"] >= 0
    # The publish step adds the warehouse load it timed, which the pool cannot see.
    from batch_inference.fallback import add_load_time

    assert add_load_time(conn, job, 600.0) == pytest.approx(run["overhead_s"] + 600.0)
    assert add_load_time(conn, "jv_without_a_fallback_run", 600.0) is None
    print(f"\npool: 60 requests over 4 shard threads at a {rate:g}/s limit: {span:.2f} s between the first and "
          f"last request; measured {run['rate']:.1f} records/s busy, overhead {run['overhead_s']:.2f} s")


# -- an endpoint that is down is not a poison record -----------------------------------

QUICK = {"backoff_base_s": 0.01}     # the engine's retry backoff, short for tests
DOWN = "records left pending, no attempts spent"


def assert_untouched(conn, job: str, records: int, pool_running: bool = False) -> None:
    """Every record pending with no attempt counted, no dead letter, no shard done or lost, and none
    leased (``pool_running``: a pool still re-driving may hold a lease at the moment of the check)."""
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (0, 0, records), c
    assert (pool_running or c["shards"]["leased"] == 0) and c["shards"]["done"] == 0, c["shards"]
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s", (job,)).fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.dead_letters WHERE job_version = %s",
                        (job,)).fetchone()["n"] == 0
    assert conn.execute("SELECT coalesce(sum(lost_leases), 0) AS n FROM bi.shards WHERE job_version = %s",
                        (job,)).fetchone()["n"] == 0


def test_an_endpoint_answering_500_stops_the_pool_and_spends_no_attempts(conn, db_url, endpoint, monkeypatch):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from batch_inference.operators.fallback import FallbackPoolOperator

    # llama.cpp's answer to the json_schema form, to every request.
    endpoint.status, endpoint.error = 500, JSON_SCHEMA_REFUSAL
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version
    with pytest.raises(FallbackEndpointUnavailable) as info:
        run_fallback(db_url, job, endpoint.base_url, rate=50, concurrency=4, parallel_shards=3,
                     extra_engine_options=QUICK)
    msg = str(info.value)
    assert isinstance(info.value, FallbackIncomplete) and "\n" not in msg
    assert msg.startswith(f"fallback endpoint {endpoint.base_url} failing: 5 of the last 5 requests failed "
                          "(HTTP 500: 1 validation error: "), msg
    assert "Input should be 'text' or 'json_object'" in msg and msg.endswith(DOWN)
    assert_untouched(conn, job, 30)
    assert mode_of(conn, job) == "fallback"
    assert {b["response_format"]["type"] for b in endpoint.bodies} == {"json_object"}   # the spec's default

    # The operator: a task failure Airflow may retry (the endpoint may come back), the same one line.
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    op = FallbackPoolOperator(task_id="fallback", job_version=job, base_url=endpoint.base_url, rate=50,
                              engine_options=QUICK)
    with pytest.raises(AirflowException) as info:
        op.execute({})
    assert not isinstance(info.value, AirflowFailException)
    text = str(info.value)
    assert text.startswith(f"fallback endpoint {endpoint.base_url} failing: ") and text.endswith(DOWN), text
    assert_untouched(conn, job, 30)


def test_a_refused_connection_stops_the_pool_and_the_cli_says_so_in_one_line(conn, db_url, capsys):
    from batch_inference.cli import main

    port = free_port()                          # nothing listens there
    url = f"http://bi:sk-secret@127.0.0.1:{port}/v1"
    make_source(conn, tickets(20))
    job = submit(conn, make_spec(shard_size=10)).job_version
    with pytest.raises(FallbackEndpointUnavailable) as info:
        run_fallback(db_url, job, url, rate=50, extra_engine_options=QUICK)
    assert str(info.value).startswith(f"fallback endpoint http://127.0.0.1:{port}/v1 failing: 5 of the last 5 "
                                      "requests failed (ConnectError"), str(info.value)
    assert "sk-secret" not in str(info.value)
    assert_untouched(conn, job, 20)
    # The CLI: one line on stderr, the worker's exit code for the same outage.
    assert main(["--db", db_url, "fallback", job, "--base-url", url]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"batch-inference fallback: fallback endpoint "
                                               f"http://127.0.0.1:{port}/v1 failing: "), err
    assert err[0].endswith(DOWN) and "sk-secret" not in err[0]
    assert_untouched(conn, job, 20)


def test_timeouts_stop_the_pool_and_spend_no_attempts(conn, db_url, endpoint):
    endpoint.delay = 2.0                        # well past the engine's 0.2 s timeout
    make_source(conn, tickets(10))
    job = submit(conn, make_spec(shard_size=5)).job_version
    with pytest.raises(FallbackEndpointUnavailable, match=r"5 of the last 5 requests failed \(ReadTimeout"):
        run_fallback(db_url, job, endpoint.base_url, rate=50, concurrency=2,
                     extra_engine_options={**QUICK, "timeout_s": 0.2})
    assert_untouched(conn, job, 10)


def test_invalid_output_is_the_records_failure_and_dead_letters_at_max_attempts(conn, db_url, endpoint):
    endpoint.content = '{"category": "bug", "summ'          # HTTP 200, but not JSON
    make_source(conn, tickets(6))
    job = submit(conn, make_spec(shard_size=6, max_attempts=2)).job_version
    r = run_fallback(db_url, job, endpoint.base_url, rate=50, extra_engine_options=QUICK)
    assert (r.stored, r.dead, r.outstanding, r.failed_attempts) == (0, 6, 0, 12)
    rows = conn.execute("SELECT attempts, transport FROM bi.dead_letters WHERE job_version = %s", (job,)).fetchall()
    assert len(rows) == 6 and all(row["attempts"] == 2 and row["transport"] == "fallback" for row in rows)


def test_the_response_format_comes_from_the_spec_unless_given(conn, db_url, endpoint):
    from batch_inference.operators.submit import OVERRIDABLE
    from batch_inference.spec import SpecError, parse_spec
    from tests.conftest import spec_dict

    schema_spec = make_spec(fallback={"response_format_style": "json_schema"})
    # Fallback settings do not change results: the same job version, and a DAG Param may override them.
    assert schema_spec.spec_hash == make_spec().spec_hash and "fallback" in OVERRIDABLE
    assert make_spec().fallback.response_format_style == "json_object"
    with pytest.raises(SpecError, match="spec field 'fallback.response_format_style': "):
        parse_spec(spec_dict(fallback={"response_format_style": "json"}))
    make_source(conn, tickets(4))
    job = submit(conn, make_spec(shard_size=2, fallback={"response_format_style": "json_schema"})).job_version
    assert run_fallback(db_url, job, endpoint.base_url, rate=50).stored == 4
    assert {b["response_format"]["type"] for b in endpoint.bodies} == {"json_schema"}
    make_source(conn, tickets(4, start=100))
    job = submit(conn, make_spec(shard_size=2, fallback={"response_format_style": "json_schema"})).job_version
    endpoint.hits.clear()
    assert run_fallback(db_url, job, endpoint.base_url, rate=50, style="json_object").stored == 4
    assert {b["response_format"]["type"] for b in endpoint.bodies} == {"json_object"}


@pytest.mark.slow
def test_the_default_response_format_works_against_llama_cpp_and_json_schema_leaves_records_pending(
        conn, db_url, llama_server):
    spec = make_spec(shard_size=3, output_schema=CATEGORY_ONLY, params={"max_tokens": 32},
                     prompt={"system": "Classify the support ticket."})
    make_source(conn, tickets(3))
    job = submit(conn, spec).job_version
    # The OpenAI form, as the example DAGs' pool once sent it: the real server refuses every request.
    with pytest.raises(FallbackEndpointUnavailable) as info:
        run_fallback(db_url, job, llama_server, style="json_schema", rate=20, concurrency=2,
                     extra_engine_options=QUICK)
    assert "(HTTP 500: 1 validation error: " in str(info.value)
    assert "Input should be 'text' or 'json_object'" in str(info.value) and str(info.value).endswith(DOWN)
    assert_untouched(conn, job, 3)
    # The spec's default (json_object): stored.
    r = run_fallback(db_url, job, llama_server, rate=20, concurrency=2)
    c = job_counts(conn, job)
    assert r.outstanding == 0 and r.stored >= 1 and c["stored_fallback"] == r.stored and c["outstanding"] == 0, r


# -- the whole night, through dag.test() and a real llama.cpp server ------------------

DAG_FILE = '''
"""A cutoff night for tests: slow batch worker, cutoff sensor, fallback pool (airflow dag)."""
import json, os, subprocess, sys, time
from datetime import datetime, timedelta, timezone

import psycopg
from airflow.sdk import DAG, task

from batch_inference.operators.fallback import FallbackPoolOperator
from batch_inference.sensors.cutoff import CutoffSensor

JOB = os.environ["BI_E2E_JOB"]
OUT = os.environ["BI_E2E_OUT"]


def warned(context, event):
    with open(os.path.join(OUT, "warnings.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\\n")


with DAG("bi_cutoff_e2e", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
         catchup=False) as dag:

    @task
    def start_batch():
        # A slow batch worker (noop engine, BATCH_DELAY_S per record), as a separate process.
        log = open(os.path.join(OUT, "batch_worker.log"), "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_runner", JOB, "--flush-every", "1",
             "--engine-option", "delay_s=" + os.environ["BI_E2E_BATCH_DELAY"]],
            env={**os.environ, "BATCH_INFERENCE_DB": os.environ["BI_E2E_DB"], "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=subprocess.STDOUT)
        with psycopg.connect(os.environ["BI_E2E_DB"], autocommit=True) as c:
            for _ in range(600):
                if c.execute("SELECT coalesce(sum(stored), 0) FROM bi.shards WHERE job_version = %s",
                             (JOB,)).fetchone()[0] > 0:
                    break
                time.sleep(0.1)
        deadline = datetime.now(timezone.utc) + timedelta(seconds=float(os.environ["BI_E2E_OFFSET"]))
        return {"pid": proc.pid, "deadline": deadline.isoformat()}

    cutoff = CutoffSensor(
        task_id="cutoff", job_version=JOB, postgres_conn_id="bi_ledger",
        deadline="{{ ti.xcom_pull(task_ids='start_batch')['deadline'] }}",
        poll_interval=0.5, rate=2.0, overhead_s=3.0, step_s=1, on_early_warning=warned)

    pool = FallbackPoolOperator(
        task_id="fallback", job_version=JOB, postgres_conn_id="bi_ledger", base_url=os.environ["BI_E2E_URL"],
        rate=20.0, concurrency=2, parallel_shards=2)

    @task
    def report(ti=None):
        out = {t: ti.xcom_pull(task_ids=t) for t in ("start_batch", "cutoff", "fallback")}
        with open(os.path.join(OUT, "report.json"), "w") as f:
            json.dump(out, f)

    start_batch() >> cutoff >> pool >> report()

if __name__ == "__main__":
    # Run from inside the DAGs folder: dag.test() needs the file there.
    print("DAG_RUN_STATE", dag.test().state)
'''


def airflow_env(home: Path, db_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BATCH_INFERENCE"))}
    return env | {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        # The ledger through an Airflow connection: the sensor, the trigger
        # (async getter) and the operator all resolve it; BATCH_INFERENCE_DB is unset.
        "AIRFLOW_CONN_BI_LEDGER": db.airflow_connection_json(db_url),
        # The checkout's own package and worker, whatever the environment has installed.
        "PYTHONPATH": f"{REPO / 'plugins'}{os.pathsep}{REPO}",
    }


def night_spec(style: str):
    """The cutoff night's job: 4-record shards, one short answer a record. vLLM serves the model under its
    name (the openai engine asks for spec.model.name); the batch path is noop."""
    from tests.fixtures.vllm import MODEL_NAME

    return make_spec(shard_size=4, lease_seconds=30, renew_seconds=0.5, output_schema=CATEGORY_ONLY,
                     params={"max_tokens": 32}, prompt={"system": "Classify the support ticket."},
                     model={"name": MODEL_NAME, "digest": "0" * 64}, fallback={"response_format_style": style})


def warm_up(spec, base_url: str, style: str) -> None:
    """Keep the pool warm, as the seed says of a fallback that must work at 04:39: the first request to a
    cold server evaluates the whole prompt (and vLLM compiles the schema's grammar) and can take half a
    minute on a loaded machine."""
    from batch_inference.engines import load_engine
    from batch_inference.engines.base import Request
    from batch_inference.prompting import build_messages

    warm = load_engine("openai", spec, {"base_url": base_url, "response_format_style": style})
    warm.load()
    list(warm.generate([Request("warm", build_messages(spec, "warm-up"))], threading.Event()))


@pytest.mark.slow
def test_vllm_serve_takes_the_schema_as_its_constraint_and_the_pool_stores_every_record(conn, db_url, vllm_server):
    """The pool against ``vllm serve`` with the spec's json_schema style (vLLM's server takes the schema as
    its constraint, which llama.cpp's refuses): every record stored once by the fallback, each output within
    the schema, the run measured. The night around the pool (batch worker, cutoff sensor, operator through
    dag.test) is the same whatever the endpoint: test_cutoff_night_end_to_end_through_dag_test runs it on
    llama.cpp's server."""
    spec = night_spec("json_schema")
    make_source(conn, tickets(8))
    job = submit(conn, spec).job_version
    warm_up(spec, vllm_server, "json_schema")
    r = run_fallback(db_url, job, vllm_server, rate=20.0, concurrency=2, parallel_shards=2)
    assert (r.records, r.stored, r.dead, r.outstanding) == (8, 8, 0, 0), r
    rows = conn.execute("SELECT record_id, output, transport FROM bi.results WHERE job_version = %s",
                        (job,)).fetchall()
    assert len(rows) == len({row["record_id"] for row in rows}) == 8
    assert all(row["transport"] == "fallback" for row in rows)
    enum = set(CATEGORY_ONLY["properties"]["category"]["enum"])
    assert all(set(row["output"]) == {"category"} and row["output"]["category"] in enum for row in rows), rows
    c = job_counts(conn, job)
    assert (c["stored_fallback"], c["dead_letters"], c["outstanding"]) == (8, 0, 0)
    assert c["shards"] == {"pending": 0, "leased": 0, "done": 2}
    fr = conn.execute("SELECT * FROM bi.fallback_runs WHERE job_version = %s", (job,)).fetchall()
    assert len(fr) == 1 and fr[0]["records"] == 8 and fr[0]["rate"] > 0


@pytest.mark.slow
def test_cutoff_night_end_to_end_through_dag_test(conn, db_url, llama_server, tmp_path, capsys, migrated_airflow_db):
    from batch_inference.cli import main

    # The fallback pool's endpoint: llama.cpp's server (JSON mode only, the spec's default style).
    base_url, style = llama_server, "json_object"
    spec = night_spec(style)
    make_source(conn, tickets(16))
    job = submit(conn, spec).job_version
    warm_up(spec, base_url, style)

    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "bi_cutoff_e2e.py").write_text(textwrap.dedent(DAG_FILE))
    out = tmp_path / "out"
    out.mkdir()
    env = airflow_env(home, db_url) | {
        "BI_E2E_JOB": job, "BI_E2E_OUT": str(out), "BI_E2E_DB": db_url, "BI_E2E_URL": base_url,
        "BI_E2E_BATCH_DELAY": "2.0", "BI_E2E_OFFSET": "20"}
    shutil.copyfile(migrated_airflow_db, home / "airflow.db")     # `airflow db migrate`, done once a session
    t1 = time.monotonic()
    run = subprocess.run([sys.executable, str(home / "dags" / "bi_cutoff_e2e.py")], env=env, capture_output=True,
                         text=True, timeout=600, cwd=str(REPO))
    t2 = time.monotonic()
    logs = run.stdout + run.stderr
    (tmp_path / "dag_test.log").write_text(logs)
    assert run.returncode == 0 and "DAG_RUN_STATE success" in logs, logs[-6000:]

    report = json.loads((out / "report.json").read_text())
    fired, pool = report["cutoff"], report["fallback"]
    assert fired["fired"] is True and fired["entered_fallback"] is True, fired
    assert pool["records"] > 0 and pool["outstanding"] == 0 and pool["fallback_run_id"], pool

    # The early warning went out once, before the cutoff, through the sensor's callback.
    warnings = [json.loads(line) for line in (out / "warnings.jsonl").read_text().splitlines()]
    assert len(warnings) == 1 and warnings[0]["status"] == "early_warning"
    assert "projected to finish" in warnings[0]["warning"]["message"]

    # The batch worker learned of the cutoff at a renewal, drained and left.
    batch_log = (out / "batch_worker.log").read_text()
    # (It wrote its in-flight record; if that was the shard's last, the shard
    # completed, otherwise it was released for the pool.)
    assert "cutoff fired: draining shard" in batch_log, batch_log[-3000:]
    assert "job is running/fallback; nothing for this worker" in batch_log and "exiting" in batch_log

    # Every record stored exactly once, by one of the two transports.
    r = conn.execute("SELECT count(*) AS n, count(DISTINCT record_id) AS d, "
                     "count(*) FILTER (WHERE transport = 'batch') AS b, "
                     "count(*) FILTER (WHERE transport = 'fallback') AS f "
                     "FROM bi.results WHERE job_version = %s", (job,)).fetchone()
    c = job_counts(conn, job)
    assert r["n"] == r["d"] == 16 and c["stored"] == 16 and c["dead_letters"] == 0 and c["outstanding"] == 0
    assert r["b"] > 0 and r["f"] > 0 and (r["b"], r["f"]) == (c["stored_batch"], c["stored_fallback"])
    assert pool["stored"] == r["f"]
    assert c["shards"] == {"pending": 0, "leased": 0, "done": 4}

    # Progress samples for the burn-down chart, one per poll, outstanding falling.
    prog = conn.execute("SELECT outstanding FROM bi.progress WHERE job_version = %s ORDER BY at", (job,)).fetchall()
    assert len(prog) >= 2 and prog[0]["outstanding"] >= prog[-1]["outstanding"] > 0

    # The measured run, for the next night's cutoff.
    fr = conn.execute("SELECT * FROM bi.fallback_runs WHERE job_version = %s", (job,)).fetchall()
    assert len(fr) == 1 and fr[0]["records"] == pool["records"]

    # The cost report splits the night by transport.
    assert main(["--db", db_url, "cost", job, "--json"]) == 0
    cost = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    so_far = cost["so_far"]
    assert (so_far["batch_rows"], so_far["fallback_rows"]) == (r["b"], r["f"])
    assert so_far["total"] == pytest.approx(round(r["b"] * 0.003625 + r["f"] * 0.00725, 2), abs=0.011)
    assert cost["if_fallback_now"]["total"] == so_far["total"]        # nothing left to re-drive

    print(f"\ne2e (llama.cpp): dag.test {t2 - t1:.1f} s; batch {r['b']} rows, "
          f"fallback {r['f']} rows at {pool['rate']:.2f} rows/s (busy {pool['busy_s']:.1f} s), "
          f"cutoff to done {pool['wall_s']:.1f} s, overhead {pool['overhead_s']:.1f} s; "
          f"cost ${so_far['total']:.4f} (ceiling ${so_far['all_synchronous_ceiling']:.4f})")


# -- the CLI: fire now, or wait (relabel mode) then re-drive ---------------------------


def test_cli_relabel_mode_waits_for_the_fixed_time_then_redrives(conn, db_url, endpoint, capsys):
    from datetime import datetime, timedelta, timezone

    from batch_inference.cli import main

    make_source(conn, tickets(12))
    job = submit(conn, make_spec(shard_size=5)).job_version
    now = datetime.now(timezone.utc)
    relabel = now + timedelta(seconds=1.5)
    t0 = time.monotonic()
    rc = main(["--db", db_url, "fallback", job, "--base-url", endpoint.base_url, "--rate", "50",
               "--deadline", (now + timedelta(hours=2)).isoformat(), "--relabel-at", relabel.isoformat(),
               "--poll-interval", "30", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["watch"]["status"] == "cutoff" and "relabel mode" in out["watch"]["reason"]
    assert endpoint.hits and min(endpoint.times) - t0 >= 1.0          # nothing sent before the fixed time
    assert (out["records"], out["outstanding"], out["entered_fallback"]) == (12, 0, True)
    # A second run the same night finds nothing to do.
    assert main(["--db", db_url, "fallback", job, "--base-url", endpoint.base_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == "nothing outstanding"


def test_cli_watch_ends_complete_when_the_batch_finishes(conn, db_url, endpoint, capsys):
    from gpu_runner.worker import WorkerConfig, run_worker

    from batch_inference.cli import main

    make_source(conn, tickets(6))
    job = submit(conn, make_spec()).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    assert main(["--db", db_url, "fallback", job, "--base-url", endpoint.base_url, "--deadline", "23:59"]) == 0
    assert "complete before the cutoff" in capsys.readouterr().out
    assert endpoint.hits == []


def test_cli_sigterm_stops_the_pool_and_releases_its_leases(conn, db_url, endpoint):
    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600)).job_version
    endpoint.delay = 0.2
    proc = subprocess.Popen([sys.executable, "-m", "batch_inference.cli", "--db", db_url, "fallback", job,
                             "--base-url", endpoint.base_url, "--concurrency", "2", "--parallel-shards", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job_counts(conn, job)["stored_fallback"] < 3:
        time.sleep(0.1)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert "stopping the fallback pool" in out and "leases released" in out
    c = job_counts(conn, job)
    # Nothing is left leased for ten minutes: the next run claims at once.
    assert c["shards"]["leased"] == 0 and 0 < c["outstanding"] < 40, c


def test_the_operator_killed_from_outside_releases_its_shards_and_fails_the_try(conn, db_url, endpoint, monkeypatch):
    """Airflow's SIGTERM handler calls on_kill() and returns into execute(): the try must fail."""
    from airflow.sdk.exceptions import AirflowException

    from batch_inference.operators.fallback import FallbackPoolOperator

    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600)).job_version
    endpoint.delay = 0.2
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    op = FallbackPoolOperator(task_id="fallback", job_version=job, base_url=endpoint.base_url, rate=50,
                              concurrency=2, parallel_shards=2)
    runner, outcome = execute_in_thread(op)
    end = time.monotonic() + 60
    while job_counts(conn, job)["stored_fallback"] < 3:
        assert time.monotonic() < end, "the pool stored nothing"
        time.sleep(0.1)
    op.on_kill()
    runner.join(timeout=60)
    assert "result" not in outcome and isinstance(outcome.get("error"), AirflowException), outcome
    assert "stopped from outside" in str(outcome["error"])
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 0 and 0 < c["outstanding"] < 40, c


def test_with_a_deadline_the_operator_pages_when_it_is_lost_and_redrives_once_the_endpoint_is_back(
        conn, db_url, endpoint, monkeypatch, tmp_path):
    """The Airflow fallback pages early: with the endpoint down, the try does not fail for a retry that
    comes after the deadline; it pages on-call the moment the rows left at the pool's limit plus the
    publish's reserve no longer fit before the deadline (the nights' one message), and re-drives once the
    endpoint answers again, here after the deadline."""
    from datetime import datetime, timedelta, timezone

    from batch_inference.operators import fallback as op_module
    from batch_inference.operators.fallback import FallbackPoolOperator

    make_source(conn, tickets(30))
    # overhead 30 s: the page's reserve is a third of it, 10 s
    job = submit(conn, make_spec(shard_size=10, fallback={"overhead_s": 30})).job_version
    endpoint.status, endpoint.error = 503, {"error": {"message": "down for the night"}}
    pages = tmp_path / "oncall.jsonl"
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", db.airflow_connection_json(db_url))
    monkeypatch.setenv("BATCH_INFERENCE_ONCALL_FILE", str(pages))
    monkeypatch.setattr(op_module, "PAGE_CHECK_S", 0.5)
    t0 = datetime.now(timezone.utc)
    deadline = t0 + timedelta(seconds=12)
    lost_at = deadline - timedelta(seconds=30 / 50 + 10)          # 30 rows at the pool's 50/s, then 10 s to publish
    op = FallbackPoolOperator(task_id="fallback", job_version=job, base_url=endpoint.base_url, rate=50,
                              engine_options=QUICK, deadline=deadline.isoformat(), retry_wait_s=2, step_s=1)
    runner, outcome = execute_in_thread(op)
    end = time.monotonic() + 60
    while not pages.exists():
        assert time.monotonic() < end and runner.is_alive(), outcome
        time.sleep(0.1)
    paged_at = datetime.now(timezone.utc)
    (msg,) = [json.loads(line) for line in pages.read_text().splitlines()]
    assert msg["kind"] == "deadline will be missed" and msg["job_version"] == job, msg
    assert msg["error"].startswith(f"deadline {deadline:%H:%M:%S} will be missed: 30 rows outstanding need 0.6s "
                                   "at 50/s + 10s to publish"), msg["error"]
    assert "; the fallback endpoint is failing: fallback endpoint " in msg["error"], msg["error"]
    assert lost_at.replace(microsecond=0) <= paged_at < deadline, (lost_at, paged_at, deadline)
    assert "tonight's data will be late" in msg["text"]
    assert_untouched(conn, job, 30, pool_running=True)
    assert runner.is_alive()                                   # still re-driving, not failed for a retry
    # Down for the tail: it answers again only after the deadline.
    while datetime.now(timezone.utc) < deadline + timedelta(seconds=1):
        time.sleep(0.1)
    endpoint.status = 200
    runner.join(timeout=60)
    assert "error" not in outcome, outcome
    assert outcome["result"]["stored"] == 30 and job_counts(conn, job)["outstanding"] == 0
    assert len(pages.read_text().splitlines()) == 1            # one page, not one per failed re-drive
