"""Hosted batch transport: the cancel drain and the per-batch reconciliation, on the emulated Batch API.

Two jobs of R records in shards of S, each shard one provider batch held by
one in-process worker (``openai-batch`` against tests/fixtures/hosted_openai.py
on loopback, through the official ``openai`` client, the real ledger on a
fresh embedded PostgreSQL).

* **Reconcile**: the first job runs to completion. Per batch, from the
  provider's end (``ended_at``, the poll that saw it) to the row reconciled
  (results downloaded, every output checked, stored put-if-absent, the next
  call closing it). Baseline in the same run: ``Ledger.put_results`` of the
  same number of rows by one connection, the database part alone.
* **Cancel drain**: the second job's batches stall half-way; the cutoff fires
  (``enter_fallback``). Per batch, from the cancel request to the batch seen
  settled (``cancel_requested_at`` to ``ended_at``). Baseline in the same run:
  the emulator's own settle time for that batch (its ``cancel_delay_s``, as
  the provider side measured it); the difference is the transport's polling.

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
from batch_inference.fallback import enter_fallback  # noqa: E402
from batch_inference.ledger import Ledger  # noqa: E402
from batch_inference.plan import submit  # noqa: E402
from benchmarks.common import bench_spec, emit, fresh_server, machine, make_tickets, median, rnd  # noqa: E402
from gpu_runner.worker import WorkerConfig, run_worker  # noqa: E402
from tests.fixtures.chat_server import completion  # noqa: E402
from tests.fixtures.hosted_openai import OpenAIBatchEmulator  # noqa: E402

# One answer that passes BENCH_SCHEMA (a summary of 240-400 characters, as the noop engine writes).
ANSWER = json.dumps({"category": "bug", "summary": "x" * 260})

CANCEL_POLL_S = 0.05
TARGET_S = 2 * CANCEL_POLL_S    # the drain the transport adds: at most two cancel polls


def run_job(url: str, emulator: OpenAIBatchEmulator, table: str, records: int, shard: int,
            cutoff: bool) -> tuple[str, float]:
    with db.connect(url) as conn:
        make_tickets(conn, records, table=table)
        # A prompt version per table: the same tickets under the same spec would be the same job version.
        spec = bench_spec(table, shard_size=shard, cleared_for_hosted=True, lease_seconds=60, renew_seconds=0.2,
                          prompt={"version": table, "system": "Classify the support ticket."},
                          engine={"name": "openai-batch", "options": {
                              "base_url": emulator.base_url, "api_key_env": "BI_BENCH_KEY", "poll_seconds": 0.05,
                              "cancel_poll_seconds": CANCEL_POLL_S}})
        job = submit(conn, spec).job_version
    cfg = lambda: WorkerConfig(job_version=job, db_url=url, wait_for_leases=False, poll_seconds=0.1)  # noqa: E731
    workers = [threading.Thread(target=run_worker, args=(cfg(),), daemon=True) for _ in range(records // shard)]
    for w in workers:
        w.start()
    t_fire = 0.0
    if cutoff:
        with db.connect(url) as conn:
            while sum(r["succeeded"] for r in conn.execute(db.q("hosted_batches"), {"job": job})) \
                    < len(workers) * emulator.hold_after:
                time.sleep(0.02)
            enter_fallback(conn, job)
            t_fire = time.monotonic()
    for w in workers:
        w.join()
    return job, (time.monotonic() - t_fire) if cutoff else 0.0


def direct_put(url: str, table: str, n: int, shard: int) -> float:
    """Baseline: Ledger.put_results of one shard's rows, one connection."""
    with db.connect(url) as conn:
        make_tickets(conn, shard, table=table)
        job = submit(conn, bench_spec(table, shard_size=shard, prompt={"version": table, "system": "Classify."})
                     ).job_version
        ledger = Ledger(conn, job, "bench-direct")
        lease = ledger.claim()
        ids = [r["record_id"] for r in ledger.records(lease)]
        out = ANSWER
        t0 = time.perf_counter()
        for i in range(0, len(ids), 1000):
            ledger.put_results(lease, ids[i:i + 1000], [out] * len(ids[i:i + 1000]), ["bug"] * len(ids[i:i + 1000]))
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--settle", type=float, default=1.0, help="the emulator's cancel settle delay, seconds")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ["BI_BENCH_KEY"] = "bench-not-a-secret"
    t0 = time.perf_counter()
    reconcile, direct, drains, settles, fire_to_released = [], [], [], [], []
    with fresh_server() as url:
        for rep in range(a.repeats):
            emulator = OpenAIBatchEmulator(lambda body: (200, completion(ANSWER)), rate=50_000.0,
                                           cancel_delay_s=a.settle)
            try:
                job, _ = run_job(url, emulator, f"public.t_full_{rep}", a.records, a.shard_size, cutoff=False)
                with db.connect(url) as conn:
                    rows = conn.execute(db.q("hosted_batches"), {"job": job}).fetchall()
                reconcile += [(r["reconciled_at"] - r["ended_at"]).total_seconds() for r in rows]
                direct.append(direct_put(url, f"public.t_direct_{rep}", a.shard_size, a.shard_size))
                emulator.hold_after = a.shard_size // 2
                job, wall = run_job(url, emulator, f"public.t_cut_{rep}", a.records, a.shard_size, cutoff=True)
                fire_to_released.append(wall)
                with db.connect(url) as conn:
                    drains += [r["drain_s"] for r in conn.execute(db.q("hosted_drain"), {"job": job})]
                settles += [w["ended_at"] - w["cancel_at"] for w in emulator.work.values() if w["cancel_at"]]
            finally:
                emulator.close()
    drain, settle = median(drains), median(settles)
    emit({"benchmark": "hosted_drain", "target": f"drain - provider settle <= {TARGET_S}s",
          "met": drain - settle <= TARGET_S, "machine": machine(), "wall_s": rnd(time.perf_counter() - t0, 1),
          "records": a.records, "shard_size": a.shard_size, "batches": len(reconcile),
          "reconcile_s": rnd(median(reconcile)), "direct_put_s": rnd(median(direct)),
          "reconcile_ratio": rnd(median(reconcile) / max(median(direct), 1e-9), 2),
          "settle_s": rnd(settle), "drain_s": rnd(drain), "drain_overhead_s": rnd(drain - settle),
          "cutoff_to_released_s": rnd(median(fire_to_released))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
