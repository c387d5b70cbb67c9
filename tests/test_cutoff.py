"""The moving cutoff: the seed's worked nights, its properties, and the CLI."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch_inference.cutoff import (
    FallbackRun,
    decide,
    derive_rate_and_overhead,
    early_warning,
    fallback_seconds,
    latest_safe_start,
    parse_clock,
    projected_finish,
    relabel_start,
)

UTC = timezone.utc
NIGHT = datetime(2025, 3, 4, 22, 0, tzinfo=UTC)  # batch submitted
DEADLINE = datetime(2025, 3, 5, 6, 0, tzinfo=UTC)  # warehouse table loaded
RATE, OVERHEAD = 85.0, 1800.0


def at(hh: int, mm: int = 0) -> datetime:
    return datetime(2025, 3, 5, hh, mm, tzinfo=UTC)


# -- the seed's numbers ------------------------------------------------------


@pytest.mark.parametrize(
    "outstanding, cutoff, exact",
    [
        (40_000, at(5, 22), "05:22:09"),  # 260,000 of 300,000 served: 8 min re-drive + 30
        (260_000, at(4, 39), "04:39:01"),  # 40,000 served: 51 min + 30
        (300_000, at(4, 31), "04:31:10"),  # nothing served: 59 min + 30
    ],
)
def test_seed_cutoffs(outstanding, cutoff, exact):
    assert latest_safe_start(DEADLINE, outstanding, RATE, OVERHEAD) == cutoff
    assert f"{latest_safe_start(DEADLINE, outstanding, RATE, OVERHEAD, step_s=0):%H:%M:%S}" == exact


def test_seed_single_number_is_0430():
    # The seed's one fixed number rounds the 59-minute re-drive up to an hour;
    # flooring the full-volume cutoff to the half hour gives the same 04:30.
    assert latest_safe_start(DEADLINE, 300_000, RATE, OVERHEAD, step_s=1800) == at(4, 30)


def test_fallback_seconds():
    assert fallback_seconds(0, RATE, OVERHEAD) == 1800
    assert fallback_seconds(40_000, RATE, OVERHEAD) == pytest.approx(1800 + 470.588, abs=1e-3)
    with pytest.raises(ValueError):
        fallback_seconds(1, 0, OVERHEAD)
    with pytest.raises(ValueError):
        fallback_seconds(-1, RATE, OVERHEAD)


def test_decide_fires_at_the_cutoff_not_before():
    before = decide(at(5, 21), DEADLINE, 40_000, RATE, OVERHEAD, done=260_000)
    on = decide(at(5, 22), DEADLINE, 40_000, RATE, OVERHEAD, done=260_000)
    assert not before.fire and on.fire
    assert on.fallback_s == pytest.approx(2270.588, abs=1e-3)
    assert not on.complete
    line = before.log_line("jv_abc")
    assert "260,000 done" in line and "40,000 outstanding" in line and "cutoff 05:22" in line
    assert "needs 38 min" in line


def test_complete_job_never_fires():
    d = decide(at(5, 59), DEADLINE, 0, RATE, OVERHEAD, done=300_000)
    assert d.complete and not d.fire
    assert "nothing to re-drive" in d.log_line()


@settings(max_examples=200, deadline=None)
@given(
    a=st.integers(0, 10_000_000),
    b=st.integers(0, 10_000_000),
    rate=st.floats(0.1, 10_000),
    overhead=st.floats(0, 20_000),
)
def test_more_outstanding_never_moves_the_cutoff_later(a, b, rate, overhead):
    lo, hi = sorted((a, b))
    assert latest_safe_start(DEADLINE, hi, rate, overhead) <= latest_safe_start(DEADLINE, lo, rate, overhead)
    # and flooring only ever moves it earlier than the exact figure
    assert latest_safe_start(DEADLINE, lo, rate, overhead) <= latest_safe_start(DEADLINE, lo, rate, overhead, step_s=0)


def test_arithmetic_is_done_in_real_seconds_across_a_clock_change():
    # Europe/Berlin springs forward at 02:00 on 2025-03-30, so that night is
    # an hour short. 06:00 local is 04:00 UTC; five real hours earlier is
    # 23:00 UTC, which is 00:00 local. Wall-clock arithmetic would say 01:00
    # and start the fallback an hour late.
    berlin = ZoneInfo("Europe/Berlin")
    deadline = datetime(2025, 3, 30, 6, 0, tzinfo=berlin)
    start = latest_safe_start(deadline, 5 * 3600 * 85, 85.0, 0.0)
    assert start.astimezone(UTC) == datetime(2025, 3, 29, 23, 0, tzinfo=UTC)
    assert f"{start:%H:%M}" == "00:00"


def test_naive_datetimes_are_utc():
    naive = datetime(2025, 3, 5, 6, 0)
    assert latest_safe_start(naive, 40_000, RATE, OVERHEAD) == at(5, 22)


# -- clock parsing and relabel mode ---------------------------------------------


def test_parse_clock_rolls_to_the_next_morning():
    assert parse_clock("06:00", NIGHT) == DEADLINE
    assert parse_clock("06:00", at(4, 0)) == at(6, 0)
    assert parse_clock("04:00", at(5, 0), roll=False) == at(4, 0)
    assert parse_clock("2025-03-05T06:00:00+00:00", NIGHT) == DEADLINE
    berlin = ZoneInfo("Europe/Berlin")
    d = parse_clock("06:00", NIGHT, tz=berlin)
    assert d == datetime(2025, 3, 5, 6, 0, tzinfo=berlin)
    for bad in ("6", "25:00", "06:60", "six"):
        with pytest.raises(ValueError):
            parse_clock(bad, NIGHT)


def test_relabel_start_is_the_fixed_time_before_the_deadline():
    assert relabel_start(DEADLINE, "04:30") == at(4, 30)
    assert relabel_start(DEADLINE, time(23, 0)) == datetime(2025, 3, 4, 23, 0, tzinfo=UTC)
    # 04:30 leaves room to re-drive the whole night: it is no later than the
    # cutoff with every row outstanding.
    assert relabel_start(DEADLINE, "04:30") <= latest_safe_start(DEADLINE, 300_000, RATE, OVERHEAD)


# -- projection and early warning -------------------------------------------------


def test_projected_finish():
    # 150,000 of 300,000 in 4 h: the other half takes 4 h more.
    assert projected_finish(NIGHT, at(2, 0), 150_000, 300_000) == at(6, 0)
    assert projected_finish(NIGHT, at(2, 0), 0, 300_000) is None
    assert projected_finish(NIGHT, NIGHT, 10, 300_000) is None
    assert projected_finish(NIGHT, at(2, 0), 300_000, 300_000) == at(2, 0)


def test_early_warning_when_the_batch_will_still_be_running_at_the_cutoff():
    now = at(2, 0)
    d = decide(now, DEADLINE, 150_000, RATE, OVERHEAD, done=150_000)
    projection = projected_finish(NIGHT, now, 150_000, 300_000)  # 06:00: too late
    w = early_warning(now, DEADLINE, projection, d)
    assert w is not None
    # Batch settles 150,000 / 4 h = 10.4 rows/s; the cutoff (05:00:35 now)
    # recedes by 10.4/85 s per second, so it and the clock meet near 05:25.
    assert at(5, 0) < w.fire_at < at(5, 30)
    # Exactly: 12,348.6 s after 02:00 (05:25:48). At that moment the rows
    # left are what 85/s clears between it and 05:30 (deadline - overhead),
    # 251.4 s * 85 = 21,369: the cutoff and the clock agree.
    assert w.fire_at == at(5, 25)
    assert w.fallback_rows == 21_369
    assert w.cost.batch_rows + w.cost.fallback_rows == 300_000
    assert w.cost.total <= w.cost.all_synchronous_ceiling
    assert "05:2" in w.message and "rows" in w.message and "$" in w.message


def test_no_warning_when_the_batch_finishes_first():
    now = at(2, 0)
    d = decide(now, DEADLINE, 100_000, RATE, OVERHEAD, done=200_000)
    projection = projected_finish(NIGHT, now, 200_000, 300_000)  # 04:00
    assert early_warning(now, DEADLINE, projection, d) is None


def test_no_warning_when_only_the_current_cutoff_is_passed():
    # The projection (05:10) is after this poll's cutoff (05:00) but before
    # deadline - overhead (05:30): as rows settle the cutoff moves past the
    # finish, so the fallback will not fire and a warning would be a false alarm.
    now = at(2, 0)
    d = decide(now, DEADLINE, 150_000, RATE, OVERHEAD, done=150_000)
    assert d.latest_safe_start < at(5, 10)
    assert early_warning(now, DEADLINE, at(5, 10), d) is None
    assert early_warning(now, DEADLINE, at(5, 31), d) is not None


def test_no_warning_without_a_projection_or_when_complete():
    d = decide(at(1, 0), DEADLINE, 300_000, RATE, OVERHEAD)
    assert early_warning(at(1, 0), DEADLINE, None, d) is None
    done = decide(at(1, 0), DEADLINE, 0, RATE, OVERHEAD, done=300_000)
    assert early_warning(at(1, 0), DEADLINE, at(1, 0), done) is None


def test_warning_after_firing_reports_everything_outstanding():
    d = decide(at(5, 30), DEADLINE, 40_000, RATE, OVERHEAD, done=260_000)
    assert d.fire
    w = early_warning(at(5, 30), DEADLINE, at(6, 30), d)
    assert w is not None and w.fallback_rows == 40_000 and w.fire_at == at(5, 30)


# -- constants that go stale ---------------------------------------------------


def test_derive_without_history_uses_the_configured_constants():
    rate, overhead, source = derive_rate_and_overhead([], 85.0, 1800.0, n=5)
    assert (rate, overhead) == (85.0, 1800.0)
    assert source.startswith("configured")


def test_derive_from_history_takes_the_safe_side_of_the_last_n():
    runs = [
        FallbackRun(records=200_000, rate=60.0, overhead_s=2500, finished_at=at(5, 0) - timedelta(days=9)),  # aged out
        FallbackRun(records=120_000, rate=90.0, overhead_s=1500, finished_at=at(5, 0) - timedelta(days=4)),
        FallbackRun(records=260_000, rate=78.5, overhead_s=1690, finished_at=at(5, 0) - timedelta(days=3)),
        FallbackRun(records=500, rate=400.0, overhead_s=1620, finished_at=at(5, 0) - timedelta(days=2)),  # too short
        FallbackRun(records=40_000, rate=88.0, overhead_s=1710, finished_at=at(5, 0) - timedelta(days=1)),
    ]
    # Given out of order: sorted by finished_at before the last n are taken.
    derived = derive_rate_and_overhead(list(reversed(runs)), 85.0, 1800.0, n=4)
    assert derived.rate == 78.5  # slowest sustained rate among the last 4, the 500-row run excluded
    assert derived.overhead_s == 1740.0  # longest (1,710 s) rounded up to the minute
    assert derived.runs_used == 4
    assert derived.source.startswith("history") and "78.5" in derived.source


def test_derive_with_only_short_runs_keeps_the_configured_rate():
    runs = [FallbackRun(records=100, rate=300.0, overhead_s=1900)]
    rate, overhead, source = derive_rate_and_overhead(runs, 85.0, 1800.0, n=5)
    assert rate == 85.0 and overhead == 1920.0
    assert "configured" in source and "history" in source


# -- CLI -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from batch_inference.commands import cutoff

    p = argparse.ArgumentParser(prog="batch-inference")
    cutoff.register(p.add_subparsers(dest="command"))
    return p


def _run(argv, capsys):
    args = _parser().parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr()


def test_cli_cutoff_json(capsys):
    rc, out = _run(["cutoff", "--deadline", "06:00", "--outstanding", "260000", "--now", "04:00", "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.out)
    assert doc["latest_safe_start_clock"] == "04:39:00"
    assert doc["fallback_s"] == pytest.approx(4858.824, abs=1e-3)
    assert doc["fire"] is False and doc["outstanding"] == 260_000


def test_cli_cutoff_text(capsys):
    rc, out = _run(["cutoff", "--deadline", "06:00", "--outstanding", "40000", "--rate", "85",
                    "--overhead", "1800", "--now", "05:00"], capsys)
    assert rc == 0
    assert "latest safe start 05:22:00" in out.out
    assert "2,271 s" in out.out


def test_cli_cutoff_rejects_bad_input(capsys):
    rc, out = _run(["cutoff", "--deadline", "6am", "--outstanding", "1"], capsys)
    assert rc == 2 and "HH:MM" in out.err
    rc, out = _run(["cutoff", "--deadline", "06:00"], capsys)
    assert rc == 2 and "--outstanding" in out.err


def _store_batch_results(db_url: str, job: str, n: int) -> None:
    """Settle ``n`` rows of the job through the batch transport, as a worker would."""
    from batch_inference import db
    from batch_inference.ledger import Ledger

    with db.connect(db_url) as c:
        lg = Ledger(c, job, "batch-worker")
        lease = lg.claim()
        ids = [r["record_id"] for r in lg.records(lease)][:n]
        lg.put_results(lease, ids, [{"category": "billing", "summary": "charged twice"}] * len(ids),
                       ["billing"] * len(ids))


def test_cli_cutoff_reads_a_job_version(db_url, conn, capsys):
    # A real job on the embedded PostgreSQL: 25 records, 10 stored by the
    # batch path. Rate and overhead come from the spec's fallback block.
    from batch_inference.plan import submit
    from tests.conftest import make_source, make_spec, tickets

    make_source(conn, tickets(25))
    job = submit(conn, make_spec(fallback={"rate": 0.5, "overhead_s": 600})).job_version
    _store_batch_results(db_url, job, 10)

    rc, out = _run(["cutoff", job, "--deadline", "06:00", "--now", "05:00", "--json", "--db", db_url], capsys)
    assert rc == 0, out.err
    doc = json.loads(out.out)
    # 15 outstanding at 0.5/s is 30 s, plus 600 s: 06:00 - 10.5 min = 05:49:30, floored to 05:49.
    assert doc["job_version"] == job and doc["done"] == 10 and doc["outstanding"] == 15
    assert (doc["rate"], doc["overhead_s"]) == (0.5, 600.0)
    assert doc["latest_safe_start_clock"] == "05:49:00"
    # a flag still overrides the spec
    rc, out = _run(["cutoff", job, "--deadline", "06:00", "--now", "05:00", "--rate", "85",
                    "--overhead", "1800", "--json", "--db", db_url], capsys)
    assert json.loads(out.out)["latest_safe_start_clock"] == "05:29:00"
