"""The model ladder end to end: worker processes killed mid-run (0 duplicates, each record's final
answer written once and resumed at its rung), and SmolLM2-135M on llama.cpp as both rungs (different
params): calibrate, submit, worker, validate, publish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from batch_inference.ladder.calibrate import calibrate
from batch_inference.ladder.report import report
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from batch_inference.validate import validate
from benchmarks.ladder import known_ladder, smollm2_rungs, ticket_rows
from benchmarks.ladder import ticket_tables as tables
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import spec_dict
from tests.integration.test_ladder import check_one_final_each

ENGINES = "tests,benchmarks.ladder"


def start_worker(db_url: str, job: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url,
           "BATCH_INFERENCE_ENGINE_MODULES": ENGINES}
    return subprocess.Popen([sys.executable, "-m", "gpu_runner", job, "--flush-every", "10", "--flush-seconds", "0.5",
                             "--poll-seconds", "0.5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_killed_ladder_workers_leave_one_final_answer_per_record(conn, db_url, monkeypatch):
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", ENGINES)
    rows = ticket_rows(160, hard_share=0.4)
    tables(conn, rows, [])
    spec = parse_spec(known_ladder("public.tickets", None, thresholds=(0.5,), delay_s=0.02, shard_size=40,
                                   lease_seconds=3, renew_seconds=1))
    job = submit(conn, spec).job_version
    answered = "SELECT count(*) AS n FROM bi.ladder_answers WHERE job_version = %s"
    kills = 0
    for _ in range(2):                           # kill a worker twice, each time once it has answered some
        w = start_worker(db_url, job)
        start = conn.execute(answered, (job,)).fetchone()["n"]
        deadline = time.monotonic() + 60
        while conn.execute(answered, (job,)).fetchone()["n"] < start + 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        w.send_signal(signal.SIGKILL)
        w.communicate(timeout=30)
        kills += 1
    assert job_counts(conn, job)["outstanding"] > 0
    finishers = [start_worker(db_url, job) for _ in range(2)]
    for w in finishers:
        out, _ = w.communicate(timeout=240)
        assert w.returncode == 0, out[-3000:]
    assert job_counts(conn, job)["outstanding"] == 0
    finals = check_one_final_each(conn, job, len(rows))       # 0 duplicates; results == the final answers
    hard = {r for r, t, _ in rows if "[hard]" in t}
    assert {r for r, rung in finals.items() if rung == 2} == hard
    truth = {r: label for r, _, label in rows}
    got = {r["record_id"]: r["output"]["category"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    assert got == truth and kills == 2
    # Records a killed worker had taken partway up the ladder were finished by another from what it stored.
    resumed = conn.execute("""SELECT count(DISTINCT r.record_id) AS n FROM bi.results r
                                JOIN bi.ladder_answers a ON a.job_version = r.job_version AND a.record_id = r.record_id
                               WHERE r.job_version = %s AND a.worker_id <> r.worker_id""", (job,)).fetchone()["n"]
    assert resumed > 0
    # Nothing written from a stale epoch reached the ledger, and every lease was fenced.
    assert conn.execute("SELECT count(*) AS n FROM bi.shards WHERE job_version = %s AND state <> 'done'",
                        (job,)).fetchone()["n"] == 0


SCHEMA = {"type": "object",
          "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]}},
          "required": ["category"], "additionalProperties": False}
REAL_ROWS = [
    ("r1", "I was charged twice for my subscription this month.", "billing"),
    ("r2", "The export button crashes the app when I click it.", "bug"),
    ("r3", "Please change the email address on my account.", "account"),
    ("r4", "Do you have a office in Lisbon?", "other"),
]


@pytest.mark.slow
def test_smollm2_as_both_rungs_calibrates_runs_validates_and_publishes(conn, db_url):
    tables(conn, REAL_ROWS, REAL_ROWS)
    d = spec_dict(source={"table": "public.tickets", "id_column": "id", "text_column": "body", "acl_column": None},
                  output_schema=SCHEMA, shard_size=2, dataset="ladder_real",
                  prompt={"system": "Classify the support ticket into billing, bug, account or other."},
                  evaluation={"golden": {"table": "public.golden", "id_column": "id", "text_column": "body"}},
                  ladder={"target": 0.5})
    for k in ("model", "engine", "params"):
        del d[k]
    d["models"] = smollm2_rungs(n_ctx=(512, 1024))
    for rung in d["models"]:      # one llama.cpp thread: on shared cores two spin (docs/engines.md); not pinned
        rung["engine"]["options"]["n_threads"] = 1
    spec = parse_spec(d)
    cal = calibrate(conn, spec)
    r = cal.report
    print(f"\nSmolLM2 ladder, golden: rung 1 alone {r['rungs'][0]['accuracy']:.0%}, top alone "
          f"{r['top_alone']['accuracy']:.0%}; picked threshold {cal.thresholds[0]:.4f}: {r['picked']['accuracy']:.0%} "
          f"at {r['picked']['bill_share_of_top']:.0%} of the top rung's bill")
    assert r["picked"]["accuracy"] >= 0.5 * r["top_alone"]["accuracy"]
    assert cal.spec.models[0].threshold == cal.thresholds[0] is not None

    job = submit(conn, cal.spec).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    c = job_counts(conn, job)
    assert c["outstanding"] == 0
    finals = check_one_final_each(conn, job, c["stored"])
    assert set(finals.values()) <= {1, 2} and c["stored"] >= 3
    rep = report(conn, job)
    assert rep["rungs"][0]["answered"] == len(REAL_ROWS) - c["dead_letters"] or rep["rungs"][0]["answered"] >= 3
    v = validate(conn, job)
    assert v["evaluation"]["golden"]["mode"] == "join"       # the gate graded the cascade's own final answers
    assert v.passed, v["failures"]
    publish(conn, job)
    assert conn.execute("SELECT count(*) AS n FROM published.ladder_real").fetchone()["n"] == c["stored"]
