"""Prices by tier through the real pool and ledger (issue 47, build item 3): a budget stop that spends the
budget row by row at the tier each row goes to, a row in flight reserved at its tier's price. The endpoint is
the loopback stand-in of test_fallback_tiers (flex refusing a share at random, default at once)."""

from __future__ import annotations

import json
from decimal import Decimal

from batch_inference.cli import main as cli_main
from batch_inference.cost import rows_within
from batch_inference.fallback import run_fallback
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_fallback_tiers import TIERS, TieredEndpoint, no_attempts, tier_rows


def budget_spec(budget: float):
    return make_spec(fallback={"provider": "openai", "tiers": TIERS}, cost={"budget": budget, "on_budget": "page"},
                     shard_size=100, lease_seconds=30, renew_seconds=0.2)


def bill(capsys, db_url: str, job: str) -> dict:
    assert cli_main(["cost", job, "--db", db_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["so_far"]


def test_a_budget_one_price_would_stop_at_lets_every_row_through_at_flex(conn, db_url, capsys):
    """$1.00 for 200 rows: at one price ($0.00725) it affords 137 and the pool would stop; at flex
    ($0.003625, with refused rows moving up to default) every row fits and nothing is left pending."""
    ep = TieredEndpoint(refuse=0.3)
    make_source(conn, tickets(200))
    job = submit(conn, budget_spec(1.0)).job_version
    pages: list[str] = []
    try:
        result = run_fallback(db_url, job, ep.server.base_url, rate=2000.0, concurrency=8, on_page=pages.append)
    finally:
        ep.close()
    assert rows_within(Decimal("1.0"), 0, Decimal("0.00725")) == 137
    assert pages and "at most 275 row(s) at flex $0.003625" in pages[0] and "at least 137 at default" in pages[0]
    assert result.stored == 200 and not result.budget_stop and job_counts(conn, job)["outstanding"] == 0
    assert no_attempts(conn, job) and sum(tier_rows(conn, job).values()) == 200 and ep.answered["default"] > 0
    assert bill(capsys, db_url, job)["fallback_cost"] <= 1.0


def test_a_budget_stop_reserves_rows_in_flight_at_their_tier_and_never_overspends(conn, db_url, capsys):
    """$0.40 for 300 rows: 55 rows at one price, up to 110 at flex. The pool sends rows while the rest of
    the budget affords each at its tier (8 in flight at once, refused rows topped up to default's price),
    stops, and leaves the rest pending with no attempt spent; the bill by tier stays within the budget."""
    ep = TieredEndpoint(refuse=0.3, seed=3)
    make_source(conn, tickets(300))
    job = submit(conn, budget_spec(0.4)).job_version
    try:
        result = run_fallback(db_url, job, ep.server.base_url, rate=2000.0, concurrency=8)
    finally:
        ep.close()
    stored = job_counts(conn, job)["stored"]
    assert result.budget_stop and result.allowance == 110 and "at least 55 at default" in result.budget_page
    assert 55 < stored <= 110 and result.outstanding == 300 - stored and no_attempts(conn, job)
    split = tier_rows(conn, job)
    assert sum(split.values()) == stored
    spent = split.get("flex", 0) * Decimal("0.003625") + split.get("default", 0) * Decimal("0.00725")
    assert spent <= Decimal("0.40")
    so_far = bill(capsys, db_url, job)
    assert abs(Decimal(str(so_far["fallback_cost"])) - spent) < Decimal("0.01")
