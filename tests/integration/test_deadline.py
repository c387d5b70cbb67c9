"""The cutoff watch, the trigger and the sensor against the real embedded PostgreSQL.

The trigger must never block the triggerer's event loop: the first test
injects a one-second query into every poll and measures the loop's lag
while the real ``CutoffTrigger.run()`` polls through it.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

# Airflow reads its configuration at import; keep it away from ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bi-airflow-"))

from batch_inference import db  # noqa: E402
from batch_inference import deadline as watchlib  # noqa: E402
from batch_inference.cost import Prices  # noqa: E402
from batch_inference.cutoff import DerivedConstants, FallbackRun, history_params  # noqa: E402
from batch_inference.plan import submit  # noqa: E402
from tests.conftest import make_source, make_spec, tickets  # noqa: E402

UTC = timezone.utc


def now() -> datetime:
    return datetime.now(UTC)


def new_job(conn, n: int = 40, **spec_over: Any) -> str:
    make_source(conn, tickets(n))
    return submit(conn, make_spec(**spec_over)).job_version


def store(conn, job: str, shard: int, k: int, transport: str = "batch") -> None:
    """Write k results into a shard through the real ledger functions (claim, put, release)."""
    lease = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'test', %s, 60)", (job, transport)).fetchone()
    ids = [r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no = %s ORDER BY record_id LIMIT %s",
        (job, lease["shard_no"], k))]
    conn.execute(db.q("put_results"), {"job": job, "shard": lease["shard_no"], "epoch": lease["epoch"],
                                       "owner": "test", "transport": transport, "engine": "noop",
                                       "endpoint": "local", "ids": ids,
                                       "outputs": ['{"category": "bug", "summary": "x"}'] * len(ids),
                                       "categories": ["bug"] * len(ids)})
    conn.execute("SELECT bi.release_shard_v2(%s, %s, %s, 'test')", (job, lease["shard_no"], lease["epoch"]))


def cfg(job: str, deadline: datetime, **kw: Any) -> watchlib.WatchConfig:
    return watchlib.WatchConfig(job_version=job, deadline=deadline, **kw)


def run_watch(db_url: str, c: watchlib.WatchConfig, **kw: Any) -> dict[str, Any]:
    return asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), c, **kw))


# -- the decision, pure --------------------------------------------------------


def ctx(rate: float = 85.0, overhead: float = 1800.0) -> watchlib.JobContext:
    return watchlib.JobContext("jv_x", "tickets_triage", make_spec(),
                               DerivedConstants(rate, overhead, "test constants"), Prices())


def counts(stored: int, outstanding: int, mode: str = "batch", first_claim_at: datetime | None = None) -> dict:
    return {"records": stored + outstanding, "stored": stored, "stored_batch": stored, "stored_fallback": 0,
            "reused": 0, "dead_letters": 0, "outstanding": outstanding, "mode": mode, "status": "running",
            "shards": {"pending": 1, "leased": 0, "done": 0}, "first_claim_at": first_claim_at}


D = datetime(2025, 3, 5, 6, 0, tzinfo=UTC)


def test_evaluate_the_seed_nights():
    good = watchlib.evaluate(cfg("jv_x", D), ctx(), counts(260_000, 40_000), datetime(2025, 3, 5, 5, 0, tzinfo=UTC))
    assert good.status == "wait" and f"{good.decision.latest_safe_start:%H:%M}" == "05:22"
    bad = watchlib.evaluate(cfg("jv_x", D), ctx(), counts(40_000, 260_000), datetime(2025, 3, 5, 4, 39, tzinfo=UTC))
    assert bad.status == "cutoff" and "moving cutoff" in bad.reason
    done = watchlib.evaluate(cfg("jv_x", D), ctx(), counts(300_000, 0), datetime(2025, 3, 5, 5, 59, tzinfo=UTC))
    assert done.status == "complete"


def test_evaluate_early_warning_once():
    # The seed's example: 150,000 of 300,000 in 4 h projects to 06:00, past the cutoff.
    c = counts(150_000, 150_000, first_claim_at=datetime(2025, 3, 4, 22, 0, tzinfo=UTC))
    t = datetime(2025, 3, 5, 2, 0, tzinfo=UTC)
    v = watchlib.evaluate(cfg("jv_x", D), ctx(), c, t)
    assert v.status == "early_warning" and v.warning is not None
    assert f"{v.warning.fire_at:%H:%M}" == "05:25"
    assert watchlib.evaluate(cfg("jv_x", D, warned=True), ctx(), c, t).status == "wait"


def test_evaluate_relabel_and_already_fired():
    relabel = datetime(2025, 3, 5, 4, 30, tzinfo=UTC)
    c = counts(299_000, 1_000)
    before = watchlib.evaluate(cfg("jv_x", D, relabel_at=relabel), ctx(), c, relabel - timedelta(seconds=1))
    assert before.status == "wait" and before.sleep_hint_s == pytest.approx(1.0)
    at = watchlib.evaluate(cfg("jv_x", D, relabel_at=relabel), ctx(), c, relabel)
    assert at.status == "cutoff" and "relabel" in at.reason       # a nearly finished batch: fires anyway
    fired = watchlib.evaluate(cfg("jv_x", D), ctx(), counts(10, 5, mode="fallback"), D - timedelta(hours=5))
    assert fired.status == "cutoff" and "already in fallback mode" in fired.reason


def test_constants_override_beats_history_beats_spec():
    from batch_inference.cutoff import FallbackRun

    spec = make_spec(fallback={"rate": 50, "overhead_s": 900})
    k0 = watchlib.choose_constants(spec, [], None, None)
    assert (k0.rate, k0.overhead_s) == (50.0, 900.0) and k0.source.startswith("configured")
    hist = [FallbackRun(records=6000, rate=60.0, overhead_s=1500.0), FallbackRun(records=6000, rate=70.0, overhead_s=1000.0)]
    k = watchlib.choose_constants(spec, hist, None, None)
    # Partial runs (no drain or load measured) only tighten: the longer overhead counts, the faster rate does not.
    assert (k.rate, k.overhead_s) == (50.0, 1500.0) and k.source.startswith("history")
    o = watchlib.choose_constants(spec, hist, 85.0, None)
    assert (o.rate, o.overhead_s) == (85.0, 1500.0) and o.source.startswith("override")


# -- against the database ------------------------------------------------------


def test_poll_counts_is_the_shard_table_view(conn, db_url):
    from batch_inference.status import job_counts

    job = new_job(conn)
    store(conn, job, 0, 7)

    async def go():
        async with await watchlib.connect_async(db_url) as a:
            return await watchlib.poll_counts(a, job)

    got = asyncio.run(go())
    want = job_counts(conn, job)
    # the ledger's counts, plus the hosted term (no hosted batch in flight here)
    assert {k: got[k] for k in want} == want and got["stored"] == 7 and got["outstanding"] == 33
    assert got["hosted_in_flight"] == got["hosted_succeeded"] == 0


def test_watch_records_progress_and_fires_at_the_moving_cutoff(conn, db_url, caplog):
    job = new_job(conn)
    store(conn, job, 0, 10)
    # 30 outstanding at 10/s is 3 s plus 2 s overhead: the cutoff is 5 s before the deadline.
    deadline = now() + timedelta(seconds=6.5)
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="batch_inference.deadline"):
        # warned: the stalled batch would otherwise (rightly) end the watch with an early warning first.
        ev = run_watch(db_url, cfg(job, deadline, poll_interval_s=0.2, rate=10.0, overhead_s=2.0, step_s=1,
                                   warned=True))
    waited = time.monotonic() - t0
    assert ev["status"] == "cutoff", ev
    assert 0.4 <= waited < 3.5                       # fired on time, not a poll interval late
    assert ev["counts"]["outstanding"] == 30 and ev["constants"]["source"].startswith("override")
    rows = conn.execute("SELECT * FROM bi.progress WHERE job_version = %s ORDER BY at", (job,)).fetchall()
    assert len(rows) == ev["polls"] >= 2
    assert rows[-1]["outstanding"] == 30 and rows[-1]["stored"] == 10 and rows[-1]["deadline"] == deadline
    assert rows[-1]["latest_safe_start"] == deadline.replace(microsecond=0) - timedelta(seconds=5)
    lines = [r.getMessage() for r in caplog.records]
    assert any("10 done, 30 outstanding" in m and "cutoff" in m for m in lines)
    assert any("override" in m for m in lines)       # which constants were used is logged once
    json.dumps(ev)                                   # the payload must be JSON for the trigger event


def test_watch_takes_rate_and_overhead_from_history(conn, db_url, caplog):
    job = new_job(conn, fallback={"rate": 85, "overhead_s": 1800, "history_runs": 2})
    for i, (rate, overhead) in enumerate([(1.0, 9999.0), (40.0, 600.0), (50.0, 700.0)]):
        conn.execute("INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, rate, "
                     "overhead_s) VALUES ('old', 'tickets_triage', now() - interval '1 day', "
                     "now() - make_interval(hours => %s), 100000, %s, %s)", (10 - i, rate, overhead))
    with caplog.at_level("INFO", logger="batch_inference.deadline"):
        ev = run_watch(db_url, cfg(job, now() + timedelta(hours=2)), max_polls=1)
    assert ev["status"] == "wait"
    # The last two runs, both partial (recorded without drain or load): the slower rate (40/s, the
    # median of the slowest half of 40 and 50) tightens; their shorter overhead (720 s) cannot relax 1,800 s.
    assert (ev["constants"]["rate"], ev["constants"]["overhead_s"]) == (40.0, 1800.0)
    assert any("history (2 recent fallback runs, 0 complete)" in r.getMessage() and
               "history would give 720 s" in r.getMessage() for r in caplog.records)


def insert_run(conn, job: str, *, rate: float, overhead_s: float, hours_ago: float, records: int = 100_000,
               drain_s: float | None = 60.0, load_s: float | None = 300.0) -> None:
    conn.execute("INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, rate, "
                 "overhead_s, drain_s, busy_s, load_s) VALUES (%s, 'tickets_triage', now() - interval '2 days', "
                 "now() - make_interval(hours => %s), %s, %s, %s, %s, %s, %s)",
                 (job, hours_ago, records, rate, overhead_s, drain_s, records / rate, load_s))


def test_watch_relaxes_the_constants_only_on_enough_complete_runs(conn, db_url, caplog):
    job = new_job(conn, fallback={"rate": 85, "overhead_s": 1800, "min_history_runs": 3})
    for i in range(2):
        insert_run(conn, f"old{i}", rate=100.0, overhead_s=900.0, hours_ago=30 - i)
    insert_run(conn, "short", rate=100.0, overhead_s=0.0, hours_ago=20, records=300)        # 3 s re-drive
    insert_run(conn, "partial", rate=100.0, overhead_s=100.0, hours_ago=19, load_s=None)    # never published
    ev = run_watch(db_url, cfg(job, now() + timedelta(hours=2)), max_polls=1)
    assert (ev["constants"]["rate"], ev["constants"]["overhead_s"]) == (85.0, 1800.0)
    assert "overhead 1,800 s configured (2 complete runs of the 3 needed to relax it; history would give 1,200 s)" \
        in ev["constants"]["source"]
    insert_run(conn, "old2", rate=100.0, overhead_s=900.0, hours_ago=10)
    with caplog.at_level("INFO", logger="batch_inference.deadline"):
        ev = run_watch(db_url, cfg(job, now() + timedelta(hours=2)), max_polls=1)
    # Three complete runs: 100/s, 900 s + 300 s load.
    assert (ev["constants"]["rate"], ev["constants"]["overhead_s"]) == (100.0, 1200.0)
    assert any("history (5 recent fallback runs, 3 complete)" in r.getMessage() for r in caplog.records)


def test_fallback_run_records_the_drain_from_batch_lease_ends(conn, db_url):
    from batch_inference.fallback import enter_fallback

    job = new_job(conn, n=20, shard_size=10)
    lease = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'batch-w', 'batch', 60)", (job,)).fetchone()
    assert enter_fallback(conn, job)
    j = conn.execute(db.q("cutoff_job"), {"job": job}).fetchone()
    params = {"job": job, "dataset": j["dataset"], "started_at": j["fallback_at"], "finished_at": j["db_now"],
              "records": 20, "rate": 10.0, "overhead_s": 1.0, "busy_s": 2.0}
    with pytest.raises(RuntimeError, match="probe"):   # roll the insert back: it is only a probe
        with conn.transaction():
            r = conn.execute(db.q("fallback_run_insert"), params).fetchone()
            assert r["drain_s"] is None          # a batch worker still holds a lease: the drain is not over
            raise RuntimeError("probe")
    conn.execute("SELECT bi.release_shard_v2(%s, %s, %s, 'batch-w')", (job, lease["shard_no"], lease["epoch"]))
    ended = conn.execute("SELECT batch_lease_ended_at FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (job, lease["shard_no"])).fetchone()["batch_lease_ended_at"]
    assert ended is not None and ended >= j["fallback_at"]
    r = conn.execute(db.q("fallback_run_insert"), params).fetchone()
    assert r["drain_s"] == pytest.approx((ended - j["fallback_at"]).total_seconds(), abs=1e-6)
    run = conn.execute("SELECT * FROM bi.fallback_runs WHERE id = %s", (r["id"],)).fetchone()
    assert (run["busy_s"], run["load_s"]) == (2.0, None)        # not complete until publish records the load

    # No batch lease when the cutoff fired: the drain is 0.
    job2 = new_job(conn, n=10)
    assert enter_fallback(conn, job2)
    j2 = conn.execute(db.q("cutoff_job"), {"job": job2}).fetchone()
    r2 = conn.execute(db.q("fallback_run_insert"), params | {"job": job2, "started_at": j2["fallback_at"]}).fetchone()
    assert r2["drain_s"] == 0.0


def test_publish_records_the_load_time_on_the_jobs_fallback_run(conn, db_url):
    from batch_inference.fallback import add_load_time
    from batch_inference.publish import publish
    from batch_inference.validate import validate
    from tests.integration.test_validate import finish

    job = new_job(conn, n=20)
    finish(db_url, job)
    assert validate(conn, job).passed
    conn.execute("INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, rate, "
                 "overhead_s, drain_s, busy_s) VALUES (%s, 'tickets_triage', now() - interval '3 hours', "
                 "now() - interval '1 hour', 20, 0.1, 600, 120, 200)", (job,))
    assert add_load_time(conn, job) is None          # not published yet: nothing to measure
    out = publish(conn, job)
    assert out["changed"]
    run = conn.execute("SELECT * FROM bi.fallback_runs WHERE job_version = %s", (job,)).fetchone()
    switched = conn.execute("SELECT switched_at FROM bi.publish_pointer WHERE dataset = 'tickets_triage'"
                            ).fetchone()["switched_at"]
    # From nothing outstanding (finished_at) to the pointer switch, on the database clock.
    assert run["load_s"] == pytest.approx((switched - run["finished_at"]).total_seconds(), abs=1e-6)
    assert run["load_s"] >= 3600
    # Recorded once: a repeated publish or a second call keeps it.
    assert publish(conn, job)["changed"] is False
    assert add_load_time(conn, job, 5.0) == pytest.approx(600 + run["load_s"])
    assert conn.execute("SELECT load_s FROM bi.fallback_runs WHERE job_version = %s", (job,)
                        ).fetchone()["load_s"] == run["load_s"]
    # The run now measured every part; the history reads it as complete.
    rows = conn.execute(db.q("fallback_history"), history_params("tickets_triage", 5)).fetchall()
    assert [FallbackRun.from_row(r).complete for r in rows] == [True]
    # A job without a fallback run publishes as before.
    other = new_job(conn, n=5)
    finish(db_url, other)
    assert validate(conn, other).passed and publish(conn, other)["changed"]


def test_watch_completes_when_nothing_is_outstanding(conn, db_url):
    job = new_job(conn, n=5)
    store(conn, job, 0, 5)
    ev = run_watch(db_url, cfg(job, now() + timedelta(hours=1)))
    assert ev["status"] == "complete" and ev["counts"]["stored"] == 5 and ev["polls"] == 1


def test_watch_unknown_job_and_unreachable_database(db_url):
    assert run_watch(db_url, cfg("jv_missing", now() + timedelta(hours=1)))["status"] == "error"

    async def refused():
        raise psycopg.OperationalError("connection refused")

    slept: list[float] = []

    async def sleep(s):
        slept.append(s)

    ev = asyncio.run(watchlib.watch(refused, cfg("jv_x", now() + timedelta(seconds=0.05)), sleep=sleep,
                                    now=lambda: now() + timedelta(seconds=len(slept))))
    assert ev["status"] == "error" and "unreachable past the deadline" in ev["message"]


# -- the trigger ---------------------------------------------------------------

SLOW_COUNTS = """
ALTER FUNCTION bi.job_counts_v1(text) RENAME TO job_counts_v1_fast;
CREATE FUNCTION bi.job_counts_v1(p_job text)
RETURNS TABLE (records bigint, stored bigint, stored_batch bigint, stored_fallback bigint, reused bigint,
               dead_letters bigint, outstanding bigint, shards_pending bigint, shards_leased bigint,
               shards_done bigint, mode text, status text, first_claim_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(1);   -- a slow poll: a loaded database, a lock wait
    RETURN QUERY SELECT * FROM bi.job_counts_v1_fast(p_job);
END $$;
"""


async def lag_monitor(stop: asyncio.Event, tick: float = 0.01) -> float:
    """The worst delay of a 10 ms sleep: how long the loop was blocked by someone else."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(tick)
        worst = max(worst, loop.time() - t - tick)
    return worst


def test_trigger_never_blocks_the_event_loop(conn, db_url, monkeypatch):
    from batch_inference.triggers.cutoff import CutoffTrigger

    job = new_job(conn)
    conn.execute(SLOW_COUNTS)
    monkeypatch.setenv(db.DB_ENV, db_url)
    trigger = CutoffTrigger(job_version=job, deadline=(now() + timedelta(hours=1)).isoformat(), poll_interval=0.1)

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        monitor = asyncio.create_task(lag_monitor(stop))
        events = trigger.run()
        with pytest.raises(TimeoutError):
            # Three or so polls, each one a second inside PostgreSQL.
            await asyncio.wait_for(anext(events), timeout=3.5)
        await events.aclose()
        stop.set()
        trigger_lag = await monitor
        # The monitor itself: a blocking call on the loop does show up.
        stop2 = asyncio.Event()
        monitor2 = asyncio.create_task(lag_monitor(stop2))
        await asyncio.sleep(0.05)
        with psycopg.connect(db_url) as c:
            c.execute("SELECT pg_sleep(0.3)")
        stop2.set()
        return trigger_lag, await monitor2

    trigger_lag, blocking_lag = asyncio.run(scenario())
    polls = conn.execute("SELECT count(*) AS n FROM bi.progress WHERE job_version = %s", (job,)).fetchone()["n"]
    print(f"\nevent-loop lag over {polls} one-second polls: worst {trigger_lag * 1000:.1f} ms "
          f"(a blocking 0.3 s query: {blocking_lag * 1000:.0f} ms)")
    assert polls >= 2
    assert trigger_lag < 0.1
    assert blocking_lag > 0.25


def test_serialize_round_trips_and_carries_no_secrets(monkeypatch):
    from airflow.sdk._shared.module_loading import import_string
    from airflow.sdk.serde import deserialize, serialize

    from batch_inference.triggers.cutoff import CutoffTrigger

    monkeypatch.setenv("AIRFLOW_CONN_BI_LEDGER", json.dumps({
        "conn_type": "postgres", "host": "db.internal", "login": "bi", "password": "s3cret-pw", "schema": "ledger"}))
    t = CutoffTrigger(job_version="jv_0123456789abcdef", deadline="2026-03-05T06:00:00+01:00", poll_interval=120,
                      rate=85.0, overhead_s=1800.0, postgres_conn_id="bi_ledger",
                      relabel_at="2026-03-05T04:30:00+01:00", step_s=60)
    path, kwargs = t.serialize()
    assert path == "batch_inference.triggers.cutoff.CutoffTrigger"
    assert kwargs == {"job_version": "jv_0123456789abcdef", "deadline": "2026-03-05T06:00:00+01:00",
                      "poll_interval": 120.0, "rate": 85.0, "overhead_s": 1800.0,
                      "relabel_at": "2026-03-05T04:30:00+01:00", "warned": False, "step_s": 60,
                      "since": None, "paged": False, "postgres_conn_id": "bi_ledger"}
    text = json.dumps(kwargs)
    for secret in ("s3cret-pw", "db.internal", "postgresql://", "@"):
        assert secret not in text
    # As the scheduler stores it and dag.test / the triggerer rebuild it.
    again = import_string(path)(**deserialize(serialize(kwargs)))
    assert again.serialize() == (path, kwargs)
    with pytest.raises(ValueError):
        CutoffTrigger(job_version="jv_x", deadline="not a time")


def test_trigger_resolves_an_airflow_connection_without_blocking(conn, db_url, monkeypatch):
    """The async connection getter: the conn id in, a conninfo out, the watch runs."""
    from psycopg.conninfo import conninfo_to_dict

    from batch_inference.triggers.cutoff import CutoffTrigger

    job = new_job(conn, n=5)
    store(conn, job, 0, 5)
    parts = conninfo_to_dict(db_url)
    monkeypatch.setenv("AIRFLOW_CONN_BI_LEDGER", json.dumps({
        "conn_type": "postgres", "host": parts["host"], "login": parts["user"], "schema": parts["dbname"],
        "extra": {"sslmode": "disable", "not_a_libpq_option": "x"}}))
    monkeypatch.delenv(db.DB_ENV, raising=False)
    t = CutoffTrigger(job_version=job, deadline=(now() + timedelta(hours=1)).isoformat(), postgres_conn_id="bi_ledger")

    async def first():
        return await anext(t.run())

    ev = asyncio.run(first())
    assert ev.payload["status"] == "complete", ev.payload
    no_db = CutoffTrigger(job_version=job, deadline=(now() + timedelta(hours=1)).isoformat())
    ev = asyncio.run(anext(no_db.run()))
    assert ev.payload["status"] == "error" and "BATCH_INFERENCE_DB" in ev.payload["message"]


# -- the sensor (execute / execute_complete, without a scheduler) ---------------


class Deferred(Exception):
    pass


def default_connection(monkeypatch, db_url: str) -> None:
    """The ledger as the Airflow connection the sensor defaults to (``batch_inference_default``)."""
    from batch_inference.db import airflow_connection_json

    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", airflow_connection_json(db_url))


def sensor_context(run_after: datetime) -> dict[str, Any]:
    class DagRun:
        pass

    dr = DagRun()
    dr.run_after = run_after
    return {"dag_run": dr, "logical_date": run_after}


def test_sensor_defers_with_the_right_trigger(conn, db_url, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from batch_inference.sensors.cutoff import CutoffSensor

    job = new_job(conn)
    default_connection(monkeypatch, db_url)
    s = CutoffSensor(task_id="cutoff", job_version=job, deadline="06:00", relabel_at="04:30", tz="Europe/Berlin",
                     poll_interval=120)
    with pytest.raises(TaskDeferred) as exc:
        s.execute(sensor_context(datetime(2031, 3, 4, 21, 0, tzinfo=UTC)))   # 22:00 in Berlin
    _, kwargs = exc.value.trigger.serialize()
    assert kwargs["deadline"] == "2031-03-05T06:00:00+01:00"              # the next morning, Berlin time
    assert kwargs["relabel_at"] == "2031-03-05T04:30:00+01:00"
    assert kwargs["poll_interval"] == 120.0 and kwargs["postgres_conn_id"] == "batch_inference_default"
    assert exc.value.method_name == "execute_complete"


def test_sensor_refuses_a_hosted_fallback_before_waiting(conn, db_url, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.sensors.cutoff import CutoffSensor

    job = new_job(conn, fallback={"hosted": True, "base_url": "https://api.example.com/v1"})
    default_connection(monkeypatch, db_url)
    s = CutoffSensor(task_id="cutoff", job_version=job, deadline="06:00")
    with pytest.raises(AirflowFailException, match="not cleared for hosted APIs"):
        s.execute(sensor_context(now()))


def test_sensor_early_warning_notifies_once_and_watches_on(conn, db_url, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from batch_inference.sensors.cutoff import CutoffSensor

    default_connection(monkeypatch, db_url)
    got: list[dict] = []

    def broken(context, event):
        raise RuntimeError("the pager is down")

    s = CutoffSensor(task_id="cutoff", job_version="jv_x", deadline="06:00",
                     on_early_warning=[broken, lambda context, event: got.append(event)])
    watch = {"job_version": "jv_x", "deadline": "2026-03-05T06:00:00+00:00", "poll_interval": 60.0, "rate": None,
             "overhead_s": None, "relabel_at": None, "warned": False, "step_s": 60}
    event = {"status": "early_warning", "reason": "batch projected to finish 06:10", "warning": {"message": "m"},
             "watch": watch}
    with pytest.raises(TaskDeferred) as exc:
        s.execute_complete({}, event)
    assert got == [event]                              # the broken notifier did not stop the next one
    assert exc.value.trigger.serialize()[1]["warned"] is True


def test_relabel_mode_fires_at_the_fixed_time_with_nothing_else(conn, db_url, monkeypatch):
    """No worker, no cutoff in sight (an hour of slack): only the clock fires it."""
    from batch_inference.sensors.cutoff import CutoffSensor
    from batch_inference.triggers.cutoff import CutoffTrigger

    job = new_job(conn)
    monkeypatch.setenv(db.DB_ENV, db_url)
    default_connection(monkeypatch, db_url)
    relabel = now() + timedelta(seconds=1.5)
    t = CutoffTrigger(job_version=job, deadline=(now() + timedelta(hours=1)).isoformat(), poll_interval=30,
                      rate=1000.0, overhead_s=60.0, relabel_at=relabel.isoformat())
    t0 = time.monotonic()
    ev = asyncio.run(anext(t.run())).payload
    fired_at = now()
    assert ev["status"] == "cutoff" and "relabel mode" in ev["reason"], ev
    # At the fixed time, not a 30 s poll interval later.
    assert relabel <= fired_at < relabel + timedelta(seconds=1), (relabel, fired_at)
    assert time.monotonic() - t0 < 5
    assert ev["counts"]["outstanding"] == 40 and ev["decision"]["fire"] is False   # the moving cutoff was far off
    s = CutoffSensor(task_id="cutoff", job_version=job, deadline="06:00")
    out = s.execute_complete({}, ev)
    assert out["fired"] is True and out["entered_fallback"] is True
    assert conn.execute("SELECT mode FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["mode"] == "fallback"


def test_sensor_decides_a_past_cutoff_at_its_first_poll_without_deferring(conn, db_url, monkeypatch):
    """The apache/airflow#72716 workaround: a trigger that would fire at once is never created."""
    from batch_inference.sensors.cutoff import CutoffSensor

    job = new_job(conn)
    default_connection(monkeypatch, db_url)
    s = CutoffSensor(task_id="cutoff", job_version=job, deadline=(now() + timedelta(minutes=1)).isoformat())
    summary = s.execute(sensor_context(now()))           # no TaskDeferred
    assert summary["fired"] is True and summary["entered_fallback"] is True
    from batch_inference.status import job_counts

    assert job_counts(conn, job)["mode"] == "fallback"


def test_sensor_fails_without_deferring_when_the_workers_halted_the_job(conn, db_url, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.sensors.cutoff import CutoffSensor

    job = new_job(conn)
    default_connection(monkeypatch, db_url)
    started = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    conn.execute(db.q("halt_job"), {"job": job, "reason": "fatal: refusing to start: weights digest mismatch"})
    ctx = sensor_context(datetime(2031, 3, 4, 21, 0, tzinfo=UTC))
    ctx["dag_run"].start_date = started
    s = CutoffSensor(task_id="cutoff", job_version=job, deadline="06:00")
    with pytest.raises(AirflowFailException, match="cannot work.*digest mismatch"):
        s.execute(ctx)


def test_watch_ends_on_a_halt_after_its_run_began_and_ignores_older_ones(conn, db_url):
    job = new_job(conn)
    conn.execute(db.q("halt_job"), {"job": job, "reason": "engine 'x': bad option"})
    halted = conn.execute(db.q("job_halt"), {"job": job}).fetchone()["halted_at"]
    deadline = (now() + timedelta(days=2)).isoformat()
    # A run re-queued after the halt (cleared) watches on; one begun before it ends.
    later = watchlib.config_from_kwargs(job, deadline, since=(halted + timedelta(seconds=1)).isoformat())
    assert asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), later, max_polls=1))["status"] == "wait"
    earlier = watchlib.config_from_kwargs(job, deadline, since=(halted - timedelta(seconds=1)).isoformat())
    out = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), earlier, max_polls=1))
    assert out["status"] == "halted" and "bad option" in out["message"]



def test_sensor_pages_at_once_when_the_deadline_is_already_lost_as_the_cutoff_fires(conn, db_url, monkeypatch,
                                                                                       tmp_path):
    """A cutoff that fires late (a late submit, a triggerer that was down) with the deadline already lost
    pages on-call then, with the nights' one message, not at the deadline; one that fires in time does not."""
    import json

    from batch_inference.sensors.cutoff import CutoffSensor

    pages = tmp_path / "oncall.jsonl"
    monkeypatch.setenv("BATCH_INFERENCE_ONCALL_FILE", str(pages))
    default_connection(monkeypatch, db_url)
    # Default constants: 85 rows/s, 1,800 s overhead, of which a third (600 s) is the publish's reserve.
    job = new_job(conn)
    in_time = CutoffSensor(task_id="cutoff", job_version=job, deadline=(now() + timedelta(minutes=20)).isoformat())
    summary = in_time.execute(sensor_context(now()))
    assert summary["fired"] is True and summary["page"] is None and not pages.exists()

    late = new_job(conn, dataset="late_night")
    deadline = now() + timedelta(minutes=1)
    s = CutoffSensor(task_id="cutoff", job_version=late, deadline=deadline.isoformat())
    summary = s.execute(sensor_context(now()))
    assert summary["fired"] is True and summary["entered_fallback"] is True
    assert summary["page"].startswith(f"deadline {deadline:%H:%M:%S} will be missed: 40 rows outstanding need 0.5s "
                                      "at 85/s + 600s to publish"), summary["page"]
    assert "; the cutoff fired at " in summary["page"] and "latest safe start" in summary["page"]
    (msg,) = [json.loads(line) for line in pages.read_text().splitlines()]
    assert msg["kind"] == "deadline will be missed" and msg["job_version"] == late
    assert msg["error"] == summary["page"] and msg["counts"]["outstanding"] == 40
