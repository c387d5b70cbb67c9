"""The validator: may this job version be published?

Run when no shard is left. Five checks, each a line in ``failures`` when it
fails:

* coverage: every snapshot record has exactly one of a result or a dead
  letter, and nothing else is stored (an anti-join, in SQL);
* schema: every stored output is checked again against the spec's schema and
  rules (the worker checked it once, but reused rows, the fallback pool and
  hand-made fixes also write results);
* dead letters: their share of the snapshot stays under
  ``spec.validation.max_dead_letter_rate``;
* drift: the category distribution against the version the dataset publishes
  now (total variation distance under ``spec.validation.max_drift``);
* a seeded random sample is exported as JSONL for the evaluation suite.

The report is stored in ``bi.jobs.validation`` and the status becomes
``validated`` or ``failed_validation`` (guarded in SQL, ``bi.record_validation_v1``).

Speed: at a million records, reading every output into Python and running
jsonschema on it costs tens of seconds. So the schema and rules are compiled
into one SQL predicate that *vouches* for a row (true only if the row is
valid) and is evaluated in the same scan that counts categories. Only rows it
does not vouch for (normally the invalid ones) are streamed to Python, where
``outputs.check_output`` (the worker's own check) gives the verdict and the
reason. A schema keyword the compiler cannot express exactly (pattern,
format, $ref, ...) makes it vouch for nothing: every row then goes through
Python, slower but never wrong.
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

from batch_inference import db
from batch_inference.db import q
from batch_inference.exceptions import BatchInferenceError, NotReady
from batch_inference.outputs import check_output
from batch_inference.spec import JobSpec, Rule
from batch_inference.status import UnknownJob, job_counts, job_spec

log = logging.getLogger(__name__)

MISSING_IDS = 20          # missing record ids listed in the report
INVALID_EXAMPLES = 5      # invalid outputs quoted with their reason
NO_CATEGORY = "(none)"    # the key for rows whose category is NULL
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


# ---------------------------------------------------------------------------
# The schema and rules as one SQL predicate that vouches for a row.
# ---------------------------------------------------------------------------

class Unsupported(BatchInferenceError):
    """A keyword the SQL form cannot check exactly; the caller falls back to Python."""


# Keywords with no effect on validity.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id", "contentMediaType", "contentEncoding"})
_SUPPORTED = frozenset({"type", "enum", "const", "minLength", "maxLength", "minimum", "maximum",
                        "exclusiveMinimum", "exclusiveMaximum", "required", "properties",
                        "additionalProperties", "minProperties", "maxProperties", "items", "minItems",
                        "maxItems", "allOf", "anyOf"})
# Bounds beyond this are not exactly representable as doubles; the comparison
# Python makes could then differ from the decimal one.
_MAX_EXACT = 2 ** 53

TRUE = sql.SQL("true")
FALSE = sql.SQL("false")


def _and(parts: list[sql.Composable]) -> sql.Composable:
    parts = [p for p in parts if p is not TRUE]
    if not parts:
        return TRUE
    return sql.SQL("(") + sql.SQL(" AND ").join(parts) + sql.SQL(")")


def _or(parts: list[sql.Composable]) -> sql.Composable:
    if not parts:
        return FALSE
    return sql.SQL("(") + sql.SQL(" OR ").join(parts) + sql.SQL(")")


def _when(x: sql.Composable, kind: str, pred: sql.Composable) -> sql.Composable:
    """``pred`` applies only to values of JSON type ``kind`` (JSON Schema keywords
    constrain one type and let the others through). CASE fixes the evaluation
    order, so a cast inside ``pred`` never meets the wrong type."""
    return sql.SQL("(CASE WHEN jsonb_typeof({x}) = {k} THEN {p} ELSE true END)").format(
        x=x, k=sql.Literal(kind), p=pred)


def _lit(value: Any) -> sql.Composable:
    return sql.SQL("{}::jsonb").format(sql.Literal(json.dumps(value, ensure_ascii=False)))


def _num(x: sql.Composable) -> sql.Composable:
    return sql.SQL("({}::numeric)").format(x)


def _bound(x: sql.Composable, op: str, bound: Any) -> sql.Composable:
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or abs(bound) > _MAX_EXACT:
        raise Unsupported(f"numeric bound {bound!r}")
    # Both the exact decimal comparison and the double one: Python compares the
    # parsed float, and only when both hold is its verdict sure to agree.
    return sql.SQL("({n} {op} {b}::numeric AND {n}::float8 {op} {b}::float8)").format(
        n=_num(x), op=sql.SQL(op), b=sql.Literal(str(bound)))


def _within(n: sql.Composable, lo: int, hi: int) -> sql.Composable:
    """``n BETWEEN lo AND hi`` with ``n`` evaluated once (BETWEEN evaluates its
    operand twice, and a character count is a loop over the string)."""
    return sql.SQL("(abs(2 * {n} - {mid2}) <= {span})").format(
        n=n, mid2=sql.Literal(int(lo) + int(hi)), span=sql.Literal(int(hi) - int(lo)))


def schema_predicate(schema: Any, x: sql.Composable, text: sql.Composable | None = None) -> sql.Composable:
    """A boolean SQL expression over the jsonb value ``x``: true only if ``x`` is
    valid against ``schema``. Raises Unsupported for keywords it cannot decide.
    ``text`` is the cheapest SQL for ``x`` as text (``parent ->> 'key'``).

    Only monotone combinators (allOf, anyOf) are compiled, so each piece need
    only be sound (true implies valid), never its negation."""
    if schema is True or schema == {}:
        return TRUE
    if schema is False:
        return FALSE
    if not isinstance(schema, dict):
        raise Unsupported(f"schema {schema!r}")
    unknown = set(schema) - _SUPPORTED - _ANNOTATIONS
    if unknown:
        raise Unsupported(", ".join(sorted(unknown)))
    if text is None:
        text = sql.SQL("({} #>> '{{}}')").format(x)
    parts: list[sql.Composable] = []
    t = sql.SQL("jsonb_typeof({})").format(x)
    kinds: list[str] = []

    values = list(schema.get("enum", []))
    string_enum = bool(values) and all(isinstance(v, str) for v in values)
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        alts: list[sql.Composable] = []
        for kind in kinds:
            if kind == "integer":
                # 1.0 is an integer to JSON Schema; 1e400 would be a float('inf') to Python.
                alts.append(sql.SQL("({t} = 'number' AND (CASE WHEN {t} = 'number' THEN "
                                    "{n} = trunc({n}) AND abs({n}) < 1e300 ELSE false END))").format(t=t, n=_num(x)))
            elif kind in ("number", "string", "boolean", "null", "object", "array"):
                alts.append(sql.SQL("{} = {}").format(t, sql.Literal(kind)))
            else:
                raise Unsupported(f"type {kind!r}")
        if not (string_enum and "string" in kinds):   # else the enum's own type test below implies it
            parts.append(_or(alts))
    if "enum" in schema:
        if string_enum:
            # One text comparison per row instead of one jsonb equality per value.
            parts.append(sql.SQL("({t} = 'string' AND {s} = ANY ({vals}::text[]))").format(
                t=t, s=text, vals=sql.Literal(values)))
        else:
            parts.append(_or([sql.SQL("{} = {}").format(x, _lit(v)) for v in values]))
    if "const" in schema:
        parts.append(sql.SQL("{} = {}").format(x, _lit(schema["const"])))

    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        if lo is not None and hi is not None:
            cond = _within(sql.SQL("length({})").format(text), lo, hi)
        elif hi is not None:
            # Characters never outnumber bytes: the byte count (free) settles
            # most rows, the character count (a loop over the string) the rest.
            cond = sql.SQL("(octet_length({s}) <= {n} OR length({s}) <= {n})").format(s=text, n=sql.Literal(int(hi)))
        else:
            cond = sql.SQL("length({}) >= {}").format(text, sql.Literal(int(lo)))
        # With type string asserted alongside, a non-string fails anyway and
        # measuring its text form is harmless: no CASE needed.
        parts.append(cond if kinds == ["string"] else _when(x, "string", cond))

    for key, op in (("minimum", ">="), ("maximum", "<="), ("exclusiveMinimum", ">"), ("exclusiveMaximum", "<")):
        if key in schema:
            parts.append(_when(x, "number", _bound(x, op, schema[key])))

    obj: list[sql.Composable] = []
    required = list(schema.get("required") or [])
    if required:
        obj.append(sql.SQL("{} ?& {}").format(x, sql.Literal(required)))
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise Unsupported("properties")
    for name, sub in props.items():
        key = sql.Literal(name)
        p = schema_predicate(sub, sql.SQL("({} -> {})").format(x, key), sql.SQL("({} ->> {})").format(x, key))
        if p is TRUE:
            continue
        if name in required:
            obj.append(p)      # absent: ?& above is false, and so is the whole AND
        else:
            obj.append(sql.SQL("(NOT ({x} ? {k}) OR {p})").format(x=x, k=key, p=p))
    if "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        if extra is False:
            obj.append(sql.SQL("({} - {}::text[]) = '{{}}'::jsonb").format(x, sql.Literal(list(props))))
        elif extra is not True and extra != {}:
            p = schema_predicate(extra, sql.SQL("e.value"))
            obj.append(sql.SQL("NOT EXISTS (SELECT 1 FROM jsonb_each({x}) e WHERE NOT (e.key = ANY ({k}::text[])) "
                               "AND NOT coalesce({p}, false))").format(x=x, k=sql.Literal(list(props)), p=p))
    for key_, op in (("minProperties", ">="), ("maxProperties", "<=")):
        if key_ in schema:
            obj.append(sql.SQL("(SELECT count(*) FROM jsonb_object_keys({})) {} {}").format(
                x, sql.SQL(op), sql.Literal(int(schema[key_]))))
    if obj:
        parts.append(_when(x, "object", _and(obj)))

    arr: list[sql.Composable] = []
    if "items" in schema:
        if not isinstance(schema["items"], (dict, bool)):
            raise Unsupported("items as a list")
        p = schema_predicate(schema["items"], sql.SQL("e.value"))
        if p is not TRUE:
            arr.append(sql.SQL("NOT EXISTS (SELECT 1 FROM jsonb_array_elements({x}) e WHERE NOT coalesce({p}, false))")
                       .format(x=x, p=p))
    if "minItems" in schema:
        arr.append(sql.SQL("jsonb_array_length({}) >= {}").format(x, sql.Literal(int(schema["minItems"]))))
    if "maxItems" in schema:
        arr.append(sql.SQL("jsonb_array_length({}) <= {}").format(x, sql.Literal(int(schema["maxItems"]))))
    if arr:
        parts.append(_when(x, "array", _and(arr)))

    for sub in schema.get("allOf", []):
        parts.append(schema_predicate(sub, x, text))
    if "anyOf" in schema:
        parts.append(_or([schema_predicate(sub, x, text) for sub in schema["anyOf"]]))
    return _and(parts)


# Python's str.strip() removes exactly the characters for which isspace() is
# true; a string with any other character is not blank to check_rule.
_NOT_BLANK = "[^" + "".join(chr(c) for c in range(0x3001) if chr(c).isspace()) + "]"


def rule_predicate(rule: Rule, x: sql.Composable) -> sql.Composable:
    """SQL that vouches for ``outputs.check_rule(rule, obj)`` finding nothing."""
    v = sql.SQL("({} -> {})").format(x, sql.Literal(rule.field))
    present = sql.SQL("({} ? {})").format(x, sql.Literal(rule.field))
    checks: list[sql.Composable] = []
    if rule.not_empty:
        checks.append(sql.SQL("(CASE jsonb_typeof({v}) WHEN 'null' THEN false "
                              "WHEN 'string' THEN ({v} #>> '{{}}') ~ {nb} "
                              "WHEN 'array' THEN jsonb_array_length({v}) > 0 "
                              "WHEN 'object' THEN {v} <> '{{}}'::jsonb ELSE true END)").format(v=v, nb=sql.Literal(_NOT_BLANK)))
    if rule.one_of is not None:
        checks.append(_or([sql.SQL("{} = {}").format(v, _lit(c)) for c in rule.one_of]))
    if rule.min_length is not None or rule.max_length is not None:
        def within(n: sql.Composable) -> sql.Composable:
            if rule.max_length is None:
                return sql.SQL("{} >= {}").format(n, sql.Literal(rule.min_length))
            return _within(n, rule.min_length or 0, rule.max_length)
        checks.append(sql.SQL("(CASE jsonb_typeof({v}) WHEN 'string' THEN {s} WHEN 'array' THEN {a} ELSE false END)").format(
            v=v, s=within(sql.SQL("length({} #>> '{{}}')").format(v)), a=within(sql.SQL("jsonb_array_length({})").format(v))))
    if not checks:
        return TRUE
    if rule.not_empty:
        return _and([present, *checks])          # a missing field breaks not_empty
    return sql.SQL("(NOT {} OR {})").format(present, _and(checks))


def output_predicate(spec: JobSpec, conn: psycopg.Connection, column: str = "output") -> tuple[sql.SQL, str | None]:
    """The vouching predicate for a job's outputs (over ``r.<column>``), never
    NULL, rendered for a statement that also takes %(name)s parameters.
    Second item: why the schema could not be compiled (then the predicate is
    ``false`` and every row is checked in Python)."""
    x = sql.SQL("r.{}").format(sql.Identifier(column))
    try:
        parts = [schema_predicate(spec.output_schema, x)]
        if spec.output_schema.get("type") != "object":   # the spec forces it; belt and braces
            parts.insert(0, sql.SQL("jsonb_typeof({}) = 'object'").format(x))
        parts += [rule_predicate(rule, x) for rule in spec.rules]
    except Unsupported as exc:
        return sql.SQL("false"), f"schema keywords checked in Python only: {exc}"
    text = sql.SQL("coalesce({}, false)").format(_and(parts)).as_string(conn)
    # A '%' inside a literal (an enum value "100%") would read as a parameter.
    return sql.SQL(text.replace("%", "%%")), None


# ---------------------------------------------------------------------------
# The validator
# ---------------------------------------------------------------------------

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
    unvouched = 0
    for r in conn.execute(sql.SQL(q("validate_results")).format(valid=vouch), {"job": job}):
        categories[r["category"] if r["category"] is not None else NO_CATEGORY] = r["n"]
        unvouched += r["unvouched"]
    checked = sum(categories.values())
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
             "checked_in_python": unvouched, "sql_check": why is None}, categories)


def _shares(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


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
    # The published version was validated (or force-published with a report):
    # its category counts are in its report, so its rows need not be read again.
    base = (pub["validation"] or {}).get("categories")
    if not isinstance(base, dict):
        base = {(r["category"] if r["category"] is not None else NO_CATEGORY): r["n"]
                for r in conn.execute(q("category_counts"), {"job": against})}
    p, b = _shares(categories), _shares(base)
    per = {}
    for cat in sorted(set(p) | set(b)):
        cur, old = p.get(cat, 0.0), b.get(cat, 0.0)
        per[cat] = {"current": round(cur, 6), "published": round(old, 6), "shift": round(cur - old, 6)}
    distance = 0.5 * sum(abs(v["current"] - v["published"]) for v in per.values())
    out.update(distance=round(distance, 6), per_category=per, against=against)
    if distance > threshold:
        worst = sorted(per.items(), key=lambda kv: -abs(kv[1]["shift"]))[:3]
        shown = ", ".join(f"{k} {v['shift']:+.2f}" for k, v in worst)
        failures.append(f"drift: category distribution moved {distance:.2f} (total variation) against {against}, "
                        f"over the gate of {threshold:.2f} ({shown})")
    return out


def _sample(conn: psycopg.Connection, spec: JobSpec, job: str, path: Path) -> dict[str, Any]:
    n = spec.validation.sample_size
    out = {"path": None, "rows": 0, "seed": spec.validation.sample_seed, "size": n}
    if n <= 0:
        return out
    rows = conn.execute(q("validate_sample"), {"job": job, "seed": spec.validation.sample_seed, "n": n}).fetchall()
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
