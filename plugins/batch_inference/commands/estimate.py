"""``estimate``: what a spec's job will cost and when it will finish, from its records, before any spend.

One JSON object on stdout (``estimate.Preview.as_dict``), its readable form on
stderr. Writes nothing to the ledger; ``--pilot N`` first runs N records drawn
from the source through one in-process worker into a scratch version (dropped
afterwards) and keeps only the measured figures (``bi.estimate_pilots``), which
this preview and later ones use.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

from batch_inference.commands.common import connect, db_arg, doc_summary, print_json


def register(sub: Any) -> None:
    p = sub.add_parser("estimate", help="preview a job's tokens, GPU-hours, bill and finish before any spend",
                       description=doc_summary(__doc__))
    p.add_argument("spec")
    p.add_argument("--deadline", default=None,
                   help="when the version must be published: '+20h', 'HH:MM' (next such time, UTC) or ISO")
    p.add_argument("--workers", type=int, default=None,
                   help="batch workers the run will have (default: the spec's cost.max_workers with the "
                        "autopilot on, else cost.min_workers, at least 1)")
    p.add_argument("--pilot", type=int, default=None, metavar="N",
                   help="first run N records drawn from the source through the real worker (a scratch version, "
                        "dropped afterwards) and use what it measured")
    p.add_argument("--seed", type=int, default=0, help="the pilot's draw")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (object-store sources)")
    db_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batch_inference.cutoff import parse_clock
    from batch_inference import estimate   # estimate.preview: `import preview` from it, grimp reads as the submodule
    from batch_inference.estimate import counter_for, default_workers, render, run_pilot
    from batch_inference.exceptions import InvalidValue
    from batch_inference.params import resolve_deadline
    from batch_inference.sources import for_spec
    from batch_inference.spec import load_spec

    spec = load_spec(args.spec)
    now = datetime.now(UTC)
    deadline = None
    if args.deadline:
        try:
            deadline = parse_clock(resolve_deadline(args.deadline, now), now)
        except ValueError as exc:
            raise InvalidValue(f"--deadline {args.deadline!r}: {exc}") from None
    workers = args.workers if args.workers is not None else default_workers(spec)
    counter = counter_for(spec)
    try:
        with connect(args) as conn:
            if args.pilot is not None:
                figures = run_pilot(conn, spec, args.pilot, counter=counter, seed=args.seed,
                                    reader=for_spec(spec, s3_endpoint_url=args.s3_endpoint))
                print(f"pilot: {figures['records']} records in {figures['seconds']:.1f}s, "
                      f"{figures['records_per_s']:.3g} records/s, {figures['valid_rate']:.0%} valid",
                      file=sys.stderr)
            p = estimate.preview(conn, spec, counter=counter, workers=workers, deadline=deadline, now=now,
                        reader=for_spec(spec, s3_endpoint_url=args.s3_endpoint))
    finally:
        counter.close()
    out = p.as_dict()
    print_json(out)
    print(render(out), file=sys.stderr)
    return 0
