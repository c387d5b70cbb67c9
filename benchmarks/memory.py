"""Worker memory: peak RSS of one worker process (``python -m gpu_runner``)
over 1, 5 and 10 shards of 5,000 records with the noop engine.

A worker holds one shard at a time (its records, outcomes waiting for a
flush); nothing it keeps should grow with the number of shards it has done.
Peak RSS comes from ``os.wait4`` on that one child (the kernel's high-water
mark for exactly that process), so other processes and earlier runs do not
leak into the figure. The baseline, in the same run, is a worker that starts,
loads the engine and exits without claiming (``--max-shards 0``): the cost of
the interpreter and the imports.

    python -m benchmarks.memory [--shards 1,5,10] [--shard-size 5000] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

from batch_inference import db
from batch_inference.plan import submit
from benchmarks.common import PYTHON, REPO, bench_spec, emit, fresh_server, machine, make_tickets, median, rnd, worker_env

# Growth allowed from the fewest to the most shards before we call it growth:
# allocator noise and lazily imported modules are a few MiB.
TOLERANCE_MIB = 4.0


def peak_rss_mib(url: str, job: str, max_shards: int) -> float:
    proc = subprocess.Popen([PYTHON, "-m", "gpu_runner", job, "--no-wait", "--max-shards", str(max_shards)],
                            cwd=REPO, env=worker_env(url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited with {proc.returncode}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def run(shard_counts: tuple[int, ...] = (1, 5, 10), shard_size: int = 5000, repeats: int = 3) -> dict[str, Any]:
    most = max(shard_counts)
    peaks: dict[int, list[float]] = {k: [] for k in (0, *shard_counts)}
    with fresh_server() as url, db.connect(url) as conn:
        make_tickets(conn, most * shard_size)
        for rep in range(repeats):
            for k in (0, *shard_counts):
                # A fresh job version per run, so every run finds its shards pending.
                spec = bench_spec(shard_size=shard_size,
                                  prompt={"version": f"r{rep}_k{k}", "system": "Classify the support ticket."})
                job = submit(conn, spec).job_version
                peaks[k].append(peak_rss_mib(url, job, k))
                done = conn.execute("SELECT count(*) AS n FROM bi.shards WHERE job_version = %s AND state = 'done'",
                                    (job,)).fetchone()["n"]  # type: ignore[index]
                assert done == k, (done, k)
                conn.execute("SELECT bi.drop_job_version_v1(%s)", (job,))
    med = {k: median(v) for k, v in peaks.items()}
    fewest, growth = min(shard_counts), med[most] - med[min(shard_counts)]
    return {"benchmark": "memory", "shard_size": shard_size, "repeats": repeats,
            "baseline_peak_rss_mib": rnd(med[0]),
            "peak_rss_mib": {str(k): rnd(med[k]) for k in shard_counts},
            "per_shard_mib": rnd(med[fewest] - med[0]),
            "growth_mib": rnd(growth), "target": f"no growth from {fewest} to {most} shards (<= {TOLERANCE_MIB} MiB)",
            "met": growth <= TOLERANCE_MIB, "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="1,5,10")
    ap.add_argument("--shard-size", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    emit(run(tuple(int(x) for x in a.shards.split(",")), a.shard_size, a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
