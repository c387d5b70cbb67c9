"""Evaluation: is a schema-valid answer also right?

The validator (``batch_inference.validate``) calls ``evaluate`` after its
shape checks; this module owns the four correctness checks the spec's
``evaluation`` block asks for:

* the golden set: records with expected outputs (a table). When every golden
  record is in the job's snapshot with the same text, the job's own results
  are graded (``join``); otherwise the job's engine runs over them under a
  companion job version (``engine``): the same spec (model, prompt, params,
  schema) with the golden table as its source, submitted and run by the
  validator's companion runner (``batch_inference.companion``), so it is keyed, resumable
  and stored like any job, and a second validate reads it instead of
  generating again. Each field is graded by its grader (exact for enums,
  numbers and booleans, normalized text otherwise, or a similarity ratio),
  giving per-field accuracy and a confusion matrix for the category field;
* the judge: a second engine given the spec's rubric grades rows of the
  review sample (input and output side by side), again as a companion job
  version, so its verdicts are results and its rows are priced by
  ``batch_inference.cost``;
* the human review: verdicts on the review sample stored in ``bi.reviews``
  (``record_review``), checked at publish by ``bi.publish_v1`` through
  ``bi.review_gate_problem_v1`` (sql/schema/evaluation.sql);
* the comparison with the published version: accuracy and label
  distribution per enum field, so a more accurate prompt that moves labels
  shows before publish.

Each failed threshold is one line in the validator's ``failures``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
import time
import unicodedata
from collections.abc import Mapping
from typing import Any, Protocol

import psycopg
from psycopg import errors, sql

from batch_inference import drift
from batch_inference.cost import Prices, night_cost
from batch_inference.db import composed, first_line, q
from batch_inference.exceptions import InvalidValue, ReviewRefused
from batch_inference.exits import HALTING, describe
from batch_inference.spec import FieldGrader, JobSpec, parse_spec
from batch_inference.status import job_counts

log = logging.getLogger(__name__)

VERDICTS = ("right", "wrong", "unsure")
MAX_COMMENT = 2000          # characters of a review comment
MISSED_EXAMPLES = 5         # record ids of wrong answers listed per field
JUDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["right", "wrong"]},
        "reason": {"type": "string", "maxLength": 160},
    },
    "required": ["verdict", "reason"],
    "additionalProperties": False,
}
NO_OUTPUT = "(no output)"   # the confusion matrix's column for a golden record without a result


class RunCompanion(Protocol):
    """Submits ``spec`` (over ``rows``, else its source) as the ``kind`` companion of version ``serves``,
    runs what is left of it, and returns (its job version, the worker's exit code):
    ``batch_inference.companion.run_companion``."""

    def __call__(self, conn: psycopg.Connection, spec: JobSpec, serves: str, kind: str,
                 rows: list[dict[str, Any]] | None = None) -> tuple[str, int]: ...


# -- graders --------------------------------------------------------------------


def normalize(value: Any) -> str:
    """Text for the normalized grader: NFKC, case-folded, punctuation and runs of white space as one space."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


def graders_for(spec: JobSpec) -> dict[str, FieldGrader]:
    """Each top-level output field's grader: the spec's, else exact for enums, numbers, booleans
    and nested values, normalized for free text."""
    out: dict[str, FieldGrader] = {}
    for name, sub in (spec.output_schema.get("properties") or {}).items():
        if name in spec.evaluation.graders:
            out[name] = spec.evaluation.graders[name]
        elif isinstance(sub, dict) and sub.get("type") == "string" and "enum" not in sub:
            out[name] = FieldGrader(grader="normalized")
        else:
            out[name] = FieldGrader(grader="exact")
    return out


def grade_value(grader: FieldGrader, expected: Any, got: Any) -> tuple[bool, float | None]:
    """(right, similarity): similarity only for the similarity grader."""
    if grader.grader == "exact":
        return (type(expected) is type(got) or {type(expected), type(got)} <= {int, float}) and expected == got, None
    a, b = normalize(expected), normalize(got)
    if grader.grader == "normalized":
        return a == b, None
    ratio = difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
    return ratio >= grader.min_similarity, ratio


def grade(spec: JobSpec, golden: list[Mapping[str, Any]], outputs: Mapping[str, Any]) -> dict[str, Any]:
    """Grade ``outputs`` (record id -> output object; absent: no output) against the golden rows.

    A golden record without an output counts wrong in every field it expects."""
    graders = graders_for(spec)
    fields: dict[str, dict[str, Any]] = {}
    confusion: dict[str, dict[str, int]] = {}
    cat = spec.category_field
    for row in golden:
        expected = row["expected"]
        got = outputs.get(row["record_id"])
        for name, want in expected.items():
            if name not in graders:
                continue
            f = fields.setdefault(name, {"graded": 0, "right": 0, "grader": graders[name].grader, "missed": []})
            f["graded"] += 1
            have = got.get(name) if isinstance(got, dict) else None
            ok, ratio = (False, None) if not isinstance(got, dict) or name not in got else \
                grade_value(graders[name], want, have)
            if ratio is not None:
                f.setdefault("similarities", []).append(ratio)
            if ok:
                f["right"] += 1
            elif len(f["missed"]) < MISSED_EXAMPLES:
                f["missed"].append(row["record_id"])
            if name == cat:
                column = NO_OUTPUT if have is None else str(have)
                confusion.setdefault(str(want), {}).setdefault(column, 0)
                confusion[str(want)][column] += 1
    accuracy = {}
    for name, f in fields.items():
        f["accuracy"] = round(f["right"] / f["graded"], 4) if f["graded"] else None
        sims = f.pop("similarities", None)
        if sims:
            f["mean_similarity"] = round(sum(sims) / len(sims), 4)
        accuracy[name] = f["accuracy"]
    return {"graded": len(golden), "with_output": sum(1 for r in golden if isinstance(outputs.get(r["record_id"]), dict)),
            "accuracy": accuracy, "fields": fields, "confusion": confusion}


# -- companion job versions -----------------------------------------------------


def _key(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:12]


def _stopped(conn: psycopg.Connection, job: str, code: int) -> str:
    """Why a companion run stopped short: the worker's exit in words, the halt it recorded,
    and whether validating again resumes it (not after a halting exit: fix the cause first)."""
    halt = conn.execute(q("job_halt"), {"job": job}).fetchone()
    why = halt["halt_reason"] if halt and halt["halt_reason"] else None
    then = "fix it, then validate again" if code in HALTING else "validate again to resume it"
    return f"worker: {describe(code)}" + (f"; {why}" if why else "") + f"); {then}"


def golden_rows(conn: psycopg.Connection, spec: JobSpec) -> list[dict[str, Any]]:
    """The golden set's records (record_id, text, expected), each text as the job stores a record: the
    golden table's ``text_column``, or with ``source.columns`` the JSON array of those same columns of
    the golden table, written as the snapshot writes one (``json_build_array``, ``prompting.columns_text``),
    so calibrate, validate and the job render a golden record one way. The one reader of a golden set. A
    golden set that does not fit the spec (a table, column or expected value it lacks) is InvalidValue,
    one line naming the golden set and the shape it must have; an empty one is ``[]``."""
    g = spec.evaluation.golden
    assert g is not None
    cols = spec.source.columns
    text: sql.Composable = sql.Identifier(g.text_column) if not cols else sql.SQL("json_build_array({})").format(
        sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in cols))
    shape = (f"{g.id_column}, {', '.join(cols) if cols else g.text_column}, {g.expected_column} (a JSON object "
             "with some or all of the output's fields)")
    if cols:
        shape += (": with source.columns a golden record is the same columns as a source record, not one text "
                  "(docs/evaluation.md, a golden set for columns)")
    try:
        with conn.transaction():
            rows = conn.execute(composed(
                "golden_rows", table=sql.Identifier(*g.table.split(".")), id=sql.Identifier(g.id_column),
                text=text, expected=sql.Identifier(g.expected_column))).fetchall()
    except (errors.UndefinedTable, errors.UndefinedColumn, errors.DataError, errors.CannotCoerce) as exc:
        raise InvalidValue(f"golden set {g.table} does not fit the spec: {first_line(exc)}; it needs the columns "
                           f"{shape}") from None
    bad = [r["record_id"] for r in rows if not isinstance(r["expected"], dict)]
    if bad:
        raise InvalidValue(f"golden set {g.table}: {len(bad)} expected value(s) are not JSON objects "
                           f"({', '.join(bad[:5])})")
    return rows


def golden_spec(spec: JobSpec) -> JobSpec:
    """The companion spec of the golden run: the job's own result-defining fields, the golden table as
    source, read as ``golden_rows`` reads it (its ``text_column``, or the spec's ``source.columns``)."""
    g = spec.evaluation.golden
    assert g is not None
    cols = spec.source.columns
    record = {"columns": list(cols)} if cols else {"text_column": g.text_column}
    return spec.with_overrides(
        dataset="golden_" + _key(g.table, g.id_column, *(cols or [g.text_column])),
        source={"kind": "postgres", "table": g.table, "id_column": g.id_column, **record},
        incremental=False, evaluation={}, validation={"sample_size": 0})


def judge_spec(spec: JobSpec) -> JobSpec:
    """The judge's companion spec: its own model, engine and params; the rubric as system prompt;
    its records are (input, output) pairs given to plan.submit; the job's clearance and endpoints."""
    j = spec.evaluation.judge
    assert j is not None
    return parse_spec({
        "dataset": "judge_" + _key(spec.dataset, j.model.digest, j.rubric),
        "source": {"kind": "postgres", "table": "bi.review_sample", "id_column": "record_id"},
        "model": j.model.model_dump(mode="json"), "engine": j.engine.model_dump(mode="json"),
        "prompt": {"version": "judge-" + _key(j.rubric), "system": j.rubric, "template": "{text}"},
        "params": j.params.model_dump(mode="json"), "output_schema": JUDGE_SCHEMA, "category_field": "verdict",
        "record_class": spec.record_class, "cleared_for_hosted": spec.cleared_for_hosted,
        "endpoints": [e.model_dump(mode="json") for e in spec.endpoints],
        "max_input_chars": spec.max_input_chars + 20_000, "shard_size": max(j.sample_size, 1),
        "max_attempts": spec.max_attempts, "cost": j.cost.model_dump(mode="json"),
        "validation": {"sample_size": 0},
    })


def judge_text(text: str, output: Any) -> str:
    """What the judge reads for one row: the record and the answer given for it."""
    return (f"Record:\n<<<\n{text}\n>>>\n\nAnswer:\n{json.dumps(output, ensure_ascii=False)}\n\n"
            "Is the answer right for this record?")


# -- the checks -----------------------------------------------------------------


def _golden(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str],
            notes: list[str], run: RunCompanion) -> dict[str, Any] | None:
    g = spec.evaluation.golden
    if g is None:
        return None
    t = time.perf_counter()
    out: dict[str, Any] = {"table": g.table, "mode": None, "job_version": None}
    # A golden set that cannot be graded fails the gates that need it; with no gate on it, it is a note.
    problems = failures if spec.evaluation.min_accuracy else notes
    try:
        rows = golden_rows(conn, spec)
    except InvalidValue as exc:
        problems.append(f"evaluation: {exc}")
        return out
    in_snapshot = {r["record_id"] for r in conn.execute(q("golden_in_snapshot"), {
        "job": job, "ids": [r["record_id"] for r in rows], "texts": [r["text"] for r in rows]})}
    mode = g.run if g.run != "auto" else ("join" if rows and len(in_snapshot) == len(rows) else "engine")
    out["mode"] = mode
    if mode == "join":
        if len(in_snapshot) < len(rows):
            notes.append(f"evaluation: {len(rows) - len(in_snapshot)} of {len(rows)} golden records are not in "
                         f"the snapshot of {job} with the same text; graded the other {len(in_snapshot)}")
        rows = [r for r in rows if r["record_id"] in in_snapshot]
    if not rows:
        problems.append(f"evaluation: golden set {g.table} has no record to grade"
                        + (" in this job's snapshot (golden.run is join)" if mode == "join" else ""))
        return out
    if mode == "join":
        graded_job = job
    else:
        graded_job, code = run(conn, golden_spec(spec), job, "golden")
        out["worker_exit"] = code
        left = job_counts(conn, graded_job)["outstanding"]
        if left:
            problems.append(f"evaluation: the golden run {graded_job} has {left} of {len(rows)} records left "
                            f"({_stopped(conn, graded_job, code)}")
    out["job_version"] = graded_job
    ids = [r["record_id"] for r in rows]
    outputs = {r["record_id"]: r["output"] for r in conn.execute(q("outputs_of"), {"job": graded_job, "ids": ids})}
    out.update(grade(spec, rows, outputs))
    out["seconds"] = round(time.perf_counter() - t, 3)
    for name, least in spec.evaluation.min_accuracy.items():
        f = out["fields"].get(name)
        if f is None or f["accuracy"] is None:
            failures.append(f"evaluation: no golden record expects {name!r}, so its accuracy gate of "
                            f"{least:.0%} cannot pass")
        elif f["accuracy"] < least:
            failures.append(f"evaluation: {name} accuracy {f['accuracy']:.1%} on the golden set ({f['right']} of "
                            f"{f['graded']}) is under the gate of {least:.1%}")
    return out


def _judge(conn: psycopg.Connection, spec: JobSpec, job: str, failures: list[str],
           run: RunCompanion) -> dict[str, Any] | None:
    j = spec.evaluation.judge
    if j is None:
        return None
    t = time.perf_counter()
    rows = conn.execute(q("review_rows"), {"job": job, "n": j.sample_size}).fetchall()
    # The pairs it grades are the judge's records (plan.submit's rows), each with its record's ACL.
    judge_job, code = run(conn, judge_spec(spec), job, "judge", [
        {"record_id": r["record_id"], "text": judge_text(r["text"], r["output"]), "acl": r["acl"]} for r in rows])
    verdicts = {r["record_id"]: r["output"] for r in conn.execute(q("outputs_of"), {
        "job": judge_job, "ids": [r["record_id"] for r in rows]})}
    judged = len(verdicts)
    right = sum(1 for v in verdicts.values() if v.get("verdict") == "right")
    agreement = round(right / judged, 4) if judged else None
    out = {"job_version": judge_job, "worker_exit": code, "sample": len(rows), "judged": judged, "right": right,
           "agreement": agreement, "min_agreement": j.min_agreement,
           "cost": float(night_cost(judged, 0, Prices.from_spec(spec.evaluation.judge))),
           "wrong_ids": sorted(k for k, v in verdicts.items() if v.get("verdict") != "right")[:MISSED_EXAMPLES],
           "seconds": round(time.perf_counter() - t, 3)}
    if judged < len(rows):
        failures.append(f"evaluation: the judge {judge_job} graded {judged} of {len(rows)} sample rows "
                        f"({_stopped(conn, judge_job, code)}")
    if j.min_agreement is not None and agreement is not None and agreement < j.min_agreement:
        failures.append(f"evaluation: the judge calls {agreement:.1%} of {judged} sample rows right, under the "
                        f"gate of {j.min_agreement:.1%}")
    return out


def review_state(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """The review counts against the spec's gate; ``problem`` says why it is not met (None: met)."""
    r = conn.execute(q("review_state"), {"job": job_version}).fetchone()
    if r is None:
        return {"required": 0, "min_right": 0.0, "sampled": 0, "reviewed": 0, "right": 0, "wrong": 0, "unsure": 0,
                "right_rate": None, "passed": True, "problem": None, "rejection": None}
    return {"required": r["required"], "min_right": r["min_right"], "sampled": r["sampled"],
            "reviewed": r["reviewed"], "right": r["right_n"], "wrong": r["wrong_n"], "unsure": r["unsure_n"],
            "right_rate": round(r["right_n"] / r["reviewed"], 4) if r["reviewed"] else None,
            "passed": r["problem"] is None, "problem": r["problem"], "rejection": r["rejection"]}


def _labels(conn: psycopg.Connection, job: str, field: str,
            counts: Mapping[str, int] | None = None) -> dict[str, float]:
    """Label shares of one field; ``counts`` when the caller has them, else a scan of the results."""
    if counts is None:
        counts = {drift.category_key(r["label"]): r["n"]
                  for r in conn.execute(q("label_counts"), {"job": job, "field": field})}
    total = sum(counts.values())
    return {k: round(v / total, 4) for k, v in sorted(counts.items())} if total else {}


def _against_published(conn: psycopg.Connection, spec: JobSpec, dataset: str, job: str,
                       golden: dict[str, Any] | None,
                       categories: Mapping[str, int] | None) -> dict[str, Any] | None:
    """Accuracy and label shares per enum field, this version beside the published one.

    The category field's counts are not read again: this version's are the validator's
    (``categories``), the published one's are in its report (``drift.category_counts``)."""
    pub = conn.execute(q("published_version"), {"dataset": dataset}).fetchone()
    if pub is None or pub["job_version"] == job:
        return None
    against = pub["job_version"]
    report = pub["validation"] if isinstance(pub["validation"], dict) else {}
    theirs = ((report.get("evaluation") or {}).get("golden") or {}).get("accuracy") or {}
    ours = (golden or {}).get("accuracy") or {}
    enums = [n for n, s in ((spec.output_schema or {}).get("properties") or {}).items() if isinstance(s, dict) and "enum" in s]
    cat = spec.category_field
    known: dict[str, Mapping[str, int] | None] = {job: None, against: None}
    if cat in enums and categories is not None:
        known[job] = categories
        theirs_spec = conn.execute(q("job_spec"), {"job": against}).fetchone()["spec"] or {}
        if theirs_spec.get("category_field") == cat:   # its bi.results.category holds the same field
            known[against] = drift.category_counts(conn, against, pub["validation"])[0]
    return {
        "against": against,
        "accuracy": {n: {"this": ours.get(n), "published": theirs.get(n),
                         "change": round(ours[n] - theirs[n], 4) if ours.get(n) is not None
                         and theirs.get(n) is not None else None} for n in sorted(set(ours) | set(theirs))},
        "labels": {n: {"this": _labels(conn, job, n, known[job] if n == cat else None),
                       "published": _labels(conn, against, n, known[against] if n == cat else None)}
                   for n in enums},
    }


def evaluate(conn: psycopg.Connection, spec: JobSpec, job_version: str, dataset: str,
             failures: list[str], notes: list[str], categories: Mapping[str, int] | None = None, *,
             run: RunCompanion) -> dict[str, Any]:
    """The ``evaluation`` section of the validation report; each failed threshold appended to ``failures``.

    Needs the review sample stored (validate stores it first) for the judge. ``categories``: the
    version's rows per category, as the validator's schema scan counted them (else read again).
    ``run`` submits and runs a companion version (the golden run, the judge): the validator passes
    ``companion.run_companion``."""
    t = time.perf_counter()
    golden = _golden(conn, spec, job_version, failures, notes, run)
    judge = _judge(conn, spec, job_version, failures, run)
    review = review_state(conn, job_version)
    return {
        "graded": golden["graded"] if golden and "graded" in golden else 0,
        "accuracy": golden.get("accuracy", {}) if golden else {},
        "confusion": golden.get("confusion", {}) if golden else {},
        "golden": golden,
        "judge": judge,
        "judge_agreement": judge["agreement"] if judge else None,
        "review": review,
        "published": _against_published(conn, spec, dataset, job_version, golden, categories),
        "seconds": round(time.perf_counter() - t, 3),
    }


# -- reviews --------------------------------------------------------------------


def review_rows(conn: psycopg.Connection, job_version: str, limit: int = 1000) -> list[dict[str, Any]]:
    """The review sample with each row's verdict, as the connection's role sees it."""
    return conn.execute(q("review_rows"), {"job": job_version, "n": limit}).fetchall()


def record_review(conn: psycopg.Connection, job_version: str, record_id: str, verdict: str, *,
                  reviewer: str, comment: str | None = None) -> dict[str, Any]:
    """Store (or replace) one verdict on a row of the review sample, with who gave it.

    :raises ReviewRefused: an unknown verdict, an over-long comment, or a record outside the sample."""
    if verdict not in VERDICTS:
        raise ReviewRefused(f"verdict must be one of {', '.join(VERDICTS)}, not {verdict!r}")
    for name, value in (("comment", comment), ("reviewer", reviewer), ("record id", record_id)):
        if value is not None and "\x00" in value:
            raise ReviewRefused(f"the {name} contains a NUL character")
    if comment is not None and len(comment) > MAX_COMMENT:
        raise ReviewRefused(f"the comment is longer than {MAX_COMMENT:,} characters")
    try:
        row = conn.execute(q("record_review"), {"job": job_version, "record": record_id, "verdict": verdict,
                                                "comment": comment, "reviewer": reviewer}).fetchone()
    except (errors.NoDataFound, errors.InvalidParameterValue) as exc:
        raise ReviewRefused(exc.diag.message_primary or first_line(exc)) from None
    log.info("%s reviewed %s of %s: %s", reviewer, record_id, job_version, verdict)
    return dict(row)


def _one_line_text(name: str, value: str | None) -> str:
    """``value`` stripped, refused (one line) when empty, over-long or holding a NUL."""
    text = (value or "").strip()
    if not text:
        raise ReviewRefused(f"the {name} must not be empty")
    if "\x00" in text:
        raise ReviewRefused(f"the {name} contains a NUL character")
    if len(text) > MAX_COMMENT:
        raise ReviewRefused(f"the {name} is longer than {MAX_COMMENT:,} characters")
    return text


def record_rejection(conn: psycopg.Connection, job_version: str, *, reviewer: str, reason: str) -> dict[str, Any]:
    """Store a reviewer's rejection of the whole version: until it is withdrawn, ``bi.publish_v1``
    refuses the version (forced or not) and its review gate is not met. ``status`` is the version's
    status when it was recorded (``published``: the rejection came after the publish; roll back).

    :raises ReviewRefused: no reviewer or reason, or no such version."""
    reviewer, reason = _one_line_text("reviewer", reviewer), _one_line_text("reason", reason)
    try:
        row = conn.execute(q("record_rejection"), {"job": job_version, "reviewer": reviewer,
                                                   "reason": reason}).fetchone()
    except (errors.NoDataFound, errors.InvalidParameterValue) as exc:
        raise ReviewRefused(exc.diag.message_primary or first_line(exc)) from None
    log.warning("%s rejected %s: %s", reviewer, job_version, reason)
    return dict(row)


def withdraw_rejections(conn: psycopg.Connection, job_version: str, *, actor: str, reason: str) -> int:
    """Withdraw the version's standing rejections, with who and why; how many were standing."""
    actor, reason = _one_line_text("name", actor), _one_line_text("reason", reason)
    n = conn.execute(q("withdraw_rejections"), {"job": job_version, "actor": actor, "reason": reason}).fetchone()["n"]
    log.warning("%s withdrew %d rejection(s) of %s: %s", actor, n, job_version, reason)
    return n

