"""The CPU probe before llama.cpp runs a model (batch_inference.engines.cpu_probe), with the real
llama-cpp-python build and the SmolLM2 GGUF, in real child processes.

This machine's CPU does not fault (no AMX), so the faulting path is forced with the probe's test
switch (``BATCH_INFERENCE_CPU_PROBE_FAULT``, honoured only by the probe child: it dies by SIGSEGV
where the extra buffer types are on, as llama.cpp's AMX path does on a Sapphire Rapids VM whose
tiles fault). The probe's real decision for the CPU the suite runs on is put in the test log as a
warning (the warnings summary shows it on every run).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest

from batch_inference.engines import cpu_probe
from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, LlamaCppEngine, default_gguf_path
from batch_inference.engines.base import Request
from batch_inference.exits import ExitCode
from batch_inference.plan import submit
from batch_inference.status import job_counts, job_halt
from tests.conftest import make_source, make_spec

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"category": {"type": "string", "enum": ["billing", "bug", "other"]}},
          "required": ["category"], "additionalProperties": False}


def real_spec(**over):
    return make_spec(model={"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
                     engine={"name": "llama-cpp", "options": {"n_threads": 1}}, output_schema=SCHEMA,
                     params={"max_tokens": 16}, prompt={"system": "Classify the ticket: billing, bug or other."},
                     **over)


@pytest.fixture
def probe_cache(tmp_path, monkeypatch):
    path = tmp_path / "cpu-probe.json"
    monkeypatch.setenv(cpu_probe.CACHE_ENV, str(path))
    monkeypatch.delenv(cpu_probe.FAULT_ENV, raising=False)
    return path


def test_the_probe_decides_for_this_cpu_once_and_says_so(probe_cache):
    first = cpu_probe.llama_choice(default_gguf_path())
    again = cpu_probe.llama_choice(default_gguf_path())
    warnings.warn(f"CPU probe on the machine the suite runs on: {first.line}", UserWarning, stacklevel=1)
    print(first.line)
    assert not first.cached and again.cached
    assert again.extra_bufts == first.extra_bufts
    assert cpu_probe.this_cpu().model in first.line
    entries = json.loads(probe_cache.read_text())
    assert [e["extra_bufts"] for e in entries.values()] == [first.extra_bufts]


def test_a_faulting_extra_buffer_path_is_kept_off_and_the_engine_generates(probe_cache, monkeypatch, caplog):
    monkeypatch.setenv(cpu_probe.FAULT_ENV, "extra_bufts")
    choice = cpu_probe.llama_choice(default_gguf_path())
    assert choice.extra_bufts is False and "SIGSEGV" in choice.reason
    [entry] = json.loads(probe_cache.read_text()).values()
    assert entry["extra_bufts"] is False and entry["mode"] == "generate"

    # The engine, loaded as a worker loads it: the cached choice, said once, and a real generation.
    engine = LlamaCppEngine(real_spec(), {"n_threads": 1})
    with caplog.at_level(logging.INFO, logger="batch_inference.engines.llama_cpp"):
        engine.load()
    lines = [r.getMessage() for r in caplog.records if r.name == "batch_inference.engines.llama_cpp"]
    assert len(lines) == 1 and "no extra buffer types" in lines[0] and "SIGSEGV" in lines[0]
    assert "cached probe" in lines[0] and cpu_probe.this_cpu().model in lines[0]
    assert engine._llm.model_params.use_extra_bufts is False
    spec = engine.spec
    [out] = list(engine.generate([Request("r1", spec=spec, text="I was charged twice.")], threading.Event()))
    engine.close()
    assert out.error is None and json.loads(out.text)["category"] in {"billing", "bug", "other"}


def test_the_embedding_engine_takes_the_same_probe(probe_cache, monkeypatch):
    from batch_inference.embed.engines import LlamaCppEmbedder
    from tests.integration.test_embed import DIMS, embed_spec
    from batch_inference.spec import parse_spec

    monkeypatch.setenv(cpu_probe.FAULT_ENV, "extra_bufts")
    engine = LlamaCppEmbedder(parse_spec(embed_spec()), {"n_threads": 1})
    engine.load()
    [vector] = engine.embed_texts(["passage: the invoice is wrong"])
    engine.close()
    assert len(vector) == DIMS
    [entry] = json.loads(probe_cache.read_text()).values()
    assert entry["mode"] == "embed" and entry["extra_bufts"] is False


def test_a_cpu_where_nothing_works_gets_one_line_not_a_signal(probe_cache, monkeypatch, conn, db_url):
    monkeypatch.setenv(cpu_probe.FAULT_ENV, "all")
    make_source(conn, [("r1", "I was charged twice.", None), ("r2", "The app crashes.", None)])
    job = submit(conn, real_spec(shard_size=2)).job_version
    env = {**os.environ, "BATCH_INFERENCE_DB": db_url, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "gpu_runner", job], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == ExitCode.CONFIG, p.stderr          # an exit code, never a signal
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, p.stderr
    assert "cannot run SmolLM2-135M-Instruct.Q4_1.gguf on this CPU" in errors[0]
    assert cpu_probe.this_cpu().model in errors[0] and "SIGSEGV" in errors[0]
    c = job_counts(conn, job)
    assert c["stored"] == 0 and c["outstanding"] == 2 and c["shards"]["pending"] == 1   # nothing claimed
    assert "cannot run" in (job_halt(conn, job)["halt_reason"] or "")                  # the cutoff watch ends


def test_a_cache_that_cannot_be_written_costs_a_probe_not_the_engine(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(cpu_probe.CACHE_ENV, str(blocked / "cpu-probe.json"))   # under a file: no directory
    monkeypatch.setenv(cpu_probe.FAULT_ENV, "extra_bufts")
    choice = cpu_probe.llama_choice(default_gguf_path())
    assert choice.extra_bufts is False and not choice.cached


def test_vllm_on_a_cpu_whose_amx_faults_keeps_onednn_off_it_and_says_why(probe_cache, monkeypatch):
    """The oneDNN child runs where AMX is advertised: forced to die (this CPU has no AMX), the notes say
    so and ONEDNN_MAX_CPU_ISA keeps oneDNN off AMX; a CPU without avx512_bf16 is told its bfloat16 is
    emulated; this CPU's own line is put in the test log."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "unset")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")             # restored (absent) after the test
    amx = cpu_probe.Cpu("Intel(R) Xeon(R) Platinum 8480+", ("avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                            "amx_int8", "amx_bf16"))
    monkeypatch.setenv(cpu_probe.FAULT_ENV, "all")
    [note] = cpu_probe.vllm_cpu_notes("bfloat16", amx)
    assert "died by SIGSEGV" in note and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in note
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    [again] = cpu_probe.vllm_cpu_notes("bfloat16", amx)  # cached: no second child
    assert again == note
    avx2 = cpu_probe.Cpu("AMD EPYC 7B13", ("avx", "avx2", "fma"))
    [slow] = cpu_probe.vllm_cpu_notes("bfloat16", avx2)
    assert "bfloat16 is emulated" in slow
    here = cpu_probe.vllm_cpu_notes("bfloat16")
    warnings.warn(f"vLLM's CPU notes on the machine the suite runs on: {' / '.join(here)}", UserWarning,
                  stacklevel=1)
    assert here and cpu_probe.this_cpu().model in here[0]
