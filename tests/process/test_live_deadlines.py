"""The deadline's paths on the live Airflow deployment (tests/fixtures/live_airflow.py): a cutoff that fires
at once and the fallback pool through the real llama.cpp server, and a fallback endpoint down for the tail
that pages before the deadline (the autopilot's: test_live_autopilot.py); driven through the REST API, the
ledger read over SQL (the helpers of test_live_airflow.py)."""

from __future__ import annotations

import time

import pytest

from batch_inference import db
from tests.fixtures.chat_server import completion
from tests.process.test_live_airflow import BACKFILL, counts, make_spec, make_table, published_rows

pytestmark = pytest.mark.live


def test_cutoff_firing_at_once_is_redriven_by_the_fallback_through_llama_cpp(live_airflow, webhook_sink,
                                                                              llama_server):
    """The deadline is a minute away, the overhead 30 minutes: the cutoff is already past when the
    sensor starts. The slow batch worker drains; the fallback pool re-drives the rest through the
    real llama.cpp server (the spec's default response format), and the run publishes. By the spec's
    constants (10 minutes to publish, a third of the overhead) the deadline is already lost as the
    cutoff fires, so the sensor pages on-call then; the run still makes it, because this deployment's
    load takes seconds, not the 10 minutes the constants assume."""
    dep = live_airflow
    # Six rows at 4 s a record (24 s of batch work, as twelve at 2 s were): the sensor's first poll fires
    # the cutoff long before the batch could finish them, and the fallback re-drives the rest through the
    # model, the costly part (CPU-seconds a row).
    table = make_table(dep.ledger_url, "live_cutoff", 6)
    spec = make_spec(dep, "live_cutoff", engine={"name": "noop", "options": {"delay_s": 4.0}},
                     renew_seconds=2, fallback={"base_url": llama_server, "rate": 5, "concurrency": 2})
    t0 = time.monotonic()
    run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 3, "workers": 1,
                                    "deadline": "+1m"})
    run = dep.wait_run(BACKFILL, run_id, timeout=500)
    tis = dep.task_instances(BACKFILL, run_id)
    assert run["state"] == "success", dep.explain(BACKFILL, run_id)
    # The cutoff fired in the sensor's first try: no race with the scheduler (apache/airflow#72716).
    assert tis["cutoff"]["try_number"] == 1
    cutoff = dep.xcom(BACKFILL, run_id, "cutoff")
    assert cutoff["fired"] is True
    assert cutoff["page"].startswith("deadline ") and "at 5/s + 600s to publish" in cutoff["page"], cutoff
    msg = webhook_sink.wait_for(lambda m: m.get("job_version") == cutoff["job_version"]
                                and m.get("task_id") == "cutoff", 30)
    assert msg["kind"] == "deadline will be missed" and msg["error"] == cutoff["page"]
    fallback = dep.xcom(BACKFILL, run_id, "fallback")
    job = fallback["job_version"]
    c = counts(dep, job)
    assert fallback["stored"] > 0, fallback
    assert c["status"] == "published" and c["outstanding"] == 0
    assert c["stored"] + c["dead_letters"] == c["records"]
    with db.connect(dep.ledger_url) as conn:
        by = {r["transport"]: r["n"] for r in conn.execute(
            "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY 1", (job,))}
        dupes = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                             (job,)).fetchone()["d"]
    assert by.get("fallback", 0) == fallback["stored"] and dupes == 0
    print(f"cutoff path: trigger to published in {time.monotonic() - t0:.1f} s; cutoff to nothing outstanding "
          f"{fallback['wall_s']} s; {by}")


ROWS, RATE, RESERVE_S = 12, 2.0, 35.0   # the endpoint-down run: its rows, the pool's rate, the page's reserve


def test_a_fallback_endpoint_down_for_the_tail_pages_before_the_deadline_and_the_run_publishes_late(
        live_airflow, webhook_sink):
    """The Airflow fallback pages early: the cutoff fires in time (the deadline not yet lost: no page
    from the sensor), the fallback endpoint answers 503 from then until past the deadline. The fallback
    task pages on-call once the rows left at the pool's limit plus the publish's reserve no longer fit
    before the deadline (the nights' one message), keeps re-driving in the same try, and once the
    endpoint is back the run publishes, late but announced."""
    from datetime import datetime, timedelta, timezone

    from batch_inference.deadline import parse_iso
    from tests.fixtures.chat_server import ChatServer

    answer = completion('{"category": "billing", "priority": "normal", "summary": "charged twice"}')
    up = {"now": False}
    endpoint = ChatServer(lambda body: (200, {}, answer) if up["now"] else
                          (503, {}, {"error": {"message": "down for the night", "type": "server_error"}}))
    try:
        dep = live_airflow
        table = make_table(dep.ledger_url, "live_down", ROWS)
        # The deadline is lost, with the endpoint down, at the page's latest start: the deadline less the
        # rows at 2/s and the reserve (a third of the overhead), floored to the minute as the cutoff and the
        # fallback floor it. The deadline is placed so that this minute, LOST, is the first one at least a
        # minute after the trigger (the run's first four tasks take up to a minute where the suite's workers
        # share the cores) and the floor takes nothing off it: the rows at 2/s and the reserve end 1 s
        # after LOST, whatever the batch did first. The cutoff's own latest start (the rows and the whole
        # overhead) is then two minutes before LOST, at or before the trigger, so the cutoff fires at its
        # first poll with no page from the sensor, and the fallback pages from LOST on, RESERVE_S + 7 s
        # before the deadline.
        now = datetime.now(timezone.utc)
        lost = (now + timedelta(seconds=60)).replace(second=0, microsecond=0) + timedelta(minutes=1)
        deadline = lost + timedelta(seconds=ROWS / RATE + RESERVE_S + 1)
        spec = make_spec(dep, "live_down", engine={"name": "noop", "options": {"delay_s": 5.0}}, renew_seconds=2,
                         fallback={"base_url": endpoint.base_url, "rate": RATE, "overhead_s": 3 * RESERVE_S,
                                   "concurrency": 2})
        run_id = dep.trigger(BACKFILL, {"spec_path": spec, "source_table": table, "shard_size": 3, "workers": 1,
                                        "deadline": deadline.isoformat()})
        dep.wait_task(BACKFILL, run_id, "cutoff", ("success",), timeout=300)
        cutoff = dep.xcom(BACKFILL, run_id, "cutoff")
        assert cutoff["fired"] is True and cutoff["page"] is None, cutoff
        assert parse_iso(cutoff["deadline"]) == deadline, cutoff
        job = cutoff["job_version"]
        left = (deadline - datetime.now(timezone.utc)).total_seconds()
        msg = webhook_sink.wait_for(lambda m: m.get("job_version") == job and m.get("kind") ==
                                    "deadline will be missed", max(1.0, left))
        assert msg["task_id"] == "fallback" and lost <= parse_iso(msg["at"]) < deadline, (msg, lost)
        assert msg["error"].startswith(f"deadline {deadline:%H:%M:%S} will be missed: "), msg["error"]
        assert f"at {RATE:g}/s + {RESERVE_S:g}s to publish" in msg["error"] \
            and "the fallback endpoint is failing" in msg["error"]
        assert counts(dep, job)["outstanding"] > 0
        while datetime.now(timezone.utc) < deadline:
            time.sleep(0.5)
        up["now"] = True                                      # back only after the deadline
        run = dep.wait_run(BACKFILL, run_id, timeout=300)
        tis = dep.task_instances(BACKFILL, run_id)
        assert run["state"] == "success", dep.explain(BACKFILL, run_id)
        assert tis["fallback"]["try_number"] == 1              # re-driven in the same try, no retry needed
        c = counts(dep, job)
        assert c["status"] == "published" and c["outstanding"] == 0 and c["dead_letters"] == 0
        assert c["stored_fallback"] > 0 and published_rows(dep, "live_down") == ROWS
        assert parse_iso(tis["publish"]["end_date"]) > deadline          # late, and paged before it
        pages = [m for m in webhook_sink.received if m.get("job_version") == job]
        assert [m["task_id"] for m in pages] == ["fallback"], pages      # one page, no task failed
        print(f"endpoint down for the tail: paged {(deadline - parse_iso(msg['at'])).total_seconds():.0f} s "
              f"before the deadline; published {(parse_iso(tis['publish']['end_date']) - deadline).total_seconds():.0f}"
              " s after it")
    finally:
        endpoint.close()
