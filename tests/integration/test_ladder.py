"""The model ladder on the real ledger with engines of known quality (benchmarks.ladder.KnownEngine,
loaded by dotted path): calibrate, submit, an in-process worker, validate, publish; what each
rung answered in bi.ladder_answers; bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import threading

import pytest
from psycopg.types.json import Jsonb

from batch_inference.cli import main as cli_main
from batch_inference.engines.base import build_request
from batch_inference.exceptions import InvalidValue, SpecError
from batch_inference.ladder import audit
from batch_inference.ladder.calibrate import calibrate
from batch_inference.ladder.engine import LadderEngine
from batch_inference.ladder.report import report
from batch_inference.ladder.rungs import Answer
from batch_inference.ledger import Ledger, StaleLease
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from batch_inference.validate import validate
from benchmarks.ladder import KnownEngine, known_ladder, ticket_rows
from benchmarks.ladder import ticket_tables as tables
from gpu_runner.worker import WorkerConfig, run_worker


@pytest.fixture(autouse=True)
def known_engines(monkeypatch):
    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "tests,benchmarks.ladder")


def answers_of(conn, job: str) -> list[dict]:
    return conn.execute("SELECT record_id, rung, output, valid, confidence, escalated FROM bi.ladder_answers "
                        "WHERE job_version = %s ORDER BY record_id, rung", (job,)).fetchall()


def check_one_final_each(conn, job: str, n: int) -> dict[str, int]:
    """Every result is the one answer bi.ladder_answers names as final; returns record -> its rung."""
    results = {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    assert len(results) == n
    dup = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                       (job,)).fetchone()["d"]
    assert dup == 0
    finals: dict[str, int] = {}
    by_record: dict[str, list[dict]] = {}
    for a in answers_of(conn, job):
        by_record.setdefault(a["record_id"], []).append(a)
    for rid, answers in by_record.items():
        kept = [a for a in answers if not a["escalated"]]
        assert len(kept) == 1, (rid, answers)
        assert json.loads(kept[0]["output"]) == results[rid]
        # Escalated at every rung below the one that kept it, and asked no higher.
        assert [a["rung"] for a in answers] == list(range(1, kept[0]["rung"] + 1))
        finals[rid] = kept[0]["rung"]
    assert set(finals) == set(results)
    return finals


def test_a_calibrated_two_rung_ladder_runs_validates_and_publishes(conn, db_url, capsys):
    rows = ticket_rows(60, hard_share=0.3)
    golden = ticket_rows(40, hard_share=0.3, prefix="g")
    tables(conn, rows, golden)
    spec = parse_spec(known_ladder("public.tickets", "public.golden", shard_size=20,
                                   evaluation={"golden": {"table": "public.golden", "id_column": "id",
                                                          "text_column": "body", "expected_column": "expected",
                                                          "run": "engine"},
                                               "min_accuracy": {"category": 0.95}}))
    before = conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"]
    cal = calibrate(conn, spec)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == before   # no job version
    picked, top = cal.report["picked"], cal.report["top_alone"]
    assert top["accuracy"] == 1.0 and picked["accuracy"] >= 0.98 * top["accuracy"]
    assert picked["bill_per_record"] < 0.5 * top["bill_per_record"]
    assert cal.thresholds[0] is not None and cal.spec.models[0].threshold == cal.thresholds[0]
    assert cal.spec.spec_hash != spec.spec_hash                 # the thresholds are part of the job version
    assert len(cal.report["curve"]) >= 2

    job = submit(conn, cal.spec).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    finals = check_one_final_each(conn, job, len(rows))
    hard = {r for r, t, _ in rows if "[hard]" in t}
    assert {r for r, rung in finals.items() if rung == 2} == hard   # the cheap rung is unsure exactly there
    truth = {r: label for r, _, label in rows}
    out = {r["record_id"]: r["output"]["category"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}
    assert out == truth

    r = report(conn, job)
    assert [g["kept"] for g in r["rungs"]] == [len(rows) - len(hard), len(hard)]
    assert r["rungs"][0]["answered"] == len(rows) and r["rungs"][1]["answered"] == len(hard)
    assert r["bill"] == pytest.approx(len(rows) * 0.0004 + len(hard) * 0.004)
    assert r["calibration"]["thresholds"] == cal.thresholds and r["rungs"][1]["golden_accuracy"] == 1.0
    assert cli_main(["--db", db_url, "ladder", job]) == 0
    assert "rung 2 known-dear" in capsys.readouterr().out

    # The publish gate grades the cascade's final answers (a golden run of the ladder itself).
    v = validate(conn, job)
    assert v.passed, v["failures"]
    assert v["evaluation"]["accuracy"]["category"] == 1.0
    publish(conn, job)
    assert conn.execute("SELECT count(*) AS n FROM published.ladder_bench").fetchone()["n"] == len(rows)


def test_a_worker_meeting_stored_answers_resumes_each_record_where_it_stopped(conn, db_url):
    """A first worker's ladder answers are in the ledger but its results are not (it died between):
    the next holder hands on the stored final answers as they are and asks no rung again."""
    rows = ticket_rows(12, hard_share=0.5)
    tables(conn, rows, [])
    spec = parse_spec(known_ladder("public.tickets", None, thresholds=(0.5,), shard_size=12))
    job = submit(conn, spec).job_version
    ledger = Ledger(conn, job, "first")
    lease = ledger.claim()
    engine = LadderEngine(spec)
    engine.load()
    engine.begin_shard(ledger, lease, threading.Event())
    first = {o.record_id: o.text for o in engine.generate(
        [build_request(spec, r, t) for r, t, _ in rows], threading.Event())}
    assert engine.asked == [12, sum(1 for _, t, _ in rows if "[hard]" in t)]
    ledger.release(lease)                      # as if it died: nothing went to bi.results
    assert job_counts(conn, job)["stored"] == 0

    again = LadderEngine(spec)
    again.load()
    ledger2 = Ledger(conn, job, "second")
    lease2 = ledger2.claim()
    again.begin_shard(ledger2, lease2, threading.Event())
    second = {o.record_id: o.text for o in again.generate(
        [build_request(spec, r, t) for r, t, _ in rows], threading.Event())}
    assert second == first and again.asked == [0, 0]
    # The first holder's epoch is over: its answers are refused, nothing written.
    with pytest.raises(StaleLease):
        audit.put(ledger, lease, [(1, Answer("t000000", '{"category": "bug"}', True, 0.9), False)])


def test_submit_refuses_a_rung_whose_engine_gives_no_confidence_and_writes_nothing(conn, monkeypatch):
    tables(conn, ticket_rows(4, hard_share=0.0), [])
    monkeypatch.setattr(KnownEngine, "gives_logprobs", False)
    with pytest.raises(SpecError) as exc:
        submit(conn, parse_spec(known_ladder("public.tickets", None)))
    assert str(exc.value) == ("spec field 'models[1]' (known-cheap): engine 'benchmarks.ladder:KnownEngine' gives no "
                              "token log-probabilities, which ladder.confidence 'logprobs' needs")
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0


def test_calibrate_refuses_bad_input_in_one_line_and_writes_nothing(conn, db_url, capsys, tmp_path):
    rows = ticket_rows(6, hard_share=0.0)
    tables(conn, rows, [])
    counts = "SELECT (SELECT count(*) FROM bi.jobs) + (SELECT count(*) FROM bi.ladder_calibrations) AS n"
    before = conn.execute(counts).fetchone()["n"]
    no_golden = parse_spec(known_ladder("public.tickets", None))
    with pytest.raises(InvalidValue, match="^calibrate needs a golden set"):
        calibrate(conn, no_golden)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(known_ladder("public.tickets", None)))
    assert cli_main(["--db", db_url, "calibrate", str(path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibrate needs a golden set" in err[0]
    empty = parse_spec(known_ladder("public.tickets", "public.golden"))
    with pytest.raises(InvalidValue, match="golden set public.golden has no record"):
        calibrate(conn, empty)

    # Every golden ticket hard, the cheap rung's surest answer wrong: no threshold keeps it within 100%.
    golden = ticket_rows(30, hard_share=1.0, prefix="h")
    cheap = KnownEngine(parse_spec(known_ladder("public.tickets", None)), {"quality": "cheap"})
    sure = max(golden, key=lambda g: cheap.answer(build_request(no_golden, g[0], g[1]))[1])
    if cheap.answer(build_request(no_golden, sure[0], sure[1]))[0] == sure[2]:
        golden.remove(sure)   # keep the golden set one whose surest cheap answer is wrong
        sure = max(golden, key=lambda g: cheap.answer(build_request(no_golden, g[0], g[1]))[1])
    assert cheap.answer(build_request(no_golden, sure[0], sure[1]))[0] != sure[2]
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO public.golden VALUES (%s, %s, %s)",
                        [(r, t, Jsonb({"category": label})) for r, t, label in golden])
    strict = parse_spec(known_ladder("public.tickets", "public.golden", target=1.0))
    with pytest.raises(InvalidValue, match=r"no thresholds reach ladder.target 100.0% .* the best reachable is "
                                           r"9\d\.\d% of it"):
        calibrate(conn, strict)
    assert conn.execute(counts).fetchone()["n"] == before


def test_the_calibrate_command_prints_the_pick_and_writes_the_calibrated_spec(conn, db_url, capsys, tmp_path):
    from batch_inference.spec import load_spec

    tables(conn, ticket_rows(4, hard_share=0.0), ticket_rows(30, hard_share=0.4, prefix="g"))
    path, out = tmp_path / "spec.json", tmp_path / "calibrated.yaml"
    path.write_text(json.dumps(known_ladder("public.tickets", "public.golden")))
    assert cli_main(["--db", db_url, "calibrate", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "top rung alone: 100.0% right" in printed and "picked thresholds" in printed
    calibrated = load_spec(out)
    assert calibrated.models[0].threshold is not None and calibrated.engine.name == "ladder"
    job = submit(conn, calibrated).job_version
    assert report(conn, job)["calibration"]["thresholds"] == [calibrated.models[0].threshold]
