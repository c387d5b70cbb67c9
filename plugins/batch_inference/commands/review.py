"""``batch-inference review JOB_VERSION``: the review sample beside its
verdicts and the gate's progress; with ``--record ID --verdict V`` it records
one verdict (stored in the ledger with the reviewer's name); ``--reject
--reason WHY`` rejects the whole version (publish refuses it while the
rejection stands) and ``--withdraw-rejection --reason WHY`` withdraws it."""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from batch_inference.commands.common import connect, db_arg, doc_summary, print_json, printable

EXCERPT = 100   # characters of input text and output shown per row


def register(sub: Any) -> None:
    p = sub.add_parser("review", help="show a validated version's review sample, or record a verdict on one row",
                       description=doc_summary(__doc__))
    p.add_argument("job_version")
    p.add_argument("--record", metavar="ID", help="the sample row to give a verdict on")
    p.add_argument("--verdict", choices=("right", "wrong", "unsure"), help="the verdict on --record")
    p.add_argument("--comment", help="why (stored with the verdict)")
    p.add_argument("--reviewer", help="who reviews (default: cli:<login name>)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--reject", action="store_true",
                     help="reject the whole version: publish refuses it, even forced, until withdrawn")
    act.add_argument("--withdraw-rejection", action="store_true", help="withdraw the version's standing rejections")
    p.add_argument("--reason", help="why (required with --reject and --withdraw-rejection)")
    p.add_argument("--limit", type=int, default=1000, help="sample rows to show")
    p.add_argument("--json", action="store_true")
    db_arg(p)
    p.set_defaults(func=run)


def _excerpt(value: Any) -> str:
    text = printable(" ".join(str(value).split()))
    return text if len(text) <= EXCERPT else text[:EXCERPT - 1] + "\u2026"


def run(args: argparse.Namespace) -> int:
    from batch_inference import evaluation, publish
    from batch_inference.exceptions import InvalidValue, ReviewRefused
    from batch_inference.status import job_counts

    if (args.record is None) != (args.verdict is None):
        raise InvalidValue("--record and --verdict go together")
    if (args.reject or args.withdraw_rejection) and not (args.reason or "").strip():
        raise InvalidValue(f"--{'reject' if args.reject else 'withdraw-rejection'} needs --reason WHY")
    if args.limit < 1:
        raise InvalidValue(f"--limit must be at least 1, got {args.limit}")
    with connect(args) as conn:
        job_counts(conn, args.job_version)   # UnknownJob, one line, for a version that does not exist
        recorded = rejected = withdrawn = None
        reviewer = args.reviewer or f"cli:{getpass.getuser()}"
        if not reviewer.strip():
            raise ReviewRefused("--reviewer must not be empty")
        if args.record is not None:
            recorded = evaluation.record_review(conn, args.job_version, args.record, args.verdict,
                                                reviewer=reviewer, comment=args.comment)
        if args.reject:
            rejected = evaluation.record_rejection(conn, args.job_version, reviewer=reviewer, reason=args.reason)
        if args.withdraw_rejection:
            withdrawn = evaluation.withdraw_rejections(conn, args.job_version, actor=reviewer, reason=args.reason)
        state = evaluation.review_state(conn, args.job_version)
        acted = recorded or rejected or withdrawn is not None
        rows = [] if acted else evaluation.review_rows(conn, args.job_version, args.limit)
        rejections = publish.rejections(conn, job_version=args.job_version)
    if args.json:
        print_json({"job_version": args.job_version, "recorded": recorded, "rejected": rejected,
                    "withdrawn": withdrawn, "review": state, "rejections": rejections,
                    "rows": [{k: v for k, v in r.items() if k != "acl"} for r in rows]})
        return 0
    if recorded:
        print(f"{args.job_version}: {printable(recorded['record_id'])} marked {recorded['verdict']} by "
              f"{printable(recorded['reviewer'])}")
    if rejected:
        after = "; it is published already: roll it back with `batch-inference rollback DATASET`" \
            if rejected["status"] == "published" else "; publish refuses it until the rejection is withdrawn"
        print(f"{args.job_version}: rejected by {printable(rejected['reviewer'])}{after}")
    if withdrawn is not None:
        print(f"{args.job_version}: {withdrawn} standing rejection(s) withdrawn by {printable(reviewer)}")
    for r in rejections:
        if r["standing"]:
            print(f"  rejected by {printable(r['reviewer'])} at {r['rejected_at']:%Y-%m-%d %H:%M:%S %Z}: "
                  f"{printable(r['reason'])}")
    gate = "met" if state["passed"] else printable(state["problem"])
    print(f"{args.job_version}: {state['reviewed']} of {state['sampled']} sample rows reviewed "
          f"({state['right']} right, {state['wrong']} wrong, {state['unsure']} unsure); gate: {gate}")
    for r in rows:
        print(f"  {printable(r['record_id'])}  [{r['verdict'] or '-'}]  {_excerpt(r['text'])}")
        print(f"      -> {_excerpt(r['output'])}")
    if not rows and not recorded and not state["sampled"]:
        print("  no review sample yet: run `batch-inference validate` first")
    return 0
