"""A worker whose engine dies by a signal is never silent (issue 45, item 2).

Real ``python -m gpu_runner`` processes under the local launcher (``LocalWorkersOperator`` on
``batch_inference.fleet.Fleet``) and the real ledger; the engine is a stand-in that kills its own
process with SIGSEGV at its first record, as llama.cpp's AMX path does on a CPU whose tiles fault
(no real engine's fault can be ordered on this CPU). Checked: the launcher's log, the shard's
last error and ``batch-inference status`` name the signal, the engine and the step; the shards
are pending again at once (not after their 600 s lease); the launcher stops after the same
death repeats with nothing done between; nothing stored is lost and no attempt is spent; and a
DAG run under ``airflow dags test`` ends non-zero within 30 s of the last death, naming it.
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.fleet import worker_death
from batch_inference.status import job_counts, job_halt
from tests.conftest import make_source, make_spec, tickets

CONN_ID = "bi_test_deaths"
# The dying engine lives in a module that imports no Airflow (this one does): each worker start loads it.
SEGV = "tests.fixtures.segv_engine:SegvEngine"


@pytest.fixture
def ledger(db_url, monkeypatch):
    from batch_inference.hooks.batch_inference import airflow_connection_json

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", airflow_connection_json(db_url))
    return db_url


def test_a_worker_dying_by_sigsegv_is_named_its_shards_come_back_at_once_and_the_launcher_stops(
        ledger, conn, capfd):
    from batch_inference.operators import LocalWorkersOperator

    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(40))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600, renew_seconds=5)).job_version
    # A healthy worker stores one shard first: what is stored stays whatever dies after it.
    assert run_worker(WorkerConfig(job_version=job, db_url=ledger, max_shards=1)) == 0
    assert job_counts(conn, job)["stored"] == 10
    op = LocalWorkersOperator(task_id="workers", job_version=job, workers=2, engine=SEGV,
                              engine_options={"after": 0}, postgres_conn_id=CONN_ID, max_restarts=3,
                              grace_seconds=2)
    t0 = time.monotonic()
    with pytest.raises(AirflowFailException) as info:
        op.execute({})
    took = time.monotonic() - t0
    msg = str(info.value)
    assert f"died by SIGSEGV in engine {SEGV} while:" in msg and "not restarting" in msg, msg
    # Not three blind restarts per slot: each worker's first death, and at most the same death once more.
    assert op.fleet.started < 2 + 2 * 3, op.fleet.started
    assert took < 120

    # The launcher's log names the signal, the engine and what the worker was doing.
    logged = "".join(capfd.readouterr()).splitlines()    # the task log (Airflow's logger writes to stdout)
    deaths = [m for m in logged if "died by SIGSEGV in engine" in m]
    assert len(deaths) >= 2 and all(f"died by SIGSEGV in engine {SEGV} while: shard " in m for m in deaths)
    assert any("pending again at once" in m for m in logged)

    # The shards are pending again now, not after their 600 s lease; nothing stored is lost.
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 0 and c["shards"]["pending"] + c["shards"]["done"] == 4
    assert c["dead_letters"] == 0 and c["stored"] == 10 and c["outstanding"] == 30
    assert conn.execute("SELECT coalesce(sum(attempts), 0) AS n FROM bi.attempts WHERE job_version = %s",
                        (job,)).fetchone()["n"] == 0                       # no attempt spent
    # The shard's last error (the ledger) and the job's halt (the cutoff watch ends the run on it).
    death = worker_death(conn, job)
    assert death is not None and "died by SIGSEGV" in death["last_error"] and SEGV in death["last_error"]
    assert "SIGSEGV" in (job_halt(conn, job)["halt_reason"] or "")

    # batch-inference status says it.
    env = {**os.environ, "BATCH_INFERENCE_DB": ledger}
    out = subprocess.run([str(Path(sys.executable).parent / "batch-inference"), "status", job], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "last worker death at" in out.stdout and "died by SIGSEGV" in out.stdout and SEGV in out.stdout
    assert "HALTED" in out.stdout

    # A healthy engine then finishes the job: every record once, the stored ones kept.
    assert submit(conn, make_spec(shard_size=10, lease_seconds=600, renew_seconds=5)).job_version == job
    assert run_worker(WorkerConfig(job_version=job, db_url=ledger)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 40 and c["dead_letters"] == 0 and c["outstanding"] == 0


DAG = '''
from airflow.sdk import DAG

from batch_inference.operators.pipeline import (batch_inference_pipeline, local_workers, pipeline_dag_args,
                                                 pipeline_params)

with DAG(dag_id="bi_segv", schedule=None, params=pipeline_params(spec_path={spec!r}, shard_size=10),
         **pipeline_dag_args(retries=0)) as dag:
    batch_inference_pipeline(dataset="ticket_triage", estimate=False,
                             workers=local_workers(engine={engine!r}, engine_options={{"after": 0}}))
'''


def test_a_dag_run_whose_workers_all_die_by_a_signal_ends_within_30_s_naming_it(db_url, conn, tmp_path,
                                                                                migrated_airflow_db):
    """``airflow dags test`` of the standard pipeline: the workers die by SIGSEGV at their first
    record, the launcher stops on the repeat and halts the job, and the run ends non-zero at once
    instead of waiting at the cutoff for its 20-hour deadline."""
    from batch_inference.commands.demo import demo_env, load_tickets
    from batch_inference.data import DEMO_SOURCE_TABLE, write_noop_spec

    with db.connect(db_url) as c:
        load_tickets(c, 20)
    home = tmp_path / "home"
    dags = tmp_path / "dags"
    dags.mkdir()
    spec = write_noop_spec(tmp_path)
    (dags / "bi_segv.py").write_text(DAG.format(spec=str(spec), engine=SEGV))
    env = {**os.environ, **demo_env(home, db_url, dags), "PYTHONPATH": str(Path.cwd())}
    shutil.copyfile(migrated_airflow_db, home / "airflow" / "airflow.db")   # `airflow db migrate`, done once a session
    conf = {"source_table": DEMO_SOURCE_TABLE, "workers": 2, "engine": ""}
    p = subprocess.run([sys.executable, "-m", "airflow", "dags", "test", "bi_segv", "-c", json.dumps(conf)],
                       env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    out = p.stdout + p.stderr
    assert "died by SIGSEGV" in out, out[-3000:]
    job = conn.execute(db.q("latest_job_of_dataset"), {"dataset": "ticket_triage"}).fetchone()["job_version"]
    death = worker_death(conn, job)
    assert death is not None and "died by SIGSEGV" in death["last_error"]
    last_death = death["last_error_at"].timestamp()
    print(f"airflow dags test exit {p.returncode}, {ended - last_death:.1f} s after the last worker death")
    assert ended - last_death < 30, (ended - last_death, out[-3000:])
    assert p.returncode != 0
    # The cutoff ended on the halt, naming the cause in one line.
    assert any("cannot work" in ln and "died by SIGSEGV" in ln for ln in out.splitlines()), out[-3000:]
    c = job_counts(conn, job)
    assert c["shards"]["leased"] == 0 and c["stored"] == 0 and c["dead_letters"] == 0


def test_the_cutoff_watch_between_polls_ends_at_once_on_a_halt(db_url, conn):
    """A deployed watch polls every minute or so; a halt (bi.halt_job_v1 notifies bi_halt) ends its wait
    at once, so a run whose workers cannot work fails within seconds, not at the next poll."""
    import asyncio
    from datetime import datetime, timedelta, timezone

    from batch_inference import deadline as watchlib

    make_source(conn, tickets(20))
    job = submit(conn, make_spec(shard_size=10)).job_version
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    cfg = watchlib.WatchConfig(job_version=job, deadline=datetime.now(timezone.utc) + timedelta(hours=20),
                               poll_interval_s=600, since=since)
    halted_at: list[float] = []

    def halt_later() -> None:
        time.sleep(3)
        with db.connect(db_url) as c:
            c.execute(db.q("halt_job"), {"job": job, "reason": "worker w0 died by SIGSEGV in engine x while: y"})
        halted_at.append(time.monotonic())

    t = threading.Thread(target=halt_later)
    t.start()
    event = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), cfg))
    ended = time.monotonic()
    t.join()
    assert event["status"] == "halted" and "died by SIGSEGV" in event["reason"], event
    assert ended - halted_at[0] < 5          # not the 600 s poll interval


def test_the_cutoff_watch_between_polls_ends_at_once_when_the_last_shard_is_done(db_url, conn):
    """The same watch, polling every 600 s, hears the completion that leaves no shard undone
    (bi.complete_shard_v2 notifies bi_done): the run goes on to validate within seconds of its last
    record, not at the next poll."""
    import asyncio
    from datetime import datetime, timedelta, timezone

    from batch_inference import deadline as watchlib
    from gpu_runner.worker import WorkerConfig, run_worker

    make_source(conn, tickets(20))
    job = submit(conn, make_spec(shard_size=10)).job_version
    cfg = watchlib.WatchConfig(job_version=job, deadline=datetime.now(timezone.utc) + timedelta(hours=20),
                               poll_interval_s=600)
    done_at: list[float] = []

    def work_later() -> None:
        time.sleep(3)
        assert run_worker(WorkerConfig(job_version=job, db_url=db_url, max_shards=1)) == 0   # one of two
        time.sleep(2)
        assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
        done_at.append(time.monotonic())

    t = threading.Thread(target=work_later)
    t0 = time.monotonic()
    t.start()
    event = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), cfg))
    ended = time.monotonic()
    t.join()
    assert event["status"] == "complete", event
    assert done_at and ended - t0 > 5, (ended - t0, done_at)   # the first shard done ended nothing
    assert ended - done_at[0] < 5                              # not the 600 s poll interval
