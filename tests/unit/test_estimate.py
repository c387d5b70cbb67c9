"""The preview's arithmetic without a database: token tallies, the snapshot's judgement, and the
projection (the bill by transport, the cutoff, the budget and deadline verdicts) from measured figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from batch_inference.estimate import CharEstimate, judge, preview
from batch_inference.estimate.preview import Measured, TokenTally, render
from tests.conftest import make_spec

NOW = datetime(2026, 12, 6, 22, 0, tzinfo=UTC)


def rows(n: int, text: str = "I was charged twice for my subscription.") -> list[dict]:
    return [{"record_id": f"r{i}", "text": f"{text} {i}", "acl": None} for i in range(n)]


def test_the_tally_gives_nearest_rank_percentiles_and_the_common_prefix():
    t = TokenTally()
    for ids in ([1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 7]):
        t.add(ids)
    assert (t.records, t.total, t.shared_prefix) == (3, 12, 2)
    assert (t.percentile(50), t.percentile(90), t.percentile(99)) == (4, 5, 5)


def test_records_are_judged_as_the_snapshot_judges_them():
    spec = make_spec(max_input_chars=10)
    assert judge(spec, {"text": "   \n"})[1] == "empty text"
    assert judge(spec, {"text": None})[1] == "empty text"
    assert judge(spec, {"text": "x" * 11})[1].startswith("input over the length cap (11 characters > 10)")
    assert judge(spec, {"text": "a\x00b"})[1] == "text contains NUL bytes"
    assert judge(spec, {"text": "fine", "reject": "empty text"})[1] == "empty text"
    assert judge(spec, {"text": "fine"}) == ("fine", None)


def test_without_a_measured_rate_nothing_is_invented():
    p = preview(None, make_spec(), rows=iter(rows(10) + [{"record_id": "b", "text": " "}]), counter=CharEstimate(),
                now=NOW, deadline=NOW + timedelta(hours=8))
    assert (p.records, p.eligible, p.rejected) == (11, 10, 1)
    assert p.exact is False and p.gpu_hours is None and p.finish is None and p.can_finish is None
    assert p.output_tokens["per_record"] == 64 and "upper bound" in p.output_tokens["source"]
    assert p.bill["planned"]["batch_rows"] == 10 and p.bill["planned"]["total"] == "0.04"   # 10 x $0.003625
    assert p.verdict == "go" and "no measured rate" in p.why


def test_a_batch_in_time_is_billed_by_gpu_hours_and_the_budget_decides():
    spec = make_spec(cost={"gpu_hour_spot": 3.5, "budget": 10.0})
    rate = Measured("pilot", 1.0, 20.0, 0.9, "test")
    p = preview(None, spec, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate, workers=2,
                deadline=NOW + timedelta(hours=8))
    assert p.gpu_hours == 1.0 and p.finishes_on_batch is True and p.fallback_rows == 0
    assert datetime.fromisoformat(p.finish) == NOW + timedelta(minutes=30)
    assert p.bill["planned"]["gpu"] == "3.50" and p.bill["planned"]["total"] == "3.50"
    assert p.budget_holds is True and p.verdict == "go"
    assert p.output_tokens == {"per_record": 20.0, "total": 72000, "source": "measured (pilot)"}

    tight = make_spec(cost={"gpu_hour_spot": 3.5, "budget": 3.0})
    p = preview(None, tight, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate, workers=2)
    assert p.verdict == "over_budget" and p.budget_holds is False and "over cost.budget $3.00" in p.why


def test_a_slow_batch_hands_the_rest_to_the_fallback_at_the_cutoff_or_misses_the_deadline():
    spec = make_spec(fallback={"rate": 10.0, "overhead_s": 600})
    rate = Measured("pilot", 0.5, 10.0, None, "test")
    # 3,600 rows at 0.5/s need 2 h on batch; the deadline is in 1 h: the cutoff sends the rest synchronous.
    p = preview(None, spec, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate,
                deadline=NOW + timedelta(hours=1))
    assert p.finishes_on_batch is False and p.can_finish is True and p.verdict == "go"
    assert p.batch_rows + p.fallback_rows == 3600 and p.fallback_rows > 0 and p.batch_rows > 0
    cutoff = datetime.fromisoformat(p.cutoff_at)
    assert cutoff + timedelta(seconds=600 + p.fallback_rows / 10.0) <= NOW + timedelta(hours=1)
    assert p.batch_rows == pytest.approx(0.5 * (cutoff - NOW).total_seconds(), abs=60)
    assert p.bill["planned"]["fallback_rows"] == p.fallback_rows
    # 10 minutes left for 3,600 rows that need 16 even synchronous (600 s overhead + 360 s): lost before it starts.
    p = preview(None, spec, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate,
                deadline=NOW + timedelta(minutes=10))
    assert p.can_finish is False and p.verdict == "misses_deadline" and "even through the fallback" in p.why


def test_each_worker_pays_its_start_up_once_and_no_more_workers_run_than_shards():
    spec = make_spec(cost={"gpu_hour_spot": 3.6}, shard_size=100)
    rate = Measured("pilot", 1.0, 20.0, 0.9, "test", startup_s=60.0)
    # 3,600 rows in 36 shards on 2 workers: 1,800 s each after a 60 s start-up; the start-up billed twice.
    p = preview(None, spec, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate, workers=2)
    assert datetime.fromisoformat(p.finish) == NOW + timedelta(seconds=60 + 1800)
    assert p.gpu_hours == pytest.approx((3600 + 2 * 60) / 3600)
    assert p.bill["planned"]["gpu"] == "3.72" and p.rate["workers_running"] == 2
    # 150 rows are 2 shards: a third worker has none to run, so it neither speeds the run nor costs a start-up.
    p = preview(None, spec, rows=iter(rows(150)), counter=CharEstimate(), now=NOW, rate=rate, workers=3)
    assert p.rate["workers_running"] == 2 and p.rate["fleet_records_per_s"] == 2.0
    assert datetime.fromisoformat(p.finish) == NOW + timedelta(seconds=60 + 75)
    assert p.gpu_hours == pytest.approx((150 + 2 * 60) / 3600)


def test_a_tail_with_price_tiers_is_priced_at_the_tier_the_cutoffs_arithmetic_picks():
    tiers = [{"name": "flex", "per_row": 0.003625, "latency_s": 2.0}, {"name": "default", "per_row": 0.00725}]
    rate = Measured("pilot", 0.5, 10.0, None, "test")

    def tail(fallback: dict) -> tuple:
        spec = make_spec(fallback={"rate": 10.0, "overhead_s": 600, "concurrency": 16, "provider": "openai",
                                   "tiers": tiers, **fallback})
        p = preview(None, spec, rows=iter(rows(3600)), counter=CharEstimate(), now=NOW, rate=rate,
                    deadline=NOW + timedelta(hours=1))
        return spec, p, {t["tier"]: t["rows"] for t in p.bill["fallback_tiers"]["split"]}

    # flex answers 16 / 2 s = 8 rows/s: the whole tail x 1.25 fits the time the plan has left, all at flex.
    spec, p, split = tail({})
    assert p.fallback_rows > 0 and split == {"flex": p.fallback_rows, "default": 0}
    ft = p.bill["fallback_tiers"]
    assert ft["one_price"] == f"{p.fallback_rows * 0.00725:.2f}" and ft["one_price_per_row"] == "0.00725"
    assert p.bill["planned"]["fallback"] == f"{p.fallback_rows * 0.003625:.2f}"
    assert "flex $0.003625, default $0.00725" in p.bill["prices"] and "cost.fallback_per_row" in p.bill["prices"]
    assert f"flex {p.fallback_rows:,} rows x $0.003625" in render(p.as_dict())

    # flex at 20 s a request answers 0.8 rows/s: the head of the tail moves up to default, only the rows
    # flex can still finish go there, and the tail costs between the two prices.
    spec, p, split = tail({"tiers": [{**tiers[0], "latency_s": 20.0}, tiers[1]]})
    assert split["default"] > 0 and split["flex"] > 0 and sum(split.values()) == p.fallback_rows
    cost = split["flex"] * 0.003625 + split["default"] * 0.00725
    assert p.bill["planned"]["fallback"] == f"{cost:.2f}"
    assert float(p.bill["planned"]["fallback"]) < float(p.bill["fallback_tiers"]["one_price"])
