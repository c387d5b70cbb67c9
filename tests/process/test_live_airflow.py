"""The example DAGs on a live Airflow deployment, driven as users drive it.

``live_airflow`` (tests/fixtures/live_airflow.py) starts the four Airflow
processes with LocalExecutor on the embedded PostgreSQL, the repository's
``dags/`` and the ledger connection as docs/airflow.md configures it. Every
step here goes through the REST API; the ledger is read over SQL, as a
warehouse user reads it. Each test has its own source table and spec (its own
dataset), so each has its own job version, and the live files run side by side
on one deployment (test_live_deadlines.py, test_live_actions.py and the others
import the helpers below).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference import db
from batch_inference.data import DEMO_SPEC
from batch_inference.status import job_counts
from tests.conftest import NOOP_DIGEST
from tests.fixtures.chat_server import completion
from tests.fixtures.hosted_openai import OpenAIBatchEmulator
from tests.fixtures.live_airflow import LIVE_API_KEY_ENV

pytestmark = pytest.mark.live

BACKFILL = "batch_inference_backfill"
NIGHTLY = "batch_inference_nightly"
# The noop engine runs only under a spec that names it (a worker refuses it over a real model).
NOOP_MODEL = {"name": "noop", "digest": NOOP_DIGEST}


def make_table(ledger_url: str, name: str, n: int) -> str:
    """``public.<name>``: the first ``n`` sample tickets (the deployment's ledger holds them)."""
    with db.connect(ledger_url) as conn:
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


def test_backfill_of_the_nightly_over_two_dates_never_overlaps(live_airflow):
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_nightly", 10)
    spec = make_spec(dep, "live_nightly", engine={"name": "noop", "options": {"delay_s": 0.2}})
    dep.api("POST", "/api/v2/backfills", json={
        "dag_id": NIGHTLY, "from_date": "2026-11-01T00:00:00Z", "to_date": "2026-11-02T23:00:00Z",
        "dag_run_conf": {"spec_path": spec, "source_table": table, "engine": ""}, "max_active_runs": 2})
    # Unpausing also creates the latest scheduled run (the demo's default spec and table): between 22:00
    # and 06:00 UTC its deadline is ahead and it would run the real model beside the suite, so it is
    # marked failed as soon as it shows (a user's Mark as failed, through the REST API).
    dep.unpause(NIGHTLY)
    end = time.monotonic() + 600
    while True:
        every = dep.api("GET", f"/api/v2/dags/{NIGHTLY}/dagRuns", params={"limit": 50})["dag_runs"]
        for r in every:
            if r["run_type"] != "backfill" and r["state"] not in ("success", "failed"):
                dep.api("PATCH", f"/api/v2/dags/{NIGHTLY}/dagRuns/{r['dag_run_id']}", json={"state": "failed"})
        runs = [r for r in every if r["run_type"] == "backfill"]
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
