"""``publish``, ``rollback`` and ``published``: switch and inspect the pointer
that decides which job version downstream reads."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batch_inference.commands.common import connect, db_arg, printable


def register(sub: Any) -> None:
    p = sub.add_parser("publish", help="make a validated job version the published one of its dataset")
    p.add_argument("job_version")
    p.add_argument("--force", action="store_true", help="publish although not validated (needs --reason)")
    p.add_argument("--reason", help="why (recorded in the publish history; required with --force)")
    p.add_argument("--actor", help="who publishes (default: the database user)")
    p.add_argument("--expect", metavar="VERSION",
                   help="refuse unless VERSION is the one published now (nobody published since you "
                        "looked); 'none': refuse if anything is published")
    p.add_argument("--json", action="store_true")
    db_arg(p)
    p.set_defaults(func=run_publish)

    r = sub.add_parser("rollback", help="switch a dataset back to the version the current one replaced")
    r.add_argument("dataset")
    r.add_argument("--reason")
    r.add_argument("--actor")
    r.add_argument("--expect", metavar="VERSION",
                   help="refuse unless VERSION is the one published now: roll back only what you looked at")
    r.add_argument("--json", action="store_true")
    db_arg(r)
    r.set_defaults(func=run_rollback)

    s = sub.add_parser("published", help="the version a dataset publishes now, its view and its history")
    s.add_argument("dataset")
    s.add_argument("--json", action="store_true")
    s.add_argument("--history", type=int, default=20, help="history entries to show")
    db_arg(s)
    s.set_defaults(func=run_published)


def _print_switch(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, default=str))
    elif not out["changed"]:
        print(f"{out['to_version']} is already published for {out['dataset']}; nothing changed")
    else:
        forced = " (FORCED)" if out["forced"] else ""
        print(f"{out['action']} {out['dataset']}: {out['from_version'] or '(nothing)'} -> {out['to_version']}"
              f"{forced}; read it from {out['view']}")


def run_publish(args: argparse.Namespace) -> int:
    from batch_inference.publish import publish

    if args.force and not (args.reason or "").strip():
        print("batch-inference publish: error: --force needs --reason TEXT (it is recorded)", file=sys.stderr)
        return 2
    with connect(args) as conn:
        out = publish(conn, args.job_version, actor=args.actor, force=args.force, reason=args.reason,
                      expected_current="" if (args.expect or "").lower() == "none" else args.expect)
    _print_switch(out, args.json)
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    from batch_inference.publish import rollback

    with connect(args) as conn:
        out = rollback(conn, args.dataset, actor=args.actor, reason=args.reason, expected_current=args.expect)
    _print_switch(out, args.json)
    return 0


def _known_dataset(conn: Any, dataset: str) -> None:
    """Refuse, in one line, a dataset no job version was ever submitted for (a typo, most often)."""
    import difflib

    from batch_inference import db
    from batch_inference.exceptions import UnknownDataset

    names = [r["dataset"] for r in conn.execute(db.q("dataset_names")).fetchall()]
    if dataset in names:
        return
    near = difflib.get_close_matches(dataset, names, n=1, cutoff=0.6)
    hint = (f"did you mean '{near[0]}'?" if near else
            f"the ledger's datasets: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}" if names else
            "the ledger has no job version yet")
    raise UnknownDataset(f"no dataset {printable(repr(dataset))}: no job version was ever submitted for it; {hint}")


def run_published(args: argparse.Namespace) -> int:
    from batch_inference.publish import published

    with connect(args) as conn:
        out = published(conn, args.dataset, history=args.history)
        if out["job_version"] is None and not out["history"]:
            _known_dataset(conn, args.dataset)
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    if out["job_version"] is None:
        print(f"{args.dataset}: nothing published")
        return 0
    print(f"{args.dataset}: {out['job_version']} in {out['view']} (since {out['switched_at']}, by "
          f"{out['switched_by']}); records without an ACL: {out['null_acl']}")
    for h in out["history"]:
        forced = " FORCED" if h["forced"] else ""
        why = f": {h['reason']}" if h["reason"] else ""
        print(f"  {h['at']}  {h['action']}{forced}  {h['from_version'] or '-'} -> {h['to_version']}  "
              f"by {h['actor']}{why}")
    for r in out["rejections"]:
        state = "standing" if r["standing"] else f"withdrawn by {r['withdrawn_by']}: {r['withdraw_reason']}"
        print(printable(f"  {r['rejected_at']}  rejected  {r['job_version']}  by {r['reviewer']}: {r['reason']} "
                        f"({state})"))
    return 0
