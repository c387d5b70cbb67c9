"""``batch-inference validate JOB_VERSION``: coverage, schema, dead letters,
drift and a sample; exit 0 if the version passed, 1 if it failed."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from batch_inference.commands.common import connect, db_arg, doc_summary


def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="check a finished job version before publish (exit 1 if it fails)",
                       description=doc_summary(__doc__))
    p.add_argument("job_version")
    p.add_argument("--json", action="store_true", help="print the whole report as one JSON object")
    p.add_argument("--sample-dir", default=None,
                   help="where the JSONL sample goes (default: $BATCH_INFERENCE_HOME/samples)")
    db_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batch_inference.validate import validate

    if not args.verbose:
        # The report below says what the validator's own log line says (each failure): once is enough.
        logging.getLogger("batch_inference.validate").setLevel(logging.WARNING)
    with connect(args) as conn:
        report = validate(conn, args.job_version, sample_dir=args.sample_dir)
    if args.json:
        print(json.dumps(report, default=str, ensure_ascii=False))
    else:
        c, s, d = report["coverage"], report["schema"], report["drift"]
        # A failed gate is said once, by its FAIL line (stderr), not also by its summary line here.
        failed = {f.split(":", 1)[0] for f in report["failures"]}
        print(f"{args.job_version}: {'PASSED' if report.passed else 'FAILED'} ({report['status']})")
        missing = f", {c['missing']} missing" if c["missing"] else ""
        if "coverage" not in failed:
            print(f"  coverage: {c['snapshot']} snapshot = {c['stored']} stored + {c['dead_letters']} dead letters"
                  f"{missing}")
        if "schema" not in failed:
            print(f"  schema: {s['checked']} checked, {s['invalid']} invalid")
        if "dead letters" not in failed:
            print(f"  dead letters: {report['dead_letter_rate']:.2%} (gate {report['dead_letter_gate']:.2%})")
        if d["distance"] is not None and "drift" not in failed:
            print(f"  drift: {d['distance']:.3f} against {d['against']} (gate {d['threshold']:.2f})")
        if report["sample"]["path"]:
            print(f"  sample: {report['sample']['rows']} rows in {report['sample']['path']}")
        ev = report["evaluation"]
        if ev["golden"]:
            shown = ", ".join(f"{k} {v:.1%}" for k, v in ev["accuracy"].items() if v is not None)
            print(f"  golden set: {ev['graded']} graded ({ev['golden']['mode']}): {shown or 'no accuracy'}")
        if ev["published"] and ev["published"]["accuracy"]:
            moved = ", ".join(f"{k} {v['published']:.1%} -> {v['this']:.1%}" for k, v in ev["published"]["accuracy"].items()
                              if v["this"] is not None and v["published"] is not None)
            if moved:
                print(f"  against {ev['published']['against']} (published): {moved}")
        if ev["judge"]:
            j = ev["judge"]
            agreement = "n/a" if j["agreement"] is None else f"{j['agreement']:.1%}"
            print(f"  judge: {j['judged']} of {j['sample']} sample rows graded, {agreement} right, cost {j['cost']:.4f}")
        if ev["review"]["problem"]:
            print(f"  publish needs: {ev['review']['problem']}")
        for note in report["notes"]:
            print(f"  note: {note}")
        for failure in report["failures"]:
            print(f"  FAIL {failure}", file=sys.stderr)
    return 0 if report.passed else 1
