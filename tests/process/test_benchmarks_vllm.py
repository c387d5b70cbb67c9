"""The vLLM engine's benchmark keeps working: its quick run loads vLLM's CPU build five times (the
worker and run-batch arms, a multi-shard job's worker and one-shard worker arms, and one bare process
for both bare arms, ``--one-bare-process``), the longest of the model benchmarks, so it has a file of
its own beside tests/process/test_benchmarks_models.py and scripts/test.sh's workers (a file to a
worker) run them side by side. The same check (check_quick_run)."""

from __future__ import annotations

from tests.process.test_benchmarks import check_quick_run


def test_the_vllm_benchmark_prints_one_json_line_of_the_documented_shape():
    check_quick_run("vllm_engine")
