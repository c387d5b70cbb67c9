"""Bounded fields on the shipped model: the dead-letter rate of a product-review job whose schema
bounds its fields (sentiment enum, integer rating 1-5, summary of at most 60 characters), run
twice on the same records through the real worker and ledger with SmolLM2 on llama.cpp:

* ``before`` (the baseline): the schema through llama-cpp-python's own converter (integer bounds
  dropped) and every retry the same request as the failed one, as the engine did before issue 39;
* ``after``: the engine as it is: the schema compiled by ``engines.gbnf`` (bounds in the grammar)
  and each retry asked with a repair turn naming the last error and the next seed.

Prints both arms, their dead letters by first error line, and how many stored ratings lie outside
1-5 (none may). ``--arms`` runs one arm alone.

    python -m benchmarks.bounded_fields [--records 60] [--threads 2] [--arms before,after]
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from batch_inference import db
from batch_inference.engines.base import Outcome, Request, build_request
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, LlamaCppEngine
from batch_inference.plan import submit
from batch_inference.spec import JobSpec, parse_spec
from batch_inference.status import dead_letters, job_counts
from benchmarks.common import emit, fresh_server, machine, rnd
from gpu_runner.worker import WorkerConfig, run_worker

MODEL = "SmolLM2-135M-Instruct"
REVIEWS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 60},
    },
    "required": ["sentiment", "rating", "summary"],
    "additionalProperties": False,
}
PRODUCTS = ["blender", "kettle", "desk lamp"]
REVIEWS = [
    "Absolutely love this {p}, 10/10 would buy again.",
    "Ten stars! The best {p} I have ever owned.",
    "Perfect {p}. I would give it 10 out of 10.",
    "Great value, works exactly as described. 5 stars.",
    "My {p} arrived broken and support never answered. Zero stars.",
    "Stopped working after two days. 1/10, avoid.",
    "It does the job. Nothing special, 3 out of 5.",
    "Decent {p} for the price, a bit noisy. 7/10.",
    "Wow, just wow. 100 percent satisfied, 10 stars.",
    "Terrible. I would give minus five stars if I could.",
    "The {p} is fine but the manual is useless. 6 out of 10.",
    "Excellent build quality and fast delivery, a solid 9/10.",
    "Returned it the same week; it smelled of burnt plastic.",
    "Works, but the cable is far too short. Three stars.",
    "I bought two more for my family. Eleven out of ten!",
    "Average {p}. Does what it says, no more.",
    "Best purchase of the year, 10/10, highly recommended.",
    "The colour is nice, the rest is disappointing. 2/10.",
    "Quiet, quick and easy to clean. Love it, 10 stars.",
    "Not bad, not great: 50 out of 100.",
]


def review_rows(n: int) -> list[dict[str, Any]]:
    """``n`` product reviews, the templates over the products in turn."""
    return [{"record_id": f"rev{i:04d}", "text": REVIEWS[i % len(REVIEWS)].format(p=PRODUCTS[i // len(REVIEWS)
                                                                                          % len(PRODUCTS)])}
            for i in range(n)]


def reviews_spec(dataset: str) -> JobSpec:
    return parse_spec({
        "dataset": dataset,
        "source": {"table": "public.reviews"},
        "model": {"name": MODEL, "digest": SMOLLM2_GGUF_SHA256},
        "engine": {"name": "llama-cpp"},
        # The scale is the schema's to say (as a user's spec leaves it): the prompt asks for the reviewer's rating.
        "prompt": {"version": "v1", "system": "Read the product review and answer with its sentiment, the rating "
                   "the reviewer gives and a one-line summary."},
        "params": {"temperature": 0, "max_tokens": 64},
        "output_schema": REVIEWS_SCHEMA,
        "shard_size": 20,
    })


class ConverterEngine(LlamaCppEngine):
    """The baseline: the engine before issue 39. The schema goes through llama-cpp-python's own
    converter, and a retried record is sent the very request that failed."""

    serves_models = (MODEL,)

    def constraint_kwargs(self) -> dict[str, Any]:
        return {"response_format": {"type": "json_object", "schema": self.spec.output_schema}}

    def generate(self, requests: Sequence[Request], stop: Any) -> Iterator[Outcome]:
        same = [build_request(r.spec, r.record_id, r.text) if r.spec is not None else r for r in requests]
        yield from super().generate(same, stop)


# The engine each arm's worker runs (None: the spec's, llama-cpp).
ARMS = {"before": "benchmarks.bounded_fields:ConverterEngine", "after": None}


def run_arm(conn: Any, url: str, arm: str, rows: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    job = submit(conn, reviews_spec(f"reviews_{arm}"), rows).job_version
    t0 = time.perf_counter()
    code = run_worker(WorkerConfig(job_version=job, db_url=url, engine=ARMS[arm], backoff=(0.0,),
                                   engine_options={"n_threads": threads}, wait_for_leases=False))
    seconds = time.perf_counter() - t0
    counts = job_counts(conn, job)
    dead = dead_letters(conn, job)
    causes = collections.Counter(d["reason"].split(": ", 1)[-1][:120] for d in dead)
    ratings = [r["rating"] for r in conn.execute(
        "SELECT (output ->> 'rating')::numeric AS rating FROM bi.results WHERE job_version = %s", (job,))]
    return {"exit": code, "seconds": rnd(seconds), "stored": counts["stored"], "dead_letters": counts["dead_letters"],
            "dead_letter_rate": round(counts["dead_letters"] / len(rows), 4),
            "stored_ratings_outside_1_5": sum(1 for r in ratings if not 1 <= r <= 5),
            "dead_letter_causes": dict(causes.most_common())}


def run(records: int = 60, threads: int = 2, arms: Sequence[str] = ("before", "after")) -> dict[str, Any]:
    os.environ["BATCH_INFERENCE_ENGINE_MODULES"] = "benchmarks.bounded_fields"
    rows = review_rows(records)
    out: dict[str, Any] = {"benchmark": "bounded_fields", "records": records, "threads": threads}
    with fresh_server() as url, db.connect(url) as conn:
        for arm in arms:
            out[arm] = run_arm(conn, url, arm, rows, threads)
    before, after = out.get("before"), out.get("after")
    out["target"] = "after: fewer dead letters than before, no stored rating outside 1-5"
    out["met"] = bool(after and after["stored_ratings_outside_1_5"] == 0 and
                      (before is None or after["dead_letters"] < before["dead_letters"]
                       or before["dead_letters"] == 0))
    out["dead_letter_rate_before_after"] = [before and before["dead_letter_rate"], after and after["dead_letter_rate"]]
    out["machine"] = machine()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="before,after")
    a = ap.parse_args(argv)
    emit(run(a.records, a.threads, [x for x in a.arms.split(",") if x]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
