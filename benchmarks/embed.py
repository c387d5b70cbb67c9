"""Embedding jobs: the worker against the engines' own embed calls on the same records, in one run; the bytes
of a stored vector; a nearest-neighbour query on the published view before and after its HNSW index.

Throughput arms, each in a process of its own (the worker's with a fresh embedded PostgreSQL), over the
same ``--records`` ticket texts:

* ``llama_bare``: ``llama_cpp.Llama(embedding=True)`` with the engine's own arguments, ``Llama.embed``
  over the texts in the engine's batches (``embed.engines.EMBED_BATCH``);
* ``llama_worker``: ``plan.submit`` of the same rows into one shard, then the worker in the process
  (``run_worker``'s ``Worker``) with the llama-cpp engine in its embedding mode: lease, every vector
  checked, normalized and stored as float32 with ``bi.put_embeddings_v1``, completion;
* ``vllm_bare`` / ``vllm_worker``: the same with vLLM's CPU build (``LLM(runner="pooling")`` and
  ``LLM.embed`` over every text at once; SmolLM2-135M converted from the GGUF, eager, bfloat16).

Records/s counts embedding and storing only: each worker's start-up (connect, spec, digest, load) is
taken off its clock (``Worker.startup``), as the bare arms' load is not on theirs, and its clock stops when
it asks its engine to shut down (the teardown is reported as ``worker_engine_close_s``). The vectors are
compared record by record: the worker's stored vector against bare's, normalized (max absolute
difference, and the least cosine).

The index arm (``--vectors``, 100,000 by default): that many random unit vectors of the model's size
(clustered: ``--vectors / 100`` centres and noise, seeded) are written through the worker's own path
(a lease, ``Ledger.put_results`` with vectors, in batches of 2,000), validated, copied into the version's
search table, and searched with ``ORDER BY embedding <=> q LIMIT 10`` (median of ``--queries`` queries)
on the search table before its index (an exact scan), then, after the HNSW index is built and the
version published, on the published view; with recall@10 of the index against the exact answers.

The arms alternate, bare then worker, ``--repeats`` times: the ratio is the median of each pair's (the
arms of a pair meet the same minute's load), records/s the medians of each arm's runs.

    python -m benchmarks.embed [--records 512] [--vectors 100000] [--queries 30] [--engines llama,vllm] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TOPICS = ["I was charged twice for my subscription this month.", "The app crashes when I open the settings page.",
          "How do I export my data to a CSV file?", "Please cancel my account and delete my data.",
          "The invoice shows the wrong company address.", "Two-factor login codes never arrive by SMS."]
DIMS = 576   # SmolLM2-135M's hidden size


def texts(n: int) -> list[tuple[str, str]]:
    return [(f"t{i:06d}", f"Ticket {i}: {TOPICS[i % len(TOPICS)]} Order {i * 7919 % 100000}.") for i in range(n)]


def spec_data(engine: str) -> dict[str, Any]:
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256

    d: dict[str, Any] = {"dataset": "bench_embed", "task": "embed",
                         "source": {"table": "public.tickets", "id_column": "id", "text_column": "body"},
                         "prompt": {"version": "e1", "template": "{text}"}, "embedding": {"dimensions": DIMS},
                         "shard_size": 1_000_000, "max_attempts": 1}
    if engine == "llama":
        d.update(model={"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
                 engine={"name": "llama-cpp", "options": {"n_threads": os.cpu_count() or 1}})
    else:
        from batch_inference.engines.convert import default_model_dir
        from batch_inference.pinning import sha256_tree

        path = default_model_dir()
        d.update(model={"name": "SmolLM2-135M-Instruct", "digest": sha256_tree(path), "path": str(path)},
                 engine={"name": "vllm", "options": {"enforce_eager": True, "dtype": "bfloat16",
                                                     "max_model_len": 2048}})
    return d


# -- the arms (each in its own process) ---------------------------------------------------------------

def arm_bare(engine: str, records: int, out: Path) -> dict[str, Any]:
    """The engine's own embed call over the texts, with the arguments the worker's engine uses."""
    from batch_inference.embed.engines import EMBED_BATCH, LlamaCppEmbedder, VllmEmbedder, embed_input
    from batch_inference.spec import parse_spec

    spec = parse_spec(spec_data(engine))
    inputs = [embed_input(spec, t) for _, t in texts(records)]
    t0 = time.perf_counter()
    if engine == "llama":
        from batch_inference.engines.cpu_probe import llama_for

        llm = llama_for(LlamaCppEmbedder(spec).llama_kwargs())   # as this CPU allows, as the engine loads it
        loaded = time.perf_counter()
        vectors = [v for i in range(0, len(inputs), EMBED_BATCH)
                   for v in llm.embed(inputs[i:i + EMBED_BATCH], normalize=False, truncate=True)]
    else:
        import vllm

        llm = vllm.LLM(**VllmEmbedder(spec).llm_kwargs())
        loaded = time.perf_counter()
        vectors = [o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)]
    done = time.perf_counter()
    np.save(out, np.asarray(vectors, dtype=np.float32))
    return {"records": records, "load_s": loaded - t0, "embed_s": done - loaded}


def arm_worker(engine: str, records: int, out: Path) -> dict[str, Any]:
    """Submit the rows, run the worker in this process, read back the stored vectors."""
    from batch_inference import db
    from batch_inference.embed.engines import LlamaCppEmbedder, VllmEmbedder
    from batch_inference.plan import submit
    from batch_inference.spec import parse_spec
    from benchmarks.common import fresh_server
    from gpu_runner.worker import Worker, WorkerConfig

    # The clock stops when the worker asks its engine to shut down, as vllm_engine's does: bare's stops
    # when its embed call returns, with no teardown (vLLM's engine-core shutdown is over a second).
    closing: list[float] = []
    cls = LlamaCppEmbedder if engine == "llama" else VllmEmbedder
    close = cls.close

    def timed_close(self: Any) -> None:
        closing.append(time.perf_counter())
        close(self)

    cls.close = timed_close
    spec = parse_spec(spec_data(engine))
    with fresh_server() as url, db.connect(url) as conn:
        conn.execute("CREATE TABLE public.tickets (id text, body text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO public.tickets VALUES (%s, %s)", texts(records))
        job = submit(conn, spec).job_version
        worker = Worker(WorkerConfig(job_version=job, db_url=url, wait_for_leases=False))
        t0 = time.perf_counter()
        code = worker.run()
        ended = time.perf_counter()
        total = (closing[0] if closing else ended) - t0
        if code != 0:
            raise RuntimeError(f"worker exited {code}")
        rows = conn.execute("SELECT record_id, embedding, pg_column_size(embedding) AS bytes FROM bi.results "
                            "WHERE job_version = %s ORDER BY record_id", (job,)).fetchall()
    from batch_inference.embed import from_storage

    np.save(out, np.stack([from_storage(r["embedding"]) for r in rows]))
    startup = sum(worker.startup.values())
    return {"records": len(rows), "load_s": startup, "embed_s": total - startup,
            "engine_close_s": ended - t0 - total, "bytes_per_vector": float(np.mean([r["bytes"] for r in rows]))}


def arm_index(vectors: int, queries: int) -> dict[str, Any]:
    """Write ``vectors`` random unit vectors through the worker's path, validate, then time nearest-neighbour
    queries before and after the HNSW index (see the module docstring)."""
    from batch_inference import db
    from batch_inference.destinations.search_index import SearchIndex
    from batch_inference.ledger import Ledger
    from batch_inference.plan import submit
    from batch_inference.publish import publish
    from batch_inference.spec import parse_spec
    from batch_inference.validate import validate
    from benchmarks.common import fresh_server, make_tickets

    rng = np.random.default_rng(7)
    centres = rng.standard_normal((max(1, vectors // 100), DIMS)).astype(np.float32)
    spec = parse_spec({**spec_data("llama"), "source": {"table": "public.tickets", "id_column": "id",
                                                        "text_column": "body"}})
    out: dict[str, Any] = {"vectors": vectors, "dimensions": DIMS}
    with fresh_server() as url, db.connect(url) as conn:
        make_tickets(conn, vectors)
        job = submit(conn, spec).job_version
        ids = [r["record_id"] for r in conn.execute(
            "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s ORDER BY record_id", (job,))]
        ledger = Ledger(conn, job, "bench-writer", "batch", 600, "llama-cpp", "local")
        lease = ledger.claim()
        t = time.perf_counter()
        for i in range(0, len(ids), 2000):
            batch = ids[i:i + 2000]
            m = centres[rng.integers(0, len(centres), len(batch))] + 0.3 * rng.standard_normal(
                (len(batch), DIMS)).astype(np.float32)
            m /= np.linalg.norm(m, axis=1, keepdims=True)
            ledger.put_results(lease, batch, [json.dumps({"dimensions": DIMS, "norm": 1.0})] * len(batch),
                               [None] * len(batch), [v.astype("<f4").tobytes() for v in m])
        out["write_rows_per_s"] = len(ids) / (time.perf_counter() - t)
        assert ledger.complete(lease) == "done"
        t = time.perf_counter()
        report = validate(conn, job, sample_dir=tempfile.mkdtemp(prefix="bi-embed-"))
        out["validate_s"] = time.perf_counter() - t
        out["bytes_per_vector"] = report["schema"]["bytes_per_vector"]
        index = SearchIndex(spec, ledger=conn)
        t = time.perf_counter()
        index.fill(job, spec)
        out["copy_s"] = time.perf_counter() - t
        qids = [ids[int(i)] for i in rng.integers(0, len(ids), queries)]
        table = f"bi.embed_{job}"

        def search(relation: str) -> tuple[list[float], list[list[str]]]:
            times, answers = [], []
            for qid in qids:
                qv = conn.execute(f"SELECT embedding FROM {table} WHERE record_id = %s", (qid,)).fetchone()
                t0 = time.perf_counter()
                found = conn.execute(f"SELECT record_id FROM {relation} ORDER BY embedding <=> %s::text::"
                                     f"{index_type(conn)} LIMIT 10", (str(qv["embedding"]),)).fetchall()
                times.append(time.perf_counter() - t0)
                answers.append([r["record_id"] for r in found])
            return times, answers

        before, exact = search(table)
        t = time.perf_counter()
        index.index(job)
        out["index_build_s"] = time.perf_counter() - t
        publish(conn, job)
        after, approx = search("published.bench_embed")
        out["query_ms_before"] = float(np.median(before)) * 1000
        out["query_ms_after"] = float(np.median(after)) * 1000
        out["recall_at_10"] = float(np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx, exact)]))
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
            f"EXPLAIN SELECT record_id FROM published.bench_embed ORDER BY embedding <=> "
            f"(SELECT embedding FROM {table} LIMIT 1) LIMIT 10"))
        out["view_uses_hnsw"] = f"embed_{job}_hnsw" in plan
    return out


def index_type(conn) -> str:
    schema = conn.execute("SELECT bi.pgvector_schema_v1() AS s").fetchone()["s"]
    return f"{schema}.vector"


# -- the run ------------------------------------------------------------------------------------------

def run_arm(name: str, *args: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "benchmarks.embed", "--arm", name, *args], capture_output=True,
                       text=True, env={**os.environ, **CPU_ENV})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"arm {name} exited {p.returncode}: {p.stderr.strip().splitlines()[-3:]}")
    return json.loads(lines[-1])


def compare(worker: np.ndarray, bare: np.ndarray) -> dict[str, float]:
    b = bare / np.linalg.norm(bare, axis=1, keepdims=True)
    cos = np.sum(worker.astype(np.float64) * b, axis=1) / np.linalg.norm(worker, axis=1)
    return {"max_abs_diff": float(np.max(np.abs(worker - b))), "min_cosine": float(np.min(cos))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--vectors", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--engines", default="llama,vllm")
    ap.add_argument("--repeats", type=int, default=3, help="bare/worker pairs per engine (the ratio is their median)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        engine, _, kind = a.arm.partition("_")
        res = arm_index(a.vectors, a.queries) if a.arm == "index" else \
            (arm_bare if kind == "bare" else arm_worker)(engine, a.records, Path(a.out))
        print(json.dumps(res), flush=True)
        return
    from benchmarks.common import emit, machine, median

    tmp = Path(tempfile.mkdtemp(prefix="bi-bench-embed-"))
    summary: dict[str, Any] = {"benchmark": "embed", "target": "worker >= 0.95 of the engine's own embed "
                               "records/s, vectors equal; a nearest-neighbour query faster after the index",
                               "met": True, "machine": machine(),
                               "avx512": "avx512" in Path("/proc/cpuinfo").read_text(), "records": a.records}
    for engine in [e for e in a.engines.split(",") if e]:
        runs: dict[str, list[dict[str, Any]]] = {"bare": [], "worker": []}
        ratios = []
        for _ in range(a.repeats):   # bare, worker, bare, worker...: each pair meets the load of its minute
            for kind in ("bare", "worker"):
                runs[kind].append(run_arm(f"{engine}_{kind}", "--records", str(a.records),
                                          "--out", str(tmp / f"{engine}_{kind}.npy")))
            w, b = runs["worker"][-1], runs["bare"][-1]
            ratios.append((w["records"] / w["embed_s"]) / (b["records"] / b["embed_s"]))
        arms = {k: v[-1] for k, v in runs.items()}
        rps = {k: median([r["records"] / r["embed_s"] for r in v]) for k, v in runs.items()}
        summary[engine] = {
            "bare_records_per_s": round(rps["bare"], 2), "worker_records_per_s": round(rps["worker"], 2),
            "ratio": round(median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
            "bare_load_s": round(arms["bare"]["load_s"], 2), "worker_startup_s": round(arms["worker"]["load_s"], 2),
            "worker_engine_close_s": round(arms["worker"]["engine_close_s"], 2),
            "bytes_per_vector": arms["worker"]["bytes_per_vector"],
            **{k: round(v, 6) for k, v in compare(np.load(tmp / f"{engine}_worker.npy"),
                                                   np.load(tmp / f"{engine}_bare.npy")).items()}}
        summary["met"] = summary["met"] and summary[engine]["ratio"] >= 0.95 and summary[engine]["max_abs_diff"] < 1e-5
    if a.vectors:
        res = run_arm("index", "--vectors", str(a.vectors), "--queries", str(a.queries))
        summary["index"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}
        summary["met"] = summary["met"] and res["query_ms_after"] < res["query_ms_before"]
    emit(summary)


if __name__ == "__main__":
    main()
