"""CPU of one ``batch-inference`` command, start to exit, beside the floor every command pays.

Each command runs in a process of its own, as a user (and the test suite, hundreds of times a run)
starts it: interpreter start-up, imports, parsing, the connection and its migration check, the
command's own work on a finished 30-record noop job, and the interpreter's exit. The figure is the
process's user + system CPU (its children's rusage), the median of ``--repeats`` runs; the floor,
measured in the same run, is a bare interpreter importing what a command that reads the ledger cannot
do without (psycopg and the spec's pydantic models) and exiting as the CLI does (its objects frozen
out of the last collection): ``over_floor`` is each command against it.
``python -m gpu_runner`` is the worker process the chaos and nights harnesses start.

    python -m benchmarks.cli_startup [--repeats 7] [--against CHECKOUT]

``--against`` runs every command a second time, interleaved, with another checkout's code first on
PYTHONPATH (a commit before a change: ``git archive COMMIT plugins gpu_runner | tar -x -C DIR``, then
``python -m compileall -q DIR`` where PYTHONDONTWRITEBYTECODE is set, or every run compiles it):
``against_cpu_s`` and ``ratio_to_against`` are the same commands on that code, under the same load.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/cli_startup.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PYTHON, emit, finished_noop_job, fresh_server, median, rnd, worker_env  # noqa: E402

BI = str(Path(PYTHON).parent / "batch-inference")
FLOOR = [PYTHON, "-c", "import gc, psycopg, batch_inference.spec; gc.freeze()"]
COMMANDS = {   # name -> argv, {spec} and {job} filled in
    "help": [BI, "--help"],
    "submit": [BI, "submit", "{spec}"],
    "status": [BI, "status", "{job}"],
    "dead_letters": [BI, "dead-letters", "{job}", "--json"],
    "validate": [BI, "validate", "{job}"],
    "published": [BI, "published", "bench"],
    "worker": [BI, "worker", "{job}"],
    "gpu_runner": [PYTHON, "-m", "gpu_runner", "{job}"],
}


def cpu_of(argv: list[str], env: dict[str, str]) -> float:
    """User + system CPU seconds of one process run to its exit (it must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--against", help="another checkout whose code runs the same commands, interleaved")
    args = ap.parse_args(argv)
    with fresh_server() as url, tempfile.TemporaryDirectory(prefix="bi-cli-") as tmp:
        job, spec = finished_noop_job(url, Path(tmp))
        arms = {"this": worker_env(url)}
        if args.against:
            root = Path(args.against).resolve()
            arms["against"] = {**arms["this"], "PYTHONPATH": os.pathsep.join([str(root / "plugins"), str(root)])}
        fill = {"{spec}": str(spec), "{job}": job}
        cpu: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
        for _ in range(args.repeats):
            for name, cmd in {"floor": FLOOR, **COMMANDS}.items():
                for arm, arm_env in arms.items():
                    cpu[arm].setdefault(name, []).append(cpu_of([fill.get(a, a) for a in cmd], arm_env))
    this = {name: median(xs) for name, xs in cpu["this"].items()}
    summary = {
        "benchmark": "cli_startup",
        "repeats": args.repeats,
        "cpu_s": {name: rnd(v) for name, v in this.items()},
        "over_floor": {name: rnd(v / this["floor"]) for name, v in this.items() if name != "floor"},
    }
    if "against" in cpu:
        against = {name: median(xs) for name, xs in cpu["against"].items()}
        summary["against"] = args.against
        summary["against_cpu_s"] = {name: rnd(v) for name, v in against.items()}
        summary["ratio_to_against"] = {name: rnd(this[name] / v) for name, v in against.items()}
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
