"""Calibrate a ladder on its golden set: the thresholds that cost least within ``ladder.target``.

``calibrate(conn, spec)``:

1. refuses, writing nothing, a spec without ``models:``, without a golden set
   (``evaluation.golden``), with a rung whose engine gives no confidence under
   the confidence rule, or whose golden table cannot be read or is empty;
2. runs every golden record through every rung in this process: the ladder's
   own engine (``LadderEngine.answers``, each rung verified against its pinned
   digest first), so each answer is checked and given its confidence exactly
   as a worker would; the golden run is not a job version and writes nothing;
3. grades each rung's answers against the expected outputs
   (``evaluation.grade``: a record is right when every field it expects is);
4. tries every threshold of every rung below the top (each confidence a valid
   answer had there, so every rung keeps something) and picks the cascade
   right on at least ``target`` x the top rung's golden accuracy at the least
   bill (price per record x samples, summed over the rungs a record visits),
   ties to the more accurate; none reaching it is one line naming the best
   reachable, and nothing is written;
5. records the figures and the accuracy/cost curve (the cheapest cascade for
   each accuracy) in bi.ladder_calibrations under the calibrated spec's hash
   and dataset: the job versions submitted from that spec read them
   (``report``).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from batch_inference.db import q
from batch_inference.evaluation import golden_rows as evaluation_golden_rows
from batch_inference.evaluation import grade
from batch_inference.exceptions import InvalidValue
from batch_inference.ladder import rungs as rungs_mod
from batch_inference.spec import JobSpec
from batch_inference.status import Progress

log = logging.getLogger("batch_inference.calibrate")

# A progress line every this many golden answers or seconds, and at the end (status.Progress).
PROGRESS_EVERY = 50
PROGRESS_SECONDS = 10.0
# Threshold candidates per rung when the ladder has three rungs or more (quantiles of the
# confidences seen): the search tries every combination.
MAX_CANDIDATES = 40
CURVE_POINTS = 60


@dataclass
class Calibration:
    spec: JobSpec                       # the spec with the picked thresholds
    thresholds: list[float | None]      # one per rung below the top
    report: dict[str, Any] = field(default_factory=dict)
    recorded_id: int | None = None


def check(spec: JobSpec) -> None:
    """Refuse (one line, nothing written) a spec calibrate cannot work on."""
    if not spec.models:
        raise InvalidValue("calibrate needs a ladder: a spec with models: (the rungs, cheapest first)")
    if spec.evaluation.golden is None:
        raise InvalidValue("calibrate needs a golden set: set evaluation.golden (a table of id, text, expected)")
    rungs_mod.check_engines(spec)


def golden_rows(conn: psycopg.Connection, spec: JobSpec) -> list[dict[str, Any]]:
    """The golden set's rows (record_id, text, expected), read as validate and the job read them
    (``evaluation.golden_rows``); one line if it cannot be, or is empty."""
    try:
        rows = evaluation_golden_rows(conn, spec)
    except InvalidValue as exc:
        raise InvalidValue(f"calibrate: {exc}") from None
    if not rows:
        raise InvalidValue(f"calibrate: golden set {spec.evaluation.golden.table} has no record")
    return rows


def rung_bills(spec: JobSpec) -> list[float]:
    """Dollars per record a visit to each rung costs (price x samples)."""
    return [r.cost_per_row * rungs_mod.samples(spec, no) for no, r in enumerate(spec.models or (), 1)]


def simulate(answers: list[dict[str, tuple[bool, float | None, bool]]], bills: list[float],
             thresholds: tuple[float | None, ...], ids: list[str]) -> tuple[float, float, list[int]]:
    """(accuracy, bill per record, records finished at each rung) of the cascade with ``thresholds``.

    ``answers[r][id]``: (valid, confidence, right) of rung r's answer (absent: none)."""
    top = len(bills) - 1
    right = 0
    bill = 0.0
    shares = [0] * len(bills)
    for rid in ids:
        for r in range(top + 1):
            bill += bills[r]
            a = answers[r].get(rid)
            t = thresholds[r] if r < top else None
            if r == top or (a is not None and a[0] and t is not None and a[1] is not None and a[1] >= t):
                shares[r] += 1
                right += 1 if a is not None and a[2] else 0
                break
    n = max(len(ids), 1)
    return right / n, bill / n, shares


def _candidates(values: list[float], many: bool) -> list[float | None]:
    distinct = sorted(set(values))
    if many and len(distinct) > MAX_CANDIDATES:
        step = (len(distinct) - 1) / (MAX_CANDIDATES - 1)
        distinct = sorted({distinct[round(i * step)] for i in range(MAX_CANDIDATES)})
    return distinct or [None]


def search(answers: list[dict[str, tuple[bool, float | None, bool]]], bills: list[float], ids: list[str],
           target: float) -> dict[str, Any]:
    """Every threshold combination's cascade; the cheapest within ``target`` of the top rung alone."""
    top = len(bills) - 1
    top_right = sum(1 for rid in ids if (a := answers[top].get(rid)) is not None and a[2])
    top_alone = {"accuracy": top_right / max(len(ids), 1), "bill_per_record": bills[top]}
    need = target * top_alone["accuracy"]
    cands = [_candidates([a[1] for a in answers[r].values() if a[0] and a[1] is not None], top > 1)
             for r in range(top)]
    tried = []
    for combo in itertools.product(*cands):
        acc, bill, shares = simulate(answers, bills, combo, ids)
        tried.append({"thresholds": list(combo), "accuracy": acc, "bill_per_record": bill, "finished_at": shares})
    feasible = [t for t in tried if t["accuracy"] >= need - 1e-12]
    # Least bill; then most accurate; then the highest thresholds (the safer of equals).
    order = lambda t: (t["bill_per_record"], -t["accuracy"],   # noqa: E731
                       [-(x if x is not None else 2.0) for x in t["thresholds"]])
    picked = min(feasible, key=order) if feasible else None
    best = max(tried, key=lambda t: (t["accuracy"], -t["bill_per_record"]))
    curve, best_acc = [], -1.0
    for t in sorted(tried, key=order):
        if t["accuracy"] > best_acc + 1e-12:
            curve.append(t)
            best_acc = t["accuracy"]
    if len(curve) > CURVE_POINTS:
        step = (len(curve) - 1) / (CURVE_POINTS - 1)
        curve = [curve[round(i * step)] for i in range(CURVE_POINTS)]
    return {"top_alone": top_alone, "need": need, "picked": picked, "best": best, "curve": curve,
            "combinations": len(tried)}


def _right(spec: JobSpec, row: dict[str, Any], obj: dict[str, Any] | None) -> bool:
    graded = grade(spec, [row], {row["record_id"]: obj} if obj is not None else {})
    values = [v for v in graded["accuracy"].values() if v is not None]
    return bool(values) and all(v == 1.0 for v in values)


def _shown(thresholds: list[float | None]) -> str:
    return ", ".join("none" if t is None else f"{t:.4f}" for t in thresholds)


def golden_answers(spec: JobSpec, rows: list[dict[str, Any]]) -> list[dict[str, tuple[bool, float | None, bool]]]:
    """Per rung: record id -> (valid, confidence, right) of its answer to each golden record."""
    from batch_inference.engines.base import build_request
    from batch_inference.ladder.engine import LadderEngine
    from batch_inference.pinning import verify_weights

    by_id = {r["record_id"]: r for r in rows}
    requests = [build_request(spec, r["record_id"], r["text"]) for r in rows]
    engine = LadderEngine(spec)
    out: list[dict[str, tuple[bool, float | None, bool]]] = []
    try:
        verify_weights(engine, spec)
        engine.load()
        top = len(engine.rungs)
        progress = Progress(len(requests) * top, every=PROGRESS_EVERY, seconds=PROGRESS_SECONDS)
        for no in range(1, top + 1):
            given = {}
            for a in engine.answers(no, requests, threading.Event()):
                obj = json.loads(a.text) if a.valid and a.text else None
                given[a.record_id] = (a.valid, a.confidence, _right(spec, by_id[a.record_id], obj))
                if progress.add(1):
                    log.info("calibrate: rung %d of %d (%s), golden records asked at every rung: %s", no, top,
                             spec.models[no - 1].model.name, progress.text())
            out.append(given)
    finally:
        engine.close()
    return out


def calibrate(conn: psycopg.Connection, spec: JobSpec, *, record: bool = True) -> Calibration:
    """Run the golden set up every rung, pick the thresholds, record them (see the module docstring)."""
    check(spec)
    rows = golden_rows(conn, spec)
    answers = golden_answers(spec, rows)
    bills = rung_bills(spec)
    ids = [r["record_id"] for r in rows]
    found = search(answers, bills, ids, spec.ladder.target)
    top_acc = found["top_alone"]["accuracy"]
    per_rung = []
    for no, (rung, given) in enumerate(zip(spec.models or (), answers), 1):
        n = len(given)
        per_rung.append({"rung": no, "model": rung.model.name, "engine": rung.engine.name,
                         "bill_per_record": bills[no - 1], "answered": n,
                         "valid": sum(1 for a in given.values() if a[0]),
                         "accuracy": sum(1 for a in given.values() if a[2]) / max(len(ids), 1)})
    if found["picked"] is None:
        best = found["best"]
        share = best["accuracy"] / top_acc if top_acc else 0.0
        raise InvalidValue(
            f"calibrate: no thresholds reach ladder.target {spec.ladder.target:.1%} of the top rung's golden accuracy "
            f"({top_acc:.1%}): the best reachable is {share:.1%} of it ({best['accuracy']:.1%}, thresholds "
            f"{_shown(best['thresholds'])}); to reach it, run the top rung alone (leave out the rungs below) or "
            f"lower ladder.target; nothing recorded")
    picked = found["picked"]
    thresholds = list(picked["thresholds"])
    calibrated = spec.with_overrides(models=[{**r.model_dump(mode="json"), "threshold": t}
                                             for r, t in zip(spec.models or (), [*thresholds, None])])
    report = {"golden": {"table": spec.evaluation.golden.table, "records": len(ids)},
              "target": spec.ladder.target, "confidence": spec.ladder.confidence, "rungs": per_rung,
              "top_alone": found["top_alone"],
              "picked": {**picked, "share_of_top_accuracy": picked["accuracy"] / top_acc if top_acc else None,
                         "bill_share_of_top": picked["bill_per_record"] / found["top_alone"]["bill_per_record"]
                         if found["top_alone"]["bill_per_record"] else None},
              "curve": found["curve"], "combinations": found["combinations"]}
    out = Calibration(calibrated, thresholds, report)
    if record:
        r = conn.execute(q("ladder_record_calibration"), {
            "dataset": calibrated.dataset, "spec_hash": calibrated.spec_hash,
            "target": spec.ladder.target, "thresholds": Jsonb(thresholds), "report": Jsonb(report)}).fetchone()
        out.recorded_id = r["id"]
    return out


def with_thresholds(text: str, thresholds: list[float | None]) -> str:
    """The spec's YAML ``text`` with each rung's ``threshold`` set to ``thresholds`` (one per rung below
    the top) and nothing else changed: comments, order, quoting and layout stay as written. A targeted
    edit at the positions YAML's composer gives: a rung's threshold value replaced where it is, or a
    ``threshold:`` line added after the rung's last line (first in the rung when its last value is a
    block; ``, threshold: X`` inside a flow mapping). The top rung is left as written."""
    import yaml

    from batch_inference.exceptions import SpecError

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    models = next((v for k, v in (root.value if isinstance(root, yaml.MappingNode) else [])
                   if k.value == "models"), None)
    if not isinstance(models, yaml.SequenceNode) or len(models.value) != len(thresholds) + 1:
        raise SpecError("calibrate --out: the spec's models: is not the list of rungs it calibrated")
    edits: list[tuple[int, int, str]] = []   # (start, end, replacement) in the text
    for rung, t in zip(models.value, thresholds):
        if not isinstance(rung, yaml.MappingNode):
            raise SpecError("calibrate --out: a rung of models: is not a mapping")
        value = "null" if t is None else repr(float(t))
        current = next((v for k, v in rung.value if k.value == "threshold"), None)
        if current is not None:
            edits.append((current.start_mark.index, current.end_mark.index, value))
        elif rung.flow_style:
            close = text.rindex("}", rung.start_mark.index, rung.end_mark.index)
            edits.append((close, close, f", threshold: {value}"))
        else:
            indent = " " * rung.start_mark.column
            last = rung.value[-1][1]
            if isinstance(last, yaml.ScalarNode) or last.flow_style:   # after the line the last value ends on
                end = text.find("\n", last.end_mark.index)
                end = len(text) if end < 0 else end
                edits.append((end, end, f"\n{indent}threshold: {value}"))
            else:                                                       # a block value last: first in the rung
                at = rung.start_mark.index
                edits.append((at, at, f"threshold: {value}\n{indent}"))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text
