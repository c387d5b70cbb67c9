"""Run every benchmark and print one JSON line per benchmark.

    python -m benchmarks.run                 # the sizes of issue 8 (about 15-25 minutes on 2 cores)
    python -m benchmarks.run --quick         # tiny sizes, a minute: the shape of each line, not speed
    python -m benchmarks.run --only cutoff_poll --only memory
    python -m benchmarks.run --out results.jsonl

Each benchmark runs in its own Python process with its own fresh embedded
PostgreSQL, so one benchmark's imports, caches or crash cannot touch another.
A benchmark that fails prints {"benchmark": NAME, "error": ...} and the run
goes on; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO  # noqa: E402

# name -> (arguments at full size, arguments with --quick)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "control_plane": (["--components"], ["--records", "2000", "--shard-size", "500", "--flush", "200,1000",
                                          "--repeats", "1", "--components"]),
    "submit": ([], ["--records", "5000", "--shard-size", "500", "--repeats", "1"]),
    "cutoff_poll": ([], ["--cases", "100:500000,100:5000000,1000:5000000", "--polls", "20"]),
    "memory": ([], ["--shards", "1,2", "--shard-size", "200", "--repeats", "1"]),
    "scale": ([], ["--workers", "3,6", "--seconds", "3", "--warmup", "1", "--start-jitter", "0.5",
                   "--rate", "40", "--renew", "1",
                   "--lease", "3", "--shard-size", "60", "--ceiling-records", "2000", "--stalls-per-minute", "3",
                   "--kills-per-minute", "3"]),
    "pipeline_overhead": ([], ["--records", "2", "--chunk", "1", "--max-tokens", "32", "--repeats", "1"]),
    "evaluation": ([], ["--records", "2000", "--golden", "100", "--repeats", "1"]),
    "hosted_drain": ([], ["--records", "2000", "--shard-size", "500", "--settle", "0.3", "--repeats", "1"]),
    "vllm_engine": ([], ["--records", "6", "--prefix-records", "0", "--max-tokens", "96", "--repeats", "1",
                         "--jobs", "12:3", "--job-max-tokens", "96", "--job-schema", "short", "--one-shard-arm",
                         "--one-bare-process"]),
    "lakehouse": ([], ["--records", "5000", "--rollback-sizes", "500,5000", "--repeats", "1"]),
    "reads": ([], ["--sizes", "2000,20000", "--repeats", "3"]),
    "sources": ([], ["--sizes", "200,2000", "--kinds", "sqlite,parquet,iceberg", "--fork-children"]),
    "bounded_fields": (["--threads", "1"], ["--records", "1", "--threads", "1"]),
    "ladder": (["--real", "4"], ["--records", "400", "--golden", "100"]),
    "estimate": ([], ["--records", "2000", "--demo-records", "3", "--pilot", "1"]),
    "embed": ([], ["--records", "8", "--vectors", "400", "--queries", "3", "--engines", "llama", "--repeats", "1"]),
    "hostile_specs": ([], ["--repeats", "3"]),
    "regions": ([], ["--records", "120", "--shard-size", "40", "--delay-ms", "1", "--rtt-ms", "30", "--repeats", "1"]),
    "region_nights": ([], ["--seeds", "22", "--records", "600", "--deadline-s", "40"]),
    "tier_nights": ([], ["--seeds", "15"]),
}


def run_one(name: str, quick: bool, extra: list[str], timeout: float | None) -> dict:
    full, small = BENCHMARKS[name]
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *(small if quick else full), *extra]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"benchmark": name, "error": f"timed out after {timeout:.0f}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"benchmark": name, "error": f"exit {p.returncode}: {tail[:500]}"}
    out = json.loads(lines[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the tests use this)")
    ap.add_argument("--only", action="append", choices=sorted(BENCHMARKS), help="run only these (repeatable)")
    ap.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed per benchmark")
    a = ap.parse_args(argv)
    failed = 0
    for name in a.only or list(BENCHMARKS):
        result = run_one(name, a.quick, [], a.timeout)
        line = json.dumps(result, separators=(",", ":"))
        print(line, flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(line + "\n")
        failed += "error" in result
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
