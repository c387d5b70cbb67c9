"""The example DAGs on a live Airflow deployment, driven as users drive it.

``live_airflow`` (tests/fixtures/live_airflow.py) starts the four Airflow
processes with LocalExecutor on the embedded PostgreSQL, the repository's
``dags/`` and the ledger connection as docs/airflow.md configures it. Every
step here goes through the REST API; the ledger is read over SQL, as a
warehouse user reads it. Each test has its own source table and spec (its own
dataset), so each has its own job version.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference import db, evaluation
from batch_inference.commands.demo import load_tickets
from batch_inference.data import DEMO_SPEC
from batch_inference.status import job_counts
from tests.conftest import NOOP_DIGEST
from tests.fixtures.chat_server import completion
from tests.fixtures.hosted_openai import OpenAIBatchEmulator
from tests.fixtures.live_airflow import LIVE_API_KEY_ENV
from tests.integration.test_dashboard_api import reader_role

pytestmark = pytest.mark.live

BACKFILL = "batch_inference_backfill"
NIGHTLY = "batch_inference_nightly"
# The noop engine runs only under a spec that names it (a worker refuses it over a real model).
NOOP_MODEL = {"name": "noop", "digest": NOOP_DIGEST}


def make_table(ledger_url: str, name: str, n: int) -> str:
    """``public.<name>``: the first ``n`` sample tickets."""
    with db.connect(ledger_url) as conn:
        if conn.execute("SELECT to_regclass('public.support_tickets') AS t").fetchone()["t"] is None:
            load_tickets(conn, 320)
        conn.execute(f"DROP TABLE IF EXISTS public.{name}")
        conn.execute(f"CREATE TABLE public.{name} AS SELECT * FROM public.support_tickets ORDER BY id LIMIT {n}")
    return f"public.{name}"


def make_spec(dep: Any, dataset: str, **over: Any) -> str:
    """The demo spec with another dataset (and ``over`` merged in), written beside the deployment."""
    spec = yaml.safe_load(Path(DEMO_SPEC).read_text())
    spec["dataset"] = dataset
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    path = Path(dep.home) / f"{dataset}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def counts(dep: Any, job: str) -> dict[str, Any]:
    with db.connect(dep.ledger_url) as conn:
        return job_counts(conn, job)


def published_rows(dep: Any, dataset: str) -> int:
    with db.connect(dep.ledger_url) as conn:
        return conn.execute(f"SELECT count(*) AS n FROM published.{dataset}").fetchone()["n"]


def asset_events(dep: Any, dataset: str) -> list[dict[str, Any]]:
    events = dep.api("GET", "/api/v2/assets/events", params={"limit": 100, "order_by": "-timestamp"})["asset_events"]
    return [e for e in events if (e.get("extra") or {}).get("dataset") == dataset]


def test_backfill_with_params_publishes_and_emits_its_asset_event(live_airflow):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_backfill", 30)
    dep.unpause(BACKFILL)
    t0 = time.monotonic()
    spec = make_spec(dep, "ticket_triage", engine={"name": "noop"}, model=NOOP_MODEL)
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 10, "workers": 2,
                                    "deadline": "+20h"})
    run = dep.wait_run(BACKFILL, run_id, timeout=400)
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    print(f"backfill run: trigger to success in {time.monotonic() - t0:.1f} s")
    manifest = dep.xcom(BACKFILL, run_id, "submit")
    job = manifest["job_version"]
    c = counts(dep, job)
    assert c["status"] == "published" and c["outstanding"] == 0
    assert published_rows(dep, "ticket_triage") == c["stored"] > 0
    assert dep.xcom(BACKFILL, run_id, "cutoff")["fired"] is False
    events = asset_events(dep, "ticket_triage")
    assert any(e["extra"].get("to_version") == job and e["extra"].get("action") == "publish" for e in events), events

    # A second version of the dataset, published, then rolled back from the dashboard's API: DAGs
    # scheduled on the dataset's Asset hear of the rollback too.
    table = make_table(dep.ledger_url, "live_backfill_2", 20)
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 10, "deadline": "+20h"})
    assert dep.wait_run(BACKFILL, run_id, timeout=400)["state"] == "success", dep.explain(BACKFILL, run_id)
    second = dep.xcom(BACKFILL, run_id, "submit")["job_version"]
    r = dep.http.post("/batch-inference/api/datasets/ticket_triage/rollback",
                      json={"expected_current": second, "reason": "live test"},
                      headers={"Authorization": f"Bearer {dep.token}"})
    assert r.status_code == 200, r.text
    assert r.json()["asset_event"] is not None
    events = asset_events(dep, "ticket_triage")
    assert any(e["id"] == r.json()["asset_event"] and e["extra"]["action"] == "rollback"
               and e["extra"]["from_version"] == second and e["extra"]["to_version"] == job for e in events), events
    assert published_rows(dep, "ticket_triage") == c["stored"]


def test_a_two_column_sqlite_source_runs_through_the_deployment(live_airflow):
    """A source outside the ledger (kind sql, a SQLite file behind an Airflow connection made through the
    REST API) with a two-column template: the backfill DAG submits, works, validates and publishes it."""
    import json
    import sqlite3

    dep = live_airflow
    path = Path(dep.home) / "warehouse.db"
    with sqlite3.connect(path) as w:
        w.execute("DROP TABLE IF EXISTS tickets")
        w.execute("CREATE TABLE tickets (id TEXT, subject TEXT, body TEXT, acl TEXT)")
        w.executemany("INSERT INTO tickets VALUES (?, ?, ?, ?)",
                      [(f"s{i:03d}", f"Subject {i}", f"Body {i}: I was charged twice.", json.dumps([f"team{i % 3}"]))
                       for i in range(25)])
    dep.api("POST", "/api/v2/connections", json={"connection_id": "live_sqlite", "conn_type": "sqlite",
                                                 "host": str(path)})
    spec = make_spec(dep, "ticket_sql", engine={"name": "noop"}, model=NOOP_MODEL, source={
        "kind": "sql", "conn_id": "live_sqlite", "table": "tickets", "id_column": "id",
        "columns": ["subject", "body"], "acl_column": "acl"},
        prompt={"template": "Subject:\n<<<\n{subject}\n>>>\nBody:\n<<<\n{body}\n>>>"})
    dep.unpause(BACKFILL)
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": "", "shard_size": 10, "deadline": "+20h"})
    assert dep.wait_run(BACKFILL, run_id, timeout=400)["state"] == "success", dep.explain(BACKFILL, run_id)
    job = dep.xcom(BACKFILL, run_id, "submit")["job_version"]
    c = counts(dep, job)
    assert c["status"] == "published" and c["records"] == 25 and c["outstanding"] == 0
    assert published_rows(dep, "ticket_sql") == 25
    with db.connect(dep.ledger_url) as conn:
        text = conn.execute("SELECT text FROM bi.snapshot_rows WHERE job_version = %s AND record_id = 's001'",
                            (job,)).fetchone()["text"]
    assert text == '["Subject 1", "Body 1: I was charged twice."]'


def test_cutoff_firing_at_once_is_redriven_by_the_fallback_through_llama_cpp(live_airflow, webhook_sink):
    """The deadline is a minute away, the overhead 30 minutes: the cutoff is already past when the
    sensor starts. The slow batch worker drains; the fallback pool re-drives the rest through the
    real llama.cpp server (the spec's default response format), and the run publishes. By the spec's
    constants (10 minutes to publish, a third of the overhead) the deadline is already lost as the
    cutoff fires, so the sensor pages on-call then; the run still makes it, because this deployment's
    load takes seconds, not the 10 minutes the constants assume."""
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_cutoff", 12)
    spec = make_spec(dep, "live_cutoff", engine={"name": "noop", "options": {"delay_s": 2.0}},
                     renew_seconds=2, fallback={"base_url": dep.llama_url, "rate": 5, "concurrency": 2})
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 3, "workers": 1,
                                    "deadline": "+1m"})
    run = dep.wait_run(BACKFILL, run_id, timeout=500)
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    # The cutoff fired in the sensor's first try: no race with the scheduler (apache/airflow#72716).
    assert tis["cutoff"]["try_number"] == 1
    cutoff = dep.xcom(BACKFILL, run_id, "cutoff")
    assert cutoff["fired"] is True
    assert cutoff["page"].startswith("deadline ") and "at 5/s + 600s to publish" in cutoff["page"], cutoff
    msg = webhook_sink.wait_for(lambda m: m.get("job_version") == cutoff["job_version"]
                                and m.get("task_id") == "cutoff", 30)
    assert msg["kind"] == "deadline will be missed" and msg["error"] == cutoff["page"]
    fallback = dep.xcom(BACKFILL, run_id, "fallback")
    job = fallback["job_version"]
    c = counts(dep, job)
    assert fallback["stored"] > 0, fallback
    assert c["status"] == "published" and c["outstanding"] == 0
    assert c["stored"] + c["dead_letters"] == c["records"]
    with db.connect(dep.ledger_url) as conn:
        by = {r["transport"]: r["n"] for r in conn.execute(
            "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY 1", (job,))}
        dupes = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                             (job,)).fetchone()["d"]
    assert by.get("fallback", 0) == fallback["stored"] and dupes == 0
    print(f"cutoff path: trigger to published in {time.monotonic() - t0:.1f} s; cutoff to nothing outstanding "
          f"{fallback['wall_s']} s; {by}")


def test_a_fallback_endpoint_down_for_the_tail_pages_before_the_deadline_and_the_run_publishes_late(
        live_airflow, webhook_sink):
    """The Airflow fallback pages early: the cutoff fires in time (the deadline not yet lost: no page
    from the sensor), the fallback endpoint answers 503 from then until past the deadline. The fallback
    task pages on-call once the rows left at the pool's limit plus the publish's reserve no longer fit
    before the deadline (the nights' one message), keeps re-driving in the same try, and once the
    endpoint is back the run publishes, late but announced."""
    from datetime import datetime, timezone

    from batch_inference.deadline import parse_iso
    from tests.fixtures.chat_server import ChatServer

    answer = completion('{"category": "billing", "priority": "normal", "summary": "charged twice"}')
    up = {"now": False}
    endpoint = ChatServer(lambda body: (200, {}, answer) if up["now"] else
                          (503, {}, {"error": {"message": "down for the night", "type": "server_error"}}))
    try:
        dep = live_airflow
        table = make_table(dep.ledger_url, "live_down", 12)
        # 2 rows/s, 105 s overhead: the cutoff fires at once (the deadline is 2 minutes out), and the
        # page's reserve is a third of the overhead (35 s), so the deadline is not lost when it fires
        # (it would be only past 79 s).
        spec = make_spec(dep, "live_down", engine={"name": "noop", "options": {"delay_s": 5.0}}, renew_seconds=2,
                         fallback={"base_url": endpoint.base_url, "rate": 2, "overhead_s": 105, "concurrency": 2})
        run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 3, "workers": 1,
                                        "deadline": "+2m"})
        dep.wait_task(BACKFILL, run_id, "cutoff", ("success",), timeout=300)
        cutoff = dep.xcom(BACKFILL, run_id, "cutoff")
        assert cutoff["fired"] is True and cutoff["page"] is None, cutoff
        deadline = parse_iso(cutoff["deadline"])
        job = cutoff["job_version"]
        left = (deadline - datetime.now(timezone.utc)).total_seconds()
        msg = webhook_sink.wait_for(lambda m: m.get("job_version") == job and m.get("kind") ==
                                    "deadline will be missed", max(1.0, left))
        assert msg["task_id"] == "fallback" and parse_iso(msg["at"]) < deadline, msg
        assert msg["error"].startswith(f"deadline {deadline:%H:%M:%S} will be missed: "), msg["error"]
        assert "at 2/s + 35s to publish" in msg["error"] and "the fallback endpoint is failing" in msg["error"]
        assert counts(dep, job)["outstanding"] > 0
        while datetime.now(timezone.utc) < deadline:
            time.sleep(0.5)
        up["now"] = True                                      # back only after the deadline
        run = dep.wait_run(BACKFILL, run_id, timeout=300)
        tis = dep.task_instances(BACKFILL, run_id)
        assert run["state"] == "success", dep.explain(BACKFILL, run_id)
        assert tis["fallback"]["try_number"] == 1              # re-driven in the same try, no retry needed
        c = counts(dep, job)
        assert c["status"] == "published" and c["outstanding"] == 0 and c["dead_letters"] == 0
        assert c["stored_fallback"] > 0 and published_rows(dep, "live_down") == 12
        assert parse_iso(tis["publish"]["end_date"]) > deadline          # late, and paged before it
        pages = [m for m in webhook_sink.received if m.get("job_version") == job]
        assert [m["task_id"] for m in pages] == ["fallback"], pages      # one page, no task failed
        print(f"endpoint down for the tail: paged {(deadline - parse_iso(msg['at'])).total_seconds():.0f} s "
              f"before the deadline; published {(parse_iso(tis['publish']['end_date']) - deadline).total_seconds():.0f}"
              " s after it")
    finally:
        endpoint.close()


def test_the_autopilot_adds_a_local_worker_when_the_batch_is_behind(live_airflow):
    """The autopilot in the deployment: the cutoff's trigger decides the fleet's size at every poll
    (``LIVE_CUTOFF_POLL_S``, the deployment's cutoff_poll_interval) and the workers task reconciles its
    processes to it. One worker at
    2 s a record would finish 60 records (120 s) just inside the cutoff's last moment of a 3-minute
    deadline, not a margin before it: the autopilot, its throughput measured once its polls span half
    of a 40 s window, adds a worker, the cutoff never fires, and the run publishes."""
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_autopilot", 60)
    spec = make_spec(dep, "live_autopilot", model=NOOP_MODEL, engine={"name": "noop", "options": {"delay_s": 2.0}},
                     renew_seconds=2, fallback={"overhead_s": 30, "rate": 50},
                     cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 4},
                     autopilot={"enabled": True, "margin_s": 60, "start_s": 10, "cooldown_s": 600, "window_s": 40})
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 5, "workers": 1,
                                    "deadline": "+3m"})
    run = dep.wait_run(BACKFILL, run_id, timeout=600)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    assert dep.xcom(BACKFILL, run_id, "cutoff")["fired"] is False
    job = dep.xcom(BACKFILL, run_id, "workers")["job_version"]
    with db.connect(dep.ledger_url) as conn:
        decisions = conn.execute(db.q("fleet_decisions"), {"job": job}).fetchall()
        observed = conn.execute("SELECT launcher, running FROM bi.fleet_observed WHERE job_version = %s ORDER BY id",
                                (job,)).fetchall()
        dupes = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                             (job,)).fetchone()["d"]
    adds = [d for d in decisions if d["action"] == "add"]
    assert adds, [(d["action"], d["reason"]) for d in decisions]
    assert {o["launcher"] for o in observed} == {"local:workers"}
    assert max(o["running"] for o in observed) >= 2 and observed[-1]["running"] == 0
    assert dupes == 0 and counts(dep, job)["status"] == "published"
    print(f"autopilot: trigger to published in {time.monotonic() - t0:.1f} s; {len(decisions)} decisions, first add "
          f"{adds[0]['current']} -> {adds[0]['desired']}: {adds[0]['reason']}")


def test_a_job_on_a_hosted_batch_api_runs_through_the_deployment(live_airflow):
    """The spec's engine is openai-batch against a loopback Batch API emulator (the one boundary
    that cannot run here): the deployment's workers submit each shard as one provider batch with
    the key from their environment, the cutoff watch counts hosted work, and the run publishes."""
    dep = live_airflow
    emulator = OpenAIBatchEmulator(respond=lambda body: (200, completion(
        '{"category": "billing", "priority": "normal", "summary": "charged twice"}')))
    try:
        table = make_table(dep.ledger_url, "live_hosted", 24)
        spec = make_spec(dep, "live_hosted", cleared_for_hosted=True, engine={"name": "openai-batch", "options": {
            "base_url": emulator.base_url, "api_key_env": LIVE_API_KEY_ENV, "poll_seconds": 0.2}})
        run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 12, "workers": 2,
                                        "deadline": "+20h"})
        run = dep.wait_run(BACKFILL, run_id, timeout=300)
        assert run["state"] == "success", dep.explain(BACKFILL, run_id)
        job = dep.xcom(BACKFILL, run_id, "submit")["job_version"]
        c = counts(dep, job)
        assert c["status"] == "published" and (c["stored"], c["outstanding"]) == (24, 0)
        with db.connect(dep.ledger_url) as conn:
            by = {r["transport"]: r["n"] for r in conn.execute(
                "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY 1", (job,))}
            states = {r["state"] for r in conn.execute(db.q("hosted_batches"), {"job": job})}
        assert by == {"hosted_batch": 24} and states == {"reconciled"}
        assert published_rows(dep, "live_hosted") == 24
        # two shards, two provider batches, each request billed once, with the key the workers were given
        assert emulator.created == 2 and sorted(emulator.billed.values()) == [1] * 24
        assert emulator.auth == {f"Bearer {dep.env[LIVE_API_KEY_ENV]}"} and emulator.files == {}
    finally:
        emulator.close()

def test_wrong_digest_fails_the_run_within_minutes_and_pages_on_call(live_airflow, webhook_sink):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_digest", 8)
    spec = make_spec(dep, "live_digest", model={"digest": "f" * 64})
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "engine": "llama-cpp",
                                    "deadline": "+20h"})
    run = dep.wait_run(BACKFILL, run_id, timeout=300)
    took = time.monotonic() - t0
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "failed", dep.explain(BACKFILL, run_id)
    assert tis["workers"]["state"] == "failed" and tis["workers"]["try_number"] == 1
    assert tis["cutoff"]["state"] == "failed", dep.explain(BACKFILL, run_id)
    job = dep.xcom(BACKFILL, run_id, "submit")["job_version"]
    msg = webhook_sink.wait_for(lambda m: m.get("job_version") == job and m.get("task_id") == "workers", 60)
    assert msg["counts"]["records"] == 8 and "digest" in msg["text"], msg
    print(f"wrong digest: trigger to failed run in {took:.1f} s")


def test_workers_marked_failed_stop_and_a_clear_finishes_the_job(live_airflow):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_markfail", 40)      # about 30 s of work for two workers
    spec = make_spec(dep, "live_markfail", engine={"name": "noop", "options": {"delay_s": 1.5}}, renew_seconds=2)
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 3, "workers": 2,
                                    "deadline": "+20h"})
    dep.wait_task(BACKFILL, run_id, "workers", ("running",), timeout=180)
    job = dep.xcom(BACKFILL, run_id, "submit")["job_version"]
    end = time.monotonic() + 120
    while (c := counts(dep, job))["shards"]["leased"] == 0:
        assert c["outstanding"] > 0, "the workers finished before the test could mark them failed"
        assert time.monotonic() < end, "no worker leased a shard"
        time.sleep(0.2)
    dep.api("PATCH", f"/api/v2/dags/{BACKFILL}/dagRuns/{run_id}/taskInstances/workers", json={"new_state": "failed"})
    # The worker processes release their leases at once and exit; the task ends failed.
    end = time.monotonic() + 90
    while counts(dep, job)["shards"]["leased"] or worker_pids(job):
        assert time.monotonic() < end, f"leases {counts(dep, job)['shards']}, processes {worker_pids(job)}"
        time.sleep(0.5)
    ti = dep.wait_task(BACKFILL, run_id, "workers", ("failed",), timeout=60)
    c = counts(dep, job)
    assert c["outstanding"] > 0 and c["shards"]["leased"] == 0
    time.sleep(3)  # the task process had its chance to report success over the failed state
    assert dep.task_instances(BACKFILL, run_id)["workers"]["state"] == "failed"
    # Clearing it (the on-call advice) re-runs it; the run finishes and publishes.
    dep.api("POST", f"/api/v2/dags/{BACKFILL}/clearTaskInstances",
            json={"dry_run": False, "dag_run_id": run_id, "task_ids": ["workers"], "include_downstream": True,
                  "only_failed": False, "reset_dag_runs": True})
    run = dep.wait_run(BACKFILL, run_id, timeout=400)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    c = counts(dep, job)
    assert c["status"] == "published" and c["outstanding"] == 0 and ti["try_number"] >= 1


def worker_pids(job: str) -> list[int]:
    """Worker processes of the job still alive on this machine (``python -m gpu_runner JOB``)."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"gpu_runner" in cmd and job.encode() in cmd:
                pids.append(int(entry))
    return pids


def test_backfill_of_the_nightly_over_two_dates_never_overlaps(live_airflow):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_nightly", 10)
    spec = make_spec(dep, "live_nightly", engine={"name": "noop", "options": {"delay_s": 0.2}})
    dep.api("POST", "/api/v2/backfills", json={
        "dag_id": NIGHTLY, "from_date": "2026-11-01T00:00:00Z", "to_date": "2026-11-02T23:00:00Z",
        "dag_run_conf": {"spec_path": spec, "source_table": table, "engine": ""}, "max_active_runs": 2})
    # Unpausing also creates the latest scheduled run (the demo's default spec and table): it may
    # run beside the backfill, being another job version.
    dep.unpause(NIGHTLY)
    end = time.monotonic() + 600
    while True:
        runs = [r for r in dep.api("GET", f"/api/v2/dags/{NIGHTLY}/dagRuns", params={"limit": 50})["dag_runs"]
                if r["run_type"] == "backfill"]
        if len(runs) >= 2 and all(r["state"] in ("success", "failed") for r in runs):
            break
        assert time.monotonic() < end, [(r["dag_run_id"], r["state"]) for r in runs]
        time.sleep(2)
    dep.api("PATCH", f"/api/v2/dags/{NIGHTLY}", json={"is_paused": True})
    assert all(r["state"] == "success" for r in runs), "\n".join(dep.explain(NIGHTLY, r["dag_run_id"]) for r in runs)
    # Same spec, same rows: one job version, and its runs one after the other.
    jobs = {dep.xcom(NIGHTLY, r["dag_run_id"], "submit")["job_version"] for r in runs}
    assert len(jobs) == 1
    # Whichever submitted second waited for the other run to end before its workers started.
    a, b = runs
    wa, wb = (dep.task_instances(NIGHTLY, r["dag_run_id"])["workers"] for r in (a, b))
    assert wb["start_date"] >= a["end_date"] or wa["start_date"] >= b["end_date"], \
        "\n".join(dep.task_log(NIGHTLY, r["dag_run_id"], "submit") for r in runs)
    # Each run's deadline counted from when it ran, not from its logical date weeks ago.
    assert not any(dep.xcom(NIGHTLY, r["dag_run_id"], "cutoff")["fired"] for r in runs)



# -- the review step: a Required Action until the human review gate is met -------

REVIEW_GATE = {"min_reviewed": 2, "min_right": 1.0}
TEAMS = ("team:billing", "team:security", "team:support", "team:engineering", "team:product", "team:finance")


def review_run(dep: Any, name: str) -> tuple[str, str]:
    """A noop run of a spec with a human review gate, waiting at its review step: (run id, job version)."""
    table = make_table(dep.ledger_url, name, 12)
    spec = make_spec(dep, name, engine={"name": "noop"}, model=NOOP_MODEL,
                     evaluation={"review": REVIEW_GATE}, validation={"sample_size": 4})
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 6, "workers": 1,
                                    "deadline": "+20h", "review_timeout": "+30m"})
    dep.wait_task(BACKFILL, run_id, "review", ("deferred",), timeout=300)
    # As a person would, answer after the triggerer has taken the wait: a response in the second
    # between the deferral and that races the triggerer (the resumed try is killed; docs/airflow.md).
    end = time.monotonic() + 60
    while not ((dep.task_instances(BACKFILL, run_id)["review"].get("trigger") or {}).get("triggerer_id")):
        assert time.monotonic() < end, "no triggerer took the review task's trigger"
        time.sleep(0.5)
    return run_id, dep.xcom(BACKFILL, run_id, "submit")["job_version"]


def required_action(dep: Any, run_id: str) -> dict[str, Any]:
    """The run's open Required Action, as Airflow's UI lists it (not answered, task waiting)."""
    details = dep.api("GET", f"/api/v2/dags/{BACKFILL}/dagRuns/{run_id}/hitlDetails",
                      params={"response_received": False, "state": ["deferred", "awaiting_input"]})["hitl_details"]
    (action,) = [d for d in details if d["task_instance"]["task_id"] == "review"]
    return action


def test_the_review_step_waits_in_required_actions_until_a_dashboard_review_meets_the_gate(live_airflow):
    dep = live_airflow
    t0 = time.monotonic()
    run_id, job = review_run(dep, "live_review")
    action = required_action(dep, run_id)
    assert action["options"] == ["Reject"] and list(action["params"]) == ["reason"]
    assert f"{dep.base}/batch-inference/jobs/{job}/review" in action["body"], action["body"]
    assert "review: 0 of 2 required sample rows reviewed" in action["body"]
    assert dep.task_instances(BACKFILL, run_id)["publish"]["state"] is None

    # A reviewer on the dashboard's review screen (reading as a role that may read every ticket).
    with db.connect(dep.ledger_url) as conn:
        role = reader_role(conn, "live_reviewers", principals=TEAMS)
        conn.execute("SELECT bi.map_dashboard_reader_v1(%s, %s)", ("Anonymous", role))
    auth = {"Authorization": f"Bearer {dep.token}"}
    page = dep.http.get(f"/batch-inference/api/jobs/{job}/review", headers=auth).json()
    assert page["may_review"] and len(page["rows"]) == 4, page
    for row in page["rows"][:2]:
        r = dep.http.post(f"/batch-inference/api/jobs/{job}/review", headers=auth,
                          json={"record_id": row["record_id"], "verdict": "right", "comment": "live test"})
        assert r.status_code == 200, r.text
    reviewed = time.monotonic()

    run = dep.wait_run(BACKFILL, run_id, timeout=180)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    tis = dep.task_instances(BACKFILL, run_id)
    assert tis["review"]["try_number"] == 1 and tis["publish"]["state"] == "success"
    assert dep.xcom(BACKFILL, run_id, "review")["passed"] is True
    c = counts(dep, job)
    assert c["status"] == "published" and published_rows(dep, "live_review") == c["stored"] > 0
    print(f"review step: trigger to Required Action and reviewed in {reviewed - t0:.1f} s, "
          f"review to published {time.monotonic() - reviewed:.1f} s")


def test_a_reject_in_required_actions_fails_the_run_with_the_reason(live_airflow, webhook_sink):
    dep = live_airflow
    run_id, job = review_run(dep, "live_reject")
    assert required_action(dep, run_id)["options"] == ["Reject"]
    # What the Required Actions page sends when a reviewer picks Reject and gives a reason.
    dep.api("PATCH", f"/api/v2/dags/{BACKFILL}/dagRuns/{run_id}/taskInstances/review/-1/hitlDetails",
            json={"chosen_options": ["Reject"], "params_input": {"reason": "priorities are all urgent"}})
    try:
        run = dep.wait_run(BACKFILL, run_id, timeout=120)
    except TimeoutError:
        # The upstream race of docs/airflow.md: the resumed try was killed before it could act, and its
        # retry opened a new Required Action (Airflow clears the old answer). A person answers it again.
        dep.wait_task(BACKFILL, run_id, "review", ("deferred",), timeout=60)
        dep.api("PATCH", f"/api/v2/dags/{BACKFILL}/dagRuns/{run_id}/taskInstances/review/-1/hitlDetails",
                json={"chosen_options": ["Reject"], "params_input": {"reason": "priorities are all urgent"}})
        run = dep.wait_run(BACKFILL, run_id, timeout=120)
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "failed", dep.explain(BACKFILL, run_id)
    # A loaded scheduler may lose the first try's end (apache/airflow#72716, docs/facts.md) and start a
    # second: that try finds the rejection standing in the ledger and fails at once, naming it.
    assert tis["review"]["state"] == "failed" and tis["review"]["try_number"] in (1, 2, 3)
    assert tis["publish"]["state"] == "upstream_failed"
    msg = webhook_sink.wait_for(lambda m: m.get("job_version") == job and m.get("task_id") == "review", 60)
    err = msg["error"]
    assert err == f"review: Anonymous rejected job version {job}: priorities are all urgent" or (
        err.startswith(f"review: job version {job} was rejected by airflow:Anonymous at ")
        and err.endswith(": priorities are all urgent")), msg
    # The try that failed says why (a try lost to the race may have no log at all).
    assert "priorities are all urgent" in dep.task_log(BACKFILL, run_id, "review", tis["review"]["try_number"])
    assert counts(dep, job)["status"] != "published"
    # The rejection is in the ledger too: publish refuses the version until it is withdrawn.
    with db.connect(dep.ledger_url) as conn:
        assert evaluation.review_state(conn, job)["rejection"].endswith(": priorities are all urgent")


def test_a_night_over_budget_stops_at_the_preview_before_submit_and_pages_once(live_airflow, webhook_sink):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_estimate", 40)
    # 39 records to run at $0.003625 each on batch is $0.14: over a $0.05 budget before anything runs.
    spec = make_spec(dep, "live_estimate", engine={"name": "noop"}, model=NOOP_MODEL, cost={"budget": 0.05})
    dep.unpause(BACKFILL)
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "deadline": "+20h"})
    run = dep.wait_run(BACKFILL, run_id, timeout=300)
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "failed", dep.explain(BACKFILL, run_id)
    assert tis["estimate"]["state"] == "failed" and tis["estimate"]["try_number"] == 1
    assert tis["submit"]["state"] == "upstream_failed", dep.explain(BACKFILL, run_id)
    msg = webhook_sink.wait_for(lambda m: m.get("run_id") == run_id, 60)
    assert msg["task_id"] == "estimate" and msg["job_version"] is None and "over cost.budget" in msg["text"], msg
    with db.connect(dep.ledger_url) as conn:
        assert not conn.execute("SELECT 1 FROM bi.jobs WHERE dataset = 'live_estimate'").fetchall()
        (row,) = conn.execute(db.q("estimate_previews_of_dataset"), {"dataset": "live_estimate", "n": 5}).fetchall()
    assert row["verdict"] == "over_budget" and row["run_id"] == run_id
    assert len([m for m in webhook_sink.received if m.get("run_id") == run_id]) == 1   # one page
