"""Model outputs PostgreSQL or UTF-8 cannot hold, tried as a hostile endpoint would send them.

Each vector is one record of a real job, run by a real worker process
(``python -m gpu_runner``) against the real database. The engine is the
openai engine talking to a loopback HTTP server that answers in the
chat-completions wire shape, with the body's bytes written by hand (so a
lone surrogate can arrive as a JSON escape, as raw CESU-8 bytes, or an
invalid UTF-8 byte can arrive at all); the same vectors also come from an
engine that hands the worker Python strings directly, as llama.cpp and vLLM
do. Every vector must be one failed attempt with a readable reason and the
raw output kept, escaped, while the healthy records are stored and the
worker exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from batch_inference.engines.base import Engine, Outcome, Request
from batch_inference.outputs import check_for_storage, storable_text
from batch_inference.plan import submit
from batch_inference.status import dead_letters, job_counts
from tests.conftest import SCHEMA, make_source, make_spec
from tests.fixtures.chat_server import ChatServer

REPO = Path(__file__).resolve().parents[2]

# The ticket schema plus an optional number, so a number jsonb refuses can pass the schema.
NUMBER_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "score": {"type": "number"},
                                         "count": {"type": "integer"}}}
GOOD = '{"category": "bug", "summary": "fine"}'


def _wire(text: str) -> bytes:
    """``text`` as the body of a JSON string, the way a server's encoder writes it."""
    return json.dumps(text)[1:-1].encode("utf-8", "surrogatepass")


# name -> (the content string's bytes on the wire, what the reason must say, what the raw output must hold)
WIRE: dict[str, tuple[bytes, str, str]] = {
    # A lone high surrogate as a JSON escape on the wire: the model's text holds the raw character.
    "surrogate_raw": (_wire('{"category": "bug", "summary": "a\ud800b"}'), "lone surrogate", "\\ud800"),
    # The same character as CESU-8 bytes (ED A0 80): json.loads(bytes) decodes them with surrogatepass.
    "surrogate_cesu_bytes": (_wire('{"category": "bug", "summary": "a') + b"\xed\xa0\x80"
                             + _wire('b"}'), "lone surrogate", "\\ud800"),
    # The model wrote the escape itself: json.loads makes a lone surrogate of it, jsonb refuses it.
    "surrogate_json_escape": (_wire('{"category": "bug", "summary": "a\\ud800b"}'), "lone surrogate", "\\ud800"),
    "low_surrogate_raw": (_wire('{"category": "bug", "summary": "\udc00"}'), "lone surrogate", "\\udc00"),
    "low_surrogate_escape": (_wire('{"category": "bug", "summary": "\\udc00"}'), "lone surrogate", "\\udc00"),
    # A high surrogate escape followed by something that is not a low one.
    "broken_pair_escape": (_wire('{"category": "bug", "summary": "\\ud800\\u0041"}'), "lone surrogate", "\\ud800"),
    "nul_json_escape": (_wire('{"category": "bug", "summary": "a\\u0000b"}'), "NUL", "\\u0000"),
    # A raw NUL inside the model's string (a control character: accepted leniently, then refused).
    "nul_raw": (_wire('{"category": "bug", "summary": "a\x00b"}'), "NUL", "\\x00"),
    "nul_outside_json": (_wire('{"category": "bug", "summary": "ok"}\x00'), "not valid JSON", "\\x00"),
    # Bytes that are not UTF-8 at all.
    "invalid_utf8": (_wire('{"category": "bug", "summary": "a') + b"\xff\xfe"
                     + _wire('b"}'), "not valid UTF-8", "\\udcff"),
    # Numbers Python parses and jsonb refuses ("value overflows numeric format"), or Python cannot parse.
    "numeric_tiny": (_wire('{"category": "bug", "summary": "x", "score": 1e-20000}'), "out of range", "1e-20000"),
    "numeric_scale": (_wire('{"category": "bug", "summary": "x", "score": 0.' + "0" * 16383 + '1}'),
                      "out of range", "0.000"),
    "numeric_huge_int": (_wire('{"category": "bug", "summary": "x", "count": ' + "9" * 5000 + "}"),
                         "digits", "9999"),
    # Not text at all.
    "content_number": (b"", "not text", "12345"),
    # Far past the schema's maxLength.
    "overlong": (_wire('{"category": "bug", "summary": "' + "x" * 1_000_000 + '"}'), "too long", "xxxx"),
}


def answer(body: dict) -> tuple[int, dict, bytes]:
    """The vector the record's text names (``vec:NAME``), else a good output, as raw chat-completions bytes
    (the vectors are bytes no JSON encoder would write)."""
    user = body["messages"][-1]["content"]
    name = next((n for n in (*WIRE, "truncated_surrogate", "error_surrogate") if f"vec:{n}." in user), None)
    finish = "stop"
    if name == "error_surrogate":          # an error message PostgreSQL cannot hold either
        return 400, {}, b'{"error": {"message": "bad request \\ud800 \\u0000 here"}}'
    if name == "content_number":
        content = b"12345"
    elif name == "truncated_surrogate":      # cut off at the token cap, mid-surrogate
        content, finish = b'"' + _wire('{"category": "bug", "summary": "a\ud800') + b'"', "length"
    elif name is not None:
        content = b'"' + WIRE[name][0] + b'"'
    else:
        content = b'"' + _wire(GOOD) + b'"'
    return 200, {}, (b'{"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "'
                     + finish.encode() + b'", "message": {"role": "assistant", "content": ' + content
                     + b'}}], "usage": {"completion_tokens": 9}}')


@pytest.fixture
def endpoint():
    srv = ChatServer(answer)
    yield srv
    srv.close()


EXTRA = {"truncated_surrogate": ("truncated", "\\ud800"), "error_surrogate": ("HTTP 400", None)}


def _job(conn, names: Sequence[str], healthy: int = 4) -> str:
    rows = [(f"r{i:02d}", f"Ticket vec:{n}. Please help.", ["t"]) for i, n in enumerate(names)]
    rows += [(f"ok{i}", "Ticket: charged twice.", ["t"]) for i in range(healthy)]
    make_source(conn, rows)
    spec = make_spec(output_schema=NUMBER_SCHEMA, max_attempts=1, shard_size=100,
                     params={"max_tokens": 64})
    return submit(conn, spec).job_version


def _worker(db_url: str, job: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.run([sys.executable, "-m", "gpu_runner", job, "--no-wait", "--flush-every", "5", *extra],
                          env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO))


def _expectations() -> dict[str, tuple[str, str | None]]:
    return {**{n: (why, raw) for n, (_b, why, raw) in WIRE.items()}, **EXTRA}


def _assert_each_vector_failed_once(conn, job: str, proc: subprocess.CompletedProcess, names: Sequence[str]):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    expect = _expectations()
    dl = {d["record_id"]: d for d in dead_letters(conn, job)}
    by_name = {n: dl.get(f"r{i:02d}") for i, n in enumerate(names)}
    missing = [n for n, d in by_name.items() if d is None]
    assert not missing, f"not dead-lettered: {missing}"
    for n, d in by_name.items():
        why, raw = expect[n]
        assert d["attempts"] == 1, (n, d["stage"], d["reason"])
        assert "worker died" not in d["reason"], (n, d["reason"])
        assert why.lower() in d["reason"].lower(), (n, d["reason"])
        assert len(d["reason"]) <= 400 and "\n" not in d["reason"], (n, d["reason"])
        if raw is not None:
            assert d["raw_output"] and raw in d["raw_output"], (n, (d["raw_output"] or "")[:200])
    c = job_counts(conn, job)
    assert c["stored"] == 4 and c["outstanding"] == 0, c
    crashes = conn.execute("SELECT coalesce(sum(lost_leases), 0) AS n FROM bi.shards WHERE job_version = %s",
                           (job,)).fetchone()["n"]
    assert crashes == 0


def test_every_unstorable_output_from_an_http_endpoint_is_one_failed_attempt(conn, db_url, endpoint):
    names = [*WIRE, *EXTRA]
    job = _job(conn, names)
    proc = _worker(db_url, job, "--engine", "openai", "--engine-option", f"base_url={endpoint.base_url}",
                   "--engine-option", "max_retries=0", "--engine-option", "response_format_style=json_object")
    _assert_each_vector_failed_once(conn, job, proc, names)


def _python_text(wire: bytes) -> str:
    """The model's text for a wire vector: the JSON string body decoded as a server's client would."""
    return json.loads(b'"' + wire + b'"') if b"\xff" not in wire else \
        json.loads((b'"' + wire + b'"').decode("utf-8", "surrogateescape"))


def test_every_unstorable_output_from_an_in_process_engine_is_one_failed_attempt(conn, db_url):
    names = list(WIRE)
    job = _job(conn, names)
    proc = _worker(db_url, job, "--engine", "tests.integration.test_security_outputs:TextEngine")
    _assert_each_vector_failed_once(conn, job, proc, names)


class TextEngine(Engine):
    """The model's text for each vector as a Python string (what llama.cpp's and vLLM's bindings return)."""

    name = "text-vectors"
    serves_models = ("noop",)   # the test specs' model (batch_inference.provenance)

    def load(self) -> None:
        pass

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for req in requests:
            user = req.messages[-1]["content"]
            name = next((n for n in WIRE if f"vec:{n}." in user), None)
            if name is None:
                yield Outcome(req.record_id, GOOD)
            elif name == "content_number":
                yield Outcome(req.record_id, 12345)  # type: ignore[arg-type] - what a broken binding returns
            else:
                yield Outcome(req.record_id, _python_text(WIRE[name][0]))


@pytest.mark.parametrize("name", list(WIRE))
def test_the_check_refuses_each_vector_with_a_reason(name):
    spec = make_spec(output_schema=NUMBER_SCHEMA)
    text = 12345 if name == "content_number" else _python_text(WIRE[name][0])
    obj, stored, reason = check_for_storage(spec, text)  # type: ignore[arg-type]
    assert obj is None and stored is None and reason and WIRE[name][1].lower() in reason.lower()
    kept = storable_text(text)
    assert kept is not None and WIRE[name][2] in kept
    kept.encode("utf-8")              # UTF-8 can hold it
    assert "\x00" not in kept         # and so can PostgreSQL's text


def test_a_batch_the_database_refuses_is_split_and_only_the_bad_record_fails(conn, db_url):
    """A write PostgreSQL refuses with a data error (here a real trigger on the
    results table refusing one record's output) fails that record, with its
    raw output, and stores the rest of its batch: the worker does not die."""
    job = _job(conn, [], healthy=12)
    conn.execute("""
        CREATE FUNCTION public.refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.record_id = 'ok3' THEN
                RAISE EXCEPTION 'value overflows numeric format' USING ERRCODE = '22003';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_one BEFORE INSERT ON bi.results FOR EACH ROW EXECUTE FUNCTION public.refuse_one();
    """)
    proc = _worker(db_url, job, "--engine", "tests.integration.test_security_outputs:TextEngine")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    dl = dead_letters(conn, job)
    assert [d["record_id"] for d in dl] == ["ok3"]
    assert "cannot be stored" in dl[0]["reason"] and "overflows numeric format" in dl[0]["reason"]
    assert dl[0]["raw_output"] == GOOD
    assert job_counts(conn, job)["stored"] == 11
