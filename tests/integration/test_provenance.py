"""Which engine made each result (the real embedded PostgreSQL, in-process workers).

Every result row records its engine and that engine's endpoint class next to
its transport; a worker refuses an engine that cannot serve the spec's pinned
model before it claims anything; validate counts rows by engine, endpoint
class and transport and fails a version whose rows came from an engine the
spec does not allow (batch_inference.provenance).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from batch_inference.engines import load_engine
from batch_inference.engines.base import Engine, Outcome, Request
from batch_inference.exits import ExitCode
from batch_inference.ledger import Ledger
from batch_inference.plan import submit
from batch_inference.provenance import endpoint_class, made_by, row_refusal
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets

OUT = '{"category": "billing", "summary": "charged twice"}'


class _Fixed(Engine):
    """Answers every record with OUT."""

    name = "fixed"

    def load(self) -> None:
        pass

    def generate(self, requests: Sequence[Request], stop: threading.Event) -> Iterator[Outcome]:
        for r in requests:
            yield Outcome(r.record_id, OUT)


class UndeclaredEngine(_Fixed):
    """A dotted-path engine that does not say which model it serves."""


class DeclaredEngine(_Fixed):
    serves_models = ("noop",)


class RemoteEngine(_Fixed):
    serves_models = ("noop",)
    endpoint = "internal"


def rows_by_engine(conn, job: str) -> list[tuple]:
    return [tuple(r.values()) for r in conn.execute(
        "SELECT engine, endpoint, transport, count(*) FROM bi.results WHERE job_version = %s "
        "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3", (job,))]


def new_job(conn, n: int = 20, **spec_over) -> str:
    make_source(conn, tickets(n))
    return submit(conn, make_spec(**spec_over)).job_version


def work(db_url: str, job: str, engine: str | None = None) -> int:
    return run_worker(WorkerConfig(job_version=job, db_url=db_url, engine=engine, wait_for_leases=False,
                                   backoff=(0.0, 0.0, 0.0), flush_seconds=0.2))


def test_every_row_records_its_engine_and_endpoint_class(db_url, conn):
    job = new_job(conn)
    assert work(db_url, job) == ExitCode.OK
    assert rows_by_engine(conn, job) == [("noop", "local", "batch", 20)]
    report = validate(conn, job)
    assert report.passed, report.failures
    assert report["schema"]["engines"] == [{"engine": "noop", "endpoint": "local", "transport": "batch",
                                            "rows": 20, "allowed": True}]


def test_the_noop_engine_is_refused_for_a_real_model(db_url, conn):
    # A spec that pins the llama.cpp demo model: `worker JOB --engine noop` (or a DAG's
    # engine param) used to write placeholder outputs under this real job version.
    job = new_job(conn, engine={"name": "llama-cpp"})
    assert work(db_url, job, engine="noop") == ExitCode.CONFIG
    assert rows_by_engine(conn, job) == []
    assert conn.execute("SELECT sum(claims) AS n FROM bi.shards WHERE job_version = %s",
                        (job,)).fetchone()["n"] == 0
    reason = conn.execute("SELECT halt_reason FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["halt_reason"]
    assert "placeholder outputs" in reason and "'llama-cpp'" in reason


def test_a_dotted_path_engine_runs_only_the_models_it_declares(db_url, conn):
    job = new_job(conn)
    mod = __name__
    assert work(db_url, job, engine=f"{mod}:UndeclaredEngine") == ExitCode.CONFIG
    assert rows_by_engine(conn, job) == []
    conn.execute("UPDATE bi.jobs SET halted_at = NULL, halt_reason = NULL WHERE job_version = %s", (job,))
    assert work(db_url, job, engine=f"{mod}:DeclaredEngine") == ExitCode.OK
    assert rows_by_engine(conn, job) == [(f"{mod}:DeclaredEngine", "local", "batch", 20)]
    assert validate(conn, job).passed

    other = new_job(conn, model={"name": "smollm2", "digest": "1" * 64}, prompt={"version": "v2"})
    assert "does not declare that it serves model 'smollm2'" in row_refusal(make_spec(model={"name": "smollm2"}),
                                                                          f"{mod}:DeclaredEngine")
    assert work(db_url, other, engine=f"{mod}:DeclaredEngine") == ExitCode.CONFIG


def test_validate_fails_rows_from_an_engine_the_spec_does_not_allow(db_url, conn):
    job = new_job(conn, n=10, engine={"name": "llama-cpp"}, shard_size=5)
    good = Ledger(conn, job, "w-a", engine="llama-cpp", endpoint="local")
    placeholder = Ledger(conn, job, "w-b", engine="noop", endpoint="local")
    for lg in (good, placeholder):
        lease = lg.claim()
        ids = [r["record_id"] for r in lg.records(lease)]
        assert lg.put_results(lease, ids, [OUT] * len(ids), ["billing"] * len(ids)) == 5
        assert lg.complete(lease) == "done"
    report = validate(conn, job)
    assert not report.passed
    [failure] = [f for f in report.failures if f.startswith("engine:")]
    assert "5 stored output(s) came from engine 'noop'" in failure and "placeholder outputs" in failure
    assert report["schema"]["engines"] == [
        {"engine": "llama-cpp", "endpoint": "local", "transport": "batch", "rows": 5, "allowed": True},
        {"engine": "noop", "endpoint": "local", "transport": "batch", "rows": 5, "allowed": False}]


def test_reused_rows_keep_the_engine_that_made_them(db_url, conn):
    job = new_job(conn, incremental=True)
    assert work(db_url, job) == ExitCode.OK
    assert validate(conn, job).passed
    make_source(conn, tickets(20) + tickets(2, start=100))
    nxt = submit(conn, make_spec(incremental=True)).job_version
    assert rows_by_engine(conn, nxt) == [("noop", "local", "reused", 20)]


def test_endpoint_classes():
    spec = make_spec(endpoints=[{"host": "llm.corp.example", "hosted": False}])
    assert made_by(spec, load_engine("noop", spec)) == ("noop", "local")
    assert endpoint_class(load_engine("openai", spec, {"base_url": "http://127.0.0.1:9/v1"})) == "internal"
    assert endpoint_class(load_engine("openai", spec, {"base_url": "https://llm.corp.example/v1"})) == "internal"
    cleared = make_spec(cleared_for_hosted=True)
    assert endpoint_class(load_engine("openai", cleared, {"base_url": "https://api.openai.com/v1"})) == "hosted"
    assert endpoint_class(RemoteEngine(spec)) == "internal"
    with pytest.raises(ValueError, match="placeholder outputs"):
        made_by(make_spec(engine={"name": "openai"}), load_engine("noop", spec))
