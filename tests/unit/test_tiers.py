"""The price tiers' arithmetic and bill (batch_inference.tiers), and the tier names against the official clients'
own types; no database (the pool against an endpoint: tests/integration/test_fallback_tiers.py)."""

from __future__ import annotations

from decimal import Decimal

from batch_inference.spec import FALLBACK_TIERS
from batch_inference.tiers import TierAllowance, TierPlan, priced_by_tier
from tests.conftest import make_spec

TIERS = [{"name": "flex", "per_row": 0.003625, "latency_s": 0.05}, {"name": "default", "per_row": 0.00725}]


def tiered_spec(**fallback):
    return make_spec(fallback={"provider": "openai", "tiers": TIERS, **fallback})


def test_gemini_tiers_are_the_clients_own():
    from google.genai import types

    assert set(FALLBACK_TIERS["gemini"]) == {t.value for t in types.ServiceTier} - {"unspecified"}


def test_openai_tiers_are_the_clients_own():
    import typing

    from openai.types.chat import completion_create_params as p

    allowed = set(typing.get_args(typing.get_args(typing.get_type_hints(p.CompletionCreateParamsBase)
                                                  ["service_tier"])[0]))
    assert set(FALLBACK_TIERS["openai"]) <= allowed


def test_the_plan_chooses_the_cheapest_tier_that_finishes():
    now = [1000.0]
    spec = tiered_spec()
    plan = TierPlan(spec.fallback.tiers, base_url="http://x/v1", options={}, concurrency=10, remaining=100,
                    deadline=1000.0 + 30, reserve_s=5.0, default_rate=50.0, clock=lambda: now[0])
    # flex at 0.05 s: min(50, 10 / 0.05) = 50 rows/s; 100 x 1.25 / 50 = 2.5 s <= 25 s
    assert plan.choose() == 0
    for _ in range(40):
        plan.observe(0, 20.0)          # flex now answers in ~20 s: 0.5 rows/s, 100 rows need 250 s
    assert plan.choose() == 1
    assert plan.choose(floor=1) == 1
    now[0] = 1000.0 + 40             # past the deadline: the last tier
    assert plan.choose() == 1


def test_the_bill_prices_each_fallback_row_at_its_tier():
    from batch_inference.cost import Prices, cost_report

    report = cost_report(0, 100, Prices(), hosted_rows=0)
    priced = priced_by_tier(report, [{"tier": "flex", "rows": 60}, {"tier": "default", "rows": 30}],
                            tiered_spec().fallback.tiers)
    assert priced.fallback_cost == 60 * Decimal("0.003625") + 40 * Decimal("0.00725")
    assert [(t["tier"], t["rows"]) for t in priced.tiers] == [("flex", 60), ("default", 30), (None, 10)]
    assert priced.total == report.total - report.fallback_cost + priced.fallback_cost


def test_a_tier_that_refuses_most_requests_loses_the_rows_to_the_next():
    plan = TierPlan(tiered_spec().fallback.tiers, base_url="http://x/v1", options={}, concurrency=10, remaining=100,
                    deadline=1000.0 + 30, reserve_s=5.0, default_rate=50.0, clock=lambda: 1000.0)
    assert plan.choose() == 0
    for _ in range(80):
        plan.refused(0)               # accepted share falls towards 0: flex's throughput with it
    assert plan.tiers[0].accepted < 0.05 and plan.choose() == 1
    assert plan.summary()[0]["refused"] == 80 and plan.summary()[0]["breaker"] is None   # refusals alone trip nothing


def test_the_budget_reserves_a_row_in_flight_at_its_tier_tops_it_up_and_bills_it_where_it_was_answered():
    spent = []
    a = TierAllowance(Decimal("0.02"), Decimal("0.00725"), on_spent=lambda: spent.append(1))
    assert a.take("r1", Decimal("0.003625")) and a.take("r2", Decimal("0.003625"))   # two rows in flight at flex
    assert a.take("r1", Decimal("0.003625")) and a.reserved == Decimal("0.00725")     # a retry spends nothing twice
    assert a.take("r1") and a.reserved == Decimal("0.010875")       # r1 refused at flex moves up: topped up
    assert a.take("r3") and a.reserved == Decimal("0.018125")       # r3 at the last tier
    assert not a.take("r4", Decimal("0.003625")) and spent == [1] and a.spent   # $0.001875 left: not sent
    a.settle("r1", Decimal("0.003625"))                              # r1 answered at flex after all
    assert a.reserved == Decimal("0.0145") and a.take("r4", Decimal("0.003625")) and a.taken == 4
    assert not a.take("r5", Decimal("0.003625")) and spent == [1]   # on_spent once
