"""What the evaluation adds to validate: the same finished job validated three
ways, beside each other in one run.

* ``baseline``: a spec with no evaluation (shape, coverage, drift, sample);
* ``join``: a golden set of ``--golden`` records that are in the snapshot,
  graded against the job's own results;
* ``engine_cached``: a golden set outside the snapshot whose companion job
  version (the job's engine over the golden records) is already done, so
  validate reads it: every validate after the first.

``engine_first_s`` is the first validate of the third spec: it submits the
companion job version and runs it with the noop engine, so it is the
pipeline's own cost of a golden run; a real model adds its generation time
per golden record on top (tests/process/test_evaluation_real_model.py prints
it for SmolLM2). Medians of ``--repeats`` validates each; ratios are to the
baseline.

    python -m benchmarks.evaluation [--records N] [--golden G] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.validate import validate
from benchmarks.common import bench_spec, emit, fresh_server, machine, make_tickets, median, rnd
from benchmarks.submit import write_results

TARGET = 1.5   # join validate time / baseline validate time


def _golden(conn: psycopg.Connection, table: str, ids_texts: list[tuple[str, str]]) -> None:
    conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, body text NOT NULL, expected jsonb NOT NULL)")
    with conn.cursor() as cur, cur.copy(f"COPY {table} (id, body, expected) FROM STDIN") as cp:
        for i, (rid, text) in enumerate(ids_texts):
            cp.write_row((rid, text, json.dumps({"category": ["billing", "bug", "account", "other"][i % 4]})))


def _timed(conn: psycopg.Connection, job: str, sample_dir: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    report = validate(conn, job, sample_dir=sample_dir)
    return time.perf_counter() - t0, report


def run(records: int = 100_000, golden: int = 1000, repeats: int = 5) -> dict[str, Any]:
    sample_dir = tempfile.mkdtemp(prefix="bi-bench-eval-")
    with fresh_server() as url, db.connect(url) as conn:
        make_tickets(conn, records)
        picked = conn.execute("SELECT id, body FROM public.tickets ORDER BY id LIMIT %s", (golden,)).fetchall()
        _golden(conn, "public.golden_in", [(r["id"], r["body"]) for r in picked])
        _golden(conn, "public.golden_out", [(f"g{i:06d}", f"Golden ticket {i}: the export crashes.")
                                            for i in range(golden)])
        gates = {"max_drift": 1.0, "sample_size": 200}
        specs = {
            "baseline": bench_spec(dataset="bench_base", validation=gates),
            "join": bench_spec(dataset="bench_join", validation=gates, evaluation={
                "golden": {"table": "public.golden_in", "text_column": "body"}}),
            "engine_cached": bench_spec(dataset="bench_engine", validation=gates, evaluation={
                "golden": {"table": "public.golden_out", "text_column": "body"}}),
        }
        jobs = {}
        for name, spec in specs.items():
            jobs[name] = submit(conn, spec).job_version
            write_results(conn, jobs[name])
        first_s, first = _timed(conn, jobs["engine_cached"], sample_dir)
        assert first["evaluation"]["golden"]["mode"] == "engine", first["evaluation"]["golden"]
        times: dict[str, list[float]] = {name: [] for name in specs}
        evaluation_s: dict[str, list[float]] = {name: [] for name in specs}
        graded: dict[str, int] = {}
        for _ in range(repeats):
            for name, job in jobs.items():   # interleaved: a busy minute hits every variant alike
                wall, report = _timed(conn, job, sample_dir)
                times[name].append(wall)
                evaluation_s[name].append(report["timings"]["evaluation_s"])
                graded[name] = report["evaluation"]["graded"]
    base = median(times["baseline"])
    out: dict[str, Any] = {
        "benchmark": "evaluation", "records": records, "golden": golden, "repeats": repeats,
        "validate_s": {k: rnd(median(v)) for k, v in times.items()},
        "evaluation_s": {k: rnd(median(v)) for k, v in evaluation_s.items()},
        "ratio": {k: round(median(v) / base, 2) for k, v in times.items() if k != "baseline"},
        "graded": graded, "engine_first_s": rnd(first_s),
    }
    out.update({"target": f"join <= {TARGET} x baseline", "met": out["ratio"]["join"] <= TARGET,
                "machine": machine()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--golden", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    emit(run(a.records, a.golden, a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
