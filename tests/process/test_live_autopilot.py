"""The autopilot on the live Airflow deployment (tests/fixtures/live_airflow.py): the cutoff's trigger sizes
the batch fleet at every poll and the workers task adds a local worker; driven through the REST API, the
ledger read over SQL (the helpers of test_live_airflow.py). A file of its own: its run takes minutes, and the
live files run side by side on the suite's workers."""

from __future__ import annotations

import time

import pytest

from batch_inference import db
from tests.process.test_live_airflow import BACKFILL, NOOP_MODEL, counts, make_spec, make_table

pytestmark = pytest.mark.live


def test_the_autopilot_adds_a_local_worker_when_the_batch_is_behind(live_airflow):
    """The autopilot in the deployment: the cutoff's trigger decides the fleet's size at every poll
    (``LIVE_CUTOFF_POLL_S``, the deployment's cutoff_poll_interval) and the workers task reconciles its
    processes to it. One worker at
    2 s a record would finish 60 records (120 s) inside the cutoff's last moment of a 4-minute deadline
    (about 209 s after the run starts), not a margin (120 s) before it: the autopilot, its throughput
    measured once its polls span half of a 40 s window, adds a worker, the cutoff never fires, and the
    run publishes. The run's first tasks take up to a minute where the suite's workers share the cores,
    so the cutoff's last moment is a minute past where the margin puts the autopilot's target."""
    dep = live_airflow
    table = make_table(dep.ledger_url, "live_autopilot", 60)
    spec = make_spec(dep, "live_autopilot", model=NOOP_MODEL, engine={"name": "noop", "options": {"delay_s": 2.0}},
                     renew_seconds=2, fallback={"overhead_s": 30, "rate": 50},
                     cost={"gpu_hour_spot": 3.5, "min_workers": 1, "max_workers": 4},
                     autopilot={"enabled": True, "margin_s": 120, "start_s": 10, "cooldown_s": 600, "window_s": 40})
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 5, "workers": 1,
                                    "deadline": "+4m"})
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
