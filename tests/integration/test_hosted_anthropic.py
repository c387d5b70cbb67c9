"""The anthropic-batch transport against a loopback Message Batches emulator
(tests/fixtures/hosted_anthropic.py), through the official ``anthropic`` client;
the real ledger and the real worker, in process."""

from __future__ import annotations

import threading

import pytest

from batch_inference import db
from batch_inference.fallback import enter_fallback, run_fallback
from batch_inference.hosted.anthropic_batch import custom_id
from batch_inference.plan import submit
from batch_inference.status import job_counts
from gpu_runner.worker import run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer
from tests.fixtures.hosted_anthropic import AnthropicBatchEmulator, errored, message
from tests.integration.test_hosted_openai import OK, batches, wait_for, worker_cfg

OUT = '{"category": "billing", "summary": "charged twice"}'


def anthropic_spec(url: str, **over):
    opts = {"base_url": url, "poll_seconds": 0.05, "cancel_poll_seconds": 0.02, "api_key_env": "BI_TEST_ANTHROPIC_KEY"}
    return make_spec(engine={"name": "anthropic-batch", "options": opts}, cleared_for_hosted=True,
                     **{"shard_size": 500, "lease_seconds": 30, "renew_seconds": 0.2, **over})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("BI_TEST_ANTHROPIC_KEY", "sk-ant-test-not-a-secret")


@pytest.fixture
def emulator():
    srv = AnthropicBatchEmulator()
    yield srv
    srv.close()


def test_custom_ids_fit_the_api_and_stay_distinct():
    assert custom_id("t00001") == "t00001"
    odd = [custom_id(x) for x in ("a b", "a/b", "ä", "x" * 65)]
    assert len(set(odd)) == 4 and all(len(c) == 41 and c.startswith("r") for c in odd)


def test_a_job_runs_end_to_end_on_anthropic_batch(conn, db_url, emulator):
    overloaded_once = {"Ticket 11:"}

    def respond(params):
        text = params["messages"][0]["content"]
        assert params["system"].startswith("You label records") and params["output_config"]["format"]["schema"]
        if "Ticket 7:" in text:
            return errored("invalid_request_error", "messages.0.content: invalid")
        for marker in list(overloaded_once):
            if marker in text:
                overloaded_once.discard(marker)
                return errored("overloaded_error", "Overloaded")
        if "Ticket 13:" in text:
            return message(OUT[:20], stop_reason="max_tokens")
        return message(OUT)

    emulator.respond = respond
    make_source(conn, tickets(2000) + [("odd id/with space", "Ticket 9999: charged twice", ["team0"])])
    job = submit(conn, anthropic_spec(emulator.url)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 1999 and c["dead_letters"] == 2 and c["outstanding"] == 0
    dead = {d["record_id"]: d for d in conn.execute(
        "SELECT record_id, attempts, error, raw_output, transport FROM bi.dead_letters WHERE job_version = %s",
        (job,))}
    assert set(dead) == {"t00007", "t00013"} and {d["transport"] for d in dead.values()} == {"hosted_batch"}
    assert "invalid_request_error" in dead["t00007"]["error"] and dead["t00013"]["raw_output"] == OUT[:20]
    assert conn.execute("SELECT output FROM bi.results WHERE job_version = %s AND record_id = %s",
                        (job, "odd id/with space")).fetchone()["output"]["category"] == "billing"
    # the overloaded request spent nothing and was billed again in a later batch; the rest once each
    assert emulator.billed["t00011"] == 2 and emulator.billed["t00007"] == 3
    assert all(n == 1 for k, n in emulator.billed.items() if k not in ("t00007", "t00011", "t00013"))
    rows = batches(conn, job)
    assert {r["state"] for r in rows} == {"reconciled"} and all(r["input_tokens"] for r in rows)
    assert emulator.batches == {}              # deleted after reconciliation


def test_cutoff_cancels_an_anthropic_batch_and_the_fallback_finishes(conn, db_url, emulator):
    emulator.rate, emulator.cancel_delay_s, emulator.hold_after = 400.0, 0.3, 150
    make_source(conn, tickets(1000))
    job = submit(conn, anthropic_spec(emulator.url)).job_version
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run_worker(worker_cfg(db_url, job))), daemon=True)
    t.start()
    wait_for(lambda: any(w["next"] >= 150 for w in list(emulator.work.values())), what="150 requests done")
    # until the batch ends the API reports every request processing: the hosted term is zero
    (row,) = batches(conn, job)
    assert row["succeeded"] == 0 and row["processing"] == 500
    assert enter_fallback(conn, job)
    t.join(60)
    assert codes == [0]
    (row,) = batches(conn, job)
    assert (row["provider_status"], row["succeeded"], row["canceled"], row["state"]) == ("ended", 150, 350,
                                                                                          "reconciled")
    drain = conn.execute(db.q("hosted_drain"), {"job": job}).fetchall()
    assert len(drain) == 1 and drain[0]["drain_s"] >= 0.3
    chat = ChatServer(lambda body: (200, {}, OK))
    try:
        result = run_fallback(db_url, job, chat.base_url, rate=1000.0, concurrency=8)
    finally:
        chat.close()
    assert result.stored == 850 and job_counts(conn, job)["stored"] == 1000
    assert len(chat.bodies) == 850 and all(n == 1 for n in emulator.billed.values())
