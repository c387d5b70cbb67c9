"""Hosted batch transport: the cancel drain and the per-batch reconciliation, on the emulated Batch API.

Workers run in-process (``openai-batch`` against tests/fixtures/hosted_openai.py
on loopback, through the official ``openai`` client, the real ledger on a
fresh embedded PostgreSQL).

* **Reconcile**: a job of one shard of S records, one worker, one provider
  batch, run to completion. From the provider's end (``ended_at``, the poll
  that saw it) to the row reconciled (results downloaded and decoded, every
  output checked, stored put-if-absent a page at a time, the row closed).
  Baseline in the same run, just before it in each repeat: a direct worker on the same
  S rows (the same worker code, one thread, engine ``DirectReplayEngine``:
  each record's answer is the same chat completion the provider's result line
  holds, decoded from its JSON as a synchronous engine decodes a response, with
  no model and no wait), from its ``generate`` to its ``end_shard`` (every
  output checked and stored). Neither arm holds the provider's wait. The
  ratio is the median of the repeats' ratios.
* **Cancel drain**: a job of R records in shards of S, a worker per shard;
  the batches stall half-way; the cutoff fires (``enter_fallback``). Per
  batch, from the cancel request to the batch seen settled
  (``cancel_requested_at`` to ``ended_at``). Baseline in the same run: the
  emulator's own settle time for that batch (its ``cancel_delay_s``, as the
  provider side measured it); the difference is the transport's polling.

Emulated, not hosted: a real provider's drain is minutes (the seed budgets
10-15), which is the emulator's ``--settle`` here; what this measures is what
the transport adds to it.

    python -m benchmarks.hosted_drain [--records R] [--shard-size S] [--settle SECONDS] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_inference import db  # noqa: E402
from batch_inference.engines import ENGINE_MODULES_ENV, engine_class  # noqa: E402
from batch_inference.engines.base import Engine, parse_chat_completion  # noqa: E402
from batch_inference.fallback import enter_fallback  # noqa: E402
from batch_inference.plan import submit  # noqa: E402
from benchmarks.common import bench_spec, emit, fresh_server, machine, make_tickets, median, rnd  # noqa: E402
from gpu_runner.worker import WorkerConfig, run_worker  # noqa: E402
from tests.fixtures.chat_server import completion  # noqa: E402
from tests.fixtures.hosted_openai import OpenAIBatchEmulator  # noqa: E402

# One answer that passes BENCH_SCHEMA (a summary of 240-400 characters, as the noop engine writes).
ANSWER = json.dumps({"category": "bug", "summary": "x" * 260})

CANCEL_POLL_S = 0.05
TARGET_S = 2 * CANCEL_POLL_S    # the drain the transport adds: at most two cancel polls
RECONCILE_TARGET = 2.0          # reconcile of a batch <= 2x a direct worker storing the same rows
# The baseline's engine by the path the worker loads it from (this module may be running as __main__).
DIRECT_ENGINE = "benchmarks.hosted_drain:DirectReplayEngine"


class DirectReplayEngine(Engine):
    """The direct baseline: a synchronous engine whose endpoint answers at once, every record the same
    chat completion (the body a provider result line holds), decoded per record from its JSON."""

    name = "bench-direct-replay"
    option_names = frozenset()
    serves_models = frozenset({"noop"})     # bench_spec's model
    body = json.dumps(completion(ANSWER))
    spans: list[float] = []       # generate's start to end_shard, one per shard

    def load(self) -> None:
        pass

    def generate(self, requests, stop):
        self._t0 = time.perf_counter()
        for r in requests:
            yield parse_chat_completion(r.record_id, json.loads(self.body))

    def end_shard(self, lease) -> None:
        DirectReplayEngine.spans.append(time.perf_counter() - self._t0)


def hosted_spec(table: str, shard: int, emulator: OpenAIBatchEmulator):
    # A prompt version per table: the same tickets under the same spec would be the same job version.
    return bench_spec(table, shard_size=shard, cleared_for_hosted=True, lease_seconds=60, renew_seconds=0.2,
                      prompt={"version": table, "system": "Classify the support ticket."},
                      engine={"name": "openai-batch", "options": {
                          "base_url": emulator.base_url, "api_key_env": "BI_BENCH_KEY", "poll_seconds": 0.05,
                          "cancel_poll_seconds": CANCEL_POLL_S}})


def run_job(url: str, spec, table: str, records: int, shard: int,
            stalled: OpenAIBatchEmulator | None = None) -> tuple[str, float]:
    """Run the job, a worker thread per shard; with ``stalled``, fire the cutoff once every batch
    has stalled at the emulator's ``hold_after``. Returns (job, cutoff to workers done)."""
    with db.connect(url) as conn:
        make_tickets(conn, records, table=table)
        job = submit(conn, spec).job_version
    cfg = lambda: WorkerConfig(job_version=job, db_url=url, wait_for_leases=False, poll_seconds=0.1)  # noqa: E731
    workers = [threading.Thread(target=run_worker, args=(cfg(),), daemon=True) for _ in range(records // shard)]
    for w in workers:
        w.start()
    t_fire = 0.0
    if stalled is not None:
        with db.connect(url) as conn:
            while sum(r["succeeded"] for r in conn.execute(db.q("hosted_batches"), {"job": job})) \
                    < len(workers) * stalled.hold_after:
                time.sleep(0.02)
            enter_fallback(conn, job)
            t_fire = time.monotonic()
    for w in workers:
        w.join()
    return job, (time.monotonic() - t_fire) if stalled is not None else 0.0


def reconcile_once(url: str, emulator: OpenAIBatchEmulator, rep: int, shard: int) -> float:
    """One batch of ``shard`` rows: provider ended to row reconciled, in seconds."""
    table = f"public.t_full_{rep}"
    job, _ = run_job(url, hosted_spec(table, shard, emulator), table, shard, shard)
    with db.connect(url) as conn:
        (row,) = conn.execute(db.q("hosted_batches"), {"job": job}).fetchall()
        stored = conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s", (job,)).fetchone()["n"]
    assert row["state"] == "reconciled" and stored == shard, (row["state"], stored)
    return (row["reconciled_at"] - row["ended_at"]).total_seconds()


def direct_once(url: str, rep: int, shard: int) -> float:
    """Baseline: a direct worker checking and storing the same ``shard`` rows, in seconds."""
    table = f"public.t_direct_{rep}"
    spec = bench_spec(table, shard_size=shard, prompt={"version": table, "system": "Classify."},
                      engine={"name": DIRECT_ENGINE})
    run_job(url, spec, table, shard, shard)
    return engine_class(DIRECT_ENGINE).spans.pop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--settle", type=float, default=1.0, help="the emulator's cancel settle delay, seconds")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    os.environ["BI_BENCH_KEY"] = "bench-not-a-secret"
    t0 = time.perf_counter()
    os.environ[ENGINE_MODULES_ENV] = DIRECT_ENGINE.partition(":")[0]
    reconcile, direct, drains, settles, fire_to_released = [], [], [], [], []
    with fresh_server() as url:
        for rep in range(a.repeats):
            emulator = OpenAIBatchEmulator(lambda body: (200, completion(ANSWER)), rate=50_000.0,
                                           cancel_delay_s=a.settle)
            try:
                direct.append(direct_once(url, rep, a.shard_size))
                reconcile.append(reconcile_once(url, emulator, rep, a.shard_size))
                emulator.hold_after = a.shard_size // 2
                table = f"public.t_cut_{rep}"
                job, wall = run_job(url, hosted_spec(table, a.shard_size, emulator), table, a.records,
                                    a.shard_size, stalled=emulator)
                fire_to_released.append(wall)
                with db.connect(url) as conn:
                    drains += [r["drain_s"] for r in conn.execute(db.q("hosted_drain"), {"job": job})]
                settles += [w["ended_at"] - w["cancel_at"] for w in emulator.work.values() if w["cancel_at"]]
            finally:
                emulator.close()
    drain, settle = median(drains), median(settles)
    # Each repeat's two arms run back to back, so each pair sees the same load on the machine.
    ratio = median([r / max(d, 1e-9) for r, d in zip(reconcile, direct)])
    emit({"benchmark": "hosted_drain",
          "target": f"drain - provider settle <= {TARGET_S}s; reconcile <= {RECONCILE_TARGET:g}x direct",
          "met": drain - settle <= TARGET_S and ratio <= RECONCILE_TARGET, "machine": machine(),
          "wall_s": rnd(time.perf_counter() - t0, 1),
          "records": a.records, "shard_size": a.shard_size, "batches": len(reconcile),
          "reconcile_s": rnd(median(reconcile)), "direct_s": rnd(median(direct)),
          "reconcile_ratio": rnd(ratio, 2), "reconcile_met": ratio <= RECONCILE_TARGET,
          "settle_s": rnd(settle), "drain_s": rnd(drain), "drain_overhead_s": rnd(drain - settle),
          "cutoff_to_released_s": rnd(median(fire_to_released))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
