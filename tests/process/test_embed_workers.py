"""Embedding jobs with worker processes (``python -m gpu_runner``, as a pod runs it): on vLLM's CPU build
(its pooling runner, one load), end to end to a <=> search of the view and a DuckDB read of the Iceberg
table; and on llama.cpp, a worker killed with SIGKILL mid-shard while another runs, with every record
stored exactly once with its vector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from batch_inference.validate import validate
from tests.conftest import make_source
from tests.fixtures.vllm import CPU_OPTIONS, MODEL_NAME, RESULT_OPTIONS
from tests.integration.test_embed import DIMS, ICEBERG, embed_spec, iceberg_vectors, nearest, records
from tests.integration.test_ledger import expire


def start_worker(db_url: str, job: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.Popen([sys.executable, "-m", "gpu_runner", job, *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def stored(conn, job: str) -> list[dict]:
    return conn.execute("SELECT record_id, embedding, engine FROM bi.results WHERE job_version = %s", (job,)
                        ).fetchall()


def test_vllm_embedding_job_end_to_end(conn, db_url, vllm_model, tmp_path):
    path, digest = vllm_model
    make_source(conn, records(24))
    spec_data = embed_spec(model={"name": MODEL_NAME, "digest": digest, "path": str(path)},
                           engine={"name": "vllm", "options": {**CPU_OPTIONS, **RESULT_OPTIONS}},
                           shard_size=8, publish={"destinations": [
                               {"identifier": ICEBERG, "warehouse": str(tmp_path / "warehouse"),
                                "cleared_record_classes": ["internal"]}]})
    job = submit(conn, parse_spec(spec_data)).job_version
    w = start_worker(db_url, job, "--no-wait")
    out = finish(w)
    assert w.returncode == 0, out[-4000:]
    rows = stored(conn, job)
    assert len(rows) == 24 and {r["engine"] for r in rows} == {"vllm"}
    for r in rows:
        v = np.frombuffer(r["embedding"], dtype="<f4")
        assert v.shape == (DIMS,) and abs(float(np.linalg.norm(v)) - 1) < 1e-3
    report = validate(conn, job)
    assert report.passed, report.failures
    publish(conn, job)
    first = nearest(conn, "t003")
    assert first[0] == "t003" and int(first[1][1:]) % 5 == 3     # the same ticket text, another number
    lake = iceberg_vectors(conn, spec_data)
    assert len(lake) == 24 and {j for j, _ in lake.values()} == {job}


def test_a_killed_embedding_worker_loses_nothing_and_stores_nothing_twice(conn, db_url):
    n = 40
    make_source(conn, records(n))
    job = submit(conn, parse_spec(embed_spec(shard_size=5, lease_seconds=30, renew_seconds=1))).job_version
    doomed, other = start_worker(db_url, job), start_worker(db_url, job)
    try:
        deadline = time.monotonic() + 240
        while job_counts(conn, job)["stored"] < 10:      # both are embedding, shards are under way
            assert time.monotonic() < deadline and doomed.poll() is None, "no progress"
            time.sleep(0.2)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
        # Its leases run out (as the clock would make them): the other worker and a new one take them over.
        for r in conn.execute("SELECT shard_no FROM bi.shards WHERE job_version = %s AND state = 'leased' "
                              "AND lease_owner LIKE 'worker%%'", (job,)).fetchall():
            expire(conn, job, r["shard_no"])
        late = start_worker(db_url, job, "--no-wait")
        out = finish(other, 400)
        assert other.returncode == 0, out[-3000:]
        finish(late, 400)
    finally:
        for p in (doomed, other):
            if p.poll() is None:
                p.kill()
    rows = stored(conn, job)
    ids = [r["record_id"] for r in rows]
    assert len(ids) == n and len(set(ids)) == n            # every record once: 0 duplicates, none lost
    assert all(r["embedding"] is not None and len(r["embedding"]) == 4 * DIMS for r in rows)
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (n, 0, 0)
    assert validate(conn, job).passed
