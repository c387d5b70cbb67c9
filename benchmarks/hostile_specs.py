"""How fast a spec built to hurt the loader is refused, beside the load of a valid spec in the same run.

Every vector of ``tests/fixtures/hostile_specs.py`` (an alias bomb, flow lists nested 5,000 deep, a 1 MB
spec, out-of-range fields...) goes through ``spec.loads_spec`` ``--repeats`` times; the figure is each
vector's median time to its refusal and its ratio to the median load of the tests' valid spec. A refusal
that expanded an alias or walked a deep structure value by value would show here as a ratio in the
hundreds; the tests check only that each is refused in one line.

    python -m benchmarks.hostile_specs [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_inference.spec import SpecError, loads_spec  # noqa: E402
from benchmarks.common import emit, machine, median, rnd  # noqa: E402
from tests.fixtures.hostile_specs import SPEC_VECTORS, spec_yaml  # noqa: E402


TARGET_X = 100   # an expanded alias or a value-by-value walk of a deep structure is thousands of times slower


def _time(text: str, repeats: int, refused: bool) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            loads_spec(text, name="bench.yaml")
        except SpecError:
            if not refused:
                raise
        else:
            if refused:
                raise AssertionError("a hostile spec was accepted")
        times.append(time.perf_counter() - t0)
    return median(times)


def run(repeats: int) -> dict:
    valid_s = _time(spec_yaml(), repeats, refused=False)
    vectors = {}
    for what, text, _words in SPEC_VECTORS:
        s = _time(text, repeats, refused=True)
        vectors[what] = {"refused_ms": rnd(s * 1000), "x_valid": rnd(s / valid_s)}
    slowest = max(vectors, key=lambda w: vectors[w]["refused_ms"])
    return {"benchmark": "hostile_specs", "target": f"every hostile spec refused within {TARGET_X}x a valid spec's load",
            "met": vectors[slowest]["x_valid"] <= TARGET_X, "repeats": repeats, "valid_spec_ms": rnd(valid_s * 1000),
            "slowest": slowest, "slowest_ms": vectors[slowest]["refused_ms"],
            "slowest_x_valid": vectors[slowest]["x_valid"], "vectors": vectors, "machine": machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    emit(run(a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
