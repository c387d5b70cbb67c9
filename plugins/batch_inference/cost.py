"""What a night costs, split by transport.

Every row of a job is billed once, by the transport that produced it: the
batch path (cheap, slow, no deadline), a hosted batch API (half the
synchronous price by default, or what the provider's reported usage comes
to) or the synchronous fallback pool (about twice the price, fast enough to
meet one). A night's bill is therefore
two multiplications and a sum, and it is bounded above by the price of
sending every row synchronously, whatever moment the cutoff fired at, as long
as the batch price is not above the fallback price.

Money is kept in ``Decimal`` so the worked examples come out to the cent
(``300_000 * 0.003625`` is not exactly 1087.5 in binary floating point).
Pure functions, no I/O; the CLI and the Airflow shells read counts and
prices elsewhere and hand them in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from typing import Any, Iterable

from batch_inference.exceptions import InvalidValue

CENT = Decimal("0.01")

# The seed workload's prices: $0.00725 a row synchronously, half that on batch
# (our own workers, or a hosted batch API).
DEFAULT_FALLBACK_PER_ROW = Decimal("0.00725")
DEFAULT_BATCH_PER_ROW = DEFAULT_FALLBACK_PER_ROW / 2


def _money(value: Any) -> Decimal:
    # str() first so a float such as 0.00725 becomes Decimal("0.00725"),
    # not the binary approximation 0.007249999999999999...
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value))
    except ArithmeticError:  # decimal.InvalidOperation: not a number at all
        raise InvalidValue(f"a price must be a number, got {value!r}") from None
    if not d.is_finite() or d < 0:
        raise InvalidValue(f"a price must be a finite number >= 0, got {value!r}")
    return d


def cents(amount: Decimal) -> Decimal:
    """Round to the cent, half up, for display. Sums are taken before rounding."""
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class Prices:
    """Per-row prices of the transports, named as in the job spec's ``cost`` block.

    ``hosted_batch_per_row`` None: half of ``fallback_per_row`` (a hosted batch API's
    discount on its synchronous price). The per-million-token prices, when set, price
    hosted batch rows from the provider's reported usage instead."""

    batch_per_row: Decimal = DEFAULT_BATCH_PER_ROW
    fallback_per_row: Decimal = DEFAULT_FALLBACK_PER_ROW
    hosted_batch_per_row: Decimal | None = None
    hosted_batch_per_m_input_tokens: Decimal | None = None
    hosted_batch_per_m_output_tokens: Decimal | None = None
    # A batch worker's GPU-hour (the spec's capacity's price). Set: our own workers' rows are
    # billed by GPU-hours and not per row (``own_row``).
    gpu_hour: Decimal | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_per_row", _money(self.batch_per_row))
        if self.gpu_hour is not None:
            object.__setattr__(self, "gpu_hour", _money(self.gpu_hour))
        object.__setattr__(self, "fallback_per_row", _money(self.fallback_per_row))
        hosted = self.fallback_per_row / 2 if self.hosted_batch_per_row is None else self.hosted_batch_per_row
        object.__setattr__(self, "hosted_batch_per_row", _money(hosted))
        for name in ("hosted_batch_per_m_input_tokens", "hosted_batch_per_m_output_tokens"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _money(getattr(self, name)))

    @property
    def own_row(self) -> Decimal:
        """What one row of our own batch workers costs by itself: nothing when GPU-hours are billed."""
        return Decimal(0) if self.gpu_hour is not None else self.batch_per_row

    def gpu_cost(self, gpu_hours: float | Decimal) -> Decimal:
        """GPU-hours at the GPU-hour price (0 without one)."""
        return Decimal(0) if self.gpu_hour is None else _money(gpu_hours) * self.gpu_hour

    def hosted_usage_cost(self, input_tokens: int | None, output_tokens: int | None) -> Decimal | None:
        """What the provider's reported usage costs, or None without token prices or usage."""
        if self.hosted_batch_per_m_input_tokens is None or self.hosted_batch_per_m_output_tokens is None \
                or input_tokens is None or output_tokens is None:
            return None
        return (int(input_tokens) * self.hosted_batch_per_m_input_tokens
                + int(output_tokens) * self.hosted_batch_per_m_output_tokens) / 1_000_000

    @classmethod
    def from_spec(cls, spec: Any) -> "Prices":
        """From a ``JobSpec`` (its ``cost`` block), a spec dict, or a bare cost dict."""
        cost = getattr(spec, "cost", None)
        if cost is None and isinstance(spec, dict):
            cost = spec.get("cost", spec)
        if cost is None:
            return cls()
        get = cost.get if isinstance(cost, dict) else lambda k, d: getattr(cost, k, d)
        spot, on_demand = get("gpu_hour_spot", None), get("gpu_hour_on_demand", None)
        gpu_hour = (spot if spot is not None else on_demand) if get("capacity", "spot") == "spot" else \
            (on_demand if on_demand is not None else spot)
        return cls(
            batch_per_row=get("batch_per_row", DEFAULT_BATCH_PER_ROW),
            fallback_per_row=get("fallback_per_row", DEFAULT_FALLBACK_PER_ROW),
            hosted_batch_per_row=get("hosted_batch_per_row", None),
            hosted_batch_per_m_input_tokens=get("hosted_batch_per_m_input_tokens", None),
            hosted_batch_per_m_output_tokens=get("hosted_batch_per_m_output_tokens", None),
            gpu_hour=gpu_hour,
        )

    def to_dict(self) -> dict[str, float]:
        return {"batch_per_row": float(self.batch_per_row), "fallback_per_row": float(self.fallback_per_row),
                "hosted_batch_per_row": float(self.hosted_batch_per_row),
                "gpu_hour": None if self.gpu_hour is None else float(self.gpu_hour)}


DEFAULT_PRICES = Prices()


def _rows(n: int, name: str) -> int:
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise InvalidValue(f"{name} must be a whole number >= 0, got {n!r}")
    return int(n)


def night_cost(batch_rows: int, fallback_rows: int, prices: Prices = DEFAULT_PRICES) -> Decimal:
    """The bill for one night: each row at the price of the transport that produced it
    (``cost_report`` adds hosted batch rows)."""
    b = _rows(batch_rows, "batch_rows")
    f = _rows(fallback_rows, "fallback_rows")
    return b * prices.batch_per_row + f * prices.fallback_per_row


def all_synchronous_ceiling(rows: int, prices: Prices = DEFAULT_PRICES) -> Decimal:
    """Every row through the synchronous API: what not using batch at all would cost.

    A ceiling, not a bad case: a fallback night can only move rows from the
    batch price up to this one, never past it (when batch <= fallback price).
    """
    return night_cost(0, rows, prices)


def clean_batch_floor(rows: int, prices: Prices = DEFAULT_PRICES) -> Decimal:
    """Every row through batch: a night on which the cutoff never fired."""
    return night_cost(rows, 0, prices)


@dataclass(frozen=True)
class CostReport:
    """One night's bill with the two reference points it sits between."""

    batch_rows: int
    fallback_rows: int
    total_rows: int
    batch_cost: Decimal
    fallback_cost: Decimal
    total: Decimal
    all_synchronous_ceiling: Decimal
    clean_batch_floor: Decimal
    prices: Prices
    hosted_rows: int = 0
    hosted_cost: Decimal = Decimal(0)
    gpu_hours: Decimal = Decimal(0)       # the batch workers' GPU time (billed when prices.gpu_hour is set)
    gpu_cost: Decimal = Decimal(0)
    # A model ladder's batch rows, priced rung by rung (``priced_by_rung``): each rung's answers x its price.
    rungs: tuple[dict[str, Any], ...] = ()
    # The fallback's rows priced at the tier that answered each (``tiers.priced_by_tier``): tier, rows, per_row, cost.
    tiers: tuple[dict[str, Any], ...] = ()
    # A version placed over regions (``with_regions``): replication and egress, in ``total`` and the floor.
    regions: dict[str, Any] | None = None

    @property
    def regions_cost(self) -> Decimal:
        """Replication plus egress (steals' and the merge's cross-region reads); 0 in one region."""
        r = self.regions or {}
        return r.get("replication_cost", Decimal(0)) + r.get("egress_cost", Decimal(0))

    @property
    def overage(self) -> Decimal:
        """What the fallback added over a clean batch night."""
        return self.total - self.clean_batch_floor

    @property
    def overage_text(self) -> str:
        """The overage in words: "+$X over a clean batch night", or "$X under" it (GPU-hour prices can make
        our own rows cheaper than the batch price the floor is taken at)."""
        o = cents(self.overage)
        return f"+${o:,} over a clean batch night" if o >= 0 else f"${-o:,} under a clean batch night"

    @property
    def savings(self) -> Decimal:
        """What batch still saved against sending everything synchronously."""
        return self.all_synchronous_ceiling - self.total

    @property
    def batch_fraction(self) -> float:
        """Of the job's rows, those billed at a batch price (our workers' or a hosted API's)."""
        return (self.batch_rows + self.hosted_rows) / self.total_rows if self.total_rows else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_rows": self.batch_rows,
            "fallback_rows": self.fallback_rows,
            "total_rows": self.total_rows,
            "batch_fraction": round(self.batch_fraction, 6),
            "batch_cost": float(cents(self.batch_cost)),
            "fallback_cost": float(cents(self.fallback_cost)),
            "hosted_rows": self.hosted_rows,
            "hosted_cost": float(cents(self.hosted_cost)),
            "gpu_hours": round(float(self.gpu_hours), 6),
            "gpu_cost": float(cents(self.gpu_cost)),
            "total": float(cents(self.total)),
            "clean_batch_floor": float(cents(self.clean_batch_floor)),
            "all_synchronous_ceiling": float(cents(self.all_synchronous_ceiling)),
            "overage": float(cents(self.overage)),
            "overage_text": self.overage_text,
            "savings_vs_all_synchronous": float(cents(self.savings)),
            "prices": self.prices.to_dict(),
            **({"rungs": [{**r, "cost": round(float(r["cost"]), 6)} for r in self.rungs]} if self.rungs else {}),
            **({"fallback_tiers": [{**t, "per_row": float(t["per_row"]), "cost": round(float(t["cost"]), 6)}
                                   for t in self.tiers]} if self.tiers else {}),
            **({"regions": {k: round(float(v), 6) if isinstance(v, Decimal) else v
                            for k, v in self.regions.items()}} if self.regions else {}),
        }

    def lines(self) -> list[str]:
        return [
            f"batch     {self.batch_rows:>12,} rows  ${cents(self.batch_cost):>12,}",
            *[f"  rung {r['rung']} {r['model']}: {r['answers']:,} answers x ${r['cost_per_row']:g} = "
              f"${float(r['cost']):,.4f}" for r in self.rungs],
            *([f"hosted    {self.hosted_rows:>12,} rows  ${cents(self.hosted_cost):>12,}"] if self.hosted_rows else []),
            *([f"gpu       {float(self.gpu_hours):>12,.3f} h     ${cents(self.gpu_cost):>12,}"]
              if self.prices.gpu_hour is not None else []),
            f"fallback  {self.fallback_rows:>12,} rows  ${cents(self.fallback_cost):>12,}",
            *(self.regions_lines() if self.regions else []),
            f"night     {self.batch_rows + self.hosted_rows + self.fallback_rows:>12,} rows  "
            f"${cents(self.total):>12,}",
            f"clean batch floor ${cents(self.clean_batch_floor):,}, "
            f"all-synchronous ceiling ${cents(self.all_synchronous_ceiling):,}, "
            f"overage ${cents(self.overage):,}, saved vs all-synchronous ${cents(self.savings):,}",
        ]


    def regions_lines(self) -> list[str]:
        """The replication and egress lines of a version placed over regions."""
        r = self.regions or {}
        return [f"replication {r['replication_bytes']:>10,} bytes  ${float(r['replication_cost']):>12,.4f}"
                f"  ({r['replication_seconds']:.2f} s, from {r['ledger_region']})",
                f"egress    {r['egress_bytes']:>12,} bytes  ${float(r['egress_cost']):>12,.4f}"
                f"  ({r['steals']:,} steals, {r['merged_files']:,} result files merged from far regions)"]


def with_regions(report: CostReport, row: Any) -> CostReport:
    """``report`` with what the regions added (``row``: the ``region_bill`` statement's): replication and
    egress in ``total`` and in the clean batch floor (a clean night over these regions pays them too), so the
    overage stays what the fallback added. A version never placed: ``report`` as it is."""
    if not row or not row["placed"]:
        return report
    replication = _money(row["replication_usd"])
    egress = _money(row["steal_usd"]) + _money(row["merge_usd"])
    regions = {"ledger_region": row["ledger_region"], "replication_bytes": int(row["replication_bytes"]),
               "replication_seconds": round(float(row["replication_seconds"]), 3), "replication_cost": replication,
               "steals": int(row["steals"]), "steal_bytes": int(row["steal_bytes"]),
               "merged_files": int(row["merged_files"]), "merge_bytes": int(row["merge_bytes"]),
               "egress_bytes": int(row["steal_bytes"]) + int(row["merge_bytes"]), "egress_cost": egress}
    return dataclasses.replace(report, regions=regions, total=report.total + replication + egress,
                               clean_batch_floor=report.clean_batch_floor + replication + egress)


def cost_report(
    batch_rows: int,
    fallback_rows: int,
    prices: Prices = DEFAULT_PRICES,
    total_rows: int | None = None,
    hosted_rows: int = 0,
    hosted_cost: Decimal | None = None,
    gpu_hours: float | Decimal = 0,
) -> CostReport:
    """The night's bill split by transport.

    ``total_rows`` is the job's size when it differs from the rows billed so
    far (a running job, or one with dead letters); floor and ceiling are taken
    over it, so they stay the night's reference points while rows settle.
    """
    b = _rows(batch_rows, "batch_rows")
    f = _rows(fallback_rows, "fallback_rows")
    h = _rows(hosted_rows, "hosted_rows")
    total = b + h + f if total_rows is None else _rows(total_rows, "total_rows")
    if total < b + h + f:
        raise InvalidValue(f"total_rows {total:,} is fewer than the {b + h + f:,} rows billed")
    hosted = h * prices.hosted_batch_per_row if hosted_cost is None else _money(hosted_cost)
    gpu_h = _money(gpu_hours)
    gpu = prices.gpu_cost(gpu_h)
    return CostReport(
        batch_rows=b,
        fallback_rows=f,
        total_rows=total,
        batch_cost=b * prices.own_row,
        fallback_cost=f * prices.fallback_per_row,
        total=b * prices.own_row + hosted + f * prices.fallback_per_row + gpu,
        all_synchronous_ceiling=all_synchronous_ceiling(total, prices),
        clean_batch_floor=clean_batch_floor(total, prices),
        prices=prices,
        hosted_rows=h,
        hosted_cost=hosted,
        gpu_hours=gpu_h,
        gpu_cost=gpu,
    )


def priced_by_rung(report: CostReport, rungs: Iterable[dict[str, Any]]) -> CostReport:
    """``report`` with its batch rows priced rung by rung: a model ladder's bill is what each rung
    answered times that rung's price (``rungs``: ``{rung, model, answers, cost_per_row}``, answers
    counting every sample), not its stored rows at one per-row price. The floor becomes every
    billable row through the cascade at its price per stored row so far (before any, rung 1's)."""
    priced = tuple({**r, "cost": r["answers"] * _money(r["cost_per_row"])} for r in rungs)
    if not priced:
        return report
    batch = sum((r["cost"] for r in priced), Decimal(0))
    per_row = batch / report.batch_rows if report.batch_rows else _money(priced[0]["cost_per_row"])
    # Rows of the report priced per row (GPU-hours aside): our own rows at prices.own_row.
    total = report.total - report.batch_cost + batch
    return dataclasses.replace(report, batch_cost=batch, total=total, rungs=priced,
                               clean_batch_floor=report.total_rows * per_row + report.regions_cost)


def rows_within(budget: Any, spent: Any, per_row: Any) -> int | None:
    """How many more rows at ``per_row`` keep the bill at or under ``budget`` after ``spent``
    (0 once it is spent; None: a free row, no limit). Rounded down: the safe side for a budget."""
    b, s, p = _money(budget), _money(spent), _money(per_row)
    if p == 0:
        return None
    return max(0, int(((b - s) / p).to_integral_value(rounding=ROUND_FLOOR)))


def split_at(rows: int, completed_fraction: float | Decimal) -> tuple[int, int]:
    """(batch rows, fallback rows) for a night abandoned with this fraction done.

    Batch rows are rounded down: a part-row is re-driven, which errs towards
    the higher bill, the safe side for a budget.
    """
    n = _rows(rows, "rows")
    frac = Decimal(str(completed_fraction))
    if not (0 <= frac <= 1):
        raise InvalidValue(f"completed fraction must be within 0..1, got {completed_fraction!r}")
    batch = int((n * frac).to_integral_value(rounding=ROUND_FLOOR))
    return batch, n - batch


def fallback_table(
    rows: int,
    completed: Iterable[float] = (1.0, 0.9, 0.75, 0.5, 0.4, 0.25, 0.0),
    prices: Prices = DEFAULT_PRICES,
) -> list[tuple[float, CostReport]]:
    """The night's bill at each completion level the cutoff might fire at."""
    return [(float(c), cost_report(*split_at(rows, c), prices=prices)) for c in completed]


@dataclass(frozen=True)
class MonthRow:
    """A month with ``slip_nights`` nights abandoned at the same completion level."""

    slip_nights: int
    nights: int
    total: Decimal
    clean_month: Decimal
    all_synchronous_month: Decimal
    # With price tiers (``tail_by_tier``): the month's fallback rows by tier ({tier, rows, per_row, cost}),
    # and the same month with every fallback row at ``prices.fallback_per_row``.
    tiers: tuple[dict[str, Any], ...] = ()
    one_price_total: Decimal | None = None

    @property
    def slip_rate(self) -> float:
        return self.slip_nights / self.nights if self.nights else 0.0

    @property
    def overage(self) -> Decimal:
        return self.total - self.clean_month

    @property
    def savings(self) -> Decimal:
        return self.all_synchronous_month - self.total

    def to_dict(self) -> dict[str, Any]:
        return {
            "slip_nights": self.slip_nights,
            "nights": self.nights,
            "slip_rate": round(self.slip_rate, 6),
            "total": float(cents(self.total)),
            "overage_vs_clean": float(cents(self.overage)),
            "savings_vs_all_synchronous": float(cents(self.savings)),
            **({"fallback_tiers": [{**t, "per_row": float(t["per_row"]), "cost": float(cents(t["cost"]))}
                                   for t in self.tiers],
                "one_price_total": float(cents(self.one_price_total))} if self.one_price_total is not None else {}),
        }


@dataclass(frozen=True)
class TierShare:
    """A price tier in the month view: its price, and the share of a slip night's fallback rows it
    answers (None: what the cheaper tiers leave, the last tier)."""

    name: str
    per_row: Decimal
    share: Decimal | None = None

    @classmethod
    def parse(cls, text: str) -> "TierShare":
        """``NAME=PRICE[:SHARE]``, as ``cost --month --tier`` takes it."""
        name, eq, rest = text.partition("=")
        price, colon, share = rest.partition(":")
        if not eq or not name.strip() or not price.strip() or (colon and not share.strip()):
            raise InvalidValue(f"--tier {text!r}: give NAME=PRICE[:SHARE], e.g. flex=0.003625:0.95 "
                               "(the last tier without a share)")
        frac = None
        if colon:
            try:
                frac = Decimal(share.strip())
            except ArithmeticError:
                frac = Decimal("NaN")
            if not frac.is_finite() or not 0 <= frac <= 1:
                raise InvalidValue(f"--tier {text!r}: the share must be a number within 0..1, got {share!r}")
        try:
            per_row = _money(price.strip())
        except InvalidValue as exc:
            raise InvalidValue(f"--tier {text!r}: {exc}") from None
        return cls(name.strip(), per_row, frac)


def tail_by_tier(rows: int, tiers: Iterable[TierShare]) -> list[dict[str, Any]]:
    """A slip night's ``rows`` fallback rows split by tier ({tier, rows, per_row, cost}): each tier
    with a share its share (rounded down), the last tier (no share) the rest. Every tier but the last
    needs a share, the last none, and the shares at most 1."""
    ts = list(tiers)
    if not ts or ts[-1].share is not None or any(t.share is None for t in ts[:-1]):
        raise InvalidValue("tiers: every tier but the last needs a share of the tail (NAME=PRICE:SHARE), "
                           "the last none (it takes the rest)")
    if sum((t.share or Decimal(0) for t in ts), Decimal(0)) > 1:
        raise InvalidValue(f"tiers: the shares add up to more than 1 ({', '.join(f'{t.name} {t.share}' for t in ts[:-1])})")
    n = _rows(rows, "rows")
    out, left = [], n
    for t in ts:
        k = left if t.share is None else int((n * t.share).to_integral_value(rounding=ROUND_FLOOR))
        left -= k
        out.append({"tier": t.name, "rows": k, "per_row": t.per_row, "cost": k * t.per_row})
    return out


def month_view(
    rows_per_night: int,
    slip_nights_list: Iterable[int],
    abandon_fraction: float | Decimal,
    prices: Prices = DEFAULT_PRICES,
    nights: int = 30,
    tiers: Iterable[TierShare] = (),
) -> list[MonthRow]:
    """Month totals at several slip rates, each slip night abandoned at ``abandon_fraction`` done.

    This is the break-even table; it never breaks even. A slip night costs
    more than a clean one and less than an all-synchronous one, so every row
    of the month sits below the all-synchronous month, and the argument for
    relabelling the pipeline (docs/deadlines.md) is about operations, not money.

    ``tiers``: the fallback's price tiers, each with its share of a slip night's tail
    (``tail_by_tier``): slip nights are priced tier by tier, and each row also gives the month's
    fallback rows by tier and the same month at one price.
    """
    n = _rows(nights, "nights")
    clean = clean_batch_floor(rows_per_night, prices)
    batch_rows, tail_rows = split_at(rows_per_night, abandon_fraction)
    slip = one_price = night_cost(batch_rows, tail_rows, prices=prices)
    split = tail_by_tier(tail_rows, tiers) if tiers else []
    if split:
        slip = night_cost(batch_rows, 0, prices) + sum((t["cost"] for t in split), Decimal(0))
    ceiling = all_synchronous_ceiling(rows_per_night, prices)
    out = []
    for s in slip_nights_list:
        k = _rows(s, "slip nights")
        if k > n:
            raise InvalidValue(f"{k} slip nights in a {n}-night month")
        out.append(
            MonthRow(
                slip_nights=k,
                nights=n,
                total=(n - k) * clean + k * slip,
                clean_month=n * clean,
                all_synchronous_month=n * ceiling,
                tiers=tuple({**t, "rows": k * t["rows"], "cost": k * t["cost"]} for t in split),
                one_price_total=(n - k) * clean + k * one_price if split else None,
            )
        )
    return out


def job_bill(counts: Any, prices: Prices, hosted: Any = None,
             gpu_hours: float | Decimal = 0, regions: Any = None) -> tuple[CostReport, CostReport]:
    """A running job's bill so far by transport, and what it would be if the fallback fired now.

    ``counts`` is the job's ``JobCounts``, ``hosted`` the ``hosted_cost_rows`` row
    (rows stored through hosted batch and the providers' reported usage). Tonight's
    bill covers the rows this run produces: stored by any transport, or still to be.
    Reused rows were paid for by an earlier version and dead letters produced
    nothing, so neither is priced. Hosted batch rows are priced from the reported
    usage when the spec prices tokens and every batch reported it, else per row. With a
    GPU-hour price, our own workers' rows are billed by ``gpu_hours`` (the launchers'
    record, ``autopilot.gpu_hours``) instead of per row. ``regions``, the ``region_bill`` row of a version
    placed over regions, adds replication and egress (``with_regions``).
    """
    hosted_rows = int(hosted["rows"]) if hosted else 0
    batch = int(counts["stored_batch"]) - hosted_rows
    fallback, outstanding = int(counts["stored_fallback"]), int(counts["outstanding"])
    hosted_cost = prices.hosted_usage_cost(hosted["input_tokens"], hosted["output_tokens"]) \
        if hosted_rows and not hosted["unpriced_batches"] else None
    billable = batch + hosted_rows + fallback + outstanding
    so_far = cost_report(batch, fallback, prices, total_rows=billable, hosted_rows=hosted_rows,
                         hosted_cost=hosted_cost, gpu_hours=gpu_hours)
    # If the cutoff fired now, every outstanding row would go synchronous.
    fired = cost_report(batch, fallback + outstanding, prices, total_rows=billable, hosted_rows=hosted_rows,
                        hosted_cost=hosted_cost, gpu_hours=gpu_hours)
    return with_regions(so_far, regions), with_regions(fired, regions)
