"""Embedding jobs with worker processes (``python -m gpu_runner``, as a pod runs it): on vLLM's CPU build
(its pooling runner, one load), end to end to a <=> search of the view and a DuckDB read of the Iceberg
table; and on llama.cpp, a worker killed with SIGKILL mid-shard while another runs, with every record
stored exactly once with its vector."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from batch_inference.validate import validate
from tests.conftest import make_source
from tests.fixtures.vllm import CPU_OPTIONS, MODEL_NAME, RESULT_OPTIONS
from tests.integration.test_embed import DIMS, ICEBERG, embed_spec, iceberg_vectors, nearest, records
from tests.integration.test_ledger import expire
from tests.process.test_vllm_worker import finish, start_worker
from gpu_runner.worker import WorkerConfig, run_worker


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
    # One llama.cpp thread a worker: three workers share two cores, and waiting threads spin (docs/engines.md).
    job = submit(conn, parse_spec(embed_spec(shard_size=5, lease_seconds=30, renew_seconds=1, engine={
        "name": "llama-cpp", "options": {"n_threads": 1}}))).job_version
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


@pytest.fixture(scope="module")
def embedding_server() -> Iterator[Any]:
    """An OpenAI-compatible ``/v1/embeddings`` on loopback answering with the real SmolLM2 GGUF's mean-pooled
    vectors (llama.cpp's own server returns this model's token vectors unpooled; a hosted endpoint cannot
    run here). Its first answer is an HTTP 503: a transport failure, which must spend no attempt."""
    from batch_inference.embed.engines import LlamaCppEmbedder
    from batch_inference.harness.loopback import ChatServer

    model = LlamaCppEmbedder(parse_spec(embed_spec()))
    model.load()
    lock = threading.Lock()
    calls = {"n": 0}

    def respond(body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        with lock:
            calls["n"] += 1
            if calls["n"] == 1:
                return 503, {}, {"error": {"message": "overloaded"}}
            [vector] = model.embed_texts([body["input"]])
        return 200, {}, {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                         "model": body["model"]}

    server = ChatServer(respond)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.close()
        model.close()


def test_an_openai_compatible_embeddings_endpoint_runs_the_job(conn, db_url, embedding_server):
    """The synchronous transport's engine (``openai``) in its embedding mode: POST /v1/embeddings."""
    make_source(conn, records(12))
    spec = parse_spec(embed_spec(engine={"name": "openai", "options": {"base_url": embedding_server.base_url,
                                                                       "concurrency": 2, "backoff_base_s": 0.05}}))
    job = submit(conn, spec).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    rows = conn.execute("SELECT record_id, embedding, engine, endpoint FROM bi.results WHERE job_version = %s",
                        (job,)).fetchall()
    assert len(rows) == 12 and {(r["engine"], r["endpoint"]) for r in rows} == {("openai", "internal")}
    for r in rows:
        v = np.frombuffer(r["embedding"], dtype="<f4")
        assert v.shape == (DIMS,) and abs(float(np.linalg.norm(v)) - 1) < 1e-3
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s", (job,)).fetchone()["n"] == 0
    assert {b["input"][:9] for b in embedding_server.bodies} == {"passage: "}
    assert validate(conn, job).passed
