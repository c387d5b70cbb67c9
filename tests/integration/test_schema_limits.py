"""The output schema's limits at submit and in the worker's retries (issue 39, item 1), on the real
embedded PostgreSQL and the real CLI: a limit the engine cannot enforce while generating is one
line in the submit's JSON; a retried record is asked with its last error and another seed, and the
ledger records how each retry was asked."""

from __future__ import annotations

import json

import yaml

from batch_inference.cli import main as cli_main
from batch_inference.engines.noop import INVALID_OUTPUT_MARKER, NoopEngine
from batch_inference.plan import submit
from batch_inference.status import dead_letters
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, spec_dict, tickets

REVIEWS = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
    "required": ["sentiment", "rating", "summary"],
    "additionalProperties": False,
}


def test_submit_names_in_one_line_what_the_engine_cannot_enforce(conn, db_url, tmp_path, capsys, caplog):
    make_source(conn, tickets(4))
    path = tmp_path / "spec.yaml"
    for engine, expected in (("llama-cpp", "tags: uniqueItems"), ("vllm", "tags: uniqueItems")):
        data = spec_dict(engine={"name": engine}, output_schema=REVIEWS, dataset=f"reviews_{engine[:4]}",
                         model={"name": "m", "digest": "0" * 64, "path": str(tmp_path)})
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert cli_main(["--db", db_url, "submit", str(path)]) == 0
        [line] = capsys.readouterr().out.splitlines()   # stdout: the JSON line alone
        said = json.loads(line)["not_enforced"]
        assert said == (f"engine '{engine}' cannot enforce while generating: {expected}; an answer outside them "
                        "fails validation and is retried (then dead-lettered)")
        assert said in caplog.messages and "\n" not in said     # and a warning on stderr
    # Every limit enforced, or an engine that does not constrain decoding: nothing to say.
    enforced = {**REVIEWS, "properties": {k: v for k, v in REVIEWS["properties"].items() if k != "tags"}}
    assert submit(conn, make_spec(engine={"name": "llama-cpp"}, output_schema=enforced, dataset="reviews_ok",
                                  model={"name": "m", "digest": "0" * 64, "path": str(tmp_path)})).not_enforced is None
    assert submit(conn, make_spec(output_schema=REVIEWS, dataset="reviews_noop")).not_enforced is None


WRONG = ("output does not match the schema at (top level): ['noop: deliberately invalid output'] is not of "
         "type 'object'")


def test_a_retry_carries_the_last_error_and_another_seed_and_the_ledger_records_how(conn, db_url, monkeypatch):
    """A record whose answer fails validation every time: each retry is a new request (a repair turn
    naming the last error, the next seed), and its dead letter says how the last attempt was asked."""
    make_source(conn, [("bad", f"Ticket {INVALID_OUTPUT_MARKER}", None), ("good", "A fine ticket.", None)])
    job = submit(conn, make_spec(params={"seed": 7}, max_attempts=3)).job_version
    seen: list[tuple[str, int | None, list[dict[str, str]]]] = []
    generate = NoopEngine.generate

    def recording(self, requests, stop):
        for req in requests:
            seen.append((req.record_id, req.seed(self.spec.params.seed), req.messages))
        yield from generate(self, requests, stop)

    monkeypatch.setattr(NoopEngine, "generate", recording)
    cfg = WorkerConfig(job_version=job, db_url=db_url, backoff=(0.0,), wait_for_leases=False)
    assert run_worker(cfg) == 0
    asked = [(seed, messages) for rid, seed, messages in seen if rid == "bad"]
    assert [seed for seed, _ in asked] == [7, 8, 9]
    first, second, third = (messages for _, messages in asked)
    assert len(second) == len(first) + 2 and second[:len(first)] == first
    assert second[-2]["role"] == "assistant" and second[-2]["content"] == '["noop: deliberately invalid output"]'
    assert second[-1]["role"] == "user" and WRONG in second[-1]["content"]
    assert third[-1] == second[-1] and third != first
    [dead] = dead_letters(conn, job)
    assert dead["record_id"] == "bad" and dead["attempts"] == 3
    assert dead["reason"] == f"failed 3 attempts: {WRONG}"
    row = conn.execute("SELECT error FROM bi.dead_letters WHERE job_version = %s AND record_id = 'bad'",
                       (job,)).fetchone()
    assert row["error"].splitlines() == [WRONG,
                                        "retry: attempt 3, a repair turn naming the last error, seed offset 2"]
