"""task: embed on the ``openai-batch`` transport: the OpenAI Batch API's ``/v1/embeddings`` endpoint.

A hosted provider cannot be reached from here: the loopback emulator (tests/fixtures/hosted_openai.py)
speaks the Files + Batches API and answers ``/v1/embeddings`` lines in the Embeddings API's shapes,
its vectors a text's hashed trigrams rather than a model's. The ledger is the real embedded PostgreSQL
with pgvector, the worker the real worker in process, driving the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import numpy as np
import pytest

from batch_inference import deadline
from batch_inference.cli import main as cli_main
from batch_inference.cost import cents
from batch_inference.embed.engines import embed_input
from batch_inference.engines import load_engine
from batch_inference.fallback import run_fallback
from batch_inference.exceptions import BatchInferenceError, InvalidValue, NotCleared, SpecError
from batch_inference.harness.hosted_openai import embedding_answer, trigram_vector
from batch_inference.hosted.core import ERRORED, SUCCEEDED, TRANSPORT
from batch_inference.hosted.openai_batch import parse_line
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from batch_inference.validate import validate
from gpu_runner.worker import run_worker
from tests.conftest import make_source
from tests.fixtures.hosted_openai import OpenAIBatchEmulator
from tests.integration.test_embed import TOPICS, embed_spec, nearest, records
from tests.fixtures.chat_server import ChatServer
from tests.integration.test_hosted_openai import batches, wait_for, worker_cfg

MODEL = "text-embedding-3-small"
DIMS = 256        # shortened by the request's `dimensions` from the model's 1,536
KEY = "sk-test-not-a-secret"


def hosted_embed_spec(url: str | None, **over) -> dict:
    """A hosted model has no weights here: its digest pins the name it is called by."""
    opts = {"poll_seconds": 0.05, "cancel_poll_seconds": 0.02, "api_key_env": "BI_TEST_OPENAI_KEY",
            **({"base_url": url} if url else {}), **over.pop("engine_options", {})}
    model = over.pop("model_name", MODEL)
    return embed_spec(model={"name": model, "digest": hashlib.sha256(model.encode()).hexdigest()},
                      engine={"name": "openai-batch", "options": opts},
                      embedding={"dimensions": over.pop("dimensions", DIMS), "instruction": "passage: "},
                      **{"cleared_for_hosted": True, "shard_size": 10, "lease_seconds": 30, "renew_seconds": 0.2,
                         **over})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("BI_TEST_OPENAI_KEY", KEY)


@pytest.fixture
def emulator():
    srv = OpenAIBatchEmulator()
    yield srv
    srv.close()


def expected(spec_data: dict, text: str) -> np.ndarray:
    """The emulator's vector for one record, shortened and normalized as the Embeddings API does."""
    v = trigram_vector(embed_input(parse_spec(spec_data), text), 1536)[:DIMS]
    return (v / np.linalg.norm(v)).astype("<f4")


def test_an_embedding_job_runs_end_to_end_on_the_batch_api(conn, db_url, emulator, capsys):
    fail_once = {"Ticket 11:"}

    def embed(body):
        if "Ticket 7:" in body["input"]:
            return 400, {"error": {"message": "'$.input' is invalid.", "type": "invalid_request_error"}}
        for mark in list(fail_once):
            if mark in body["input"]:
                fail_once.discard(mark)
                return 500, {"error": {"message": "The server had an error", "type": "server_error"}}
        return embedding_answer(body)

    emulator.embed = embed
    rows_in = records(30)
    make_source(conn, rows_in)
    conn.execute("CREATE TABLE public.pairs (left_id text, right_id text)")
    conn.execute("INSERT INTO public.pairs VALUES ('t000', 't005'), ('t001', 't006'), ('t002', 't012')")
    spec = hosted_embed_spec(emulator.base_url, evaluation={"pairs": {"table": "public.pairs", "k": 5,
                                                                      "min_recall": 1.0}},
                             validation={"max_dead_letter_rate": 0.05},
                             cost={"hosted_batch_per_m_input_tokens": 1000.0, "hosted_batch_per_m_output_tokens": 0})
    job = submit(conn, parse_spec(spec)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0

    c = job_counts(conn, job)
    assert c["stored"] == 29 and c["dead_letters"] == 1 and c["outstanding"] == 0
    # The refused line spent an attempt each time, dead after three; the 500 spent none.
    dead = conn.execute("SELECT record_id, attempts, error, transport FROM bi.dead_letters WHERE job_version = %s",
                        (job,)).fetchall()
    assert [(d["record_id"], d["attempts"], d["transport"]) for d in dead] == [("t007", 3, "hosted_batch")]
    assert "HTTP 400" in dead[0]["error"] and "input" in dead[0]["error"]
    a = conn.execute("SELECT attempts FROM bi.attempts WHERE job_version = %s AND record_id = 't011'",
                     (job,)).fetchone()
    assert a is None or a["attempts"] == 0
    assert emulator.billed["t007"] == 3 and emulator.billed["t011"] == 2
    assert {k: n for k, n in emulator.billed.items() if k not in ("t007", "t011")} == \
        {r[0]: 1 for r in rows_in if r[0] not in ("t007", "t011")}

    # Stored as the other engines store vectors: float32 bytes, unit norm, the engine that made them;
    # each the provider's answer for the rendered record.
    texts = {r[0]: r[1] for r in rows_in}
    stored = conn.execute("SELECT record_id, embedding, output, engine, endpoint, transport FROM bi.results "
                          "WHERE job_version = %s ORDER BY record_id", (job,)).fetchall()
    assert len(stored) == 29
    for r in stored:
        v = np.frombuffer(r["embedding"], dtype="<f4")
        assert v.shape == (DIMS,) and abs(float(np.linalg.norm(v)) - 1) < 1e-3
        assert np.allclose(v, expected(spec, texts[r["record_id"]]), atol=1e-6)
        assert (r["engine"], r["endpoint"], r["transport"]) == ("openai-batch", "hosted", "hosted_batch")
        assert r["output"]["dimensions"] == DIMS

    # What went out: one /v1/embeddings batch per shard, each line the documented request body.
    rows = batches(conn, job)
    assert {r["state"] for r in rows} == {"reconciled"} and {r["provider"] for r in rows} == {"openai"}
    assert {b["endpoint"] for b in emulator.batches.values()} == {"/v1/embeddings"}
    line = emulator.work[rows[0]["provider_batch_id"]]["lines"][0]
    assert line["url"] == "/v1/embeddings" and line["method"] == "POST"
    assert line["body"] == {"model": MODEL, "input": "passage: " + texts[line["custom_id"]],
                            "encoding_format": "float", "dimensions": DIMS}
    assert emulator.files == {} and emulator.auth == {f"Bearer {KEY}"}
    tokens_in = sum(r["input_tokens"] or 0 for r in rows)
    assert tokens_in > 0 and sum(r["output_tokens"] or 0 for r in rows) == 0

    # Validated (vectors, coverage, dead letters, recall@k of the pairs) and published to the search view.
    report = validate(conn, job)
    assert report.passed, report.failures
    assert report["schema"]["checked"] == 29 and report["schema"]["invalid"] == 0
    assert report["evaluation"]["pairs"]["recall"] == 1.0
    publish(conn, job)
    first = nearest(conn, "t003")
    assert first[0] == "t003" and int(first[1][1:]) % len(TOPICS) == 3

    # Priced from the provider's reported usage at the spec's (batch) token price; no key in any output.
    assert cli_main(["cost", job, "--db", db_url, "--json"]) == 0
    out = capsys.readouterr()
    bill = json.loads(out.out.strip().splitlines()[-1])["so_far"]
    assert bill["hosted_rows"] == 29 and bill["hosted_cost"] == float(cents(Decimal(tokens_in) * 1000 / 1_000_000))
    assert KEY not in out.out + out.err
    dumped = json.dumps([dict(r) for r in rows], default=str) + json.dumps([d["error"] for d in dead])
    assert KEY not in dumped


def test_the_cutoff_cancels_the_embedding_batch_and_the_fallback_embeds_the_rest(conn, db_url, emulator):
    """The same cutoff as for answers: the provider batch is cancelled and what it completed is stored
    (paid for), and the fallback pool's openai engine embeds the rest on a synchronous /embeddings."""
    emulator.rate, emulator.hold_after = 400.0, 10     # the batch stalls after 10 of 30, as a slow queue does
    rows_in = records(60)
    make_source(conn, rows_in)
    spec = hosted_embed_spec(emulator.base_url, shard_size=30)
    job = submit(conn, parse_spec(spec)).job_version
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(run_worker(worker_cfg(db_url, job))), daemon=True)
    worker.start()
    wait_for(lambda: sum(r["succeeded"] for r in batches(conn, job)) >= 10, what="the batch part done")
    cfg = deadline.config_from_kwargs(job, (datetime.now(timezone.utc) + timedelta(minutes=30)).isoformat(), 0.1,
                                      warned=True)
    event = asyncio.run(deadline.watch(lambda: deadline.connect_async(db_url), cfg))
    assert event["status"] == "cutoff"
    sync = ChatServer(lambda body: (200, {}, embedding_answer(body)[1]))
    try:
        result = run_fallback(db_url, job, sync.base_url, rate=1000.0, concurrency=4)
    finally:
        sync.close()
    worker.join(60)
    assert codes == [0]
    (row,) = batches(conn, job)
    assert row["provider_status"] == "cancelled" and row["state"] == "reconciled"
    c = job_counts(conn, job)
    assert c["stored"] == 60 and c["outstanding"] == 0 and c["dead_letters"] == 0
    by = {(r["transport"], r["engine"]): r["n"] for r in conn.execute(
        "SELECT transport, engine, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY 1, 2", (job,))}
    assert by == {("hosted_batch", "openai-batch"): row["succeeded"], ("fallback", "openai"): 60 - row["succeeded"]}
    assert result.stored == 60 - row["succeeded"]
    # No record bought twice; both transports sent the same request body and stored the same vectors.
    sent = [b["input"] for b in sync.bodies]
    assert len(sent) == len(set(sent)) == 60 - row["succeeded"] and len(emulator.billed) == row["succeeded"]
    assert all(n == 1 for n in emulator.billed.values())
    assert {k for k in sync.bodies[0]} == {"model", "input", "encoding_format", "dimensions"}
    texts = {r[0]: r[1] for r in rows_in}
    for r in conn.execute("SELECT record_id, embedding FROM bi.results WHERE job_version = %s", (job,)):
        assert np.allclose(np.frombuffer(r["embedding"], dtype="<f4"), expected(spec, texts[r["record_id"]]),
                           atol=1e-6)
    assert validate(conn, job).passed


def test_a_batch_api_outage_spends_no_attempt_and_the_next_worker_finishes(conn, db_url, emulator):
    """The create call answered 503 (the client does not retry it): the worker leaves with the endpoint's
    exit code, every record untouched; a later worker re-attaches to the intent and embeds them all."""
    down = {"creates": 1}
    create = emulator.create_batch

    def flaky_create(*, body, **kw):
        if down["creates"]:
            down["creates"] -= 1
            return 503, {"error": {"message": "The engine is currently overloaded", "type": "server_error"}}
        return create(body=body, **kw)

    emulator.routes = [(m, p, (lambda srv, **kw: flaky_create(**kw)) if fn is OpenAIBatchEmulator.create_batch
                        else fn) for m, p, fn in OpenAIBatchEmulator.routes]
    make_source(conn, records(10))
    job = submit(conn, parse_spec(hosted_embed_spec(emulator.base_url))).job_version
    assert run_worker(worker_cfg(db_url, job)) != 0
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0
    assert job_counts(conn, job)["stored"] == 0 and emulator.batches == {}
    assert run_worker(worker_cfg(db_url, job)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 10 and c["dead_letters"] == 0
    assert all(n == 1 for n in emulator.billed.values()) and len(emulator.billed) == 10


def test_a_restricted_record_class_never_reaches_the_batch_api(conn, db_url, emulator):
    spec = hosted_embed_spec(emulator.base_url, cleared_for_hosted=False)
    with pytest.raises(NotCleared, match="hosted"):
        load_engine("openai-batch", parse_spec(spec))
    make_source(conn, records(5))
    job = submit(conn, parse_spec(spec)).job_version
    assert run_worker(worker_cfg(db_url, job)) != 0
    assert emulator.calls == [] and job_counts(conn, job)["stored"] == 0


@pytest.mark.parametrize("change, words", [
    ({"model_name": "text-embedding-ada-002"}, "makes 1536-dimensional embeddings and takes no 'dimensions'"),
    ({"dimensions": 4096}, "makes at most 1536-dimensional embeddings"),
    ({"model_name": "gpt-4o-mini", "url": None}, "'gpt-4o-mini' is not one of OpenAI's embedding models"),
    ({"shard_size": 60_000}, "more than the 50,000 inputs a /v1/embeddings batch may hold"),
])
def test_bad_hosted_embedding_spec_is_one_line_and_writes_nothing(conn, emulator, change, words):
    make_source(conn, records(5))
    url = change.pop("url", emulator.base_url)
    with pytest.raises((SpecError, BatchInferenceError)) as err:
        submit(conn, parse_spec(hosted_embed_spec(url, **change)))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0
    assert emulator.calls == []


def test_embedding_result_lines_are_read_as_the_batch_api_writes_them(emulator):
    """One line of each kind, through the engine's own reading of an answered body."""
    engine = load_engine("openai-batch", parse_spec(hosted_embed_spec(emulator.base_url)))
    status, body = embedding_answer({"model": MODEL, "input": "passage: hello", "dimensions": DIMS})

    def line(code, b):
        return {"custom_id": "t1", "response": {"status_code": code, "body": b}, "error": None}

    ok = parse_line(line(status, body), engine.read_answer)
    assert ok.kind == SUCCEEDED and len(ok.vector) == DIMS and ok.tokens_in == body["usage"]["prompt_tokens"]
    empty = parse_line(line(200, {"object": "list", "data": [], "model": MODEL}), engine.read_answer)
    assert (empty.kind, empty.error) == (ERRORED, "response has no data[0].embedding")
    assert parse_line(line(*embedding_answer({"model": "text-embedding-ada-002", "input": "x", "dimensions": 8})),
                      engine.read_answer).kind == ERRORED
    assert parse_line(line(503, {"error": {"message": "busy"}}), engine.read_answer).kind == TRANSPORT
    # extra_body adds to a request and never replaces the spec's own fields.
    with pytest.raises(InvalidValue) as err:
        load_engine("openai-batch", parse_spec(hosted_embed_spec(emulator.base_url,
                                                                 engine_options={"extra_body": {"input": "x"}})))
    assert "'extra_body.input' is refused" in str(err.value) and "\n" not in str(err.value)
