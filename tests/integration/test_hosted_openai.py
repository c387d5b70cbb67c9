"""The openai-batch transport against a loopback Batch API emulator (tests/fixtures/hosted_openai.py).

A hosted provider cannot be reached from here; the emulator speaks the Batch
API's published shapes and the transport drives it through the official
``openai`` client. The ledger is the real embedded PostgreSQL, the worker the
real worker (in process; the crash test is tests/process/test_hosted_crash.py), the fallback
the real pool against a loopback chat-completions server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import psycopg
import pytest

from batch_inference import db, deadline
from batch_inference.cli import main as cli_main
from batch_inference.cost import Prices, cents, cost_report
from batch_inference.cutoff import decide
from batch_inference.exceptions import NotCleared
from batch_inference.engines import load_engine
from batch_inference.fallback import run_fallback
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.status import job_counts
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer, completion
from tests.fixtures.hosted_openai import OpenAIBatchEmulator

OK = completion('{"category": "billing", "summary": "charged twice"}')
UTC = timezone.utc


def hosted_spec(url: str, **over):
    opts = {"base_url": url, "poll_seconds": 0.05, "cancel_poll_seconds": 0.02, "api_key_env": "BI_TEST_OPENAI_KEY",
            **over.pop("engine_options", {})}
    return make_spec(engine={"name": "openai-batch", "options": opts}, cleared_for_hosted=True,
                     **{"shard_size": 500, "lease_seconds": 30, "renew_seconds": 0.2, **over})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("BI_TEST_OPENAI_KEY", "sk-test-not-a-secret")


@pytest.fixture
def emulator():
    srv = OpenAIBatchEmulator()
    yield srv
    srv.close()


def worker_cfg(db_url: str, job: str, **over) -> WorkerConfig:
    return WorkerConfig(job_version=job, db_url=db_url, backoff=(0.05, 0.05, 0.05), poll_seconds=0.1,
                        **{"wait_for_leases": False, **over})


def batches(conn, job: str) -> list[dict]:
    return conn.execute(db.q("hosted_batches"), {"job": job}).fetchall()


def wait_for(pred, timeout: float = 60.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_restricted_record_class_never_reaches_the_batch_api(emulator):
    spec = make_spec(engine={"name": "openai-batch", "options": {"base_url": emulator.base_url}})
    with pytest.raises(NotCleared, match="hosted"):
        load_engine("openai-batch", spec)
    assert emulator.calls == []


def test_the_key_and_endpoint_come_from_an_airflow_connection(conn, db_url, emulator, monkeypatch):
    """conn_id: the connection's password is the API key and its host the endpoint (no base_url option)."""
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_BATCH_API", json.dumps(
        {"conn_type": "generic", "host": emulator.base_url, "password": "sk-from-the-connection"}))
    make_source(conn, tickets(20))
    spec = make_spec(engine={"name": "openai-batch", "options": {"conn_id": "bi_test_batch_api", "poll_seconds": 0.05}},
                     cleared_for_hosted=True, lease_seconds=30, renew_seconds=0.2)
    job = submit(conn, spec).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    assert job_counts(conn, job)["stored"] == 20
    assert emulator.auth == {"Bearer sk-from-the-connection"}


def test_a_job_runs_end_to_end_on_openai_batch(conn, db_url, emulator):
    fail_once = {"t00011"}

    def respond(body):
        text = body["messages"][1]["content"]
        if "Ticket 7:" in text:
            return 400, {"error": {"message": "Invalid 'messages': unsupported content", "type": "invalid_request_error"}}
        for rid in list(fail_once):
            if f"Ticket {int(rid[1:])}:" in text:
                fail_once.discard(rid)
                return 500, {"error": {"message": "The server had an error", "type": "server_error"}}
        return 200, OK

    emulator.respond = respond
    make_source(conn, tickets(2000))
    job = submit(conn, hosted_spec(emulator.base_url)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 1999 and c["dead_letters"] == 1 and c["outstanding"] == 0
    transports = {r["transport"]: r["n"] for r in conn.execute(
        "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY transport", (job,))}
    assert transports == {"hosted_batch": 1999}
    dead = conn.execute("SELECT record_id, attempts, error, transport FROM bi.dead_letters WHERE job_version = %s",
                        (job,)).fetchall()
    assert [(d["record_id"], d["attempts"], d["transport"]) for d in dead] == [("t00007", 3, "hosted_batch")]
    assert "HTTP 400" in dead[0]["error"] and "unsupported content" in dead[0]["error"]
    # the 500 spent no attempt: the record went into a later batch and succeeded
    a = conn.execute("SELECT attempts FROM bi.attempts WHERE job_version = %s AND record_id = 't00011'",
                     (job,)).fetchone()
    assert a is None or a["attempts"] == 0
    # every request billed once, except the retries of the refused and the 5xx one
    assert emulator.billed["t00007"] == 3 and emulator.billed["t00011"] == 2
    assert {k: v for k, v in emulator.billed.items() if k not in ("t00007", "t00011")} == \
        {f"t{i:05d}": 1 for i in range(2000) if i not in (7, 11)}
    rows = batches(conn, job)
    assert {r["state"] for r in rows} == {"reconciled"} and {r["provider"] for r in rows} == {"openai"}
    assert sum(r["input_tokens"] or 0 for r in rows) > 0
    # the same system turn first and the output schema as response_format, in every request
    first = emulator.work[rows[0]["provider_batch_id"]]["lines"][0]["body"]
    assert first["messages"][0]["role"] == "system" and first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["schema"] == make_spec().output_schema
    # reconciled: the input, output and error files are deleted at the provider
    assert emulator.files == {}
    assert emulator.auth == {"Bearer sk-test-not-a-secret"}          # the key from api_key_env


def test_an_expired_batch_gives_its_completed_part_and_the_rest_goes_into_the_next_batch(conn, db_url, emulator):
    """The completion window ran out with 150 of 500 done: those are stored (they were paid for), the
    other 350 spend no attempt and go into the shard's next batch."""
    # 150 completions take 0.15 s at this rate on an idle machine: the 3 s window holds them on a loaded one
    emulator.rate, emulator.expire_s, emulator.hold_after = 1000.0, 3.0, 150

    def second_gets_a_full_window(batch):
        if emulator.created == 2:
            batch["_expire_s"], emulator.hold_after = None, None

    emulator.on_create = second_gets_a_full_window
    make_source(conn, tickets(500))
    job = submit(conn, hosted_spec(emulator.base_url)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    first, second = batches(conn, job)
    assert (first["provider_status"], first["succeeded"], first["requests"]) == ("expired", 150, 500)
    assert (second["provider_status"], second["succeeded"], second["requests"]) == ("completed", 350, 350)
    assert job_counts(conn, job)["stored"] == 500
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0",
                        (job,)).fetchone()["n"] == 0
    assert all(n == 1 for n in emulator.billed.values()) and len(emulator.billed) == 500


def test_the_cutoff_counts_hosted_work_with_the_seed_numbers(conn, db_url, emulator):
    """300 records in one provider batch stand for the seed's 300,000 (rate 85/s becomes 0.085/s)."""
    emulator.hold_after = 40
    make_source(conn, tickets(300))
    job = submit(conn, hosted_spec(emulator.base_url, shard_size=300)).job_version
    done = threading.Event()
    t = threading.Thread(target=lambda: (run_worker(worker_cfg(db_url, job)), done.set()), daemon=True)
    t.start()

    async def poll():
        async with await psycopg.AsyncConnection.connect(db_url, row_factory=psycopg.rows.dict_row) as a:
            return await deadline.poll_counts(a, job)

    def cutoff_at(now: str, succeeded: int):
        wait_for(lambda: any(r["succeeded"] == succeeded for r in batches(conn, job)), what=f"{succeeded} mirrored")
        counts = asyncio.run(poll())
        assert counts["hosted_succeeded"] == succeeded and counts["stored"] == 0
        d = decide(datetime.fromisoformat(now), datetime(2026, 12, 2, 6, 0, tzinfo=UTC), counts["outstanding"],
                   0.085, 1800.0)
        return counts["outstanding"], f"{d.latest_safe_start:%H:%M}"

    assert cutoff_at("2026-12-02T04:00:00+00:00", 40) == (260, "04:39")
    emulator.hold_after = 260
    assert cutoff_at("2026-12-02T05:00:00+00:00", 260) == (40, "05:22")
    emulator.hold_after = None
    assert done.wait(60)
    c = job_counts(conn, job)
    assert c["stored"] == 300 and asyncio.run(poll())["hosted_succeeded"] == 0   # ended: the ledger has them


def test_the_bill_of_a_night_abandoned_at_90_percent():
    prices = Prices()     # the seed's: $0.00725 a row synchronously, hosted batch half of it
    r = cost_report(0, 30_000, prices, hosted_rows=270_000)
    assert cents(r.hosted_cost) == Decimal("978.75") and cents(r.fallback_cost) == Decimal("217.50")
    assert (round(r.hosted_cost), round(r.fallback_cost)) == (979, 218)
    assert r.total <= r.all_synchronous_ceiling == Decimal("2175.00")


def test_cutoff_cancels_mid_batch_and_the_fallback_finishes_the_night(conn, db_url, emulator, capsys):
    emulator.rate = 400.0
    emulator.cancel_delay_s = 0.4
    emulator.hold_after = 200            # each batch stalls after 200 of 500, as a slow provider queue does
    make_source(conn, tickets(2000))
    job = submit(conn, hosted_spec(emulator.base_url)).job_version
    codes: list[int] = []
    workers = [threading.Thread(target=lambda: codes.append(run_worker(worker_cfg(db_url, job))), daemon=True)
               for _ in range(2)]
    for w in workers:
        w.start()
    wait_for(lambda: sum(r["succeeded"] for r in batches(conn, job)) >= 400, what="two batches part done")
    # The real cutoff watch: 30 minutes to the deadline and a 1,800 s overhead, so it fires at its first
    # poll, with outstanding already net of what the provider has succeeded.
    cfg = deadline.config_from_kwargs(job, (datetime.now(UTC) + timedelta(minutes=30)).isoformat(), 0.1,
                                      warned=True)
    event = asyncio.run(deadline.watch(lambda: deadline.connect_async(db_url), cfg))
    assert event["status"] == "cutoff" and event["counts"]["outstanding"] == 2000 - 400
    # The fallback pool starts at once (it puts the job in fallback mode) beside the draining hosted workers.
    chat = ChatServer(lambda body: (200, {}, OK))
    t_fire = time.monotonic()
    try:
        result = run_fallback(db_url, job, chat.base_url, rate=1000.0, concurrency=8)
    finally:
        chat.close()
    for w in workers:
        w.join(60)
    drain_wall = time.monotonic() - t_fire
    assert codes == [0, 0]
    rows = batches(conn, job)
    assert len(rows) == 2 and {r["provider_status"] for r in rows} == {"cancelled"}
    assert {r["state"] for r in rows} == {"reconciled"}
    drains = [r["drain_s"] for r in conn.execute(db.q("hosted_drain"), {"job": job})]
    assert len(drains) == 2 and all(d >= 0.4 for d in drains)
    hosted_stored = int(conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND "
                                     "transport = 'hosted_batch'", (job,)).fetchone()["n"])
    assert hosted_stored == sum(r["succeeded"] for r in rows) >= 400     # the cancelled batches' paid-for part
    assert result.stored == 2000 - hosted_stored
    c = job_counts(conn, job)
    assert c["stored"] == 2000 and c["outstanding"] == 0
    by_transport = {r["transport"]: r["n"] for r in conn.execute(
        "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY transport", (job,))}
    assert by_transport == {"hosted_batch": hosted_stored, "fallback": 2000 - hosted_stored}
    # no record bought twice: what the provider completed was collected, the fallback did the rest
    sent = Counter(json.loads(json.dumps(b["messages"][1]["content"])) for b in chat.bodies)
    assert all(n == 1 for n in sent.values()) and len(sent) == 2000 - hosted_stored
    assert all(n == 1 for n in emulator.billed.values()) and len(emulator.billed) == hosted_stored
    # the fallback run's measured drain (the constants the cutoff re-derives) covers the cancel settling
    run = conn.execute("SELECT drain_s FROM bi.fallback_runs WHERE job_version = %s", (job,)).fetchone()
    assert run["drain_s"] >= emulator.cancel_delay_s
    report = validate(conn, job)
    assert report.passed, report.failures
    publish(conn, job)
    # the night's bill by transport: hosted rows at half the synchronous price, within the all-synchronous ceiling
    assert cli_main(["cost", job, "--db", db_url, "--json"]) == 0
    bill = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["so_far"]
    assert (bill["hosted_rows"], bill["fallback_rows"], bill["batch_rows"]) == (hosted_stored, 2000 - hosted_stored, 0)
    assert bill["hosted_cost"] == float(cents(hosted_stored * Decimal("0.003625")))
    assert bill["total"] <= bill["all_synchronous_ceiling"] == 14.5
    print(f"\nemulated cancel drain per batch: {', '.join(f'{d:.2f}s' for d in drains)} "
          f"(emulator's settle delay {emulator.cancel_delay_s}s); cutoff to nothing outstanding: {drain_wall:.2f}s")
