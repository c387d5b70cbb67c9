"""The preview before any spend (batch_inference.estimate), against its baselines and against a real run.

Two parts, one line.

* ``scale``: a source table of ``--records`` short tickets in the ledger's
  database and the demo's spec (SmolLM2's GGUF vocabulary on llama.cpp) over it.
  Timed in the same run: the source read alone (the preview's own read path,
  every record judged), the tokenizer alone (every record's messages rendered
  and counted, the texts made in Python, no database), and the whole preview.
  ``overhead`` is preview / (read + tokenizer): the goal is about 1 (the preview
  is the read plus the tokenizer's own time, nothing more). ``rss_growth_mb``:
  the process's peak resident memory grown during the preview (bounded:
  a histogram and the shared prefix, not the records).
* ``demo``: the demo's first ``--demo-records`` tickets. A pilot of ``--pilot``
  records, then the preview for one worker, then the real run: the same spec
  submitted and run by one in-process llama.cpp worker. Compared: the preview's
  input tokens against the engine's own prompt count (``usage.prompt_tokens``
  of the loaded model, one call per record, one output token), the projected
  worker seconds against the run's, and the bill (GPU-hour priced at $3.50, so
  it follows the worker's time) against the run's. Goal: tokens exact; finish
  and bill within 10%.

    python -m benchmarks.estimate [--records 100000] [--demo-records 40] [--pilot 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from datetime import UTC, datetime
from typing import Any

from batch_inference import db
from batch_inference.commands.demo import load_tickets
from batch_inference.data import DEMO_SPEC
from batch_inference.estimate import counter_for, judge, preview, run_pilot, source_rows
from batch_inference.prompting import build_messages
from batch_inference.spec import load_spec
from benchmarks.common import emit, fresh_server, machine, make_tickets, rnd

TARGET_OVERHEAD = 1.1
TARGET_ERROR = 0.10


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scale(url: str, records: int) -> dict[str, Any]:
    base = load_spec(DEMO_SPEC)
    spec = base.with_overrides(source={**base.source.model_dump(mode="json"), "table": "public.tickets",
                                       "text_column": "body", "acl_column": "acl"})
    counter = counter_for(spec)
    try:
        with db.connect(url) as conn:
            make_tickets(conn, records)
            t0 = time.perf_counter()
            n = sum(1 for row in source_rows(conn, spec) if judge(spec, row)[1] is None)
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(1, records + 1):
                counter.count(build_messages(spec, f"Ticket {i}: I was charged twice for my subscription."))
            tok_s = time.perf_counter() - t0
            rss0 = _rss_mb()
            t0 = time.perf_counter()
            p = preview(conn, spec, counter=counter)
            est_s = time.perf_counter() - t0
            rss1 = _rss_mb()
    finally:
        counter.close()
    assert n == p.eligible == records, (n, p.eligible, records)
    return {"records": records, "read_s": rnd(read_s), "tokenizer_s": rnd(tok_s), "preview_s": rnd(est_s),
            "overhead": round(est_s / (read_s + tok_s), 3), "records_per_s": rnd(records / est_s),
            "input_tokens": p.input_tokens["total"], "rss_growth_mb": round(rss1 - rss0, 1)}


def engine_prompt_tokens(spec: Any, texts: list[str]) -> int:
    """The engine's own prompt count: the loaded model's ``usage.prompt_tokens``, one output token each."""
    from batch_inference.engines.cpu_probe import llama_for
    from batch_inference.engines.llama_cpp import LlamaCppEngine

    llm = llama_for(LlamaCppEngine(spec).llama_kwargs())   # as this CPU allows, as the engine loads it
    try:
        return sum(llm.create_chat_completion(messages=build_messages(spec, t), max_tokens=1, temperature=0)
                   ["usage"]["prompt_tokens"] for t in texts)
    finally:
        llm.close()


def demo(url: str, records: int, pilot: int) -> dict[str, Any]:
    from batch_inference import plan
    from batch_inference.companion import run_in_process
    from batch_inference.status import bill, job_counts

    base = load_spec(DEMO_SPEC)
    spec = base.with_overrides(cost={**base.cost.model_dump(mode="json"), "gpu_hour_spot": 3.5})
    load = [round(os.getloadavg()[0], 1)]
    with db.connect(url) as conn:
        load_tickets(conn, records)
        t0 = time.perf_counter()
        pil = run_pilot(conn, spec, pilot)
        load.append(round(os.getloadavg()[0], 1))
        pilot_s = time.perf_counter() - t0
        now = datetime.now(UTC)
        counter = counter_for(spec)
        p = preview(conn, spec, workers=1, now=now, counter=counter)
        texts = [judge(spec, r)[0] for r in source_rows(conn, spec) if judge(spec, r)[1] is None]
        job = plan.submit(conn, spec).job_version
        startup: dict[str, float] = {}
        t0, c0 = time.perf_counter(), time.process_time()
        run_in_process(conn, job, startup)
        run_s = time.perf_counter() - t0
        run_cpu_s = time.process_time() - c0
        run_out_tokens = sum(counter.count_text(r["output"]) for r in conn.execute(
            db.q("estimate_outputs"), {"job": job, "n": records}))
        counter.close()
        run_failed = int(conn.execute(db.q("estimate_failed_attempts"), {"job": job}).fetchone()["failed"])
        load.append(round(os.getloadavg()[0], 1))
        counts = job_counts(conn, job)
        so_far, _ = bill(conn, job, counts=counts)
    actual_tokens = engine_prompt_tokens(spec, texts)
    projected_s = (datetime.fromisoformat(p.finish) - now).total_seconds()
    wall_s = p.eligible * pil["seconds"] / (pil["stored"] + pil["dead_letters"])
    # The run's bill at the same price: its worker's hours (one worker, one "GPU").
    actual_bill = round(run_s / 3600 * 3.5, 6)
    planned_bill = round(p.gpu_hours * 3.5, 6)   # the preview's GPU-hours at the price (its cents round it)
    return {"records": records, "eligible": p.eligible, "pilot_records": pilot, "pilot_s": rnd(pilot_s),
            "pilot_records_per_s": rnd(pil["records_per_s"]), "pilot_startup_s": rnd(pil["startup_s"]),
            "pilot_valid_rate": round(pil["valid_rate"], 3),
            "preview_input_tokens": p.input_tokens["total"], "engine_input_tokens": actual_tokens,
            "tokens_exact": p.input_tokens["total"] == actual_tokens,
            "projected_s": rnd(projected_s), "run_s": rnd(run_s), "run_startup_s": rnd(sum(startup.values())),
            "run_records_per_s": rnd(p.eligible / max(run_s - sum(startup.values()), 1e-9)),
            "finish_error": round(projected_s / run_s - 1, 3),
            # The projection before start-up was measured apart (the pilot's wall-time rate, model load
            # included, scaled to the job's records): the same pilot, the same run.
            "wall_rate_projected_s": rnd(wall_s),
            "wall_rate_finish_error": round(wall_s / run_s - 1, 3),
            "projected_bill": planned_bill, "projected_bill_cents": p.bill["planned"]["total"],
            "run_bill": actual_bill,
            "bill_error": round(planned_bill / actual_bill - 1, 3) if actual_bill else None,
            "run_stored": counts["stored"], "run_dead_letters": counts["dead_letters"],
            "pilot_failed_attempts": pil["failed"], "run_failed_attempts": run_failed,
            "ledger_bill_so_far": str(so_far.total), "load1_start_pilot_run": load,
            # Where the time went, per record: the pilot's and the run's CPU seconds (this process, all
            # threads: what the machine's load does not change) and tokens in and out.
            "pilot_cpu_s_per_record": rnd(pil["cpu_s"] / pil["records"]),
            "run_cpu_s_per_record": rnd(run_cpu_s / p.eligible),
            "pilot_tokens_per_record": [rnd(pil["input_tokens"] / pil["records"]),
                                        rnd(pil["output_tokens"] / max(pil["stored"], 1))],
            "run_tokens_per_record": [rnd(p.input_tokens["total"] / p.eligible),
                                      rnd(run_out_tokens / max(counts["stored"], 1))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000, help="records of the scale part (0: the demo part only)")
    ap.add_argument("--demo-records", type=int, default=40, help="demo tickets run for real (0: the scale part only)")
    ap.add_argument("--pilot", type=int, default=8, help="records of the pilot before the demo's preview")
    a = ap.parse_args(argv)
    s: dict[str, Any] | None = None
    if a.records:
        with fresh_server() as url:
            s = scale(url, a.records)
    d: dict[str, Any] | None = None
    if a.demo_records:
        with fresh_server() as url:
            d = demo(url, a.demo_records, a.pilot)
    met = (s is None or s["overhead"] <= TARGET_OVERHEAD) and (d is None or (
        d["tokens_exact"] and abs(d["finish_error"]) <= TARGET_ERROR
        and d["bill_error"] is not None and abs(d["bill_error"]) <= TARGET_ERROR))
    emit({"benchmark": "estimate", "scale": s, "demo": d,
          "target": {"overhead": TARGET_OVERHEAD, "finish_and_bill_error": TARGET_ERROR, "tokens": "exact"},
          "met": met, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
