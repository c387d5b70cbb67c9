"""cost.budget on a hosted batch transport's own rows (batch_inference.hosted.budget): the arithmetic."""

from __future__ import annotations

from decimal import Decimal

from batch_inference.hosted.budget import affordable, hosted_budget
from tests.conftest import make_spec


def spend(rows: int = 0, in_flight: int = 0) -> dict:
    return {"rows": rows, "input_tokens": None, "output_tokens": None, "unpriced_batches": 1 if rows else 0,
            "in_flight": in_flight}


def counts(stored_batch: int = 0, outstanding: int = 1199) -> dict:
    return {"stored_batch": stored_batch, "stored_fallback": 0, "outstanding": outstanding}


def test_with_page_only_the_rows_the_budget_affords_at_the_batch_price_go_to_the_provider():
    check = hosted_budget(make_spec(cost={"budget": 0.05, "on_budget": "page"}), counts(), spend())
    assert check.per_row == Decimal("0.003625") and check.allowance == 13 and affordable(check, 100) == 13
    assert check.page("jv_1") == (
        "the hosted batch transport of jv_1 stops at the budget (on_budget: page): budget $0.05: spent $0.00 so far "
        "+ 1,199 rows outstanding x $0.003625/row = $4.35 projected; it sends at most 13 row(s) ($0.05), and leaves "
        "at least 1,186 row(s) pending: the job cannot be validated nor published (I3) until cost.budget is raised "
        "(resubmit the spec)")
    # The rows a provider batch holds are reserved: the next worker can afford none.
    held = hosted_budget(make_spec(cost={"budget": 0.05, "on_budget": "page"}), counts(), spend(in_flight=13))
    assert held.allowance == 0 and held.outstanding == 1186 and affordable(held, 100) == 0


def test_with_spend_nothing_is_held_back_and_the_page_says_by_how_much():
    check = hosted_budget(make_spec(cost={"budget": 0.05, "on_budget": "spend"}), counts(), spend())
    assert check.allowance is None and affordable(check, 100) == 100
    assert check.page("jv_1").startswith("the hosted batch transport of jv_1 sends every row past the budget "
                                         "(on_budget: spend): budget $0.05: ")
    assert check.page("jv_1").endswith(", $4.30 over")
    assert hosted_budget(make_spec(), counts(), spend()) is None and affordable(None, 7) == 7


def test_hosted_rows_stored_after_the_counts_were_read_are_billed_once_not_refused():
    """The watch reads the counts, then the hosted rows; a worker may store in between (2026-12-06: the
    nights ended 'batch_rows must be a whole number >= 0, got -20')."""
    check = hosted_budget(make_spec(cost={"budget": 0.05, "on_budget": "page"}), counts(stored_batch=0, outstanding=80),
                          spend(rows=20))
    assert check.spent == 20 * Decimal("0.003625") and check.allowance == 0
