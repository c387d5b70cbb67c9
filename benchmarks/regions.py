"""The far worker: records/s of a worker 80 ms from the ledger against a near one, on the same records.

Four arms over the same records and the same engine (noop with ``delay_s`` per record: a model's time
per record, so the ledger's round trips are measured against work of a realistic size), each a fresh
job version of the same rows (the prompt version differs), each run by ``run_worker`` in this process:

* ``near``: the plain worker on the server's own socket (the baseline);
* ``far_ledger``: the plain worker through a latency proxy (``benchmarks.latency_proxy``: ``--rtt-ms``
  of round trip): it reads its records from the ledger, page by page, and writes every flush there;
* ``far_flush``: a worker of a placed version with ``--region``: its shard's records from the replica
  in its own region's store (a local path here), every flush written through the proxy;
* ``far_files``: the same with ``--result-files``: each shard's results one file in its region's
  store, handed in with one call, merged by key near the ledger (a merger thread on the socket).

A worker's records/s is records / the ``run_worker`` call's wall time (its connection through the
proxy, the spec read and every claim included). ``far_files`` also reports when the merge had stored
every record. The arms alternate, ``--repeats`` times; each ratio is the median of the runs' ratios
to the same repeat's ``near``. The goal (issue #46): ``far_files`` at least 0.9 of ``near``.

    python -m benchmarks.regions [--records 3000] [--shard-size 1000] [--delay-ms 5] [--rtt-ms 80]
                                 [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.regions import merge_until, parse_deployment, place
from batch_inference.status import job_counts
from benchmarks.common import bench_spec, emit, fresh_server, make_tickets, median, rnd
from benchmarks.latency_proxy import LatencyProxy, socket_path
from gpu_runner.worker import WorkerConfig, run_worker

GOAL = 0.9
ARMS = ("near", "far_ledger", "far_flush", "far_files")


def _deployment(root: Path) -> Any:
    return parse_deployment({"clusters": [{
        "name": "far-gpu", "region": "far", "workers": {"kind": "local"},
        "gpu": {"kind": "H100", "spot_per_hour": 2.0, "on_demand_per_hour": 4.0}, "capacity": 1,
        "store": {"kind": "path", "path": str(root)}}]})


def run_arm(arm: str, url: str, far_url: str, args: argparse.Namespace, tag: str, root: Path) -> dict[str, float]:
    spec = bench_spec(shard_size=args.shard_size, prompt={"version": f"{tag}-{arm}",
                                                          "system": "Classify the support ticket."})
    with db.connect(url) as conn:
        job = submit(conn, spec).job_version
        if arm in ("far_flush", "far_files"):
            place(conn, job, _deployment(root))
    cfg = WorkerConfig(job_version=job, db_url=url if arm == "near" else far_url,
                       engine_options={"delay_s": args.delay_ms / 1000}, wait_for_leases=False,
                       region="far" if arm in ("far_flush", "far_files") else None,
                       result_files=arm == "far_files")
    stop = threading.Event()
    merger = None
    if arm == "far_files":
        merger_conn = db.connect(url)
        merger = threading.Thread(target=merge_until, args=(merger_conn, job, stop, 0.05), daemon=True)
        merger.start()
    t0 = time.perf_counter()
    assert run_worker(cfg) == 0
    worker_s = time.perf_counter() - t0
    out = {"worker_s": worker_s, "records_per_s": args.records / worker_s}
    if merger is not None:
        with db.connect(url) as conn:
            while job_counts(conn, job)["outstanding"]:
                time.sleep(0.02)
        out["all_stored_s"] = time.perf_counter() - t0
        stop.set()
        merger.join(timeout=30)
        merger_conn.close()
    with db.connect(url) as conn:
        c = job_counts(conn, job)
        assert (c["stored"], c["outstanding"]) == (args.records, 0), c
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--delay-ms", type=float, default=5.0, help="the engine's time per record")
    p.add_argument("--rtt-ms", type=float, default=80.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs: list[dict[str, dict[str, float]]] = []
    with fresh_server() as url, LatencyProxy(socket_path(url), args.rtt_ms / 1000) as proxy, \
            tempfile.TemporaryDirectory(prefix="bi-regions-") as tmp:
        far_url = proxy.url(url)
        with db.connect(far_url) as c:       # the proxy's round trip, measured
            t0 = time.perf_counter()
            for _ in range(5):
                c.execute("SELECT 1")
            measured_rtt = (time.perf_counter() - t0) / 5
        with db.connect(url) as conn:
            make_tickets(conn, args.records)
        for rep in range(args.repeats):
            runs.append({arm: run_arm(arm, url, far_url, args, f"r{rep}", Path(tmp)) for arm in ARMS})
    ratios = {arm: rnd(median([r[arm]["records_per_s"] / r["near"]["records_per_s"] for r in runs]))
              for arm in ARMS[1:]}
    return emit({
        "benchmark": "regions", "records": args.records, "shard_size": args.shard_size, "delay_ms": args.delay_ms,
        "rtt_ms": args.rtt_ms, "measured_rtt_ms": rnd(measured_rtt * 1000), "repeats": args.repeats,
        "near_records_per_s": rnd(median([r["near"]["records_per_s"] for r in runs])),
        "records_per_s": {arm: rnd(median([r[arm]["records_per_s"] for r in runs])) for arm in ARMS},
        "ratio_to_near": ratios,
        "far_files_all_stored_ratio": rnd(median([r["near"]["worker_s"] / r["far_files"]["all_stored_s"]
                                                  for r in runs])),
        "goal": GOAL, "target": f"a far worker with result files keeps >= {GOAL} of a near worker's records/s",
        "met": ratios["far_files"] >= GOAL,
    })


if __name__ == "__main__":
    main()
