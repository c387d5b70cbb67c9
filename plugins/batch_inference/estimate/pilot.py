"""The pilot: N records of the snapshot through the real pipeline, timed, into a scratch version.

The seed's "time 1,000 real records" made a command. The records are drawn
(a seeded reservoir sample of the eligible ones, in the preview's own pass
over the source) and submitted as a scratch job version: the spec's own
model, engine, prompt, params and schema under the dataset
``pilot_<hash>``, never validated, never published, no view over it. One
worker runs it in this process (``companion.run_in_process``: engine,
output checks, the keyed write, retries and dead letters as in any run);
then what it measured is read back: records/s after the worker's start-up
(its wall time less what it took before its first claim: connect, engine
import, weights digest, model load; the start-up is the wall time less
records over that rate), the valid-answer rate (stored answers over all
attempts), the output tokens of the stored answers (re-tokenized by the
pinned tokenizer) and the input tokens of the records run. The figures go
to ``bi.estimate_pilots``, where the preview and ``capacity --spec`` find
them; the scratch version is dropped (its partitions and its ``bi.jobs``
row), whatever happened, so no job list, view or validation ever sees it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import psycopg

from batch_inference import plan, sources
from batch_inference.db import q
from batch_inference.estimate.preview import OUTPUT_SAMPLE, preview
from batch_inference.estimate.tokens import Counter, counter_for
from batch_inference.exceptions import InvalidValue
from batch_inference.spec import JobSpec
from batch_inference.status import job_counts

log = logging.getLogger(__name__)

MAX_PILOT = 100_000


def scratch_spec(spec: JobSpec) -> JobSpec:
    """The pilot's spec: the job's result-defining fields under a scratch dataset, no gates, no destinations."""
    key = hashlib.sha256(f"{spec.dataset}\x1f{spec.spec_hash}".encode()).hexdigest()[:12]
    return spec.with_overrides(dataset=f"pilot_{key}", incremental=False, evaluation={},
                               validation={"sample_size": 0, "max_dead_letter_rate": 1.0}, publish={})


def run_pilot(conn: psycopg.Connection, spec: JobSpec, n: int, *, reader: sources.Reader | None = None,
              counter: Counter | None = None, seed: int = 0) -> dict[str, Any]:
    """Run ``n`` records drawn from ``spec``'s source through one in-process worker; record and return
    its figures (a ``bi.estimate_pilots`` row). The scratch version is dropped afterwards."""
    from batch_inference.companion import run_in_process

    if not 1 <= n <= MAX_PILOT:
        raise InvalidValue(f"estimate: --pilot takes 1 to {MAX_PILOT:,} records, got {n}")
    own = counter is None
    counter = counter or counter_for(spec)
    try:
        drawn = preview(conn, spec, reader=reader, counter=counter, sample=n, seed=seed).sample
        scratch = scratch_spec(spec)
        job = plan.submit(conn, scratch, [{k: r[k] for k in ("record_id", "text", "acl")} for r in drawn]
                          ).job_version
        try:
            startup: dict[str, float] = {}
            t0, c0 = time.perf_counter(), time.process_time()
            code = run_in_process(conn, job, startup)
            seconds = max(time.perf_counter() - t0, 1e-6)
            cpu_s = time.process_time() - c0
            working = max(seconds - sum(startup.values()), 1e-6)   # the records' own time, start-up paid once
            counts = job_counts(conn, job)
            failed = int(conn.execute(q("estimate_failed_attempts"), {"job": job}).fetchone()["failed"])
            outputs = [r["output"] for r in conn.execute(q("estimate_outputs"), {"job": job, "n": MAX_PILOT})]
            out_tokens = sum(counter.count_text(o) for o in outputs)
        finally:
            plan.drop_job_version(conn, job)
    finally:
        if own:
            counter.close()
    stored, dead = int(counts["stored"]), int(counts["dead_letters"])
    if code and not stored:
        raise InvalidValue(f"estimate: the pilot's worker stopped (exit {code}) before any answer was stored")
    row = conn.execute(q("estimate_pilot_insert"), {
        "dataset": spec.dataset, "spec_hash": spec.spec_hash, "model_name": spec.model.name,
        "model_digest": spec.model.digest, "engine": spec.engine.name, "records": len(drawn), "stored": stored,
        "failed": failed, "dead_letters": dead, "seconds": seconds, "records_per_s": (stored + dead) / working,
        "input_tokens": sum(r["tokens"] for r in drawn), "output_tokens": out_tokens,
        "valid_rate": stored / (stored + failed) if stored + failed else 0.0}).fetchone()
    log.info("pilot of %s: %d records in %.1fs (start-up %.1fs, then %.3g/s), %d valid, %d failed attempts, "
             "%d dead letters", spec.dataset, len(drawn), seconds, seconds - working, row["records_per_s"], stored,
             failed, dead)
    out = dict(row)
    out["measured_at"] = out["measured_at"].isoformat()
    out["sampled_outputs"] = min(len(outputs), OUTPUT_SAMPLE)
    out["worker_exit"] = int(code)
    out["startup_s"] = round(seconds - working, 3)
    out["cpu_s"] = round(cpu_s, 3)   # this process's CPU time over the run, all its threads
    return out
