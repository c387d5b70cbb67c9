"""A ladder job version in figures: each rung's share of records, accuracy and cost.

Read from bi.ladder_answers (what each rung answered and kept) and the newest
calibration of the version's spec (bi.ladder_calibrations: each rung's golden
accuracy, the cascade's and the top rung's alone). The bill is each rung's
price times the answers it gave (samples count one each under the agreement
rule); the top rung alone is its price times the records. Results the
fallback pool wrote carry no rung answer: they count at the top rung, whose
model the fallback serves.
"""

from __future__ import annotations

from typing import Any

import psycopg

from batch_inference.db import q
from batch_inference.ladder.rungs import samples
from batch_inference.status import job_counts, job_spec


def report(conn: psycopg.Connection, job_version: str) -> dict[str, Any] | None:
    """The figures of a ladder job version; None for a one-model job."""
    spec = job_spec(conn, job_version)
    if not spec.models:
        return None
    counts = {r["rung"]: r for r in conn.execute(q("ladder_rung_counts"), {"job": job_version})}
    c = job_counts(conn, job_version)
    kept_by_ladder = sum(int(r["kept"]) for r in counts.values())
    outside = max(0, int(c["stored"]) - kept_by_ladder)   # fallback or reused rows: the top rung's
    cal = conn.execute(q("ladder_calibration_of"), {"job": job_version}).fetchone()
    golden = {r["rung"]: r["accuracy"] for r in (cal["report"]["rungs"] if cal else [])}
    top = len(spec.models)
    rungs_out, bill = [], 0.0
    for no, rung in enumerate(spec.models, 1):
        r = counts.get(no)
        answered = int(r["answered"]) if r else 0
        kept = (int(r["kept"]) if r else 0) + (outside if no == top else 0)
        cost = rung.cost_per_row * samples(spec, no) * (answered + (outside if no == top else 0))
        bill += cost
        rungs_out.append({"rung": no, "model": rung.model.name, "engine": rung.engine.name,
                          "threshold": rung.threshold, "answered": answered, "kept": kept,
                          "share": kept / c["records"] if c["records"] else None,
                          "valid": int(r["valid"]) if r else 0,
                          "mean_confidence": float(r["mean_confidence"]) if r and r["mean_confidence"] is not None
                          else None,
                          "golden_accuracy": golden.get(no), "cost": round(cost, 6)})
    top_alone = spec.models[-1].cost_per_row * int(c["stored"])
    out: dict[str, Any] = {"job_version": job_version, "confidence": spec.ladder.confidence, "rungs": rungs_out,
                           "stored": int(c["stored"]), "bill": round(bill, 6), "top_alone_bill": round(top_alone, 6),
                           "bill_share_of_top": round(bill / top_alone, 4) if top_alone else None}
    if cal:
        picked = cal["report"]["picked"]
        out["calibration"] = {"calibrated_at": cal["calibrated_at"], "target": cal["target"],
                              "thresholds": cal["thresholds"], "golden_accuracy": picked["accuracy"],
                              "top_alone_golden_accuracy": cal["report"]["top_alone"]["accuracy"],
                              "curve": cal["report"]["curve"]}
    return out
