"""Two ``benchmarks.run`` outputs side by side: each benchmark's headline figures, before and after.

    python -m benchmarks.run --out before.jsonl      # on the old commit
    python -m benchmarks.run --out after.jsonl       # on the new one, same machine
    python -m benchmarks.compare before.jsonl after.jsonl

Prints a markdown table (benchmark, figure, before, after), then each
benchmark's load average and wall time in both runs, and any benchmark that
failed. A figure a run did not measure (a benchmark or an arm that did not
exist yet) reads ``-``. The figures are those the targets in
docs/performance.md are judged on: ratios against a baseline of the same run
where the benchmark has one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Row = tuple[str, str, Any]


def dig(d: Any, *path: Any) -> Any:
    """``d[path[0]][path[1]]...``, or None where a key or an index is missing."""
    for key in path:
        if isinstance(d, dict):
            d = d.get(key)
        elif isinstance(d, list) and isinstance(key, int) and key < len(d):
            d = d[key]
        else:
            return None
    return d


def pair(a: Any, b: Any) -> str | None:
    return None if a is None and b is None else f"{a} / {b}"


def headlines(name: str, out: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(figure, value) of one benchmark's JSON line."""
    if name == "control_plane":
        yield "pipeline / put-if-absent ceiling, flush 1,000", out.get("ratio")
        yield "pipeline records/s, flush 1,000", dig(out, "by_flush", "1000", "pipeline_records_s")
        yield "worker CPU us per record, flush 1,000", dig(out, "by_flush", "1000", "worker_cpu_us_per_record")
    elif name == "submit":
        yield "ids in id order: submit / raw copy", out.get("ratio")
        yield "ids in id order: submit / keyed copy", out.get("keyed_ratio")
        yield "ids in id order: submit s / keyed copy s", pair(out.get("submit_s"), out.get("keyed_copy_s"))
        yield "UUIDs: submit / keyed copy", dig(out, "by_id_order", "random", "keyed_ratio")
        yield "validate / raw copy", out.get("validate_ratio")
    elif name == "cutoff_poll":
        for case in out.get("cases") or []:
            yield f"median ms, {case['shards']:,} shards of {case['records']:,} records", case.get("median_ms")
    elif name == "memory":
        yield "peak RSS growth MiB, 1 to 10 shards", out.get("growth_mib")
    elif name == "scale":
        top = max(out.get("levels") or [{}], key=lambda lv: lv.get("workers", 0))
        n = top.get("workers")
        yield f"{n} workers: rows/s", top.get("rows_s")
        yield f"{n} workers: renewals per 30 s", top.get("renewals_per_30s")
        p99s = [v.get("p99") for v in (top.get("latency_ms") or {}).values() if v.get("p99") is not None]
        yield f"{n} workers: worst ledger call p99 ms", max(p99s) if p99s else None
    elif name == "pipeline_overhead":
        yield "submit + worker over llama.cpp directly", out.get("overhead")
    elif name == "evaluation":
        yield "evaluation join / the validate baseline", dig(out, "ratio", "join")
    elif name == "hosted_drain":
        yield "reconcile / direct worker", out.get("reconcile_ratio")
        yield "drain over provider settle s", out.get("drain_overhead_s")
    elif name == "hostile_specs":
        yield "slowest hostile spec refused / a valid spec's load", out.get("slowest_x_valid")
    elif name == "bounded_fields":
        yield "dead-letter rate: llama-cpp-python's converter, same retry / engine grammar, repair retry", \
            pair(*(out.get("dead_letter_rate_before_after") or [None, None]))
    elif name == "vllm_engine":
        yield "one shard: worker / bare LLM.chat (generation)", out.get("worker_vs_bare")
        yield "worker / vllm run-batch (whole runs)", out.get("worker_vs_run_batch")
        yield "prefix caching on / off", out.get("prefix_cache_ratio")
        for job in out.get("multi_shard") or []:
            what = f"{job['records']:,} records in {job['shards']} shards"
            yield f"{what}: generation / whole run vs bare", pair(dig(job, "worker", "generation_vs_bare"),
                                                                  dig(job, "worker", "whole_run_vs_bare"))
            yield f"{what}: engine idle s per boundary, overlap / one shard at a time", pair(
                dig(job, "worker", "idle_per_boundary_s"), dig(job, "worker_no_overlap", "idle_per_boundary_s"))
    elif name == "lakehouse":
        yield "Iceberg publish / Parquet write", out.get("ratio")
        yield "rollback, large / small job", out.get("rollback_size_ratio")
    elif name == "reads":
        yield "worst read, large / small job", out.get("max_ratio")
    elif name == "ladder":
        yield "cascade / top rung alone: bill", dig(out, "known", "bill_ratio")
        yield "cascade / top rung alone: accuracy", dig(out, "known", "accuracy_ratio")
    elif name == "sources":
        for kind, row in (out.get("results") or {}).items():
            yield f"{kind}: submit / the client's read", row.get("submit_ratio")
    elif name == "embed":
        for engine, label in (("llama", "llama.cpp"), ("vllm", "vLLM")):
            if engine in out:
                yield f"{label}: worker / bare embed records/s", dig(out, engine, "ratio")
        if "index" in out:
            yield f"NN query ms at {dig(out, 'index', 'vectors'):,} vectors, before / after the index", pair(
                dig(out, "index", "query_ms_before"), dig(out, "index", "query_ms_after"))
    elif name == "regions":
        yield "far worker, result files / near worker records/s", dig(out, "ratio_to_near", "far_files")
        yield "far worker, per-flush writes / near worker records/s", dig(out, "ratio_to_near", "far_flush")
    elif name == "tier_nights":
        yield "tail bill with tiers / one price", out.get("tail_bill_ratio")
        yield "nights met or paged / nights", pair(out.get("met_or_paged"), out.get("of"))
    elif name == "region_nights":
        yield "nights met or paged / nights", pair(out.get("met_or_paged"), out.get("of"))
        yield "duplicates, lost records", pair(out.get("duplicates"), out.get("lost_records"))
    elif name == "estimate":
        yield "preview / (source read + tokenizer)", dig(out, "scale", "overhead")
        yield "demo: projected / actual worker time - 1", dig(out, "demo", "finish_error")
        yield "demo: projected / actual bill - 1", dig(out, "demo", "bill_error")


def load(path: Path) -> dict[str, dict[str, Any]]:
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
    return {out["benchmark"]: out for out in lines}


def rows(run: dict[str, dict[str, Any]]) -> list[Row]:
    return [(name, figure, value) for name, out in run.items() if "error" not in out
            for figure, value in headlines(name, out)]


def table(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> str:
    a = {(n, f): v for n, f, v in rows(before)}
    b = {(n, f): v for n, f, v in rows(after)}

    def code(run: dict[str, dict[str, Any]]) -> str:
        return next((str(dig(o, "machine", "code")) for o in run.values() if dig(o, "machine", "code")), "?")

    def shown(v: Any) -> str:
        return "-" if v is None else str(v)

    lines = [f"| benchmark | figure | before ({code(before)}) | after ({code(after)}) |", "|---|---|---|---|"]
    lines += [f"| {n} | {f} | {shown(a.get((n, f)))} | {shown(b.get((n, f)))} |" for n, f in dict.fromkeys([*a, *b])]
    lines.append("")
    for name in dict.fromkeys([*before, *after]):
        x, y = before.get(name, {}), after.get(name, {})
        lines.append(f"- {name}: load {shown(dig(x, 'machine', 'load1'))} / {shown(dig(y, 'machine', 'load1'))}, "
                     f"wall {shown(x.get('wall_s'))} / {shown(y.get('wall_s'))} s")
        for side, out in (("before", x), ("after", y)):
            if "error" in out:
                lines.append(f"  - failed {side}: {out['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    a = ap.parse_args(argv)
    print(table(load(a.before), load(a.after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
