"""What firing costs: the seed's table, the ceiling property, the month view, the CLI."""

from __future__ import annotations

import argparse
import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batch_inference.cost import (
    DEFAULT_PRICES,
    Prices,
    all_synchronous_ceiling,
    clean_batch_floor,
    cost_report,
    fallback_table,
    month_view,
    night_cost,
    rows_within,
    split_at,
)
from batch_inference.ratelimit import RequestAllowance

ROWS = 300_000


def test_default_prices_are_the_seeds():
    assert DEFAULT_PRICES.fallback_per_row == Decimal("0.00725")
    assert DEFAULT_PRICES.batch_per_row == Decimal("0.003625")


def test_seed_nights():
    assert clean_batch_floor(ROWS) == Decimal("1087.5")
    assert all_synchronous_ceiling(ROWS) == Decimal("2175")
    assert night_cost(*split_at(ROWS, 0.4)) == Decimal("1740")


def test_seed_ninety_percent_row():
    r = cost_report(270_000, 30_000)
    assert (r.batch_cost, r.fallback_cost) == (Decimal("978.75"), Decimal("217.5"))
    assert r.total == Decimal("1196.25")
    assert r.overage == Decimal("108.75")  # night less the $1,087.50 clean night
    assert r.savings == Decimal("978.75")
    d = r.to_dict()
    assert d["batch_cost"] == 978.75 and d["fallback_cost"] == 217.5 and d["total"] == 1196.25


def test_table_ends_at_the_floor_and_the_ceiling():
    table = dict(fallback_table(ROWS))
    assert table[1.0].total == Decimal("1087.5") and table[1.0].overage == 0
    assert table[0.0].total == Decimal("2175") and table[0.0].overage == Decimal("1087.5")
    totals = [r.total for _, r in fallback_table(ROWS)]
    assert totals == sorted(totals)  # less done when it fired, higher bill


def test_seed_month_view():
    months = {m.slip_nights: m for m in month_view(ROWS, [0, 2, 6, 15, 30], 0.4)}
    assert months[0].total == Decimal("32625")
    assert months[0].all_synchronous_month == Decimal("65250")
    assert months[0].savings == Decimal("32625")
    # each slip night swaps a $1,087.50 night for a $1,740 one: +$652.50
    assert months[2].total - months[0].total == Decimal("1305")
    assert months[6].total - months[0].total == Decimal("3915")
    assert months[15].total == Decimal("42412.5")
    # abandoned every night is still cheaper than never using batch
    assert months[30].total == Decimal("52200") and months[30].savings == Decimal("13050")
    assert months[2].slip_rate == pytest.approx(1 / 15)


def test_split_rounds_batch_rows_down():
    assert split_at(10, 0.55) == (5, 5)
    assert split_at(ROWS, 0.9) == (270_000, 30_000)
    with pytest.raises(ValueError):
        split_at(10, 1.5)


def test_prices_from_spec_shapes():
    assert Prices.from_spec({"cost": {"batch_per_row": 0.002, "fallback_per_row": 0.004}}) == Prices(
        Decimal("0.002"), Decimal("0.004"))
    assert Prices.from_spec({}) == DEFAULT_PRICES

    class Cost:
        batch_per_row, fallback_per_row = 0.001, 0.003

    class Spec:
        cost = Cost()

    assert Prices.from_spec(Spec()).fallback_per_row == Decimal("0.003")
    with pytest.raises(ValueError):
        Prices(batch_per_row=-1)


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError):
        night_cost(-1, 0)
    with pytest.raises(ValueError):
        cost_report(10, 10, total_rows=5)
    with pytest.raises(ValueError):
        month_view(ROWS, [31], 0.4)


# Prices as whole hundred-thousandths of a dollar: exact in Decimal, and wide
# enough to cover every per-row price a hosted API charges.
_price = st.integers(0, 100_000).map(lambda n: Decimal(n) / 100_000)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(0, 50_000_000),
    completed=st.fractions(0, 1),
    pair=st.tuples(_price, _price).map(sorted),
)
def test_a_fallback_night_never_costs_more_than_all_synchronous(total, completed, pair):
    batch_price, sync_price = pair  # batch <= sync
    prices = Prices(batch_per_row=batch_price, fallback_per_row=sync_price)
    batch, fallback = split_at(total, Decimal(completed.numerator) / Decimal(completed.denominator))
    assert batch + fallback == total
    night = night_cost(batch, fallback, prices)
    assert clean_batch_floor(total, prices) <= night <= all_synchronous_ceiling(total, prices)


# -- CLI -----------------------------------------------------------------------------


def _run(argv, capsys):
    from batch_inference.commands import cost

    p = argparse.ArgumentParser(prog="batch-inference")
    cost.register(p.add_subparsers(dest="command"))
    args = p.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr()


def test_cli_night_json(capsys):
    rc, out = _run(["cost", "--rows", "300000", "--fallback-rows", "30000", "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.out)
    assert doc["batch_cost"] == 978.75 and doc["fallback_cost"] == 217.5
    assert doc["clean_batch_floor"] == 1087.5 and doc["all_synchronous_ceiling"] == 2175.0


def test_cli_table_json(capsys):
    rc, out = _run(["cost", "--rows", "300000", "--json"], capsys)
    assert rc == 0
    rows = {r["completed"]: r for r in json.loads(out.out)["table"]}
    assert rows[0.4]["total"] == 1740.0 and rows[0.0]["total"] == 2175.0


def test_cli_month_json(capsys):
    rc, out = _run(["cost", "--month", "--rows", "300000", "--slip-nights", "0,2,6,15,30",
                    "--abandon-at", "0.4", "--json"], capsys)
    assert rc == 0
    doc = json.loads(out.out)
    assert doc["clean_month"] == 32625.0 and doc["all_synchronous_month"] == 65250.0
    assert [m["total"] for m in doc["months"]] == [32625.0, 33930.0, 36540.0, 42412.5, 52200.0]


def test_cli_month_text_and_prices(capsys):
    rc, out = _run(["cost", "--month", "--rows", "300000", "--slip-nights", "0,30",
                    "--batch-price", "0.00725", "--fallback-price", "0.00725"], capsys)
    assert rc == 0
    assert out.out.count("65,250.00") == 2  # no discount: every month is the all-synchronous one


def test_cli_errors(capsys):
    rc, out = _run(["cost"], capsys)
    assert rc == 2 and "--rows" in out.err
    rc, out = _run(["cost", "--rows", "10", "--fallback-rows", "11"], capsys)
    assert rc == 2
    rc, out = _run(["cost", "--rows", "10", "--batch-price", "cheap"], capsys)
    assert rc == 2 and "price" in out.err


# -- the budget's allowance (the fallback pool's cap) ---------------------------------


@settings(max_examples=200, deadline=None)
@given(budget=st.decimals(min_value=0, max_value=10_000, places=2),
       spent=st.decimals(min_value=0, max_value=10_000, places=2),
       per_row=st.decimals(min_value=Decimal("0.00001"), max_value=10, places=5))
def test_rows_within_is_the_most_rows_that_keep_within_the_budget(budget, spent, per_row):
    n = rows_within(budget, spent, per_row)
    assert n >= 0
    if spent <= budget:
        assert spent + n * per_row <= budget < spent + (n + 1) * per_row
    else:
        assert n == 0


def test_rows_within_a_free_row_is_no_limit():
    assert rows_within("1", "0.5", 0) is None
    assert rows_within("0.30", "0.10", "0.01") == 20


def test_the_allowance_lets_exactly_its_limit_through_across_threads_and_calls_on_spent_once():
    import threading

    spent: list[int] = []
    allowance = RequestAllowance(250, on_spent=lambda: spent.append(1))
    took: list[int] = []

    def take() -> None:
        took.append(sum(allowance.take() for _ in range(100)))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(took) == allowance.taken == 250 and allowance.refused == 550
    assert spent == [1] and allowance.spent
    assert not RequestAllowance(3).spent


def test_the_overage_says_over_or_under_a_clean_batch_night():
    assert cost_report(270_000, 30_000).overage_text == "+$108.75 over a clean batch night"
    # GPU-hour prices bill our own rows by the hour: cheap hours put the night under the batch-price floor.
    cheap = Prices(gpu_hour=Decimal("3.50"))
    r = cost_report(1_000, 0, cheap, gpu_hours=Decimal("0.1"))
    assert r.total == Decimal("0.35") and r.overage_text == "$3.28 under a clean batch night"


def test_a_ladder_is_priced_rung_by_rung():
    """``priced_by_rung``: the batch rows cost each rung's answers times its price; the rest of the bill
    (fallback rows) is unchanged, and the floor is the cascade's price per stored row so far."""
    from batch_inference.cost import priced_by_rung

    report = cost_report(80, 5, total_rows=90)
    rungs = [{"rung": 1, "model": "small", "answers": 80, "cost_per_row": 0.0005},
             {"rung": 2, "model": "big", "answers": 20, "cost_per_row": 0.0015}]
    priced = priced_by_rung(report, rungs)
    assert priced.batch_cost == Decimal("0.0700") and priced.fallback_cost == report.fallback_cost
    assert priced.total == Decimal("0.0700") + report.fallback_cost
    assert priced.clean_batch_floor == 90 * Decimal("0.0700") / 80
    d = priced.to_dict()
    assert [r["cost"] for r in d["rungs"]] == [0.04, 0.03] and d["batch_cost"] == 0.07
    assert priced_by_rung(report, []) is report


def test_the_regions_add_replication_and_egress_to_the_bill_and_its_floor_not_to_the_overage():
    from batch_inference.cost import cost_report, with_regions

    night = cost_report(800, 200, total_rows=1000)
    row = {"placed": True, "ledger_region": "us-east", "replication_bytes": 5_000_000_000,
           "replication_seconds": 12.5, "replication_usd": 0.25, "steals": 3, "steal_bytes": 1_000_000_000,
           "steal_usd": 0.05, "merged_files": 7, "merge_bytes": 2_000_000_000, "merge_usd": 0.04}
    placed = with_regions(night, row)
    assert placed.total == night.total + Decimal("0.34")
    assert placed.clean_batch_floor == night.clean_batch_floor + Decimal("0.34")
    assert placed.overage == night.overage and placed.all_synchronous_ceiling == night.all_synchronous_ceiling
    out = placed.to_dict()["regions"]
    assert (out["replication_cost"], out["egress_cost"], out["egress_bytes"]) == (0.25, 0.09, 3_000_000_000)
    lines = placed.lines()
    assert any(ln.startswith("replication") and "from us-east" in ln for ln in lines)
    assert any(ln.startswith("egress") and "3 steals, 7 result files" in ln for ln in lines)
    # a version in one region: nothing added, no lines
    assert with_regions(night, {**row, "placed": False}) is night and "regions" not in night.to_dict()
