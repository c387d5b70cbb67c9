"""What people do to a run on the live Airflow deployment (tests/fixtures/live_airflow.py): mark its workers
failed and clear them, meet the review gate from the dashboard while the run waits in Required Actions, or
reject it there; driven through the REST API, the ledger read over SQL (the helpers of
test_live_airflow.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from batch_inference import db, evaluation
from tests.fixtures.live_airflow import poll_s
from tests.integration.test_dashboard_api import reader_role
from tests.process.test_live_airflow import BACKFILL, NOOP_MODEL, counts, make_spec, make_table, published_rows

pytestmark = pytest.mark.live


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
    # The try's processes (the LocalExecutor's worker running it, the task process) ended, so the task
    # process had its chance to report success over the failed state.
    end = time.monotonic() + 60
    while task_pids(ti["id"]):
        assert time.monotonic() < end, f"the try's processes {task_pids(ti['id'])} still run"
        time.sleep(0.2)
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
    return _pids(lambda cmd: b"gpu_runner" in cmd and job.encode() in cmd)


def task_pids(ti_id: str) -> list[int]:
    """Airflow's processes of a task instance's try still alive: the LocalExecutor worker running it and
    the task process, whose titles name the try (``airflow worker -- [LocalExecutor: ]<id>``)."""
    return _pids(lambda cmd: any(part.endswith(ti_id.encode()) for part in cmd))


def _pids(match: Any) -> list[int]:
    """Processes on this machine whose command line (its parts) ``match`` accepts, zombies left out."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if match(cmd) and not stat[stat.rfind(")") + 2:].startswith("Z"):
                pids.append(int(entry))
    return pids


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
    # The deployment reads the gate every 2 s, so the trigger can fire within seconds of the deferral and
    # lose the try to the scheduler (apache/airflow#72716, docs/airflow.md); the second try, 10 s later
    # (DEFERRING_RETRY_DELAY), reads the gate met at once.
    assert tis["review"]["try_number"] in (1, 2) and tis["publish"]["state"] == "success"
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
    answered = {dep.task_instance(BACKFILL, run_id, "review")["try_number"]}
    start = time.monotonic()
    while (run := dep.run(BACKFILL, run_id))["state"] not in ("success", "failed"):
        ti = dep.task_instance(BACKFILL, run_id, "review")
        if ti.get("state") == "deferred" and ti["try_number"] not in answered \
                and (ti.get("trigger") or {}).get("triggerer_id"):
            # The upstream race of docs/airflow.md: the resumed try was killed before it could act, and its
            # retry (10 s later) opened a new Required Action (Airflow clears the old answer). A person
            # answers it again, once the triggerer has taken its wait.
            answered.add(ti["try_number"])
            dep.api("PATCH", f"/api/v2/dags/{BACKFILL}/dagRuns/{run_id}/taskInstances/review/-1/hitlDetails",
                    json={"chosen_options": ["Reject"], "params_input": {"reason": "priorities are all urgent"}})
        assert time.monotonic() < start + 240, f"review still {ti.get('state')} (try {ti.get('try_number')})"
        time.sleep(poll_s(start))
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
