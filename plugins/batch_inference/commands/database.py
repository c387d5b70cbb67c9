"""``batch-inference db up|url|down|migrate``: the embedded PostgreSQL and the ledger's migrations."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    d = sub.add_parser("db", help="the embedded PostgreSQL: up, url, down, migrate")
    d.add_argument("action", choices=["up", "url", "down", "migrate"])
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batch_inference import db, embedded

    if args.action == "up":
        url = embedded.ensure_server(db.home())   # initdb's and the server's own lines: with -v only
        conn = db.connect(url)
        applied = db.migrate(conn)
        print(url)
        print(f"embedded PostgreSQL running under {db.home() / 'pg'}; migrations applied: "
              f"{', '.join(applied) or 'none new'}", file=sys.stderr)
    elif args.action == "url":
        # A URL to paste: the embedded server's holds no password; one that does is never printed with it.
        url, hidden = db.pasteable(db.resolve_url(args.db))
        print(url)
        if hidden:
            print("the password is not printed: the URL is the one you gave (--db or $BATCH_INFERENCE_DB)",
                  file=sys.stderr)
    elif args.action == "down":
        stopped = embedded.stop_server(db.home())
        print("stopped" if stopped else "not running", file=sys.stderr)
    elif args.action == "migrate":
        applied = db.migrate(db.connect(args.db))
        print(", ".join(applied) or "up to date")
    return 0
