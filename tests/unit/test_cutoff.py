"""The moving cutoff: the seed's worked nights, its properties, and the CLI."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from datetime import datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch_inference.cutoff import (
    MIN_REDRIVE_S,
    DerivedConstants,
    FallbackRun,
    decide,
    derive_rate_and_overhead,
    early_warning,
    fallback_seconds,
    latest_safe_start,
    parse_clock,
    projected_finish,
    relabel_start,
    slow_half_median,
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
    assert "260,000 done" in line and "40,000 outstanding" in line
    assert "needs 38 min" in line
    # Times with their dates, in plain words (the deadline is often tomorrow's).
    assert f"so the cutoff is {DEADLINE:%Y-%m-%d} 05:22 UTC for the deadline {DEADLINE:%Y-%m-%d} 06:00 UTC" in line


def test_complete_job_never_fires():
    d = decide(at(5, 59), DEADLINE, 0, RATE, OVERHEAD, done=300_000)
    assert d.complete and not d.fire
    assert d.log_line().endswith(": every record is done, the fallback is not needed")


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


def test_derive_from_partial_history_only_tightens():
    # Runs recorded without a drain or a load (legacy rows, unpublished jobs) are partial.
    runs = [
        FallbackRun(records=200_000, rate=60.0, overhead_s=2500, finished_at=at(5, 0) - timedelta(days=9)),  # aged out
        FallbackRun(records=120_000, rate=90.0, overhead_s=1500, finished_at=at(5, 0) - timedelta(days=4)),
        FallbackRun(records=260_000, rate=78.5, overhead_s=1690, finished_at=at(5, 0) - timedelta(days=3)),
        FallbackRun(records=500, rate=400.0, overhead_s=1620, finished_at=at(5, 0) - timedelta(days=2)),  # too short
        FallbackRun(records=40_000, rate=88.0, overhead_s=1710, finished_at=at(5, 0) - timedelta(days=1)),
    ]
    # Given out of order: sorted by finished_at before the last n are taken.
    derived = derive_rate_and_overhead(list(reversed(runs)), 85.0, 1800.0, n=4)
    # Slower than configured: the median of the slowest half of 78.5, 88 and 90 (the 500-row run excluded).
    assert derived.rate == pytest.approx((78.5 + 88.0) / 2)
    # Shorter than configured (1,740 s): partial runs cannot shrink it.
    assert derived.overhead_s == 1800.0
    assert (derived.runs_used, derived.complete_runs, derived.min_runs) == (4, 0, 5)
    assert derived.source.startswith("history (4 recent fallback runs, 0 complete)")
    assert "slower than the configured 85/s" in derived.source
    assert "overhead 1,800 s configured (0 complete runs of the 5 needed to relax it; history would give 1,740 s)" \
        in derived.source


def test_derive_with_only_short_runs_keeps_the_configured_rate():
    runs = [FallbackRun(records=100, rate=300.0, overhead_s=1900)]
    rate, overhead, source = derive_rate_and_overhead(runs, 85.0, 1800.0, n=5)
    assert rate == 85.0 and overhead == 1920.0
    assert "configured" in source and "history" in source


def complete_run(rate: float, whole_overhead_s: float, records: int = 100_000, day: int = 0,
                 load_s: float = 300.0) -> FallbackRun:
    """A run that measured drain, re-drive and load (overhead_s + load_s = whole_overhead_s)."""
    return FallbackRun(records=records, rate=rate, overhead_s=whole_overhead_s - load_s, drain_s=120.0,
                       busy_s=records / rate, load_s=load_s, finished_at=at(5, 0) + timedelta(days=day))


def bad_night_cutoff(k: DerivedConstants) -> datetime:
    """The seed's bad night: 260,000 outstanding, deadline 06:00."""
    return latest_safe_start(DEADLINE, 260_000, k.rate, k.overhead_s)


def test_the_configured_constants_give_0439_for_the_bad_night():
    assert bad_night_cutoff(derive_rate_and_overhead([], RATE, OVERHEAD)) == at(4, 39)


def test_one_short_run_does_not_move_the_cutoff_later():
    # The observed night: a fallback that re-drove little recorded a 60 s overhead.
    short = FallbackRun(records=340, rate=85.0, overhead_s=60.0, drain_s=5.0, busy_s=4.0, load_s=None,
                        finished_at=at(5, 0))
    k = derive_rate_and_overhead([short], RATE, OVERHEAD)
    assert (k.rate, k.overhead_s) == (85.0, 1800.0)
    assert bad_night_cutoff(k) == at(4, 39)
    assert "overhead 1,800 s configured (0 complete runs of the 5 needed to relax it; history would give 60 s)" \
        in k.source
    # Even with every part measured, a re-drive of a few seconds does not count as complete.
    k = derive_rate_and_overhead([replace(short, load_s=0.0, finished_at=at(5, 0) + timedelta(days=d))
                                  for d in range(9)], RATE, OVERHEAD)
    assert (k.rate, k.overhead_s, k.complete_runs) == (85.0, 1800.0, 0)


def test_the_source_says_which_constants_and_why():
    fast = [complete_run(120.0, 60.0, load_s=10.0, day=d) for d in range(2)]
    k = derive_rate_and_overhead(fast, RATE, OVERHEAD)
    assert k.source == ("configured constants (2 recent fallback runs, 2 complete): "
                        "rate 85/s configured (2 complete runs of the 5 needed to relax it; history would give "
                        "120.0/s); overhead 1,800 s configured (2 complete runs of the 5 needed to relax it; "
                        "history would give 60 s)")
    assert k.to_dict() == {"rate": 85.0, "overhead_s": 1800.0, "source": k.source, "runs_used": 2,
                           "complete_runs": 2, "min_runs": 5}
    assert derive_rate_and_overhead([], RATE, OVERHEAD).source == (
        "configured constants: rate 85/s configured (no re-drive of 60 s or more measured); "
        "overhead 1,800 s configured (no fallback history)")
    slow = derive_rate_and_overhead([complete_run(70.0, 2000.0)], RATE, OVERHEAD)
    assert (slow.rate, slow.overhead_s) == (70.0, 2040.0)
    assert slow.source.startswith("history (1 recent fallback run, 1 complete): rate 70.0/s measured, slower than "
                                  "the configured 85/s")
    assert "overhead 2,040 s measured, longer than the configured 1,800 s" in slow.source


def test_enough_complete_faster_runs_relax_the_constants():
    runs = [complete_run(r, o, day=d) for d, (r, o) in enumerate(
        [(104.0, 1150.0), (100.0, 1190.0), (98.0, 1120.0), (110.0, 1200.0), (101.0, 1100.0)])]
    k = derive_rate_and_overhead(runs, RATE, OVERHEAD, n=5, min_runs=5)
    # rate: the median of the slowest half (98, 100, 101); overhead: the longest, 1,200 s (a whole minute already).
    assert (k.rate, k.overhead_s, k.complete_runs) == (100.0, 1200.0, 5)
    assert k.source.startswith("history (5 recent fallback runs, 5 complete): "
                               "rate 100.0/s = median of the slowest half of 5 complete runs; "
                               "overhead 1,200 s = longest of 5 complete runs")
    # 2,600 s of re-drive + 1,200 s: 06:00 - 1:03:20, floored: 04:56, later than 04:39 on evidence.
    assert bad_night_cutoff(k) == at(4, 56)
    # One complete run fewer: the configured constants stand.
    assert bad_night_cutoff(derive_rate_and_overhead(runs[1:], RATE, OVERHEAD, n=5, min_runs=5)) == at(4, 39)
    # A later partial run that was slower still tightens the relaxed rate (never relaxes it).
    throttled = FallbackRun(records=100_000, rate=70.0, overhead_s=1300.0, busy_s=100_000 / 70.0,
                            finished_at=at(5, 0) + timedelta(days=9))
    k2 = derive_rate_and_overhead(runs + [throttled], RATE, OVERHEAD, n=5, min_runs=5)
    # Complete runs: the same 5. Recent re-drives (the last 5 of any kind): 100, 98, 110, 101 and 70,
    # whose slowest half (70, 98, 100) has the median 98.
    assert k2.complete_runs == 5 and k2.rate == 98.0
    assert k2.overhead_s == 1320.0                 # the partial run's 1,300 s is a lower bound: rounded up, it wins


def test_history_off_and_min_runs_above_history_runs():
    runs = [complete_run(120.0, 600.0, day=d) for d in range(6)]
    assert derive_rate_and_overhead(runs, RATE, OVERHEAD, n=0).source.startswith("configured constants:")
    # history_runs 2, min 5: the last 5 complete runs count for relaxing, the last 2 of any kind for tightening.
    k = derive_rate_and_overhead(runs, RATE, OVERHEAD, n=2, min_runs=5)
    assert (k.rate, k.overhead_s, k.complete_runs, k.runs_used) == (120.0, 600.0, 5, 2)


def test_slow_half_median():
    assert slow_half_median([5.0]) == 5.0
    assert slow_half_median([9.0, 1.0]) == 1.0
    assert slow_half_median([3.0, 1.0, 2.0]) == 1.5
    assert slow_half_median([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        slow_half_median([])


# The kinds of run the history can hold. Rates and overheads range far on both
# sides of the configured 85/s and 1,800 s.
_rates = st.floats(min_value=1.0, max_value=2_000.0)
_overheads = st.floats(min_value=0.0, max_value=20_000.0)
_parts = st.one_of(st.none(), st.floats(min_value=0.0, max_value=5_000.0))


@st.composite
def _short_run(draw):
    rate = draw(_rates)
    busy = draw(st.floats(min_value=0.001, max_value=MIN_REDRIVE_S - 0.001))
    return FallbackRun(records=max(1, int(rate * busy)), rate=rate, overhead_s=draw(_overheads),
                       drain_s=draw(_parts), busy_s=busy, load_s=draw(_parts))


@st.composite
def _partial_run(draw):
    rate = draw(_rates)
    records = draw(st.integers(min_value=1, max_value=2_000_000))
    drain, load = draw(_parts), draw(_parts)
    busy = draw(st.sampled_from([records / rate, None]))
    if drain is not None and load is not None and busy is not None:
        drain = None                               # at least one part missing
    return FallbackRun(records=records, rate=rate, overhead_s=draw(_overheads), drain_s=drain, busy_s=busy,
                       load_s=load)


@st.composite
def _complete_run(draw, slow: bool = False):
    rate = draw(st.floats(min_value=1.0, max_value=RATE)) if slow else draw(_rates)
    busy = draw(st.floats(min_value=MIN_REDRIVE_S, max_value=50_000.0))
    load = draw(st.floats(min_value=0.0, max_value=5_000.0))
    overhead = draw(st.floats(min_value=max(0.0, OVERHEAD - load), max_value=20_000.0)) if slow else draw(_overheads)
    return FallbackRun(records=max(1, int(rate * busy)), rate=rate, overhead_s=overhead,
                       drain_s=draw(st.floats(min_value=0.0, max_value=5_000.0)), busy_s=busy,
                       load_s=load)


def _is_complete(r: FallbackRun) -> bool:
    return r.complete and r.redrive_s >= MIN_REDRIVE_S


def _dated(runs: list[FallbackRun], order: list[int]) -> list[FallbackRun]:
    return [replace(r, finished_at=at(5, 0) + timedelta(days=d)) for r, d in zip(runs, order)]


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.one_of(_short_run(), _partial_run(), _complete_run()), max_size=25),
       n=st.integers(min_value=0, max_value=12), min_runs=st.integers(min_value=1, max_value=8),
       data=st.data())
def test_short_or_partial_runs_never_move_the_bad_night_later(runs, n, min_runs, data):
    """Done-when of issue 13: never later than the configured 04:39 unless
    complete runs say so. Short or partial runs, in any number and order, do not count."""
    runs = _dated(runs, data.draw(st.permutations(range(len(runs)))))
    k = derive_rate_and_overhead(runs, RATE, OVERHEAD, n=n, min_runs=min_runs)
    if sum(_is_complete(r) for r in runs) < min_runs or n == 0:
        assert k.rate <= RATE and k.overhead_s >= OVERHEAD
        assert bad_night_cutoff(k) <= at(4, 39), k.source


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.one_of(_short_run(), _partial_run(), _complete_run(slow=True)), max_size=25),
       n=st.integers(min_value=0, max_value=12), min_runs=st.integers(min_value=1, max_value=8),
       data=st.data())
def test_complete_runs_no_faster_than_configured_never_move_it_later(runs, n, min_runs, data):
    """However many runs, when no complete one was faster (rate <= 85/s, whole overhead >= 1,800 s), 04:39 stands."""
    runs = _dated(runs, data.draw(st.permutations(range(len(runs)))))
    k = derive_rate_and_overhead(runs, RATE, OVERHEAD, n=n, min_runs=min_runs)
    assert bad_night_cutoff(k) <= at(4, 39), k.source


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

