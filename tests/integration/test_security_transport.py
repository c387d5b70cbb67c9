"""Security of what a worker sends and loads, tried as an attacker would.

Three classes, each against the real database and real worker processes:

* **hosted transports**: records of a class not cleared for hosted APIs must
  never reach an endpoint outside the company, whatever carries them (the
  openai engine in a batch worker, the fallback pool). A small real HTTP
  server on loopback, declared hosted in the spec, stands in for the hosted
  API and counts what reaches it; a worker that refuses must leave it at zero
  requests and claim nothing.
* **pinning**: every file of a model directory is in its digest, code files
  are refused unless the spec declares them, and engine options that change
  results either join the job version or are refused at run time. These run
  through ``verify_weights`` and the vllm engine's constructor, before any
  ``load()``: the refusal comes before vLLM would read a file (the real
  vLLM loads the pinned directory in ``tests/process/test_vllm*.py``).
* **dotted-path engines**: a module named in ``engine.name`` is imported only
  when the deployment allows it; a module that writes a marker file on import
  proves that a refused one never ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batch_inference.clearance import NotCleared, check_clearance, endpoint_is_hosted
from batch_inference.engines import engine_class, load_engine
from batch_inference.fallback import FallbackRefused, run_fallback
from batch_inference.pinning import CodeInModel, DigestMismatch, sha256_tree, verify_weights
from batch_inference.plan import submit
from batch_inference.spec import SpecError, load_spec
from batch_inference.exits import ExitCode
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_fallback import endpoint  # noqa: F401 - the fixture: a loopback OpenAI-compatible server

REPO = Path(__file__).resolve().parents[2]


def claims(conn, job: str) -> int:
    return int(conn.execute("SELECT coalesce(sum(claims), 0) AS n FROM bi.shards WHERE job_version = %s",
                            (job,)).fetchone()["n"])


def worker_process(db_url: str, job: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpu_runner", job, "--no-wait", *extra],
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url, **(env or {})},
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The worker's refusal: exactly one ERROR line and no traceback."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if " ERROR " in line or line.startswith("gpu_runner: error")]
    assert len(errors) == 1, out
    return errors[0]


def restricted_openai_spec(base_url: str, **over):
    return make_spec(record_class="restricted", engine={"name": "openai", "options": {"base_url": base_url}},
                     endpoints=[{"host": "127.0.0.1", "hosted": True}], **over)


# -- hosted transports ----------------------------------------------------------------


def test_worker_refuses_a_hosted_endpoint_for_a_restricted_job_and_sends_nothing(conn, db_url, endpoint):
    make_source(conn, tickets(20))
    job = submit(conn, restricted_openai_spec(endpoint.base_url)).job_version
    # In process, the endpoint from the spec.
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, max_shards=1)) == ExitCode.CONFIG
    # As a process, the endpoint given at run time (how LocalWorkersOperator passes options).
    proc = worker_process(db_url, job, "--engine-option", f"base_url={endpoint.base_url}")
    assert proc.returncode == ExitCode.CONFIG
    line = one_error_line(proc)
    assert "restricted" in line and "not cleared for hosted APIs" in line and "127.0.0.1" in line
    # A hostname nobody declared counts as hosted.
    proc = worker_process(db_url, job, "--engine-option", "base_url=https://api.example.invalid/v1")
    assert proc.returncode == ExitCode.CONFIG and "api.example.invalid" in one_error_line(proc)
    # The spec marks its fallback endpoint hosted: the batch engine at the same host is refused too.
    marked = submit(conn, make_spec(record_class="restricted", dataset="marked",
                                    engine={"name": "openai", "options": {"base_url": endpoint.base_url}},
                                    fallback={"hosted": True, "base_url": endpoint.base_url})).job_version
    assert run_worker(WorkerConfig(job_version=marked, db_url=db_url)) == ExitCode.CONFIG
    assert endpoint.hits == [] and claims(conn, job) == 0 and claims(conn, marked) == 0


def test_declaration_and_clearance_decide_not_the_address_alone(conn, db_url, endpoint):
    make_source(conn, tickets(5))
    # Loopback, not declared: internal, so a restricted job may use it.
    job = submit(conn, make_spec(record_class="restricted", engine={"name": "openai", "options": {
        "base_url": endpoint.base_url, "response_format_style": "json_object"}})).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    assert len(endpoint.hits) == 5
    # Declared hosted but the class is cleared: allowed.
    make_source(conn, tickets(3, start=50), table="public.tickets")
    job2 = submit(conn, restricted_openai_spec(endpoint.base_url, cleared_for_hosted=True,
                                               dataset="cleared_docs")).job_version
    assert run_worker(WorkerConfig(job_version=job2, db_url=db_url, wait_for_leases=False,
                                   engine_options={"base_url": endpoint.base_url,
                                                   "response_format_style": "json_object"})) == 0
    assert len(endpoint.hits) == 8


def test_fallback_pool_uses_the_same_rule(conn, db_url, endpoint):
    make_source(conn, tickets(10))
    job = submit(conn, restricted_openai_spec(endpoint.base_url)).job_version
    for hosted in (None, False):                 # a caller cannot declare a hosted endpoint internal
        with pytest.raises(FallbackRefused, match=r"^refused: job jv_\w+ holds record class 'restricted'.*127\.0\.0\.1"):
            run_fallback(db_url, job, endpoint.base_url, hosted=hosted, rate=50)
    with pytest.raises(FallbackRefused, match="not cleared for hosted APIs"):
        run_fallback(db_url, job, "https://api.example.invalid/v1", rate=50)
    assert endpoint.hits == [] and claims(conn, job) == 0
    assert conn.execute("SELECT mode FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["mode"] == "batch"


HOSTED = [
    "https://api.example.invalid/v1", "https://api.openai.com/v1", "http://vllm.ml.svc.cluster.local:8000/v1",
    "http://printer.local/v1", "http://llm.internal/v1", "http://8.8.8.8/v1", "http://172.32.0.1/v1",
    "http://100.64.0.1/v1", "http://[2001:db8::1]/v1", "http://[::ffff:8.8.8.8]/v1", "http://0x7f000001/v1",
    "http://2130706433/v1", "http://127.1/v1", "http://0.0.0.0/v1", "http://127.0.0.1.nip.io/v1",
    "http://localhost.example.com/v1", "http://gpu.localhost/v1", "http://127.0.0.1@api.example.invalid/v1",
    "http://10.0.0.1%2f@evil.example/v1", "http://10.0.0.1:80@evil.example/v1",
]
INTERNAL = [
    "http://127.0.0.1:8000/v1", "http://127.9.9.9/v1", "http://[::1]:8000/v1", "http://localhost:8000/v1",
    "HTTP://LocalHost./v1", "http://10.1.2.3/v1", "http://172.16.0.1/v1", "http://172.31.255.255/v1",
    "http://192.168.1.10:8000/v1", "http://169.254.10.10/v1", "http://[fe80::1]/v1", "http://[fd12:3456::1]/v1",
    "http://[fc00::1]/v1", "http://[::ffff:10.0.0.1]/v1", "http://api.example.invalid@10.0.0.1/v1",
]
MALFORMED = [
    "http://api.example.invalid\\@127.0.0.1/v1", "http://user:secret@10.0.0.1\\@x/v1", "ftp://10.0.0.1/v1",
    "10.0.0.1:8000/v1", "http:///v1", "http://10.0.0.1 .evil/v1", "http://10.0.0.1\n.evil/v1",
    "http://10.0.0.1\t.evil/v1", "http://[fe80::1%25eth0]/v1", "http://10.0.0.1:99999/v1", "http://10.0.0.1:x/v1",
    "file:///etc/passwd", "http://user:secret@[::1/v1",
]


@pytest.mark.parametrize("url", HOSTED)
def test_undeclared_public_addresses_and_hostnames_are_hosted(url):
    assert endpoint_is_hosted(make_spec(), url) is True
    with pytest.raises(NotCleared, match="not cleared for hosted APIs"):
        check_clearance(make_spec(record_class="restricted"), url)
    assert check_clearance(make_spec(cleared_for_hosted=True), url) is True


@pytest.mark.parametrize("url", INTERNAL)
def test_loopback_and_private_addresses_are_internal(url):
    assert endpoint_is_hosted(make_spec(), url) is False
    assert check_clearance(make_spec(record_class="restricted"), url) is False


def test_a_refusal_never_shows_the_password():
    with pytest.raises(NotCleared) as info:
        check_clearance(make_spec(record_class="restricted"), "https://bi:sk-secret@api.example.invalid/v1")
    assert "sk-secret" not in str(info.value) and "api.example.invalid" in str(info.value)


@pytest.mark.parametrize("url", MALFORMED)
def test_ambiguous_urls_are_refused_for_every_class(url):
    for spec in (make_spec(record_class="restricted"), make_spec(cleared_for_hosted=True)):
        with pytest.raises(NotCleared) as info:
            check_clearance(spec, url)
        assert "\n" not in str(info.value) and "secret" not in str(info.value)


def test_declarations_override_the_address():
    spec = make_spec(record_class="restricted", endpoints=[
        {"host": "127.0.0.1", "hosted": True}, {"host": "llm.corp.example", "hosted": False},
        {"host": "*.gpu.corp.example", "hosted": False}, {"host": "10.0.0.7", "hosted": True},
        {"host": "LOCALHOST", "hosted": True}])
    assert endpoint_is_hosted(spec, "http://127.0.0.1:9/v1") is True
    assert endpoint_is_hosted(spec, "http://localhost:9/v1") is True
    assert endpoint_is_hosted(spec, "http://10.0.0.7/v1") is True
    assert endpoint_is_hosted(spec, "http://10.0.0.8/v1") is False
    assert endpoint_is_hosted(spec, "http://LLM.corp.example./v1") is False
    assert endpoint_is_hosted(spec, "http://a.gpu.corp.example/v1") is False
    assert endpoint_is_hosted(spec, "http://gpu.corp.example/v1") is True          # the wildcard needs a label
    assert endpoint_is_hosted(spec, "http://evilgpu.corp.example/v1") is True
    assert endpoint_is_hosted(spec, "http://llm.corp.example.evil.com/v1") is True
    with pytest.raises(SpecError, match="endpoints"):
        make_spec(endpoints=[{"host": "http://x/y", "hosted": False}])
    with pytest.raises(SpecError, match="endpoints"):
        make_spec(endpoints=[{"host": "*.com", "hosted": False}, {"host": "a.b", "hosted": True}, {}])
    # fallback.hosted: true marks the fallback endpoint hosted whatever its address.
    fb = make_spec(record_class="restricted", fallback={"hosted": True, "base_url": "http://10.0.0.1/v1"})
    with pytest.raises(NotCleared):
        check_clearance(fb, "http://10.0.0.1/v1", hosted=fb.fallback.hosted)


# -- pinning -----------------------------------------------------------------------------


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "tokenizer").mkdir(parents=True)
    (d / "model-00001-of-00002.safetensors").write_bytes(b"w1" * 1000)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"w2" * 1000)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "generation_config.json").write_text('{"temperature": 0.6}')
    (d / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (d / "tokenizer" / "special_tokens_map.json").write_text("{}")
    return d


def vllm_spec(path: Path, **over):
    return make_spec(**{"model": {"name": "m", "digest": sha256_tree(path), "path": str(path)},
                        "engine": {"name": "vllm"}, **over})


@pytest.mark.slow   # builds vLLM's engine (imports vllm and torch)
def test_model_directory_digest_is_every_file_by_relative_path(tmp_path):
    d = model_dir(tmp_path)
    # Anyone can pin a directory with standard tools.
    shell = subprocess.run("find . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum",
                           shell=True, cwd=d, capture_output=True, text=True, check=True)
    assert sha256_tree(d) == shell.stdout.split()[0]
    spec = vllm_spec(d)
    engine = load_engine("vllm", spec)
    assert verify_weights(engine, spec) == spec.model.digest
    for name, change in [("tokenizer_config.json", '{"chat_template": "ignore the system turn"}'),
                         ("config.json", '{"architectures": ["Other"]}'),
                         ("generation_config.json", '{"temperature": 1.5}'),
                         ("tokenizer/special_tokens_map.json", '{"eos": "x"}')]:
        before = (d / name).read_text()
        (d / name).write_text(change)
        with pytest.raises(DigestMismatch, match="digest mismatch"):
            verify_weights(load_engine("vllm", spec), spec)
        (d / name).write_text(before)
    (d / "chat_template.jinja").write_text("{{ evil }}")               # an added file
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        verify_weights(load_engine("vllm", spec), spec)
    (d / "chat_template.jinja").unlink()
    (d / "config.json").rename(d / "tokenizer" / "config.json")         # a moved file
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        verify_weights(load_engine("vllm", spec), spec)


@pytest.mark.parametrize("code", ["modeling_evil.py", "sub/__init__.py", "kernels/attn.so", "kernels/attn.so.1",
                                  "x.pyc", "lib.dylib", "a.pyd", "run.sh"])
def test_code_in_a_model_directory_is_refused_unless_declared(tmp_path, code):
    d = model_dir(tmp_path)
    (d / code).parent.mkdir(parents=True, exist_ok=True)
    (d / code).write_text("open('/tmp/pwned', 'w')")
    with pytest.raises(CodeInModel, match=f"code file '{code}'.*model.code_files"):
        sha256_tree(d)
    digest = sha256_tree(d, allowed_code=[code])
    spec = make_spec(model={"name": "m", "digest": digest, "path": str(d), "code_files": [code]},
                     engine={"name": "vllm"})
    assert verify_weights(load_engine("vllm", spec), spec) == digest
    # The digest alone is not a declaration.
    undeclared = make_spec(model={"name": "m", "digest": digest, "path": str(d)}, engine={"name": "vllm"})
    with pytest.raises(CodeInModel):
        verify_weights(load_engine("vllm", undeclared), undeclared)


def test_links_and_special_files_in_a_model_directory(tmp_path):
    d = model_dir(tmp_path)
    outside = tmp_path / "evil.py"
    outside.write_text("import os")
    (d / "looks_fine.json").symlink_to(outside)                     # a link to code is code
    with pytest.raises(CodeInModel):
        sha256_tree(d)
    (d / "looks_fine.json").unlink()
    os.mkfifo(d / "pipe.json")                                       # would hang a reader
    with pytest.raises(DigestMismatch, match="not a regular file"):
        sha256_tree(d)
    (d / "pipe.json").unlink()
    (d / "loop").symlink_to(d, target_is_directory=True)             # a directory loop
    with pytest.raises(DigestMismatch, match="loop"):
        sha256_tree(d)


def test_worker_refuses_a_changed_tokenizer_before_any_claim(conn, db_url, tmp_path):
    d = model_dir(tmp_path)
    make_source(conn, tickets(5))
    job = submit(conn, vllm_spec(d)).job_version
    (d / "tokenizer_config.json").write_text('{"chat_template": "changed"}')
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == ExitCode.DIGEST
    (d / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (d / "modeling_x.py").write_text("print('hi')")
    proc = worker_process(db_url, job)
    assert proc.returncode == ExitCode.DIGEST and "modeling_x.py" in one_error_line(proc)
    assert claims(conn, job) == 0


VLLM_RUNTIME_REFUSED = [
    {"trust_remote_code": True}, {"dtype": "float16"}, {"quantization": "fp8"}, {"max_model_len": 128},
    {"kv_cache_dtype": "fp8"}, {"llm_kwargs": {"trust_remote_code": True}}, {"llm_kwargs": {"model": "/elsewhere"}},
    {"llm_kwargs": {"tokenizer": "/elsewhere"}}, {"llm_kwargs": {"load_format": "pt"}},
    {"llm_kwargs": {"hf_overrides": {"rope_theta": 1}}}, {"model": "/elsewhere"}, {"tokenizer": "/elsewhere"},
    {"revision": "main"}, {"llm_kwargs": {"revision": "main"}}, {"llm_kwargs": {"seed": 1}},
]


@pytest.mark.parametrize("options", VLLM_RUNTIME_REFUSED)
def test_vllm_options_that_change_results_are_refused_at_run_time(tmp_path, options):
    """Without vllm installed: the refusal is in the engine's constructor, before ``load()``."""
    spec = vllm_spec(model_dir(tmp_path))
    with pytest.raises(ValueError, match=r"^engine 'vllm': option '[\w.]+' "):
        load_engine("vllm", spec, options)


def test_vllm_result_options_join_the_job_version(tmp_path):
    d = model_dir(tmp_path)
    plain = vllm_spec(d)
    pinned = vllm_spec(d, engine={"name": "vllm", "options": {"dtype": "bfloat16", "max_model_len": 4096,
                                                              "tensor_parallel_size": 2}})
    assert plain.spec_hash != pinned.spec_hash
    # Performance options do not change the version.
    assert vllm_spec(d, engine={"name": "vllm", "options": {"tensor_parallel_size": 4}}).spec_hash == plain.spec_hash
    # The pinned values may be repeated at run time; other options may change.
    engine = load_engine("vllm", pinned, {"dtype": "bfloat16", "max_model_len": 4096, "tensor_parallel_size": 8})
    from batch_inference.engines.vllm import build_llm_kwargs

    kwargs = build_llm_kwargs(pinned, engine.options)
    assert kwargs["dtype"] == "bfloat16" and kwargs["load_format"] == "safetensors" and kwargs["model"] == str(d)
    with pytest.raises(ValueError, match="option 'dtype' changes results"):
        load_engine("vllm", pinned, {"dtype": "float16"})
    # A pinned option left out at run time (--engine-option replaces the spec's options) keeps its pinned value.
    assert load_engine("vllm", pinned, {"max_model_len": 4096}).options["dtype"] == "bfloat16"
    # Options that are never allowed, even in the spec.
    for bad in ({"model": "org/other"}, {"llm_kwargs": {"load_format": "pt"}}, {"revision": "v2"}):
        spec = vllm_spec(d, engine={"name": "vllm", "options": bad})
        with pytest.raises(ValueError, match="is refused"):
            load_engine("vllm", spec)


def test_worker_refuses_trust_remote_code_at_run_time_before_any_claim(conn, db_url, tmp_path):
    make_source(conn, tickets(5))
    job = submit(conn, vllm_spec(model_dir(tmp_path))).job_version
    proc = worker_process(db_url, job, "--engine-option", "trust_remote_code=true")
    assert proc.returncode == ExitCode.CONFIG and "trust_remote_code" in one_error_line(proc)
    assert claims(conn, job) == 0


def test_llama_cpp_and_openai_result_options(tmp_path, conn, db_url, endpoint):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    llama = make_spec(model={"name": "m", "digest": hashlib.sha256(b"GGUF").hexdigest(), "path": str(gguf)},
                      engine={"name": "llama-cpp", "options": {"n_ctx": 4096}})
    assert llama.spec_hash != make_spec(model=llama.model.model_dump(), engine={"name": "llama-cpp"}).spec_hash
    assert load_engine("llama-cpp", llama, {"n_ctx": 4096, "n_threads": 1}).llama_kwargs()["n_ctx"] == 4096
    for options, what in [({"n_ctx": 512}, "changes results"), ({"chat_format": "chatml", "n_ctx": 4096}, "changes results"),
                          ({"model_path": "/tmp/other.gguf", "n_ctx": 4096}, "is refused")]:
        with pytest.raises(ValueError, match=f"^engine 'llama-cpp': option '\\w+' {what}"):
            load_engine("llama-cpp", llama, options)
    assert verify_weights(load_engine("llama-cpp", llama), llama) == llama.model.digest

    spec = make_spec(engine={"name": "openai", "options": {"base_url": endpoint.base_url}})
    for options in ({"base_url": endpoint.base_url, "model": "gpt-other"},
                    {"base_url": endpoint.base_url, "extra_body": {"top_k": 1}}):
        with pytest.raises(ValueError, match="changes results"):
            load_engine("openai", spec, options)
    assert load_engine("openai", spec, {"base_url": endpoint.base_url, "model": spec.model.name}).model == spec.model.name
    bodied = make_spec(engine={"name": "openai", "options": {"base_url": endpoint.base_url,
                                                             "extra_body": {"messages": []}}})
    with pytest.raises(ValueError, match="extra_body.*messages"):
        load_engine("openai", bodied)
    # The hosted Batch API engine builds the same body: the same refusal (the model is pinned by the spec).
    hosted = make_spec(cleared_for_hosted=True, engine={"name": "openai-batch", "options": {
        "base_url": endpoint.base_url, "extra_body": {"model": "gpt-other"}}})
    with pytest.raises(ValueError, match="engine 'openai-batch': option 'extra_body.model' is refused"):
        load_engine("openai-batch", hosted)
    assert make_spec(engine={"name": "openai", "options": {"model": "x"}}).spec_hash != make_spec().spec_hash
    # The fallback pool's --model is the same option.
    make_source(conn, tickets(4))
    job = submit(conn, make_spec()).job_version
    with pytest.raises(FallbackRefused, match="option 'model' changes results"):
        run_fallback(db_url, job, endpoint.base_url, model="gpt-other", rate=50)
    assert endpoint.hits == []


def test_versions_of_specs_without_result_options_are_unchanged():
    demo = load_spec(REPO / "plugins/batch_inference/data/tickets_spec.yaml")
    assert demo.spec_hash == "3f9724507ae4432755a9d5e3b3cc29bb80c31d12b5830387d8bfb272c17af995"
    assert make_spec().spec_hash == "b18a8ef7ef60cd8b4e84d505e1b4eba19d28057211ea1cbe7e24148f3b54356d"
    assert make_spec(engine={"name": "vllm", "options": {"tensor_parallel_size": 2}}).spec_hash == make_spec().spec_hash


# -- dotted-path engines -------------------------------------------------------------------


@pytest.fixture
def evil_modules(tmp_path, monkeypatch):
    """Modules that write a marker file when imported."""
    marker = tmp_path / "imported"
    code = (f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
            "from batch_inference.engines.noop import NoopEngine\n"
            "class Engine(NoopEngine):\n    name = 'evil'\n"
            "NotAnEngine = object\n")
    lib = tmp_path / "lib"
    (lib / "evil_pkg" / "sub").mkdir(parents=True)
    (lib / "evil_engine.py").write_text(code)
    (lib / "evil_pkg" / "__init__.py").write_text(code)
    (lib / "evil_pkg" / "sub" / "__init__.py").write_text(code)
    (lib / "batch_inference_evil.py").write_text(code)
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.delenv("BATCH_INFERENCE_ENGINE_MODULES", raising=False)
    monkeypatch.delenv("AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES", raising=False)
    for name in ("evil_engine", "evil_pkg", "evil_pkg.sub", "batch_inference_evil"):
        sys.modules.pop(name, None)
    yield lib, marker
    for name in ("evil_engine", "evil_pkg", "evil_pkg.sub", "batch_inference_evil"):
        sys.modules.pop(name, None)


REFUSED_NAMES = ["evil_engine:Engine", "evil_engine.Engine", "evil_pkg.sub:Engine", "evil_pkg:Engine",
                 "batch_inference_evil:Engine", "evil_engine:", ":Engine", "..evil_engine:Engine",
                 "evil_engine :Engine", "evil-engine:Engine", "evil_engine:Engine.__init__"]


@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_a_dotted_path_is_refused_before_import(evil_modules, name):
    _, marker = evil_modules
    with pytest.raises(ValueError) as info:
        engine_class(name)
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_the_allow_list_names_modules_and_packages(evil_modules, monkeypatch):
    _, marker = evil_modules
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "evil_pkg.sub, other")
    for name in ("evil_engine:Engine", "evil_pkg:Engine"):          # neither the parent nor a sibling
        with pytest.raises(ValueError, match="not in the allowed engine modules"):
            engine_class(name)
    assert not marker.exists()
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "evil")    # a prefix is not a package
    with pytest.raises(ValueError, match="not in the allowed engine modules"):
        engine_class("evil_engine:Engine")
    assert not marker.exists()
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "evil_engine")
    assert engine_class("evil_engine:Engine").name == "evil"
    with pytest.raises(ValueError, match="not a subclass"):
        engine_class("evil_engine:NotAnEngine")
    monkeypatch.delenv("BATCH_INFERENCE_ENGINE_MODULES")
    monkeypatch.setenv("AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES", "evil_pkg")   # [batch_inference] option
    assert engine_class("evil_pkg.sub:Engine").name == "evil"
    # The provider's own modules and the built-in names need no setting.
    monkeypatch.delenv("AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES")
    assert engine_class("batch_inference.engines.noop:NoopEngine").name == "noop"
    assert engine_class("noop").name == "noop"


def test_worker_refuses_a_dotted_engine_before_import(conn, db_url, evil_modules):
    lib, marker = evil_modules
    make_source(conn, tickets(5))
    # A submit resolves a dotted path, so here (module not allowed) it is refused before any import ...
    evil = make_spec(engine={"name": "evil_engine:Engine"})
    with pytest.raises(SpecError, match="'evil_engine' is not in the allowed engine modules"):
        submit(conn, evil)
    assert not marker.exists()
    # ... and a version submitted where the deployment allowed it still meets this worker's own check.
    job = submit(conn, make_spec()).job_version
    text = json.dumps(evil.model_dump(mode="json"))
    conn.execute("UPDATE bi.jobs SET spec = %s::jsonb, spec_text = %s WHERE job_version = %s", (text, text, job))
    env = {"PYTHONPATH": f"{lib}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "BATCH_INFERENCE_ENGINE_MODULES": ""}
    proc = worker_process(db_url, job, env=env)                       # from the spec
    assert proc.returncode == ExitCode.CONFIG and "evil_engine" in one_error_line(proc)
    proc = worker_process(db_url, job, "--engine", "evil_pkg.sub:Engine", env=env)   # from the command line
    assert proc.returncode == ExitCode.CONFIG and "evil_pkg.sub" in one_error_line(proc)
    # The chaos wrapper's inner engine goes through the same check.
    proc = worker_process(db_url, job, "--engine", "batch_inference.chaos:CountingEngine", "--engine-option",
                          "inner=evil_engine:Engine", "--engine-option", f"count_dir={lib}", env=env)
    assert proc.returncode == ExitCode.CONFIG and "evil_engine" in one_error_line(proc)
    assert not marker.exists() and claims(conn, job) == 0
