"""Pipeline overhead on the CPU engine: the same records through llama.cpp
directly and through the whole pipeline.

Direct arm: ``llama_cpp.Llama`` built with the engine's own arguments, then
``create_chat_completion`` in a loop over the records' messages with the
engine's own completion arguments (JSON-schema grammar, temperature 0,
max_tokens, seed). Pipeline arm: ``plan.submit`` of the same rows, then
``run_worker`` with the llama-cpp engine in this process: digest check,
model load, lease, renewals, schema checks, keyed writes, completion.

Both arms include their model load (0.1-0.2 s for SmolLM2). The direct arm
runs the spec as the worker reads it back from the database (see
``as_stored``), so both arms decode under the same grammar. The spec sets
``max_attempts: 1`` so a truncated output is dead-lettered at once instead of
retried after a backoff: each record is generated exactly once in both arms,
and the difference is the pipeline's own cost. Outputs are compared record by
record (temperature 0: they should match).

SmolLM2-135M on 2 cores runs about 0.75 records/s, so 50 records take about
70 s per arm.

    python -m benchmarks.pipeline_overhead [--records 50] [--chunk 10] [--max-tokens 120] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psycopg

from batch_inference import db
from batch_inference.data import TRIAGE_SCHEMA
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, LlamaCppEngine
from batch_inference.plan import drop_job_version, submit
from batch_inference.prompting import build_messages
from batch_inference.spec import JobSpec, parse_spec
from batch_inference.status import job_spec
from benchmarks.common import ServerCpu, emit, fresh_server, machine, median, rnd, self_cpu

TARGET = 0.03  # pipeline at most 3% slower

SCHEMA = TRIAGE_SCHEMA

TICKETS = [
    "I was charged twice for my subscription this month. Please refund one of the charges.",
    "The app crashes every time I open the settings page on Android 14.",
    "How do I change the email address on my account? The old one no longer works.",
    "Your invoice PDF shows the wrong VAT number for our company.",
    "After the last update the export button does nothing in Firefox.",
    "I cannot log in: the password reset email never arrives.",
    "Please cancel my plan at the end of the billing period.",
    "Search returns no results for any query since this morning.",
]


def make_spec(max_tokens: int, version: str, table: str = "public.tickets") -> JobSpec:
    return parse_spec({
        "dataset": "bench_llama",
        "source": {"table": table, "id_column": "id", "text_column": "body"},
        "model": {"name": "smollm2-135m-instruct-q4_1", "digest": SMOLLM2_GGUF_SHA256},
        "engine": {"name": "llama-cpp"},
        "prompt": {"version": version, "system": "Classify the support ticket into one category and "
                                                 "summarize it in one short sentence."},
        "params": {"temperature": 0, "max_tokens": max_tokens, "seed": 0},
        "output_schema": SCHEMA,
        "shard_size": 5000,
        "max_attempts": 1,
        "lease_seconds": 600,
        "renew_seconds": 30,
    })


def rows(n: int) -> list[tuple[str, str]]:
    return [(f"t{i:05d}", f"Ticket {i}: {TICKETS[i % len(TICKETS)]}") for i in range(n)]


def direct(spec: JobSpec, records: list[tuple[str, str]]) -> tuple[float, dict[str, str | None]]:
    from batch_inference.engines.cpu_probe import llama_for

    engine = LlamaCppEngine(spec)
    t0 = time.perf_counter()
    llm = llama_for(engine.llama_kwargs())   # as this CPU allows, as the engine loads it
    kwargs = engine.completion_kwargs()
    out: dict[str, str | None] = {}
    for rid, text in records:
        r = llm.create_chat_completion(messages=build_messages(spec, text), **kwargs)
        choice = r["choices"][0]
        out[rid] = choice["message"].get("content") if choice.get("finish_reason") != "length" else None
    elapsed = time.perf_counter() - t0
    llm.close()
    return elapsed, out


def pipeline(url: str, conn: psycopg.Connection, spec: JobSpec) -> tuple[float, dict[str, str | None]]:
    from gpu_runner.worker import WorkerConfig, run_worker

    t0 = time.perf_counter()
    job = submit(conn, spec).job_version
    rc = run_worker(WorkerConfig(job_version=job, db_url=url, wait_for_leases=False))
    elapsed = time.perf_counter() - t0
    assert rc == 0, rc
    stored = {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    dead = {r["record_id"] for r in conn.execute("SELECT record_id FROM bi.dead_letters WHERE job_version = %s", (job,))}
    out: dict[str, str | None] = {rid: json.dumps(o, sort_keys=True) for rid, o in stored.items()}
    out.update({rid: None for rid in dead})
    return elapsed, out


def _canon(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return json.dumps(json.loads(text, strict=False), sort_keys=True)
    except ValueError:
        return None  # invalid JSON: the pipeline dead-letters it


def as_stored(conn: psycopg.Connection, spec: JobSpec) -> JobSpec:
    """The spec as a worker reads it back from bi.jobs.

    The direct arm must run exactly what the worker runs. They differ today:
    bi.jobs.spec is jsonb, which reorders object keys (shorter first), so the
    output schema's properties come back in another order and the llama.cpp
    grammar makes the model write them in that order. A probe job version
    (another prompt version: the messages do not include it) is submitted,
    read back and dropped.
    """
    probe = spec.model_copy(update={"prompt": spec.prompt.model_copy(update={"version": spec.prompt.version + "-probe"})})
    job = submit(conn, probe).job_version
    stored = job_spec(conn, job)
    drop_job_version(conn, job)
    return stored.model_copy(update={"prompt": spec.prompt})


def run(records: int = 50, max_tokens: int = 120, repeats: int = 2, chunk: int = 10) -> dict[str, Any]:
    """Both arms over the same records, in chunks of ``chunk`` records.

    Each chunk is its own source table and job version, and the arms take
    turns chunk by chunk (the first arm alternates), so a minute in which
    the shared machine is busy lands on both arms instead of on one. Each arm
    pays its model load per chunk (the pipeline also its submit and digest
    check), as a job of that size would.
    """
    data = rows(records)
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    totals: dict[str, list[float]] = {"direct": [], "pipeline": []}
    cpus: dict[str, list[float]] = {"direct": [], "pipeline": []}
    per_chunk: list[float] = []   # pipeline / direct - 1, chunk by chunk
    pairs: list[list[float]] = []  # [direct s, pipeline s] per chunk, in run order
    matches = compared = 0
    stored_order: list[str] = []
    with fresh_server() as url, db.connect(url) as conn:
        server = ServerCpu(conn)
        for i, part in enumerate(chunks):
            conn.execute(f"CREATE TABLE public.tickets_{i} (id text, body text)")
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO public.tickets_{i} VALUES (%s, %s)", part)
        for rep in range(repeats):
            wall = {"direct": 0.0, "pipeline": 0.0}
            cpu = {"direct": 0.0, "pipeline": 0.0}
            for i, part in enumerate(chunks):
                spec = make_spec(max_tokens, f"r{rep}", table=f"public.tickets_{i}")
                worker_spec = as_stored(conn, spec)
                stored_order = list(worker_spec.output_schema.get("properties", {}))
                arms = ("direct", "pipeline") if (i + rep) % 2 == 0 else ("pipeline", "direct")
                got: dict[str, dict[str, str | None]] = {}
                took: dict[str, float] = {}
                for arm in arms:
                    # CPU of this process (llama.cpp's threads, the worker's threads) plus
                    # the database server's: steadier than wall time on a busy machine.
                    c0 = self_cpu() + server()
                    if arm == "direct":
                        took[arm], got[arm] = direct(worker_spec, part)
                    else:
                        took[arm], got[arm] = pipeline(url, conn, spec)
                    cpu[arm] += self_cpu() + server() - c0
                    wall[arm] += took[arm]
                per_chunk.append(took["pipeline"] / took["direct"] - 1)
                pairs.append([round(took["direct"], 1), round(took["pipeline"], 1)])
                for rid, _ in part:
                    compared += 1
                    matches += _canon(got["direct"].get(rid)) == got["pipeline"].get(rid)
            for arm in wall:
                totals[arm].append(wall[arm])
                cpus[arm].append(cpu[arm])
    d, p = median(totals["direct"]), median(totals["pipeline"])
    overhead = p / d - 1
    return {"benchmark": "pipeline_overhead", "engine": "llama-cpp", "model": "SmolLM2-135M-Instruct Q4_1",
            "records": records, "chunk": chunk, "max_tokens": max_tokens, "repeats": repeats,
            "direct_s": rnd(d), "pipeline_s": rnd(p), "direct_records_s": rnd(records / d),
            "overhead": round(overhead, 4), "chunk_overhead_median": round(median(per_chunk), 4),
            "chunk_seconds": pairs,
            "outputs_matching": f"{matches}/{compared}",
            "direct_cpu_s": rnd(median(cpus["direct"])), "pipeline_cpu_s": rnd(median(cpus["pipeline"])),
            "cpu_overhead": round(median(cpus["pipeline"]) / median(cpus["direct"]) - 1, 4),
            # Whether the worker sees the output schema's properties in the spec's order.
            "spec_property_order": list(SCHEMA["properties"]), "worker_property_order": stored_order,
            "target": f"<= {TARGET:.0%} slower", "met": overhead <= TARGET, "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=10, help="records per job; the arms alternate chunk by chunk")
    a = ap.parse_args(argv)
    emit(run(a.records, a.max_tokens, a.repeats, a.chunk))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
