"""What each dashboard panel shows, read from the ledger.

One function per panel, each taking a core connection (dict rows) and
returning plain data that FastAPI turns into JSON. No FastAPI and no Airflow
here, so the panels can be checked against the database without a server,
and the page only ever draws what these return.

Counts come from the shard table's counters (``bi.job_counts_v1``), the same
numbers the cutoff polls, so the page agrees with ``batch-inference status``.

Customer text (dead letters' reasons, errors and raw outputs, validation
examples) is read only inside ``reading_as(conn, role)``: a transaction that
runs ``SET LOCAL ROLE`` to the signed-in user's reader role, so the
database's row-level security (sql/schema/publish.sql, sql/schema/roles.sql)
decides which rows come back, exactly as for that role's own SELECT. Without a
role (``role=None``) those panels return counts and no text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from psycopg import sql

from batch_inference import cutoff, db
from batch_inference.cost import Prices
from batch_inference.db import q
from batch_inference.publish import publish_history, rejections
from batch_inference.drift import category_counts as drift_counts
from batch_inference.drift import compare, over_gate
from batch_inference.evaluation import review_rows, review_state
from batch_inference.plan import redrives
from batch_inference.spec import Fallback, Validation
from batch_inference.status import UnknownJob, bill, job_counts

UTC = timezone.utc


def _now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def reading_as(conn: psycopg.Connection, role: str) -> Iterator[psycopg.Connection]:
    """A transaction in which every statement runs as ``role`` (``SET LOCAL ROLE``).

    Row-level security then filters each read for that role; the role ends
    with the transaction, whether it commits or not. The connection must be
    idle: inside an open transaction ``SET LOCAL`` would outlive this block.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("reading_as needs a connection outside any transaction")
    with conn.transaction():
        conn.execute(db.composed("reader_role_set", role=sql.Identifier(role)))
        yield conn


def reader_role(conn: psycopg.Connection, airflow_user: str) -> tuple[str | None, str | None]:
    """The role ``airflow_user`` reads customer text as (bi.dashboard_readers), and
    why it may not: (role, None), (None, problem) or (None, None) when unmapped."""
    row = conn.execute(q("dashboard_reader"), {"user": airflow_user}).fetchone()
    if row is None:
        return None, None
    if row["problem"]:
        return None, row["problem"]
    return row["role_name"], None


def _job_row(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    row = conn.execute(q("job_row"), {"job": job_version}).fetchone()
    if row is None:
        raise UnknownJob(f"no job version {job_version!r}")
    return row


def _fallback_constants(conn: psycopg.Connection, dataset: str, spec: dict[str, Any]) -> cutoff.DerivedConstants:
    """The rate and overhead the cutoff uses for this job, with their source: the
    spec's constants and the dataset's fallback history, as the sensor derives them."""
    fb = (spec or {}).get("fallback") or {}
    defaults = Fallback()
    n = int(fb.get("history_runs", defaults.history_runs))
    min_runs = int(fb.get("min_history_runs", defaults.min_history_runs))
    rows = (conn.execute(q("fallback_history"), cutoff.history_params(dataset, n, min_runs)).fetchall()
            if n > 0 else [])
    return cutoff.derive_rate_and_overhead(
        [cutoff.FallbackRun.from_row(r) for r in rows], float(fb.get("rate") or defaults.rate),
        float(fb.get("overhead_s", defaults.overhead_s)), n=n, min_runs=min_runs)


# -- jobs ---------------------------------------------------------------------


def jobs(conn: psycopg.Connection, dataset: str | None = None, limit: int = 200, *,
         dags: list[str] | None = None, undagged: bool = False, companions: bool = False) -> list[dict[str, Any]]:
    """The newest job versions run by one of ``dags``, and (``undagged``) those no DAG run has;
    companion versions (a golden run, a judge) only with ``companions``: each is listed on the
    page of the version it serves (``job``)."""
    return conn.execute(q("jobs"), {"dataset": dataset, "limit": limit, "dags": list(dags or []),
                                    "undagged": undagged, "companions": companions}).fetchall()


def run_dags(conn: psycopg.Connection, *, job_version: str | None = None, dataset: str | None = None) -> list[str]:
    """The DAGs whose runs worked on a job version, on any version of a dataset, or on any job."""
    if job_version is not None:
        rows = conn.execute(q("job_dags"), {"job": job_version})
    elif dataset is not None:
        rows = conn.execute(q("dataset_dags"), {"dataset": dataset})
    else:
        rows = conn.execute(q("run_dags"))
    return [r["dag_id"] for r in rows]


_REPORT_NUMBERS = ("passed", "status", "validated_at", "dead_letter_rate", "dead_letter_gate", "reused", "seconds")


def _validation_view(conn: psycopg.Connection, job_version: str, report: Any, role: str | None) -> dict[str, Any] | None:
    """The stored validation report without customer text.

    Numbers, the category counts and the drift shares pass; each failed check
    is named by its kind (``schema``, ``coverage``, ...) without its text; the
    schema examples (record id and the validator's reason, which quotes the
    output) are kept only for records ``role`` can read, and ``examples_hidden``
    counts the rest.
    """
    if not isinstance(report, dict):
        return None
    schema = report.get("schema") if isinstance(report.get("schema"), dict) else {}
    coverage = report.get("coverage") if isinstance(report.get("coverage"), dict) else {}
    examples = [e for e in (schema.get("examples") or []) if isinstance(e, dict) and isinstance(e.get("record_id"), str)]
    seen: set[str] = set()
    if role is not None and examples:
        with reading_as(conn, role):
            seen = {r["record_id"] for r in conn.execute(
                q("visible_records"), {"job": job_version, "ids": [e["record_id"] for e in examples]})}
    shown = [{"record_id": e["record_id"], "reason": str(e.get("reason", ""))} for e in examples
             if e["record_id"] in seen]
    drift = report.get("drift") if isinstance(report.get("drift"), dict) else {}
    return {
        **{k: report.get(k) for k in _REPORT_NUMBERS},
        "categories": report.get("categories"),
        "drift": {k: drift.get(k) for k in ("distance", "threshold", "per_category", "against")},
        "coverage": {k: v for k, v in coverage.items() if v is None or isinstance(v, (bool, int, float))},
        "schema": {**{k: schema.get(k) for k in ("checked", "invalid", "checked_in_python", "sql_check")},
                   "examples": shown, "examples_hidden": len(examples) - len(shown)},
        "failed_checks": [f.split(":", 1)[0] for f in (report.get("failures") or []) if isinstance(f, str)],
    }


def job(conn: psycopg.Connection, job_version: str, role: str | None = None) -> dict[str, Any]:
    """The header of a job page: fixed facts, live counts, what is published, the
    validation report as ``role`` may see it (``_validation_view``), the companion
    versions serving it (``companions``) and the versions it serves (``serves``)."""
    row = _job_row(conn, job_version)
    counts = job_counts(conn, job_version)
    pointer = conn.execute(q("pointer"), {"dataset": row["dataset"]}).fetchone()
    spec = row.pop("spec") or {}
    row["validation"] = _validation_view(conn, job_version, row["validation"], role)
    constants = _fallback_constants(conn, row["dataset"], spec)
    return {
        **row,
        "counts": counts,
        "published_version": pointer["job_version"] if pointer else None,
        "is_published": bool(pointer and pointer["job_version"] == job_version),
        "fallback": constants.to_dict(),
        "validation_gate": (spec.get("validation") or {}),
        "companions": conn.execute(q("companions_of"), {"job": job_version}).fetchall(),
        "serves": conn.execute(q("companion_serves"), {"job": job_version}).fetchall(),
    }


# -- progress: burn-down, projection, moving cutoff, deadline ---------------------


DERIVED_SHARDS = 500    # the most shard completions a burn-down without samples draws


def _derived_samples(conn: psycopg.Connection, job_version: str, row: dict[str, Any],
                     first_claim_at: datetime | None) -> list[dict[str, Any]]:
    """A burn-down from the shard table when nobody recorded progress samples.

    From the first claim, each of the first ``DERIVED_SHARDS`` shards to
    finish counts its rows as settled at its done_at: coarse (a shard at a
    time) but true; past them the chart runs straight to the live point. It
    reads at most that many shard rows, whatever the job's size.
    """
    if first_claim_at is None:
        return []
    shards = conn.execute(q("shard_times"), {"job": job_version, "n": DERIVED_SHARDS}).fetchall()
    stored, dead = int(row["reused"]), int(row["planned_dead"])
    total = int(row["records"])
    out = [{"at": first_claim_at, "stored": stored, "dead_letters": dead, "outstanding": total - stored - dead,
            "latest_safe_start": None, "deadline": None}]
    for s in shards:
        stored += int(s["stored"])
        dead += int(s["dead"])
        out.append({"at": s["done_at"], "stored": stored, "dead_letters": dead,
                    "outstanding": total - stored - dead, "latest_safe_start": None, "deadline": None})
    return out


def progress(conn: psycopg.Connection, job_version: str, now: datetime | None = None) -> dict[str, Any]:
    """Everything the timeline chart draws, on one clock.

    - ``samples``: stored / dead-lettered / outstanding over time, from
      bi.progress, or derived from shard completion times when there are none;
      a final ``live`` point carries the counts as they are now.
    - ``deadline`` and ``cutoff``: the latest sample's deadline, and the
      cutoff recomputed from the live outstanding count (what the sensor
      would compute at this moment); ``cutoff_history`` is every sampled
      latest_safe_start, which is how the cutoff moved during the night.
    - ``projected_finish``: the batch's finish at the throughput it has shown.
    - ``lanes``: the night as bars on the same axis (batch, fallback re-drive,
      fixed overhead up to the deadline), the seed's timeline of a bad night.
    """
    now = now or _now()
    row = _job_row(conn, job_version)
    counts = job_counts(conn, job_version)
    constants = _fallback_constants(conn, row["dataset"], row["spec"])
    rate, overhead = constants.rate, constants.overhead_s
    samples = conn.execute(q("progress_samples"), {"job": job_version}).fetchall()
    source = "progress"
    if not samples:
        samples = _derived_samples(conn, job_version, row, counts.get("first_claim_at"))
        source = "shards"

    outstanding = int(counts["outstanding"])
    done_at = None
    if outstanding == 0:
        done_at = conn.execute(q("shards_finished_at"), {"job": job_version}).fetchone()["done_at"]
    live_at = done_at or now
    if not samples or samples[-1]["at"] < live_at:
        samples.append({"at": live_at, "stored": int(counts["stored"]), "dead_letters": int(counts["dead_letters"]),
                        "outstanding": outstanding, "latest_safe_start": None, "deadline": None, "live": True})

    deadline = next((s["deadline"] for s in reversed(samples) if s.get("deadline")), None)
    history = [{"at": s["at"], "latest_safe_start": s["latest_safe_start"], "outstanding": s["outstanding"]}
               for s in samples if s.get("latest_safe_start")]
    cut = cutoff.latest_safe_start(deadline, outstanding, rate, overhead) if deadline else None

    started = counts.get("first_claim_at")
    # Throughput counts only this run's work: reused rows and planning-time
    # dead letters were settled before the first claim.
    settled_here = int(counts["stored"]) + int(counts["dead_letters"]) - int(row["reused"]) - int(row["planned_dead"])
    to_settle = int(row["records"]) - int(row["reused"]) - int(row["planned_dead"])
    projected = None
    if outstanding > 0 and started is not None:
        projected = cutoff.projected_finish(started, now, settled_here, to_settle)

    lanes: list[dict[str, Any]] = []
    fallback_at = row["fallback_at"]
    if started is not None:
        batch_end = fallback_at or done_at or now
        lanes.append({"lane": "batch", "kind": "actual", "start": started, "end": batch_end})
        if fallback_at is None and projected is not None:
            lanes.append({"lane": "batch", "kind": "projected", "start": now, "end": projected})
    if fallback_at is not None:
        end = done_at or (now + timedelta(seconds=outstanding / rate))
        lanes.append({"lane": "fallback", "kind": "actual" if done_at else "projected",
                      "start": fallback_at, "end": end})
    elif cut is not None and outstanding > 0:
        redrive_end = cut + timedelta(seconds=outstanding / rate)
        lanes.append({"lane": "fallback", "kind": "planned", "start": cut, "end": redrive_end})
        lanes.append({"lane": "overhead", "kind": "planned", "start": redrive_end, "end": deadline})
    if deadline is not None and not any(ln["lane"] == "overhead" for ln in lanes):
        lanes.append({"lane": "overhead", "kind": "planned",
                      "start": deadline - timedelta(seconds=overhead), "end": deadline})

    return {
        "job_version": job_version,
        "source": source,
        "now": now,
        "samples": samples,
        "records": int(row["records"]),
        "deadline": deadline,
        "cutoff": cut,
        "cutoff_history": history,
        "fires": bool(cut is not None and outstanding > 0 and now >= cut),
        "projected_finish": projected,
        "finished_at": done_at,
        "started_at": started,
        "fallback_at": fallback_at,
        "mode": row["mode"],
        "rate": rate,
        "overhead_s": overhead,
        "constants": constants.to_dict(),
        "lanes": lanes,
        # The autopilot's changes of the batch fleet's size (and its pages), on the same time axis.
        "fleet": conn.execute(q("fleet_changes"), {"job": job_version}).fetchall(),
    }


# -- shards, dead letters ------------------------------------------------------------


def shards(conn: psycopg.Connection, job_version: str, limit: int = 500, offset: int = 0) -> dict[str, Any]:
    _job_row(conn, job_version)
    by_state = {r["state"]: r for r in conn.execute(q("shard_states"), {"job": job_version})}
    states = {s: {"shards": int(by_state[s]["shards"]) if s in by_state else 0,
                  "records": int(by_state[s]["records"]) if s in by_state else 0}
              for s in ("pending", "leased", "done")}
    rows = conn.execute(q("shard_page"), {"job": job_version, "limit": limit, "offset": offset}).fetchall()
    return {"job_version": job_version, "by_state": states,
            "total": sum(v["shards"] for v in states.values()), "shards": rows, "limit": limit, "offset": offset}


def dead_letters(conn: psycopg.Connection, job_version: str, limit: int = 100, offset: int = 0,
                 role: str | None = None) -> dict[str, Any]:
    """The job's dead letters as ``role`` sees them through row-level security.

    ``total`` is every dead letter (the shard counters); ``visible`` those the
    role may read, whose reasons and rows are returned; ``hidden`` the rest.
    Without a role nothing but the total (and ``redrives``, the operators'
    re-drives of dead letters: who, when, why, filters and counts).
    """
    counts = job_counts(conn, job_version)
    total = int(counts["dead_letters"])
    reasons: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    visible = 0
    if role is not None:
        with reading_as(conn, role):
            visible = int(conn.execute(q("dead_letter_visible"), {"job": job_version}).fetchone()["n"])
            reasons = conn.execute(q("dead_letter_reasons"), {"job": job_version}).fetchall()
            rows = conn.execute(q("dead_letter_page"),
                                {"job": job_version, "limit": limit, "offset": offset}).fetchall()
    return {"job_version": job_version, "total": total, "visible": visible, "hidden": max(total - visible, 0),
            "reasons": reasons, "dead_letters": rows, "limit": limit, "offset": offset,
            "redrives": redrives(conn, job_version)}


# -- review -------------------------------------------------------------------


def review(conn: psycopg.Connection, job_version: str, role: str | None = None,
           limit: int = 1000) -> dict[str, Any]:
    """The review sample as ``role`` sees it (row-level security), each row with its verdict,
    its first ``limit`` rows; the review gate's progress (``evaluation.review_state``); the
    validation's accuracy and judge figures. Without a role: counts only. ``hidden`` (rows the
    role may not read) is None when the page is full: the rest may be readable."""
    row = _job_row(conn, job_version)
    state = review_state(conn, job_version)
    rows: list[dict[str, Any]] = []
    if role is not None:
        with reading_as(conn, role):
            rows = [{k: v for k, v in r.items() if k != "acl"} for r in review_rows(conn, job_version, limit)]
    report = row["validation"] if isinstance(row["validation"], dict) else {}
    ev = report.get("evaluation") if isinstance(report.get("evaluation"), dict) else {}
    judge = ev.get("judge") if isinstance(ev.get("judge"), dict) else {}
    validated = row["status"] in ("validated", "published")
    return {
        "job_version": job_version, "dataset": row["dataset"], "status": row["status"],
        "review": state, "rows": rows, "visible": len(rows),
        "rejections": rejections(conn, job_version=job_version),
        "hidden": max(state["sampled"] - len(rows), 0) if len(rows) < limit else None,
        "accuracy": ev.get("accuracy") or {}, "graded": ev.get("graded") or 0,
        "confusion": ev.get("confusion") or {},
        "judge": {k: judge.get(k) for k in ("judged", "agreement", "min_agreement", "cost")} if judge else None,
        # What bi.publish_v1 checks without --force: validated, and the review gate met.
        "publishable": validated and state["passed"],
    }


# -- cost ---------------------------------------------------------------------


def cost(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """The bill so far by transport, and what it would be if the fallback fired now.

    The same reader as ``batch-inference cost JOB_VERSION`` (``status.bill``),
    hosted batch rows in their own column.
    """
    row = _job_row(conn, job_version)
    counts = job_counts(conn, job_version)
    outstanding = int(counts["outstanding"])
    so_far, fired = bill(conn, job_version, Prices.from_spec(row["spec"] or {}), counts)
    return {
        "job_version": job_version,
        "so_far": so_far.to_dict(),
        "if_fallback_now": fired.to_dict(),
        "reused": int(counts["reused"]),
        "dead_letters": int(counts["dead_letters"]),
        "outstanding": outstanding,
    }


# -- the model ladder -----------------------------------------------------------


def ladder(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """Each rung's share of records, golden accuracy and cost (``batch_inference.ladder.report``);
    ``{"ladder": None}`` for a one-model job. Counts and prices only: no customer text."""
    from batch_inference.ladder import rung_report

    _job_row(conn, job_version)   # UnknownJob: 404
    return {"job_version": job_version, "ladder": rung_report(conn, job_version)}


# -- drift --------------------------------------------------------------------


def drift(conn: psycopg.Connection, job_version: str) -> dict[str, Any]:
    """Per-category shares of this version against the published one.

    The baseline is the dataset's published version now (which may have
    changed since validation ran); for the published version itself it is
    the one it replaced. The shares, the distance and the gate are
    ``batch_inference.drift``'s, as the validator computes them.
    """
    row = _job_row(conn, job_version)
    gate = Validation.model_validate((row["spec"] or {}).get("validation") or {}).max_drift
    pointer = conn.execute(q("pointer"), {"dataset": row["dataset"]}).fetchone()
    baseline = pointer["job_version"] if pointer else None
    if baseline == job_version:
        prev = conn.execute(q("previous_published"), {"dataset": row["dataset"], "job": job_version}).fetchone()
        baseline = prev["job_version"] if prev else None

    cur_n, cur_src = drift_counts(conn, job_version, row["validation"])
    base_n: dict[str, int] = {}
    base_src = None
    if baseline:
        base_row = conn.execute(q("job_row"), {"job": baseline}).fetchone()
        base_n, base_src = drift_counts(conn, baseline, base_row["validation"] if base_row else None)
    d = compare(cur_n, base_n)
    tv = d["distance"]
    report = row["validation"] if isinstance(row["validation"], dict) else None
    return {
        "job_version": job_version,
        "baseline_version": baseline,
        "source": {"current": cur_src, "baseline": base_src},
        "categories": [{"category": c, "current": v["current"], "baseline": v["published"] if baseline else None,
                        "current_n": cur_n.get(c, 0), "baseline_n": base_n.get(c, 0) if baseline else None}
                       for c, v in d["per_category"].items()],
        "tv_distance": tv,
        "max_drift": gate,
        "over_gate": over_gate(tv, gate),
        # What the validator decided, against the version published when it ran.
        "validated": ({"passed": report.get("passed"), "drift": report.get("drift"),
                       "validated_at": report.get("validated_at")} if report else None),
    }


# -- the preview before the run (batch_inference.estimate) ------------------------------


def estimates(conn: psycopg.Connection, dataset: str, limit: int = 5) -> dict[str, Any]:
    """A dataset's newest previews (each a DAG run's estimate task, before its submit) and pilots.

    Figures only: counts, tokens, rates, prices and times; no record text."""
    previews = [dict(r) for r in conn.execute(q("estimate_previews_of_dataset"), {"dataset": dataset, "n": limit})]
    pilots = [dict(r) for r in conn.execute(q("estimate_pilots_of_dataset"), {"dataset": dataset, "n": limit})]
    return {"dataset": dataset, "previews": previews, "pilots": pilots}


# -- publish history ----------------------------------------------------------------


def history(conn: psycopg.Connection, dataset: str, limit: int = 50) -> dict[str, Any]:
    pointer = conn.execute(q("pointer"), {"dataset": dataset}).fetchone()
    return {"dataset": dataset, "pointer": pointer, "history": publish_history(conn, dataset, limit),
            "rejections": rejections(conn, dataset=dataset, limit=limit)}
