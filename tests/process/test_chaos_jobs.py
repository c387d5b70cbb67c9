"""The chaos harness on the other jobs: a two-rung model ladder and an embedding job, each on real
worker processes under kills, stalls past the lease, preemption notices and a database restart; the
ladder's and the embedding job's own checks see the failures they are there to catch; and the
harness's new fields are checked like the others."""

from __future__ import annotations

import math
import random
import threading

import pytest

from batch_inference import db
from batch_inference.chaos import ChaosConfig, _spec, run_chaos
from batch_inference.engines import load_engine
from batch_inference.engines.base import Request
from batch_inference.engines.noop import SURE, UNSURE, is_unsure
from batch_inference.exceptions import InvalidValue
from batch_inference.harness.source import make_source
from batch_inference.plan import submit

SMALL = {"workers": 3, "faults": 24, "records": 800, "shard_size": 50, "db_restarts": 1, "duration": 240}


def passed_run(job: str) -> dict:
    """A small run of ``job`` that passes every check, with no duplicate, no stale write, nothing missing."""
    report = run_chaos(ChaosConfig(job=job, **SMALL))
    print(report.table())
    f = report.figures
    assert report.passed, report.table()
    assert f["duplicates"] == 0 and f["coverage"]["missing"] == 0 and f["stale_writes_accepted"] == {
        "never_held": 0, "after_epoch_ended": 0}
    assert f["faults"]["total"] >= SMALL["faults"] and f["unexpected_exits_total"] == 0
    return f


@pytest.mark.chaos
def test_ladder_chaos_run_leaves_one_final_answer_per_record_at_its_rung():
    f = passed_run("ladder")
    lad = f["ladder"]
    healthy = f["records"] - f["poison"]
    # every healthy record has one final answer, the one stored, at rung 2 exactly when rung 1 was unsure
    assert lad["final_by_rung"]["1"] + lad["final_by_rung"]["2"] == healthy
    assert lad["final_by_rung"]["2"] == lad["unsure_healthy"] > 0 and lad["records_at_wrong_rung"] == 0
    assert lad["escalated"] == lad["unsure_healthy"] + f["poison"] - 1          # the oversized one never ran
    assert lad["results_not_final"] == lad["results_without_final"] == lad["finals_not_stored"] == 0
    assert f["faults"]["by_kind"]["db_restart"] == 1


@pytest.mark.chaos
def test_embed_chaos_run_stores_every_vector_once_and_whole():
    f = passed_run("embed")
    assert f["embed"] == {"vectors": f["records"] - f["poison"], "malformed": 0}
    for d in f["poison_dead_letters"].values():   # an engine error and a vector one short: failed attempts
        assert (d["stage"], d["attempts"]) == (("plan", 0) if d["kind"] == "oversized" else ("worker", 3))


def test_chaos_config_checks_the_job_fields():
    with pytest.raises(InvalidValue, match=r"^chaos: job must be one of generate, ladder, embed, got 'judge'$"):
        ChaosConfig(job="judge")
    with pytest.raises(InvalidValue, match=r"^chaos: unsure rate must be between 0 and 1, got 1.5$"):
        ChaosConfig(job="ladder", unsure_rate=1.5)
    with pytest.raises(InvalidValue, match="job 'embed' runs on the noop engine's embedding mode, not engine "
                                           "'llama-cpp'"):
        ChaosConfig(job="embed", engine="llama-cpp", engine_options={})
    spec = _spec(ChaosConfig(job="ladder", unsure_rate=0.2))
    assert spec.engine.name == "ladder" and [m.threshold for m in spec.models] == [0.5, None]
    assert _spec(ChaosConfig(job="embed")).task == "embed"


def test_scored_noop_gives_its_answer_a_probability_and_the_embedder_a_vector():
    spec = _spec(ChaosConfig(job="ladder"))
    rung1 = load_engine(spec.models[0].engine.name, spec, {"unsure_rate": 0.5})
    rung1.want_logprobs = True
    ids = [f"r{i}" for i in range(40)]
    outs = list(rung1.generate([Request(r, [{"role": "user", "content": "hi"}]) for r in ids], threading.Event()))
    probs = [math.exp(o.logprobs[0][1]) for o in outs]
    assert probs == [pytest.approx(UNSURE if is_unsure(r, 0.5) else SURE) for r in ids]
    assert 0 < sum(is_unsure(r, 0.5) for r in ids) < 40 and outs[0].logprobs[0][0] == outs[0].text

    espec = _spec(ChaosConfig(job="embed"))
    emb = load_engine(espec.engine.name, espec)
    reqs = [Request(r, spec=espec, text=t) for r, t in
            [("a", "charged twice"), ("b", "charged twice"), ("c", "login loops"), ("d", "x [[invalid-output]]"),
             ("e", "x [[engine-error]]")]]
    a, b, c, d, e = emb.generate(reqs, threading.Event())
    assert len(a.vector) == 16 and a.vector == b.vector != c.vector and a.text is None
    assert len(d.vector) == 15 and e.error and e.vector is None


def test_chaos_checks_see_a_stale_rung_answer_and_a_result_that_is_not_the_final_one(conn):
    from batch_inference.chaos import _ladder_checks

    cfg = ChaosConfig(job="ladder")
    conn.execute(db.q("chaos_install"))
    poison = make_source(conn, 12, random.Random(0))
    job = submit(conn, _spec(cfg)).job_version
    q = lambda name, **p: conn.execute(db.q(name), {"job": job, **p}).fetchall()  # noqa: E731
    figures, checks = _ladder_checks(cfg, q, poison, set())
    stale = lambda: conn.execute(db.q("chaos_stale_writes"), {"job": job}).fetchone()  # noqa: E731
    assert figures["results_without_final"] == 0 and stale() == {"never_held": 0, "after_epoch_ended": 0}
    rid = next(r for r in ("r0000001", "r0000002", "r0000003") if r not in poison)
    # A rung answer no lease allowed, a final answer never stored, and a result that is not it.
    conn.execute("""INSERT INTO bi.ladder_answers (job_version, record_id, rung, output, valid, confidence, escalated,
                                                   worker_id, epoch) VALUES (%s, %s, 1, '{"category": "bug"}', true,
                                                   0.99, false, 'nobody', 7)""", (job, rid))
    figures, checks = _ladder_checks(cfg, q, poison, set())
    assert stale()["never_held"] == 1 and figures["finals_not_stored"] == 1
    conn.execute("""INSERT INTO bi.results (job_version, record_id, output, model_name, model_digest, prompt_version,
                                            transport, worker_id, epoch)
                    VALUES (%s, %s, '{"category": "billing"}', 'noop', 'x', 'v1', 'batch', 'nobody', 7)""", (job, rid))
    figures, checks = _ladder_checks(cfg, q, poison, set())
    assert figures["results_not_final"] == 1 and figures["finals_not_stored"] == 0
    failed = {c.name for c in checks if not c.ok}
    assert "each result is its one final rung answer" in failed, checks


def test_a_ladder_worker_whose_connection_drops_mid_ladder_write_reconnects_and_finishes(conn, db_url,
                                                                                       monkeypatch):
    """What the ladder's chaos run found: the worker's connection lost as it writes rung answers (a
    database restart) ended it with exit 2. The write now goes through the worker's reconnect-and-retry."""
    from batch_inference.ladder import audit
    from gpu_runner.worker import WorkerConfig, run_worker

    cfg = ChaosConfig(job="ladder", engine_options={})
    poison = make_source(conn, 40, random.Random(1))
    job = submit(conn, _spec(cfg)).job_version
    put, cut = audit.put, []

    def put_after_losing_the_connection(ledger, lease, rows):
        if not cut:   # the server ends the worker's session, as a restart does
            cut.append(conn.execute("SELECT pg_terminate_backend(%s) AS ok",
                                    (ledger.conn.info.backend_pid,)).fetchone()["ok"])
        return put(ledger, lease, rows)

    monkeypatch.setattr(audit, "put", put_after_losing_the_connection)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    assert cut == [True]
    finals = {r["record_id"]: r["rung"] for r in conn.execute(db.q("chaos_ladder_final_rungs"), {"job": job})}
    stored = {r["record_id"] for r in conn.execute("SELECT record_id FROM bi.results WHERE job_version = %s", (job,))}
    assert stored == set(finals) and len(stored) == 40 - len(poison)
    assert {r for r, rung in finals.items() if rung == 2} == {r for r in stored if is_unsure(r, cfg.unsure_rate)}
