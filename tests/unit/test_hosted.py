"""The hosted batch transports' pure parts: the bill with a hosted column, the cutoff's
hosted term, and how each API's result lines become outcomes."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from batch_inference.cost import Prices, all_synchronous_ceiling, cost_report
from batch_inference.engines.base import TRUNCATED
from batch_inference.hosted.bedrock_batch import parse_record
from batch_inference.hosted.core import CANCELED, ERRORED, EXPIRED, SUCCEEDED, TRANSPORT
from batch_inference.hosted.counts import with_hosted
from batch_inference.hosted.openai_batch import parse_line

_price = st.integers(0, 100_000).map(lambda n: Decimal(n) / 100_000)


@settings(max_examples=300, deadline=None)
@given(rows=st.tuples(st.integers(0, 10_000_000), st.integers(0, 10_000_000), st.integers(0, 10_000_000)),
       prices=st.tuples(_price, _price, _price).map(sorted))
def test_a_night_across_batch_hosted_batch_and_fallback_stays_under_the_all_synchronous_ceiling(rows, prices):
    batch_rows, hosted_rows, fallback_rows = rows
    low, mid, sync = prices                     # both batch prices at most the synchronous one
    p = Prices(batch_per_row=low, hosted_batch_per_row=mid, fallback_per_row=sync)
    r = cost_report(batch_rows, fallback_rows, p, hosted_rows=hosted_rows)
    assert r.total == batch_rows * low + hosted_rows * mid + fallback_rows * sync
    assert r.total <= r.all_synchronous_ceiling == all_synchronous_ceiling(sum(rows), p)


def test_hosted_batch_costs_half_the_synchronous_price_unless_priced_and_usage_prices_tokens():
    assert Prices(fallback_per_row=Decimal("0.01")).hosted_batch_per_row == Decimal("0.005")
    p = Prices(hosted_batch_per_m_input_tokens=Decimal("0.20"), hosted_batch_per_m_output_tokens=Decimal("0.80"))
    assert p.hosted_usage_cost(1_000_000, 500_000) == Decimal("0.60")
    assert p.hosted_usage_cost(None, 5) is None and Prices().hosted_usage_cost(10, 10) is None
    assert Prices.from_spec({"cost": {"hosted_batch_per_row": 0.002}}).hosted_batch_per_row == Decimal("0.002")


def test_the_hosted_term_takes_provider_succeeded_work_off_outstanding_never_below_zero():
    counts = {"outstanding": 300_000, "stored": 0}
    out = with_hosted(counts, {"requests": 300_000, "succeeded": 260_000})
    assert (out["outstanding"], out["hosted_succeeded"], out["hosted_in_flight"]) == (40_000, 260_000, 300_000)
    assert counts["outstanding"] == 300_000                                  # the ledger's own count untouched
    assert with_hosted({"outstanding": 5}, {"requests": 10, "succeeded": 9})["outstanding"] == 0
    assert with_hosted({"outstanding": 7}, None)["outstanding"] == 7


def _openai(status=None, body=None, error=None):
    resp = None if status is None else {"status_code": status, "request_id": "r", "body": body}
    return {"id": "batch_req_1", "custom_id": "t1", "response": resp, "error": error}


def test_openai_result_lines():
    ok = {"choices": [{"finish_reason": "stop", "message": {"content": "{}"}}], "usage": {"completion_tokens": 3}}
    item = parse_line(_openai(200, ok))
    assert (item.custom_id, item.kind, item.text, item.error, item.tokens_out) == ("t1", SUCCEEDED, "{}", None, 3)
    cut = {"choices": [{"finish_reason": "length", "message": {"content": "{\"a"}}]}
    assert (parse_line(_openai(200, cut)).kind, parse_line(_openai(200, cut)).error) == (SUCCEEDED, TRUNCATED)
    bad = parse_line(_openai(400, {"error": {"message": "Invalid 'messages'"}}))
    assert bad.kind == ERRORED and "HTTP 400" in bad.error and "Invalid 'messages'" in bad.error
    assert parse_line(_openai(500, {"error": {"message": "boom"}})).kind == TRANSPORT
    assert parse_line(_openai(429, {"error": {"message": "slow down"}})).kind == TRANSPORT
    assert parse_line(_openai(error={"code": "batch_expired", "message": "x"})).kind == EXPIRED
    assert parse_line(_openai(error={"code": "batch_cancelled", "message": "x"})).kind == CANCELED


def test_bedrock_result_records():
    ok = {"recordId": "t1", "modelOutput": {"content": [{"type": "text", "text": "{}"}], "stop_reason": "end_turn",
                                            "usage": {"input_tokens": 5, "output_tokens": 2}}}
    item = parse_record(ok)
    assert (item.kind, item.text, item.tokens_in, item.tokens_out) == (SUCCEEDED, "{}", 5, 2)
    assert parse_record({"recordId": "t1", "error": {"errorCode": 400, "errorMessage": "bad"}}).kind == ERRORED
    assert parse_record({"recordId": "t1", "error": {"errorCode": 503, "errorMessage": "busy"}}).kind == TRANSPORT
    assert parse_record({"recordId": "t1", "error": {"errorCode": 429, "errorMessage": "slow"}}).kind == TRANSPORT


def test_a_stop_cuts_a_poll_back_off_short_so_a_flaky_endpoint_cannot_hold_up_the_cancel():
    """Polls failing with a transient error back off by up to a poll interval each (here 600 s);
    the cutoff or a preemption notice (``stop``) ends the wait, and the remaining retries come at
    the cancel poll's pace until the poll gives up with EndpointUnavailable."""
    import threading

    import pytest

    from batch_inference.breaker import EndpointUnavailable
    from batch_inference.engines import load_engine
    from tests.fixtures import make_spec

    spec = make_spec(cleared_for_hosted=True, engine={"name": "openai-batch", "options": {
        "base_url": "http://127.0.0.1:9/v1", "poll_seconds": 600, "cancel_poll_seconds": 0.01}})
    engine = load_engine("openai-batch", spec)
    polled = threading.Event()

    class Down:
        calls = 0

        def status(self, batch_id):
            Down.calls += 1
            polled.set()
            raise ConnectionError("connection refused")

        def transient(self, exc):
            return True

    engine.provider = Down()
    stop, result = threading.Event(), {}

    def poll():
        try:
            engine._status("batch_1", stop)
        except EndpointUnavailable as exc:
            result["error"] = exc

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    assert polled.wait(10)
    stop.set()                                  # the cutoff fired while the first back-off (600 s) ran
    t.join(60)
    assert not t.is_alive(), "the poll's back-off ignored the stop"
    assert isinstance(result.get("error"), EndpointUnavailable) and Down.calls == 10
