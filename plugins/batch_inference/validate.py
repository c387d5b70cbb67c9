"""The validator: may this job version be published?

Run when no shard is left. Seven checks, each a line in ``failures`` when it
fails:

* coverage: every snapshot record has exactly one of a result or a dead
  letter, and nothing else is stored (an anti-join, in SQL);
* schema: every stored output is checked again against the spec's schema and
  rules (the worker checked it once, but reused rows, the fallback pool and
  hand-made fixes also write results);
* engines: every stored output came from an engine that may serve the
  spec's pinned model (``batch_inference.provenance``); the report counts
  rows by engine, endpoint class and transport, from the schema scan;
* dead letters: their share of the snapshot stays under
  ``spec.validation.max_dead_letter_rate``;
* drift: the category distribution against the version the dataset publishes
  now (total variation distance under ``spec.validation.max_drift``,
  ``batch_inference.drift``);
* a seeded random sample is stored for review (``bi.review_sample``) and
  exported as JSONL;
* evaluation (``batch_inference.evaluation``): accuracy per field on the
  spec's golden set, the judge's agreement on the sample, and the state of
  the human review, which ``bi.publish_v1`` checks at publish.

The report is stored in ``bi.jobs.validation`` and the status becomes
``validated`` or ``failed_validation`` (guarded in SQL, ``bi.record_validation_v1``).

Speed: at a million records, reading every output into Python and running
jsonschema on it costs tens of seconds. So the schema and rules are compiled
(``batch_inference.schema_sql``) into one SQL predicate that *vouches* for a
row (true only if the row is valid) and is evaluated in the same scan that
counts categories. Only rows it does not vouch for (normally the invalid
ones) are streamed to Python, where ``outputs.check_output`` (the worker's
own check) gives the verdict and the reason. A schema keyword the compiler
cannot express exactly (pattern, format, $ref, ...) makes it vouch for
nothing: every row then goes through Python, slower but never wrong.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from batch_inference import companion, db, provenance
from batch_inference import drift as drifts
from batch_inference.db import q
from batch_inference.evaluation import evaluate
from batch_inference.exceptions import NotReady
from batch_inference.outputs import check_output
from batch_inference.schema_sql import output_predicate
from batch_inference.spec import JobSpec
from batch_inference.status import UnknownJob, job_counts, job_spec

log = logging.getLogger(__name__)

MISSING_IDS = 20          # missing record ids listed in the report
INVALID_EXAMPLES = 5      # invalid outputs quoted with their reason
_FETCH = 2000             # server-side cursor batch


class Report(dict):
    """The validation report: a plain dict (JSON as is, fit for an XCom) with
    ``passed`` and ``failures`` as attributes for convenience."""

    @property
    def passed(self) -> bool:
        return bool(self["passed"])

    @property
    def failures(self) -> list[str]:
        return list(self["failures"])


def default_sample_path(job_version: str) -> Path:
    return db.home() / "samples" / f"{job_version}.jsonl"


def validate(conn: psycopg.Connection, job_version: str, *, sample_dir: str | Path | None = None,
             record: bool = True) -> Report:
    """Validate a finished job version, store the report and set its status.

    Raises ``UnknownJob`` for an unknown version and ``NotReady`` while shards
    are pending or leased. ``record=False`` computes the report without storing it.
    """
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    counts = job_counts(conn, job_version)
    open_shards = counts["shards"]["pending"] + counts["shards"]["leased"]
    if open_shards:
        raise NotReady(f"job version {job_version} is not finished: {counts['shards']['pending']} shard(s) pending, "
                       f"{counts['shards']['leased']} leased; validate after every shard is done")
    job = conn.execute(q("validate_job"), {"job": job_version}).fetchone()
    if job is None:
        raise UnknownJob(f"no job version {job_version!r}")
    if job["status"] == "dropped":
        raise NotReady(f"job version {job_version} was dropped")
    spec = job_spec(conn, job_version)
    failures: list[str] = []
    notes: list[str] = []

    with conn.transaction():
        # Hash joins over a million ids want more than the 4 MB default.
        conn.execute(q("validate_work_mem"))

        # The schema scan reads every result once and also yields the count
        # of stored rows per category, which coverage and drift reuse.
        t = time.perf_counter()
        if spec.task == "embed":   # vectors, not JSON answers (batch_inference.embed)
            schema, categories = _vectors(conn, spec, job_version, failures, notes)
        else:
            schema, categories = _schema(conn, spec, job_version, failures, notes)
        timings["schema_s"] = time.perf_counter() - t

        t = time.perf_counter()
        coverage = _coverage(conn, job_version, sum(categories.values()), failures)
        timings["coverage_s"] = time.perf_counter() - t

        t = time.perf_counter()
        drift = _drift(conn, spec, job["dataset"], job_version, categories, failures, notes)
        timings["drift_s"] = time.perf_counter() - t

        t = time.perf_counter()
        path = Path(sample_dir) / f"{job_version}.jsonl" if sample_dir else default_sample_path(job_version)
        sample = _sample(conn, spec, job_version, path)
        timings["sample_s"] = time.perf_counter() - t

    # After the sample is stored: the judge grades rows of it.
    t = time.perf_counter()
    evaluation = evaluate(conn, spec, job_version, job["dataset"], failures, notes, categories,
                          run=companion.run_companion)
    if spec.task == "embed":
        from batch_inference import embed  # here, as in plan: its numpy is no part of a job that embeds nothing

        evaluation["pairs"] = embed.recall(conn, spec, job_version, failures, notes)
    timings["evaluation_s"] = time.perf_counter() - t

    snapshot = coverage["snapshot"]
    rate = coverage["dead_letters"] / snapshot if snapshot else 0.0
    gate = spec.validation.max_dead_letter_rate
    if rate > gate:
        failures.append(f"dead letters: {rate:.2%} of the snapshot ({coverage['dead_letters']} of {snapshot}) "
                        f"is over the gate of {gate:.2%}")

    report = Report(
        job_version=job_version,
        dataset=job["dataset"],
        passed=not failures,
        coverage=coverage,
        schema=schema,
        dead_letter_rate=rate,
        dead_letter_gate=gate,
        reused=job["reused"],
        categories=categories,
        drift=drift,
        sample=sample,
        evaluation=evaluation,
        failures=failures,
        notes=notes,
        validated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds=round(time.perf_counter() - t_start, 3),
        timings={k: round(v, 3) for k, v in timings.items()},
    )
    if record:
        r = conn.execute(q("record_validation"), {"job": job_version, "report": Jsonb(dict(report)),
                                                  "passed": report.passed}).fetchone()
        if r is None or r["status"] is None:
            raise NotReady(f"job version {job_version} changed while it was validated (a shard reopened or "
                           "the version was dropped); validate again")
        report["status"] = r["status"]
    log.info("validated %s: %s in %.2fs%s", job_version, "passed" if report.passed else "FAILED",
             report["seconds"], "".join(f"\n  - {f}" for f in failures))
    return report


def _coverage(conn: psycopg.Connection, job: str, stored: int, failures: list[str]) -> dict[str, Any]:
    c = conn.execute(q("validate_coverage"), {"job": job}).fetchone()
    dead = conn.execute(q("validate_dead_letter_count"), {"job": job}).fetchone()
    assert c is not None and dead is not None
    orphans = (stored - c["stored_in_snapshot"]) + (dead["n"] - c["dead_in_snapshot"])
    out: dict[str, Any] = {
        "snapshot": c["snapshot"], "stored": stored, "dead_letters": dead["n"],
        "missing": c["missing"], "missing_ids": [], "in_both": c["in_both"], "not_in_snapshot": orphans,
    }
    if c["missing"]:
        out["missing_ids"] = [r["record_id"] for r in
                              conn.execute(q("validate_missing_ids"), {"job": job, "n": MISSING_IDS})]
        shown = ", ".join(out["missing_ids"][:5]) + (", ..." if c["missing"] > 5 else "")
        failures.append(f"coverage: {c['missing']} of {c['snapshot']} snapshot records have neither a result nor "
                        f"a dead letter ({shown})")
    if c["in_both"]:
        ids = [r["record_id"] for r in conn.execute(q("validate_in_both_ids"), {"job": job, "n": MISSING_IDS})]
        out["in_both_ids"] = ids
        failures.append(f"coverage: {c['in_both']} record(s) have both a result and a dead letter "
                        f"({', '.join(ids[:5])})")
    if orphans:
        ids = [r["record_id"] for r in conn.execute(q("validate_orphan_ids"), {"job": job, "n": MISSING_IDS})]
        out["not_in_snapshot_ids"] = ids
        failures.append(f"coverage: {orphans} result(s) or dead letter(s) for records not in the snapshot "
                        f"({', '.join(ids[:5])})")
    return out


def _schema(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str],
            notes: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    vouch, why = output_predicate(spec, conn)
    if why:
        notes.append(why)
    categories: dict[str, int] = {}
    made_by: dict[tuple[str | None, str | None, str], int] = {}
    unvouched = 0
    for r in conn.execute(sql.SQL(q("validate_results")).format(valid=vouch), {"job": job}):
        key = drifts.category_key(r["category"])
        categories[key] = categories.get(key, 0) + r["n"]
        made = (r["engine"], r["endpoint"], r["transport"])
        made_by[made] = made_by.get(made, 0) + r["n"]
        unvouched += r["unvouched"]
    checked = sum(categories.values())
    engines = _engines(spec, made_by, failures, notes)
    invalid = 0
    examples: list[dict[str, str]] = []
    if unvouched:
        # Stream: at most _FETCH rows in memory whatever the job's size.
        with conn.cursor(name=f"bi_validate_{os.getpid()}") as cur:
            cur.itersize = _FETCH
            cur.execute(sql.SQL(q("validate_unvouched")).format(valid=vouch), {"job": job})
            for row in cur:
                _obj, reason = check_output(spec, row["output"])
                if reason is not None:
                    invalid += 1
                    if len(examples) < INVALID_EXAMPLES:
                        examples.append({"record_id": row["record_id"], "reason": reason})
    if invalid:
        first = examples[0]
        failures.append(f"schema: {invalid} of {checked} stored outputs fail the schema or rules "
                        f"({first['record_id']}: {first['reason']})")
    return ({"checked": checked, "invalid": invalid, "examples": examples,
             "checked_in_python": unvouched, "sql_check": why is None, "engines": engines}, categories)


def _vectors(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str],
             notes: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """An embedding job's stored vectors (``embed.scan``) in place of the schema section; its results
    have no category, so they count as one."""
    from batch_inference import embed

    section, made_by = embed.scan(conn, spec, job, failures)
    section["engines"] = _engines(spec, made_by, failures, notes)
    return section, ({drifts.category_key(None): section["checked"]} if section["checked"] else {})


def _engines(spec: JobSpec, made_by: Mapping[tuple[str | None, str | None, str], int], failures: list[str],
             notes: list[str]) -> list[dict[str, Any]]:
    """Rows by engine, endpoint class and transport; a failure for each engine
    the spec does not allow (``provenance.row_refusal``)."""
    out = [{"engine": e, "endpoint": p, "transport": t, "rows": n}
           for (e, p, t), n in sorted(made_by.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or "", kv[0][2]))]
    refused: dict[str, tuple[int, str]] = {}
    unrecorded = 0
    for row in out:
        if row["engine"] is None:
            unrecorded += row["rows"]
            row["allowed"] = None
            continue
        why = provenance.row_refusal(spec, row["engine"])
        if why is not None:
            n, _ = refused.get(row["engine"], (0, why))
            refused[row["engine"]] = (n + row["rows"], why)
        row["allowed"] = why is None
    for name, (n, why) in sorted(refused.items()):
        failures.append(f"engine: {n} stored output(s) came from engine {name!r}, which this spec does not allow "
                        f"({why})")
    if unrecorded:
        notes.append(f"engine: {unrecorded} stored output(s) record no engine (written before migration 0006)")
    return out


def _drift(conn: psycopg.Connection, spec: JobSpec, dataset: str, job: str, categories: dict[str, int],
           failures: list[str], notes: list[str]) -> dict[str, Any]:
    threshold = spec.validation.max_drift
    out: dict[str, Any] = {"distance": None, "threshold": threshold, "per_category": {}, "against": None}
    if not spec.category_field:
        notes.append("drift: skipped, the spec names no category_field")
        return out
    pub = conn.execute(q("published_version"), {"dataset": dataset}).fetchone()
    if pub is None:
        notes.append(f"drift: skipped, nothing is published for dataset {dataset} yet")
        return out
    against = pub["job_version"]
    if against == job:
        notes.append("drift: skipped, this version is the one published")
        return out
    if spec.task == "embed":   # nearest neighbours, not categories
        from batch_inference import embed

        return embed.drift(conn, spec, job, against, failures, notes)
    base, _source = drifts.category_counts(conn, against, pub["validation"])
    d = drifts.compare(categories, base)
    out.update(d, against=against)
    if d["distance"] is None:
        notes.append(f"drift: skipped, {job if not categories else against} has no stored results")
    elif drifts.over_gate(d["distance"], threshold):
        worst = sorted(d["per_category"].items(), key=lambda kv: -abs(kv[1]["shift"]))[:3]
        shown = ", ".join(f"{k} {v['shift']:+.2f}" for k, v in worst)
        failures.append(f"drift: category distribution moved {d['distance']:.2f} (total variation) against "
                        f"{against}, over the gate of {threshold:.2f} ({shown})")
    return out


def _sample(conn: psycopg.Connection, spec: JobSpec, job: str, path: Path) -> dict[str, Any]:
    n = spec.validation.sample_size
    out = {"path": None, "rows": 0, "seed": spec.validation.sample_seed, "size": n}
    if n <= 0:
        return out
    conn.execute(q("review_sample_store"), {"job": job, "seed": spec.validation.sample_seed, "n": n})
    rows = conn.execute(q("validate_sample"), {"job": job, "n": n}).fetchall()
    write_jsonl(path, ({"record_id": r["record_id"], "text": r["text"], "output": json.loads(r["output"])}
                       for r in rows))
    out.update(path=str(path), rows=len(rows))
    return out


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Atomically, and readable by the owner only: the sample holds customer text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
