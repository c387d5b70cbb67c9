"""The benchmarks that run a real model (llama.cpp, vLLM) keep working: the same check as
tests/process/test_benchmarks.py's, in a file of their own so that scripts/test.sh's workers (a
file to a worker) run them beside the other benchmarks rather than after them; vLLM's, the
longest, is test_benchmarks_vllm.py's."""

from __future__ import annotations

import pytest

from tests.process.test_benchmarks import MODEL_BENCHMARKS, check_quick_run


@pytest.mark.parametrize("name", sorted(MODEL_BENCHMARKS - {"vllm_engine"}))   # test_benchmarks_vllm.py's
def test_a_model_benchmark_prints_one_json_line_of_the_documented_shape(name):
    check_quick_run(name)
