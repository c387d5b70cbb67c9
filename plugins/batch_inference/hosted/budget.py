"""``cost.budget`` on a hosted batch transport's own rows: paid for before they are sent.

A provider bills every request of a batch that completes, so a row handed to a provider's
batch is spent the moment the batch is created. With ``on_budget: page`` a worker therefore
opens a provider batch of at most the rows the rest of the budget affords at the transport's
batch price (``cost.hosted_batch_per_row``): the bill so far (``cost.job_bill`` over the
ledger) and every request the job's provider batches still hold (reserved: paid once they
complete) are taken first. The check and the intent row that reserves the rows are one
transaction under the job's budget lock (``bi.hosted_spend_v1``), so two workers never spend
the same dollars. The rows it cannot afford stay pending (no attempt spent); a worker that can
afford none releases its shard and exits (``BudgetSpent``). The cutoff watch pages once with
the same arithmetic (``deadline.budget_page``).

With ``on_budget: spend`` nothing is held back: the watch pages once that the rows go past the
budget, with the arithmetic, and the provider gets every row.

The check is the fallback pool's (``fallback.BudgetCheck``), priced at the batch price, with the
rows in provider batches as its reserve.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from batch_inference.cost import Prices, job_bill


def hosted_budget(spec: Any, counts: Any, spend: Any, prices: Prices | None = None) -> Any:
    """The budget against sending every outstanding row to the provider's batches (a
    ``fallback.BudgetCheck``), from ``counts`` (the job's ``JobCounts``: the ledger's outstanding, not
    the cutoff's) and ``spend`` (the ``hosted_spend`` row); None without ``cost.budget``."""
    from batch_inference.fallback import BudgetCheck

    if spec.cost.budget is None:
        return None
    prices = Prices.from_spec(spec) if prices is None else prices
    # Read one after the other, while workers store: the hosted rows may be newer than the counts.
    counts = {**counts, "stored_batch": max(int(counts["stored_batch"]), int(spend["rows"]))}
    so_far, _ = job_bill(counts, prices, spend)          # a hosted job's workers run no GPU
    in_flight = int(spend["in_flight"])
    return BudgetCheck(budget=Decimal(str(spec.cost.budget)), spent=so_far.total,
                       outstanding=max(0, int(counts["outstanding"]) - in_flight),
                       per_row=prices.hosted_batch_per_row, on_budget=spec.cost.on_budget, in_provider=in_flight,
                       provider_reserve=in_flight * prices.hosted_batch_per_row,
                       who="the hosted batch transport", does="sends", note="", then="")


def affordable(check: Any, n: int) -> int:
    """Of ``n`` rows about to go to a provider batch, how many the budget lets go (all without a cap)."""
    return n if check is None or check.allowance is None else min(n, check.allowance)
