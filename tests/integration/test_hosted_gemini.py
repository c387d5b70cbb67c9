"""The gemini-batch transport against a loopback emulator of Gemini's Batch API (tests/fixtures/hosted_gemini.py),
through the official ``google-genai`` client; the real ledger and the real worker, in process, and the real
fallback pool against a loopback chat-completions server. The provider cannot be reached from here: the emulator
reads every request and writes every answer through the client's own types."""

from __future__ import annotations

import json
import threading

import pytest

from batch_inference.cli import main as cli_main
from batch_inference.engines import load_engine
from batch_inference.exceptions import InvalidValue, NotCleared
from batch_inference.fallback import enter_fallback, run_fallback
from batch_inference.hosted.gemini_batch import schema_refusal
from batch_inference.plan import submit
from batch_inference.status import job_counts
from gpu_runner.worker import run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer
from tests.fixtures.hosted_gemini import GeminiBatchEmulator, answer, status_error
from tests.fixtures.hosted_openai import OpenAIBatchEmulator
from tests.integration.test_hosted_openai import OK, batches, hosted_spec, wait_for, worker_cfg

OUT = '{"category": "billing", "summary": "charged twice"}'


def gemini_spec(url: str, **over):
    opts = {"base_url": url, "poll_seconds": 0.05, "cancel_poll_seconds": 0.02, "api_key_env": "BI_TEST_GEMINI_KEY",
            **over.pop("engine_options", {})}
    return make_spec(engine={"name": "gemini-batch", "options": opts}, cleared_for_hosted=True,
                     **{"shard_size": 500, "lease_seconds": 30, "renew_seconds": 0.2, **over})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("BI_TEST_GEMINI_KEY", "gm-test-not-a-secret")
    monkeypatch.setenv("BI_TEST_OPENAI_KEY", "sk-test-not-a-secret")


@pytest.fixture
def emulator():
    srv = GeminiBatchEmulator()
    yield srv
    srv.close()


def text_of(request: dict) -> str:
    return request["contents"][0]["parts"][0]["text"]


def stored(conn, job: str) -> dict[str, dict]:
    return {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}


def test_a_restricted_record_class_never_reaches_gemini(emulator):
    spec = make_spec(engine={"name": "gemini-batch", "options": {"base_url": emulator.base_url}})
    with pytest.raises(NotCleared, match="hosted"):
        load_engine("gemini-batch", spec)
    assert emulator.calls == []


def test_a_schema_gemini_cannot_take_is_refused_before_any_request(emulator):
    assert schema_refusal(make_spec().output_schema) is None
    assert schema_refusal({"type": "object", "properties": {"a": {"type": "string", "const": "x"}}}) == \
        "properties.a.const: a keyword Gemini does not take"
    assert schema_refusal({"allOf": [{"type": "object"}]}) == "allOf: a keyword Gemini does not take"
    assert schema_refusal({"type": "number", "exclusiveMinimum": 0}).startswith("exclusiveMinimum")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}
    spec = make_spec(engine={"name": "gemini-batch", "options": {"base_url": emulator.base_url}},
                     cleared_for_hosted=True, output_schema=schema)
    with pytest.raises(InvalidValue, match=r"Gemini's response schema cannot take: properties\.n\.multipleOf"):
        load_engine("gemini-batch", spec)
    assert emulator.calls == []


@pytest.mark.parametrize("how", ["file", "inline"])
def test_a_job_runs_end_to_end_on_gemini_batch(conn, db_url, emulator, how):
    unavailable_once = {"Ticket 11:"}

    def respond(request):
        text = text_of(request)
        gen = request["generationConfig"]
        assert "Classify the support ticket" in request["systemInstruction"]["parts"][0]["text"]
        assert gen["responseMimeType"] == "application/json" and gen["responseJsonSchema"] == make_spec().output_schema
        if "Ticket 7:" in text:
            return 400, status_error(400, "INVALID_ARGUMENT", "contents.parts: invalid")
        for marker in list(unavailable_once):
            if marker in text:
                unavailable_once.discard(marker)
                return 503, status_error(503, "UNAVAILABLE", "The model is overloaded.")
        if "Ticket 13:" in text:
            return 200, answer(OUT[:20], finish="MAX_TOKENS")
        return 200, answer(OUT)

    emulator.respond = respond
    make_source(conn, tickets(1000))
    job = submit(conn, gemini_spec(emulator.base_url, engine_options={"input": how})).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 998 and c["dead_letters"] == 2 and c["outstanding"] == 0
    dead = {d["record_id"]: d for d in conn.execute(
        "SELECT record_id, attempts, error, raw_output, transport FROM bi.dead_letters WHERE job_version = %s",
        (job,))}
    assert set(dead) == {"t00007", "t00013"} and {d["transport"] for d in dead.values()} == {"hosted_batch"}
    assert "INVALID_ARGUMENT" in dead["t00007"]["error"] and dead["t00013"]["raw_output"] == OUT[:20]
    # the 503 spent no attempt: billed again in a later batch, and stored
    assert emulator.billed["t00011"] == 2 and emulator.billed["t00007"] == 3
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND record_id = 't00011' "
                        "AND attempts > 0", (job,)).fetchone()["n"] == 0
    assert all(n == 1 for k, n in emulator.billed.items() if k not in ("t00007", "t00011", "t00013"))
    rows = batches(conn, job)
    assert {r["state"] for r in rows} == {"reconciled"} and {r["provider"] for r in rows} == {"gemini"}
    assert {r["provider_status"] for r in rows} == {"JOB_STATE_SUCCEEDED"}
    # the provider answered t00013 (truncated) in three batches: three of its successes
    assert all(r["input_tokens"] for r in rows) and sum(r["succeeded"] for r in rows) == 998 + 3
    # reconciled: the input and responses files and the batches are deleted at the provider
    assert emulator.files == {} and emulator.batches == {}
    # the key from api_key_env on every call but the bytes of a resumable upload, which its session URL authorizes
    assert emulator.auth - {""} == {"gm-test-not-a-secret"}
    first = emulator.requests[0]["request"]
    assert [c["role"] for c in first["contents"]] == ["user"] and first["generationConfig"]["seed"] == 0
    assert ("POST", "/upload/v1beta/files") in emulator.calls if how == "file" else \
        not any(p.startswith("/upload") for _, p in emulator.calls)


def test_the_same_rows_as_an_openai_batch_job_of_the_same_spec(conn, db_url, emulator):
    """One source, one prompt, params and schema: the Gemini job and the OpenAI job store the same row set."""
    emulator.respond = lambda request: (200, answer(json.dumps(
        {"category": "billing", "summary": text_of(request)[-30:]})))
    openai_emu = OpenAIBatchEmulator(respond=lambda body: (200, {
        "id": "x", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": json.dumps(
            {"category": "billing", "summary": body["messages"][1]["content"][-30:]})}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}))
    try:
        make_source(conn, tickets(300))
        gj = submit(conn, gemini_spec(emulator.base_url)).job_version
        oj = submit(conn, hosted_spec(openai_emu.base_url)).job_version
        assert run_worker(worker_cfg(db_url, gj)) == 0 and run_worker(worker_cfg(db_url, oj)) == 0
    finally:
        openai_emu.close()
    g, o = stored(conn, gj), stored(conn, oj)
    assert len(g) == 300 and g == o


def test_an_expired_job_keeps_its_finished_rows_and_the_rest_goes_into_the_next_batch(conn, db_url, emulator):
    # 150 completions take 0.15 s at this rate on an idle machine: the 3 s window holds them on a loaded one
    emulator.rate, emulator.expire_s, emulator.hold_after = 1000.0, 3.0, 150

    def second_gets_a_full_window(batch):
        if emulator.created == 2:
            batch["_expire_s"], emulator.hold_after = None, None

    emulator.on_create = second_gets_a_full_window
    make_source(conn, tickets(500))
    job = submit(conn, gemini_spec(emulator.base_url)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    first, second = batches(conn, job)
    assert (first["provider_status"], first["succeeded"], first["expired"]) == ("JOB_STATE_EXPIRED", 150, 350)
    assert (second["provider_status"], second["succeeded"], second["requests"]) == ("JOB_STATE_SUCCEEDED", 350, 350)
    assert job_counts(conn, job)["stored"] == 500
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0
    assert all(n == 1 for n in emulator.billed.values()) and len(emulator.billed) == 500


def test_5xx_on_create_and_polls_spends_nothing(conn, db_url, emulator):
    """A 503 to the create call (nothing created: the look-up by key finds none, the shard is released and taken
    again) and to polls (retried): every record stored once, no attempt spent."""
    emulator.fail_next = 1
    emulator.on_create = lambda batch: setattr(emulator, "fail_next", 3)
    make_source(conn, tickets(200))
    job = submit(conn, gemini_spec(emulator.base_url, shard_size=200)).job_version
    run_worker(worker_cfg(db_url, job))          # the first try: the endpoint refused the create
    if job_counts(conn, job)["outstanding"]:
        assert run_worker(worker_cfg(db_url, job)) == 0
    assert job_counts(conn, job)["stored"] == 200 and emulator.created == 1
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0
    assert all(n == 1 for n in emulator.billed.values()) and len(emulator.billed) == 200


def test_a_job_left_pending_past_its_window_is_cancelled_at_the_cutoff_and_its_rows_redriven(
        conn, db_url, emulator, capsys):
    emulator.pending_forever, emulator.cancel_delay_s = True, 0.2
    make_source(conn, tickets(600))
    job = submit(conn, gemini_spec(emulator.base_url, shard_size=300,
                                   engine_options={"window_s": 0.1})).job_version
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run_worker(worker_cfg(db_url, job, max_shards=2))),
                         daemon=True)
    t.start()
    wait_for(lambda: len(batches(conn, job)) == 1 and batches(conn, job)[0]["provider_status"] == "JOB_STATE_PENDING",
             what="a PENDING batch")
    assert enter_fallback(conn, job)            # the cutoff fired: the batch worker cancels and drains
    t.join(60)
    assert codes == [0]
    (row,) = batches(conn, job)
    assert (row["provider_status"], row["succeeded"], row["canceled"], row["state"]) == \
        ("JOB_STATE_CANCELLED", 0, 300, "reconciled")
    chat = ChatServer(lambda body: (200, {}, OK))
    try:
        result = run_fallback(db_url, job, chat.base_url, rate=1000.0, concurrency=8)
    finally:
        chat.close()
    assert result.stored == 600 and job_counts(conn, job)["stored"] == 600
    by_transport = {r["transport"]: r["n"] for r in conn.execute(
        "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY transport", (job,))}
    assert by_transport == {"fallback": 600} and emulator.billed == {}
    assert len(chat.bodies) == 600
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0


def test_a_create_whose_reply_is_lost_attaches_to_the_batch_found_by_its_key(conn, db_url, emulator):
    """The provider created the batch but the reply never came (the connection dropped): the transport asks for
    the batch by its key (displayName, listing newest first) instead of creating a second one."""
    lost = []

    def drop_the_first_reply(batch):
        if not lost:
            lost.append(batch["name"])
            raise ConnectionResetError("the reply to the create call is lost")

    emulator.on_create = drop_the_first_reply
    make_source(conn, tickets(200))
    job = submit(conn, gemini_spec(emulator.base_url, shard_size=200)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    (row,) = batches(conn, job)
    assert emulator.created == 1 and row["provider_batch_id"] == lost[0] and row["state"] == "reconciled"
    assert job_counts(conn, job)["stored"] == 200 and all(n == 1 for n in emulator.billed.values())
