"""``batch-inference cost``: what a night (or a month) costs, split by transport.

Three forms: a job version (counts and prices from the database), a night
given as row counts, and a month view over several slip rates. The second and
third need no database.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from batch_inference.commands.common import db_arg
from batch_inference.cost import (
    DEFAULT_PRICES,
    Prices,
    TierShare,
    cents,
    cost_report,
    fallback_table,
    month_view,
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "cost",
        help="a night's cost by transport, or a month at several slip rates",
        description=(
            "JOB_VERSION: the job's bill so far and if the fallback fired now. "
            "--rows N [--fallback-rows M]: a night of N rows, M of them re-driven synchronously "
            "(without M, a table over completion levels). "
            "--month --rows N --slip-nights 0,2,6 --abandon-at 0.4: month totals."
        ),
    )
    p.add_argument("job_version", nargs="?")
    p.add_argument("--rows", type=int, help="rows in the night (the whole job)")
    p.add_argument("--fallback-rows", type=int, help="of those, rows produced by the synchronous fallback")
    p.add_argument("--month", action="store_true", help="month view over --slip-nights")
    p.add_argument("--slip-nights", default="0,2,6,15,30", help="comma-separated slip-night counts (month view)")
    p.add_argument("--abandon-at", type=float, default=0.4, help="fraction done when a slip night is abandoned")
    p.add_argument("--nights", type=int, default=30, help="nights in the month")
    p.add_argument("--tier", action="append", default=[], metavar="NAME=PRICE[:SHARE]",
                   help="month view: a price tier of the fallback, cheapest first, with its share of a slip night's "
                        "fallback rows (the last tier without one takes the rest), e.g. --tier flex=0.003625:0.95 "
                        "--tier default=0.00725")
    p.add_argument("--batch-price", type=str, help=f"per row on batch (default {DEFAULT_PRICES.batch_per_row})")
    p.add_argument("--fallback-price", type=str, help=f"per row synchronously (default {DEFAULT_PRICES.fallback_per_row})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    db_arg(p)
    p.set_defaults(func=run)


def _prices(args: argparse.Namespace, base: Prices = DEFAULT_PRICES) -> Prices:
    return dataclasses.replace(
        base,
        batch_per_row=args.batch_price if args.batch_price is not None else base.batch_per_row,
        fallback_per_row=args.fallback_price if args.fallback_price is not None else base.fallback_per_row,
    )


def _job(args: argparse.Namespace) -> dict[str, Any]:
    from batch_inference import db, status  # lazily: the calculator forms need no database

    conn = db.connect(getattr(args, "db", None))
    try:
        counts = status.job_counts(conn, args.job_version)
        prices = _prices(args, Prices.from_spec(status.job_spec(conn, args.job_version)))
        so_far, fired = status.bill(conn, args.job_version, prices, counts)
    finally:
        close = getattr(conn, "close", None)
        if close:
            close()
    records = int(counts["records"])
    outstanding = int(counts["outstanding"])
    return {
        "job_version": args.job_version,
        "records": records,
        "stored": int(counts["stored"]),
        "dead_letters": int(counts["dead_letters"]),
        "outstanding": outstanding,
        "reused": int(counts.get("reused", 0)),
        "so_far": so_far.to_dict(),
        "if_fallback_now": fired.to_dict(),
    }


def run(args: argparse.Namespace) -> int:
    try:
        if args.job_version:
            out = _job(args)
            if args.json:
                print(json.dumps(out))
            else:
                s, f = out["so_far"], out["if_fallback_now"]
                print(f"job {out['job_version']}: {out['records']:,} records, {out['stored']:,} stored, "
                      f"{out['dead_letters']:,} dead letters, {out['outstanding']:,} outstanding")
                hosted = f"hosted batch {s['hosted_rows']:,} rows ${s['hosted_cost']:,.2f}, " \
                    if s["hosted_rows"] else ""
                gpu = f"GPU {s['gpu_hours']:,.3f} h ${s['gpu_cost']:,.2f}, " \
                    if s["prices"]["gpu_hour"] is not None else ""
                print(f"so far: batch {s['batch_rows']:,} rows ${s['batch_cost']:,.2f}, {gpu}{hosted}"
                      f"fallback {s['fallback_rows']:,} rows ${s['fallback_cost']:,.2f}, total ${s['total']:,.2f}")
                if s.get("rungs"):   # a model ladder: the batch rows rung by rung
                    print("batch rung by rung: " + "; ".join(
                        f"rung {r['rung']} {r['model']} {r['answers']:,} answers x ${r['cost_per_row']:g} = "
                        f"${r['cost']:,.4f}" for r in s["rungs"]))
                if s.get("fallback_tiers"):   # price tiers: the fallback's rows at the tier that answered each
                    print("fallback by tier: " + "; ".join(
                        f"{t['tier'] or 'no tier'} {t['rows']:,} rows x ${t['per_row']:g} = ${t['cost']:,.4f}"
                        for t in s["fallback_tiers"]))
                if s.get("regions"):   # a version over regions: what replication and egress added
                    r = s["regions"]
                    print(f"regions: replication {r['replication_bytes']:,} bytes in {r['replication_seconds']:.2f} s "
                          f"from {r['ledger_region']} ${r['replication_cost']:,.4f}; egress {r['egress_bytes']:,} "
                          f"bytes ${r['egress_cost']:,.4f} ({r['steals']:,} steals, {r['merged_files']:,} far result "
                          "files merged)")
                print(f"if the fallback fired now: ${f['total']:,.2f} ({f['overage_text']}, "
                      f"ceiling ${f['all_synchronous_ceiling']:,.2f})")
            return 0

        if args.rows is None:
            print("cost: give a JOB_VERSION, or --rows N", file=sys.stderr)
            return 2
        prices = _prices(args)

        if args.month:
            slips = [int(s) for s in args.slip_nights.split(",") if s.strip()]
            tiers = [TierShare.parse(t) for t in args.tier]
            rows = month_view(args.rows, slips, args.abandon_at, prices, nights=args.nights, tiers=tiers)
            if args.json:
                print(json.dumps({
                    "rows_per_night": args.rows,
                    "abandon_at": args.abandon_at,
                    "nights": args.nights,
                    "prices": prices.to_dict(),
                    "clean_month": float(cents(rows[0].clean_month)) if rows else None,
                    "all_synchronous_month": float(cents(rows[0].all_synchronous_month)) if rows else None,
                    "months": [r.to_dict() for r in rows],
                }))
            else:
                print(f"{'slip nights':>11}  {'rate':>6}  {'month':>12}  {'over clean':>12}  {'saved vs all-sync':>17}")
                for r in rows:
                    print(f"{r.slip_nights:>11}  {r.slip_rate:>6.0%}  ${cents(r.total):>11,}  "
                          f"${cents(r.overage):>11,}  ${cents(r.savings):>16,}"
                          + (f"  fallback by tier: " + ", ".join(f"{t['tier']} {t['rows']:,} rows ${cents(t['cost']):,}"
                                                                 for t in r.tiers)
                             + f" (one price ${cents(r.one_price_total):,})" if r.tiers else ""))
            return 0

        if args.fallback_rows is not None:
            if args.fallback_rows > args.rows:
                print(f"cost: --fallback-rows {args.fallback_rows:,} is more than --rows {args.rows:,}", file=sys.stderr)
                return 2
            report = cost_report(args.rows - args.fallback_rows, args.fallback_rows, prices)
            print(json.dumps(report.to_dict()) if args.json else "\n".join(report.lines()))
            return 0

        table = fallback_table(args.rows, prices=prices)
        if args.json:
            print(json.dumps({"rows": args.rows, "table": [dict(completed=c, **r.to_dict()) for c, r in table]}))
        else:
            print(f"{'done':>5}  {'batch':>12}  {'fallback':>12}  {'night':>12}  {'over clean':>12}")
            for c, r in table:
                print(f"{c:>5.0%}  ${cents(r.batch_cost):>11,}  ${cents(r.fallback_cost):>11,}  "
                      f"${cents(r.total):>11,}  ${cents(r.overage):>11,}")
        return 0
    except (ValueError, KeyError) as exc:
        print(f"cost: {exc}", file=sys.stderr)
        return 2
