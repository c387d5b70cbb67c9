"""``batch-inference calibrate SPEC``: a model ladder's thresholds from its golden set;
``batch-inference ladder JOB_VERSION``: each rung's share of records, accuracy and cost."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from batch_inference.commands.common import connect, db_arg, doc_summary, print_json


def register(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="run a ladder's golden set up every rung and pick its thresholds",
                       description=doc_summary(__doc__))
    p.add_argument("spec", help="a spec file with models: (the rungs) and evaluation.golden")
    p.add_argument("--out", type=Path, default=None, help="write the spec with the picked thresholds here (YAML)")
    p.add_argument("--json", action="store_true", help="print the whole report as one JSON object")
    db_arg(p)
    p.set_defaults(func=run_calibrate)

    p = sub.add_parser("ladder", help="a ladder job version: each rung's share of records, accuracy and cost",
                       description=doc_summary(__doc__))
    p.add_argument("job_version")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    db_arg(p)
    p.set_defaults(func=run_report)


def _money(x: float) -> str:
    return f"${x:,.4f}"


def run_calibrate(args: argparse.Namespace) -> int:
    import yaml

    from batch_inference import ladder   # ladder.calibrate: `import calibrate` from it, grimp reads as the submodule
    from batch_inference.spec import load_spec

    spec = load_spec(args.spec)
    ladder.check(spec)               # before any connection: a spec it cannot work on is one line
    if args.out is not None and args.out.exists() and args.out.resolve() == Path(args.spec).resolve():
        from batch_inference.exceptions import InvalidValue

        raise InvalidValue("calibrate --out must not be the spec it reads: write the calibrated spec beside it")
    with connect(args) as conn:
        cal = ladder.calibrate(conn, spec)
    if args.out is not None:   # the spec as written, its rungs' thresholds set: comments and order kept
        from batch_inference.spec import loads_spec

        text = ladder.with_thresholds(Path(args.spec).read_text(encoding="utf-8"), cal.thresholds)
        if loads_spec(text, name=str(args.out)).spec_hash != cal.spec.spec_hash:   # never a different spec
            text = yaml.safe_dump(cal.spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False,
                                  allow_unicode=True)
        args.out.write_text(text, encoding="utf-8")
    r = cal.report
    if args.json:
        print_json({**r, "thresholds": cal.thresholds, "spec_hash": cal.spec.spec_hash, "recorded": cal.recorded_id})
        return 0
    top, picked = r["top_alone"], r["picked"]
    print(f"golden set {r['golden']['table']}: {r['golden']['records']} records, confidence {r['confidence']}, "
          f"target {r['target']:.1%} of the top rung's accuracy")
    for g in r["rungs"]:
        print(f"  rung {g['rung']} {g['model']} ({g['engine']}): alone {g['accuracy']:.1%} right, "
              f"{g['valid']} of {g['answered']} valid, {_money(g['bill_per_record'])} a record")
    print(f"  top rung alone: {top['accuracy']:.1%} right, {_money(top['bill_per_record'])} a record")
    shares = ", ".join(f"rung {i} {n}" for i, n in enumerate(picked["finished_at"], 1))
    print(f"  picked thresholds {', '.join(f'{t:.4f}' if t is not None else 'none' for t in cal.thresholds)}: "
          f"{picked['accuracy']:.1%} right ({picked['share_of_top_accuracy']:.1%} of the top rung's), "
          f"{_money(picked['bill_per_record'])} a record ({picked['bill_share_of_top']:.1%} of the top rung's bill); "
          f"finished at {shares}")
    print(f"  curve: {len(r['curve'])} points of {r['combinations']} threshold combinations; recorded as "
          f"calibration {cal.recorded_id} for spec {cal.spec.spec_hash[:12]}"
          + (f"; calibrated spec written to {args.out}" if args.out else ""))
    return 0


def run_report(args: argparse.Namespace) -> int:
    from batch_inference.exceptions import InvalidValue
    from batch_inference.ladder import rung_report

    with connect(args) as conn:
        r = rung_report(conn, args.job_version)
    if r is None:
        raise InvalidValue(f"{args.job_version} is not a ladder job version (its spec names no models:)")
    if args.json:
        print_json(r)
        return 0
    print(f"{r['job_version']}: {r['stored']} stored, bill {_money(r['bill'])} against {_money(r['top_alone_bill'])} "
          f"for the top rung alone ({r['bill_share_of_top']:.1%})" if r["bill_share_of_top"] is not None else
          f"{r['job_version']}: nothing stored yet")
    for g in r["rungs"]:
        acc = "n/a" if g["golden_accuracy"] is None else f"{g['golden_accuracy']:.1%}"
        share = "n/a" if g["share"] is None else f"{g['share']:.1%}"
        print(f"  rung {g['rung']} {g['model']}: answered {g['answered']}, kept {g['kept']} ({share} of records), "
              f"golden accuracy {acc}, cost {_money(g['cost'])}")
    return 0
