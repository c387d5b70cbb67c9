"""CPU of one worker's start under the fleet: ``Popen`` of a fresh interpreter against a fork of the
warm server (``gpu_runner.forkserver``), in the same run.

Each start is a ``Fleet`` of one ``python -m gpu_runner JOB`` on a finished 30-record noop job: the
worker imports, connects, finds nothing left to claim and exits 0, alone. The figure is the worker
process's user + system CPU, start to exit (``Popen``: this process's children's rusage; a fork: the
server's ``wait4`` of it), the median of ``--repeats`` starts of each, interleaved. The server's own
start (its interpreter and the preload, paid once per fleet process and environment) is measured
apart: ``break_even_workers`` is the number of starts after which the forks have paid for it.

    python -m benchmarks.worker_start [--repeats 7]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/worker_start.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import emit, finished_noop_job, fresh_server, median, rnd, worker_env  # noqa: E402
from batch_inference.fleet import Fleet  # noqa: E402
from gpu_runner import forkserver  # noqa: E402


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_start(job: str, env: dict[str, str], method: str) -> tuple[float, float]:
    """One worker under a fleet of one, to its exit: (its CPU seconds, wall seconds)."""
    fleet = Fleet([job], env, 1, echo=False, start_method=method)
    before, t0 = children_cpu(), time.monotonic()
    fleet.start_all()
    while fleet.active():
        fleet.poll(restart=False)
        fleet.wait(1)
    wall = time.monotonic() - t0
    e = fleet.exits[0]
    if e.code != 0:
        raise SystemExit(f"{method}: worker exit {e.code}: {' | '.join(e.worker.tail)[-400:]}")
    how = fleet.start_method
    if how != method:
        raise SystemExit(f"{method}: the fleet fell back to {how}")
    cpu = e.worker.popen.cpu_s if method == "forkserver" else children_cpu() - before
    return float(cpu), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    with fresh_server() as url, tempfile.TemporaryDirectory(prefix="bi-start-") as tmp:
        job, _ = finished_noop_job(url, Path(tmp))
        env = worker_env(url)
        before = children_cpu()
        server, _ = forkserver.server_for({**env, "PYTHONUNBUFFERED": "1"})
        forkserver.close_all()                     # collected: its start is in this process's children's rusage
        server_cpu = children_cpu() - before
        cpu: dict[str, list[float]] = {"popen": [], "forkserver": []}
        wall: dict[str, list[float]] = {"popen": [], "forkserver": []}
        one_start(job, env, "forkserver")          # the server for the forks, started outside the figures
        for _ in range(args.repeats):
            for method in cpu:
                c, w = one_start(job, env, method)
                cpu[method].append(c)
                wall[method].append(w)
        forkserver.close_all()
    popen, fork = median(cpu["popen"]), median(cpu["forkserver"])
    emit({
        "benchmark": "worker_start",
        "repeats": args.repeats,
        "worker_cpu_s": {"popen": rnd(popen), "forkserver": rnd(fork)},
        "ratio": rnd(fork / popen),
        "wall_s": {m: rnd(median(xs)) for m, xs in wall.items()},
        "server_start_cpu_s": rnd(server_cpu),
        "break_even_workers": rnd(server_cpu / (popen - fork)) if popen > fork else None,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
