"""Prices by tier through the real pool and ledger (issue 47, build item 3): a budget stop that spends the
budget row by row at the tier each row goes to, a row in flight reserved at its tier's price. The endpoint is
the loopback stand-in of test_fallback_tiers (flex refusing a share at random, default at once)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

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


def bill(capsys, db_url: str, job: str, which: str = "so_far") -> dict:
    assert cli_main(["cost", job, "--db", db_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])[which]


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
    # if the fallback fired now: the rows answered so far at their tiers, the rest at cost.fallback_per_row
    fired = bill(capsys, db_url, job, "if_fallback_now")
    assert abs(Decimal(str(fired["fallback_cost"])) - spent - (300 - stored) * Decimal("0.00725")) < Decimal("0.01")
    assert cli_main(["cost", job, "--db", db_url]) == 0
    out = capsys.readouterr().out
    assert "fallback by tier: " in out and f"flex {split['flex']:,} rows x $0.003625 = $" in out


def test_the_month_view_splits_each_slip_nights_tail_by_tier(capsys):
    """A 300,000-row night abandoned at 40%: each slip night's 180,000 fallback rows 95% at flex, the rest at
    default; the month beside the same month at one price."""
    assert cli_main(["cost", "--month", "--rows", "300000", "--slip-nights", "0,6,30", "--abandon-at", "0.4",
                     "--tier", "flex=0.003625:0.95", "--tier", "default=0.00725", "--json"]) == 0
    months = {m["slip_nights"]: m for m in json.loads(capsys.readouterr().out)["months"]}
    six = months[6]
    assert [(t["tier"], t["rows"]) for t in six["fallback_tiers"]] == [("flex", 6 * 171_000), ("default", 6 * 9_000)]
    assert six["one_price_total"] == 36_540.00       # docs/deadlines.md's month view at one price
    tail = 6 * (171_000 * Decimal("0.003625") + 9_000 * Decimal("0.00725"))
    assert Decimal(str(six["total"])) == 24 * Decimal("1087.50") + 6 * 120_000 * Decimal("0.003625") + tail
    assert months[0]["total"] == months[0]["one_price_total"] == 32_625.00
    assert cli_main(["cost", "--month", "--rows", "300000", "--slip-nights", "6", "--tier", "flex=0.003625:0.95",
                     "--tier", "default=0.00725"]) == 0
    assert "fallback by tier: flex 1,026,000 rows $3,719.25, default 54,000 rows $391.50" in capsys.readouterr().out


@pytest.mark.parametrize("tiers, words", [
    (["flex=0.003625", "default=0.00725"], "every tier but the last needs a share"),
    (["flex=0.003625:0.7", "priority=0.01:0.5", "default=0.00725"], "add up to more than 1"),
    (["flex=cheap:0.9", "default=0.00725"], "a price must be a number"),
    (["flex=0.003625:1.5", "default=0.00725"], "the share must be a number within 0..1"),
    (["flex", "default=0.00725"], "give NAME=PRICE[:SHARE]"),
])
def test_a_bad_tier_in_the_month_view_is_one_line_exit_2(capsys, tiers, words):
    code = cli_main(["cost", "--month", "--rows", "1000", *[a for t in tiers for a in ("--tier", t)]])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err


def test_estimate_prices_the_tail_at_the_tiers_the_cutoffs_arithmetic_picks(conn, db_url, tmp_path, capsys):
    """`batch-inference estimate SPEC --deadline +1h` over the ledger: a pilot measured 0.5 records/s, so 3,600
    rows need 2 h on batch and the cutoff hands the tail to the fallback. Flex expected at 20 s a request
    (16 in flight: 0.8 rows/s) cannot finish it all: the head moves up to default, flex takes what it can, and
    the tail is priced so, beside the tail at one price; the prices line names each tier's price."""
    import yaml

    from batch_inference.db import q
    from batch_inference.spec import JobSpec
    from tests.conftest import spec_dict

    make_source(conn, tickets(3600))
    d = spec_dict(fallback={"rate": 10.0, "overhead_s": 600, "concurrency": 16, "provider": "openai",
                            "tiers": [{**TIERS[0], "latency_s": 20.0}, TIERS[1]]})
    spec = JobSpec.model_validate(d)
    conn.execute(q("estimate_pilot_insert"), {
        "dataset": spec.dataset, "spec_hash": spec.spec_hash, "model_name": spec.model.name,
        "model_digest": spec.model.digest, "engine": spec.engine.name, "records": 10, "stored": 10, "failed": 0,
        "dead_letters": 0, "seconds": 20.0, "records_per_s": 0.5, "input_tokens": 400, "output_tokens": 100,
        "valid_rate": 1.0})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(d))
    assert cli_main(["--db", db_url, "estimate", str(path), "--deadline", "+1h"]) == 0
    out, err = capsys.readouterr()
    p = json.loads(out.strip().splitlines()[-1])
    fallback, ft = p["fallback_rows"], p["bill"]["fallback_tiers"]
    split = {t["tier"]: t["rows"] for t in ft["split"]}
    assert fallback > 0 and split["flex"] > 0 and split["default"] > 0 and sum(split.values()) == fallback
    cost = split["flex"] * Decimal("0.003625") + split["default"] * Decimal("0.00725")
    assert Decimal(p["bill"]["planned"]["fallback"]) == cost.quantize(Decimal("0.01"))
    assert Decimal(ft["one_price"]) == (fallback * Decimal("0.00725")).quantize(Decimal("0.01"))
    assert Decimal(p["bill"]["planned"]["fallback"]) < Decimal(ft["one_price"])
    assert "fallback.tiers[].per_row (flex $0.003625, default $0.00725), beside every fallback row at " \
        "cost.fallback_per_row $0.00725 (default)" in p["bill"]["prices"]
    assert "set cost.batch_per_row and cost.fallback_per_row in the spec" in p["bill"]["prices"]
    assert f"  tiers         flex {split['flex']:,} rows x $0.003625" in err
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0     # a preview writes no job
