"""Evaluation in the publish gate, on the real embedded PostgreSQL: the golden
set graded field by field (joined to the job's results, or run through the
job's engine under a companion job version), accuracy gates in validate, the
judge's verdicts as a keyed companion job, the human review stored with the
reviewer, and publish refused while a gate fails unless forced with a reason.
The engine here is the noop engine (the real CPU model is in
tests/process/test_evaluation_real_model.py)."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest

from batch_inference import db, evaluation
from batch_inference.cli import main as cli_main
from batch_inference.exceptions import PublishRefused, ReviewRefused, SpecError
from batch_inference.plan import drop_job_version, submit
from batch_inference.publish import publish
from batch_inference.spec import FieldGrader
from batch_inference.validate import validate
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_publish import waits_on_a_lock
from tests.integration.test_validate import finish

CATS = ["billing", "bug", "account", "other"]


def golden_table(conn, rows: list[tuple[str, str, dict[str, Any]]], table: str = "public.golden") -> str:
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, body text NOT NULL, expected jsonb NOT NULL)")
    with conn.cursor() as cur:
        cur.executemany(f"INSERT INTO {table} VALUES (%s, %s, %s)",
                        [(i, t, json.dumps(e)) for i, t, e in rows])
    return table


def golden_block(table: str = "public.golden", **over: Any) -> dict[str, Any]:
    return {"golden": {"table": table, "text_column": "body", **over.pop("golden", {})}, **over}


def labelled(n: int) -> tuple[list[tuple[str, str, list[str]]], dict[str, str]]:
    """``n`` tickets and the category each one truly has (cycling through CATS)."""
    rows = tickets(n)
    return rows, {rid: CATS[i % len(CATS)] for i, (rid, _t, _a) in enumerate(rows)}


def out(category: str) -> dict[str, str]:
    return {"category": category, "summary": "charged twice"}


def test_join_mode_grades_the_jobs_own_results_and_the_gate_decides_publish(conn, db_url, capsys):
    rows, truth = labelled(20)
    make_source(conn, rows)
    golden_ids = [r[0] for r in rows[:10]]
    golden_table(conn, [(rid, text, {"category": truth[rid], "summary": "Charged twice!"})
                        for rid, text, _acl in rows[:10]])
    # The model is wrong on three of the ten golden records.
    wrong = set(golden_ids[:3])
    def answer(rid: str) -> dict[str, str]:
        right = truth[rid]
        return out(CATS[(CATS.index(right) + 1) % len(CATS)] if rid in wrong else right)

    strict = submit(conn, make_spec(evaluation=golden_block(min_accuracy={"category": 0.8}))).job_version
    finish(db_url, strict, answer)

    assert cli_main(["--db", db_url, "validate", strict, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    ev = report["evaluation"]
    assert ev["golden"]["mode"] == "join" and ev["golden"]["job_version"] == strict
    assert ev["graded"] == 10 and ev["accuracy"]["category"] == 0.7
    assert ev["accuracy"]["summary"] == 1.0          # normalized: case and punctuation do not count
    assert sum(sum(c.values()) for c in ev["confusion"].values()) == 10
    assert ev["confusion"][truth[golden_ids[0]]].get(answer(golden_ids[0])["category"]) >= 1
    lines = [f for f in report["failures"] if f.startswith("evaluation:")]
    assert lines == ["evaluation: category accuracy 70.0% on the golden set (7 of 10) is under the gate of 80.0%"]
    assert report["timings"]["evaluation_s"] >= 0

    with pytest.raises(PublishRefused, match="failed validation"):
        publish(conn, strict)
    assert cli_main(["--db", db_url, "publish", strict]) == 2
    assert "failed validation" in capsys.readouterr().err
    forced = publish(conn, strict, force=True, reason="accuracy accepted for the pilot")
    assert forced["forced"] and forced["changed"]

    # The same model and prompt under a lower gate (another dataset: a job version of its own).
    lenient = submit(conn, make_spec(dataset="tickets_lenient",
                                     evaluation=golden_block(min_accuracy={"category": 0.6}))).job_version
    finish(db_url, lenient, answer)
    passed = validate(conn, lenient)
    assert passed.passed and passed["evaluation"]["accuracy"]["category"] == 0.7
    assert publish(conn, lenient)["forced"] is False


def test_engine_mode_runs_the_golden_set_once_under_a_companion_version(conn, db_url):
    make_source(conn, tickets(6))
    expected = ["billing", "billing", "bug", "account"]          # the noop engine answers the first enum: billing
    golden_table(conn, [(f"g{i}", f"Golden ticket {i}", {"category": c}) for i, c in enumerate(expected)])
    job = submit(conn, make_spec(evaluation=golden_block(min_accuracy={"category": 0.4}))).job_version
    finish(db_url, job)

    first = validate(conn, job)
    g = first["evaluation"]["golden"]
    assert g["mode"] == "engine" and g["job_version"] != job and g["worker_exit"] == 0
    assert g["accuracy"] == {"category": 0.5} and g["fields"]["category"]["missed"] == ["g2", "g3"]
    assert first.passed
    companion = conn.execute("SELECT dataset, spec_hash, records FROM bi.jobs WHERE job_version = %s",
                             (g["job_version"],)).fetchone()
    assert companion["records"] == 4 and companion["dataset"].startswith("golden_")
    assert companion["spec_hash"] == make_spec().spec_hash           # the job's own model, prompt and schema
    stamps = conn.execute("SELECT record_id, created_at FROM bi.results WHERE job_version = %s ORDER BY 1",
                          (g["job_version"],)).fetchall()

    again = validate(conn, job)
    assert again["evaluation"]["golden"]["job_version"] == g["job_version"]
    assert conn.execute("SELECT record_id, created_at FROM bi.results WHERE job_version = %s ORDER BY 1",
                        (g["job_version"],)).fetchall() == stamps        # read, not generated again


def test_graders():
    exact, norm = FieldGrader(grader="exact"), FieldGrader(grader="normalized")
    sim = FieldGrader(grader="similarity", min_similarity=0.8)
    assert evaluation.grade_value(exact, 3, 3.0) == (True, None)
    assert evaluation.grade_value(exact, True, 1) == (False, None)
    assert evaluation.grade_value(norm, "Refund  the DUPLICATE charge.", "refund the duplicate charge") == (True, None)
    ok, ratio = evaluation.grade_value(sim, "refund the duplicate charge", "refund the duplicated charge")
    assert ok and 0.8 <= ratio < 1
    assert evaluation.grade_value(sim, "refund the duplicate charge", "cannot log in")[0] is False


def test_bad_golden_sets_fail_validation_with_one_line(conn, db_url):
    make_source(conn, tickets(4))
    job = submit(conn, make_spec(evaluation=golden_block("public.nope", min_accuracy={"category": 0.5}))).job_version
    finish(db_url, job)
    report = validate(conn, job)
    assert not report.passed
    assert [f for f in report["failures"] if "golden" in f] == [
        'evaluation: golden set public.nope does not fit the spec: relation "public.nope" does not exist; it needs '
        'the columns id, body, expected (a JSON object with some or all of the output\'s fields)']
    with pytest.raises(SpecError, match="min_accuracy needs a golden set"):
        make_spec(evaluation={"min_accuracy": {"category": 0.5}})
    with pytest.raises(SpecError, match="'colour' is not a top-level property"):
        make_spec(evaluation=golden_block(min_accuracy={"colour": 0.5}))
    with pytest.raises(SpecError, match="min_reviewed .* is more than the review sample holds"):
        make_spec(evaluation={"review": {"min_reviewed": 500}}, validation={"sample_size": 10})
    judge = {"model": {"name": "noop", "digest": "0" * 64}, "engine": {"name": "noop"}, "rubric": "Right?"}
    with pytest.raises(SpecError, match="judge grades rows of the review sample"):
        make_spec(evaluation={"judge": judge}, validation={"sample_size": 0})
    # Gates do not join the job version (I2): only what changes results does.
    assert make_spec(evaluation=golden_block(min_accuracy={"category": 0.9})).spec_hash == make_spec().spec_hash


def test_review_gate_blocks_publish_until_enough_rows_are_marked_right(conn, db_url, capsys):
    make_source(conn, tickets(12))
    job = submit(conn, make_spec(validation={"sample_size": 5},
                                 evaluation={"review": {"min_reviewed": 3, "min_right": 0.6}})).job_version
    finish(db_url, job)
    report = validate(conn, job)
    assert report.passed
    assert report["evaluation"]["review"]["problem"] == "review: 0 of 3 required sample rows reviewed"
    sample = [r["record_id"] for r in evaluation.review_rows(conn, job)]
    assert len(sample) == 5

    with pytest.raises(PublishRefused, match="review: 0 of 3 required sample rows reviewed; refused"):
        publish(conn, job)
    assert cli_main(["--db", db_url, "review", job, "--record", sample[0], "--verdict", "right",
                     "--reviewer", "cli:ana", "--comment", "looks right"]) == 0
    assert cli_main(["--db", db_url, "review", job, "--record", sample[1], "--verdict", "wrong",
                     "--reviewer", "cli:ana"]) == 0
    assert cli_main(["--db", db_url, "review", job, "--record", sample[2], "--verdict", "wrong",
                     "--reviewer", "cli:bo"]) == 0
    capsys.readouterr()
    with pytest.raises(PublishRefused, match=r"1 of 3 reviewed rows marked right \(33.3%\), under the gate of 60.0%"):
        publish(conn, job)
    # A second verdict on a row replaces the first, with its reviewer.
    evaluation.record_review(conn, job, sample[2], "right", reviewer="airflow:cy")
    assert cli_main(["--db", db_url, "review", job, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["review"]["passed"] and shown["review"]["right"] == 2 and shown["review"]["reviewed"] == 3
    by_id = {r["record_id"]: r for r in shown["rows"]}
    assert by_id[sample[2]]["reviewer"] == "airflow:cy" and by_id[sample[0]]["comment"] == "looks right"
    assert "text" in by_id[sample[0]] and by_id[sample[0]]["output"]["category"]
    assert publish(conn, job)["forced"] is False


def _gate_met(conn, db_url) -> tuple[str, list[str]]:
    """A validated version whose review gate (2 reviewed, all right) two verdicts of three sampled rows meet."""
    make_source(conn, tickets(12))
    job = submit(conn, make_spec(validation={"sample_size": 3},
                                 evaluation={"review": {"min_reviewed": 2, "min_right": 1.0}})).job_version
    finish(db_url, job)
    assert validate(conn, job).passed
    sample = [r["record_id"] for r in evaluation.review_rows(conn, job)]
    for rid in sample[:2]:
        evaluation.record_review(conn, job, rid, "right", reviewer="cli:ana")
    assert evaluation.review_state(conn, job)["passed"]
    return job, sample


def test_a_verdict_uncommitted_when_publish_checks_the_gate_is_waited_for_and_counted(conn, db_url):
    """Two connections race: a 'wrong' verdict is written but not committed when publish starts.
    The publish waits for it (the version's row lock) and then refuses, as the gate with it says."""
    job, sample = _gate_met(conn, db_url)
    result: dict[str, Any] = {}

    def publisher() -> None:
        with db.connect(db_url, application_name="racing-publish") as c:
            try:
                result["out"] = publish(c, job)
            except PublishRefused as exc:
                result["error"] = exc

    with db.connect(db_url) as reviewer, reviewer.transaction():
        evaluation.record_review(reviewer, job, sample[2], "wrong", reviewer="cli:bo")
        t = threading.Thread(target=publisher)
        t.start()
        waited = waits_on_a_lock(conn, "racing-publish", t.is_alive)
    t.join(timeout=30)
    assert waited, f"the publish did not wait for the verdict in flight: {result}"
    assert "out" not in result, result
    assert "2 of 3 reviewed rows marked right (66.7%), under the gate of 100.0%" in str(result["error"])
    assert conn.execute(db.q("published_version"), {"dataset": "tickets_triage"}).fetchone() is None


def test_a_verdict_recorded_while_a_publish_is_in_flight_waits_for_the_switch(conn, db_url):
    """The other order: the publish has checked the gate and switched, not yet committed; a verdict
    sent then waits for the commit, so it lands after the switch, never between check and switch."""
    job, sample = _gate_met(conn, db_url)
    result: dict[str, Any] = {}

    def reviewer() -> None:
        with db.connect(db_url, application_name="racing-review") as c:
            result["review"] = evaluation.record_review(c, job, sample[2], "wrong", reviewer="cli:bo")

    with db.connect(db_url) as publisher, publisher.transaction():
        switched = publish(publisher, job)
        t = threading.Thread(target=reviewer)
        t.start()
        waited = waits_on_a_lock(conn, "racing-review", t.is_alive)
    t.join(timeout=30)
    assert waited, "the verdict did not wait for the publish in flight"
    assert switched["changed"] and switched["forced"] is False
    live = conn.execute(db.q("published_version"), {"dataset": "tickets_triage"}).fetchone()
    assert live["job_version"] == job and result["review"]["reviewed_at"] > live["switched_at"]


def test_bad_reviews_are_refused_with_one_line(conn, db_url, capsys):
    make_source(conn, tickets(4))
    job = submit(conn, make_spec(validation={"sample_size": 2})).job_version
    finish(db_url, job)
    validate(conn, job)
    outside = conn.execute("SELECT record_id FROM bi.results WHERE job_version = %s AND record_id NOT IN "
                           "(SELECT record_id FROM bi.review_sample WHERE job_version = %s) LIMIT 1",
                           (job, job)).fetchone()["record_id"]
    with pytest.raises(ReviewRefused, match=f"record {outside} is not in the review sample"):
        evaluation.record_review(conn, job, outside, "right", reviewer="cli:ana")
    with pytest.raises(ReviewRefused, match="verdict must be one of right, wrong, unsure"):
        evaluation.record_review(conn, job, outside, "maybe", reviewer="cli:ana")
    assert cli_main(["--db", db_url, "review", job, "--record", outside, "--verdict", "right"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("batch-inference review: error: record") and len(err.splitlines()) == 1
    assert cli_main(["--db", db_url, "review", "jv_0000000000000000"]) == 2
    assert conn.execute("SELECT count(*) AS n FROM bi.reviews").fetchone()["n"] == 0


def test_judge_verdicts_are_a_keyed_companion_job_and_priced(conn, db_url):
    make_source(conn, tickets(10))
    judge = {"model": {"name": "noop", "digest": "0" * 64}, "engine": {"name": "noop"},
             "rubric": "Say whether the category and summary are right for the ticket.", "sample_size": 4,
             "min_agreement": 0.9, "cost": {"batch_per_row": 0.01}}
    job = submit(conn, make_spec(validation={"sample_size": 6}, evaluation={"judge": judge})).job_version
    finish(db_url, job)
    report = validate(conn, job)
    j = report["evaluation"]["judge"]
    # The noop judge answers the first verdict, "right", for every row it is given.
    assert j["sample"] == 4 and j["judged"] == 4 and j["agreement"] == 1.0 and report.passed
    assert j["cost"] == pytest.approx(0.04)
    kept = conn.execute("SELECT r.acl, s.text FROM bi.results r JOIN bi.snapshot_rows s USING (job_version, record_id) "
                        "WHERE r.job_version = %s ORDER BY r.record_id LIMIT 1", (j["job_version"],)).fetchone()
    assert kept["acl"] is not None and "Answer:" in kept["text"]       # the record's ACL travels with its verdict
    assert validate(conn, job)["evaluation"]["judge"]["job_version"] == j["job_version"]



def test_companion_versions_are_listed_under_the_version_they_serve_and_dropped_with_the_last(conn, db_url,
                                                                                             monkeypatch):
    """A golden run serves every version of a spec over the same golden set; a judge serves one.
    Job lists leave them out unless asked for, a version's page shows its own, and they go with
    the last version they serve."""
    from tests.integration.test_dashboard_api import ADMIN, _client

    judge = {"model": {"name": "noop", "digest": "0" * 64}, "engine": {"name": "noop"},
             "rubric": "Say whether the category is right for the ticket.", "sample_size": 2}
    golden_table(conn, [(f"g{i}", f"Golden ticket {i}", {"category": "billing"}) for i in range(3)])
    spec = make_spec(validation={"sample_size": 3}, evaluation={**golden_block(), "judge": judge})
    versions, made = [], {}
    for n in (6, 8):                                   # two nightly snapshots of one spec
        make_source(conn, tickets(n))
        job = submit(conn, spec).job_version
        finish(db_url, job)
        ev = validate(conn, job)["evaluation"]
        versions.append(job)
        made[job] = {"golden": ev["golden"]["job_version"], "judge": ev["judge"]["job_version"]}
    v1, v2 = versions
    golden = made[v1]["golden"]
    assert made[v2]["golden"] == golden and made[v1]["judge"] != made[v2]["judge"]
    companions = {golden, made[v1]["judge"], made[v2]["judge"]}

    def exists(job: str) -> bool:
        return conn.execute(db.q("job_row"), {"job": job}).fetchone() is not None

    with _client(db_url, monkeypatch) as client:
        listed = {j["job_version"] for j in client.get("/api/jobs", headers=ADMIN).json()["jobs"]}
        assert listed == {v1, v2}
        everything = client.get("/api/jobs", params={"companions": "true"}, headers=ADMIN).json()["jobs"]
        assert {j["job_version"] for j in everything} == {v1, v2} | companions
        page = client.get(f"/api/jobs/{v1}", headers=ADMIN).json()
        assert sorted((c["kind"], c["job_version"]) for c in page["companions"]) == [
            ("golden", golden), ("judge", made[v1]["judge"])]
        assert all(c["outstanding"] == 0 and c["stored"] > 0 for c in page["companions"])
        served = client.get(f"/api/jobs/{golden}", headers=ADMIN).json()["serves"]
        assert sorted((sv["job_version"], sv["kind"]) for sv in served) == sorted([(v1, "golden"), (v2, "golden")])

    assert drop_job_version(conn, v1)
    assert not exists(made[v1]["judge"]) and exists(golden)      # the golden run still serves v2
    assert drop_job_version(conn, v2)
    assert not any(exists(c) for c in companions)
    assert conn.execute("SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'bi' AND tablename LIKE ANY (%s)",
                        ([f"%_{hashlib.md5(c.encode()).hexdigest()[:16]}" for c in companions],)).fetchone()["n"] == 0


def test_report_compares_accuracy_and_labels_with_the_published_version(conn, db_url):
    rows, truth = labelled(12)
    make_source(conn, rows)
    golden_table(conn, [(rid, text, {"category": truth[rid]}) for rid, text, _a in rows])
    first = submit(conn, make_spec(evaluation=golden_block())).job_version
    finish(db_url, first, lambda rid: out("billing"))
    validate(conn, first)
    publish(conn, first)
    second = submit(conn, make_spec(prompt={"version": "v2"}, evaluation=golden_block())).job_version
    finish(db_url, second, lambda rid: out(truth[rid]))
    cmp = validate(conn, second)["evaluation"]["published"]
    assert cmp["against"] == first
    assert cmp["accuracy"]["category"] == {"this": 1.0, "published": 0.25, "change": 0.75}
    assert cmp["labels"]["category"]["published"] == {"billing": 1.0}
    assert cmp["labels"]["category"]["this"] == {c: 0.25 for c in sorted(CATS)}


def test_the_demo_grades_its_own_results_against_the_sample_tickets_labels(conn, db_url):
    from batch_inference.commands.demo import load_tickets
    from batch_inference.data import DEMO_SPEC, TICKETS_EXPECTED, expected_labels
    from batch_inference.data.make_tickets import labelled_tickets
    from batch_inference.spec import load_spec

    # The labels file is what the generator writes (make_tickets.py --expected).
    assert TICKETS_EXPECTED.read_text().splitlines() == [
        json.dumps({"id": t["id"], "expected": e}) for t, e in labelled_tickets() if e is not None]
    labels = expected_labels()
    assert load_tickets(conn, 30) == 30                    # ticket 29 is the blank one: no label
    spec = load_spec(DEMO_SPEC).with_overrides(engine={"name": "noop"})
    job = submit(conn, spec).job_version
    ids = [r["record_id"] for r in conn.execute("SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s "
                                                "AND reject IS NULL ORDER BY record_id", (job,))]
    right = set(ids[::2])
    finish(db_url, job, lambda rid: {**(labels[rid] if rid in right else {"category": "other", "priority": "low"}),
                                     "summary": "s"})
    ev = validate(conn, job)["evaluation"]
    g = ev["golden"]
    graded = [i for i in ids if i in labels]
    assert g["mode"] == "join" and g["graded"] == len(graded) == 29
    want = sum(1 for i in graded if i in right or labels[i]["category"] == "other")
    assert g["fields"]["category"]["right"] == want
    assert set(g["fields"]) == {"category", "priority"}     # the labels say nothing of the summary


def test_the_in_process_golden_run_gives_the_callers_signal_handlers_back(conn, db_url):
    import signal

    make_source(conn, tickets(3))
    golden_table(conn, [("g0", "Golden ticket", {"category": "billing"})])
    job = submit(conn, make_spec(evaluation=golden_block(golden={"run": "engine"}))).job_version
    finish(db_url, job)

    def mine(_signum, _frame):  # pragma: no cover - never delivered
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert validate(conn, job)["evaluation"]["golden"]["worker_exit"] == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_hosted_judge_never_gets_records_not_cleared_for_it(conn, db_url):
    make_source(conn, tickets(4))
    judge = {"model": {"name": "gpt-judge", "digest": "1" * 64},
             "engine": {"name": "openai", "options": {"base_url": "https://judge.example.com/v1", "model": "gpt-judge"}},
             "rubric": "Say whether the answer is right.", "sample_size": 2, "min_agreement": 0.5}
    job = submit(conn, make_spec(validation={"sample_size": 2}, evaluation={"judge": judge})).job_version
    finish(db_url, job)
    report = validate(conn, job)
    j = report["evaluation"]["judge"]
    assert j["judged"] == 0 and j["cost"] == 0
    line = next(f for f in report["failures"] if f.startswith("evaluation: the judge"))
    assert "graded 0 of 2 sample rows" in line and "not cleared" in line and line.endswith("fix it, then validate again"), line
    assert not report.passed
