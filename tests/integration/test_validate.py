"""The validator on the real embedded PostgreSQL: coverage, schema, dead-letter
gate, drift against the published version, the seeded sample, and the SQL
form of the schema checked against the worker's own Python check."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_inference import db
from batch_inference.cli import main as cli_main
from batch_inference.ledger import Failure, Ledger
from batch_inference.outputs import check_output
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.schema_sql import output_predicate
from batch_inference.status import job_counts
from batch_inference.validate import NotReady, validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import SCHEMA, make_source, make_spec, tickets

OUT = {"category": "billing", "summary": "charged twice"}


def finish(db_url: str, job: str, output_for: Callable[[str], dict[str, Any]] = lambda rid: OUT,
           fail: Iterable[str] = ()) -> None:
    """Drive every shard to done through the real ledger, choosing each record's
    output (the noop engine answers the same for every record, and drift needs
    distributions). Records in ``fail`` get one failed attempt each; with
    ``max_attempts=1`` that dead-letters them."""
    fail = set(fail)
    with db.connect(db_url) as c:
        lg = Ledger(c, job, "test-worker")
        while (lease := lg.claim()) is not None:
            rows = [r["record_id"] for r in lg.records(lease)]
            ok = [r for r in rows if r not in fail]
            outs = [output_for(r) for r in ok]
            lg.put_results(lease, ok, outs, [o.get("category") for o in outs])
            bad = [Failure(r, "injected failure") for r in rows if r in fail]
            if bad:
                assert all(f.dead for f in lg.fail(lease, bad))
            assert lg.complete(lease) == "done"


def new_job(conn, n: int = 40, start: int = 0, table: str = "public.tickets", **spec_over: Any) -> str:
    make_source(conn, tickets(n, start), table=table)
    return submit(conn, make_spec(source={"table": table}, **spec_over)).job_version


def status_of(conn, job: str) -> str:
    return conn.execute("SELECT status FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["status"]


# -- a clean run ------------------------------------------------------------------------

def test_a_finished_job_passes_and_is_validated(conn, db_url, tmp_path):
    job = new_job(conn, 35)
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    report = validate(conn, job, sample_dir=tmp_path)
    assert report.passed and report["failures"] == [] and report["status"] == "validated"
    assert report["coverage"] == {"snapshot": 35, "stored": 35, "dead_letters": 0, "missing": 0, "missing_ids": [],
                                  "in_both": 0, "not_in_snapshot": 0}
    assert report["schema"]["checked"] == 35 and report["schema"]["invalid"] == 0
    assert report["schema"]["sql_check"] is True and report["schema"]["checked_in_python"] == 0
    assert report["dead_letter_rate"] == 0.0
    assert report["categories"] == {"billing": 35}
    assert report["drift"]["distance"] is None and "nothing is published" in " ".join(report["notes"])
    assert status_of(conn, job) == "validated"
    stored = conn.execute("SELECT validation FROM bi.jobs WHERE job_version = %s", (job,)).fetchone()["validation"]
    assert stored["passed"] is True and stored["coverage"]["snapshot"] == 35

    path = tmp_path / f"{job}.jsonl"
    assert report["sample"]["path"] == str(path) and report["sample"]["rows"] == 35
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 35 and set(lines[0]) == {"record_id", "text", "output"}
    assert lines[0]["output"]["category"] == "billing" and lines[0]["text"].startswith("Ticket ")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600        # customer text: owner only


def test_sample_is_seeded_and_independent_of_row_order(conn, db_url, tmp_path):
    job = new_job(conn, 60, validation={"sample_size": 7, "sample_seed": 3})
    finish(db_url, job)
    first = validate(conn, job, sample_dir=tmp_path / "a")
    ids = [json.loads(x)["record_id"] for x in (tmp_path / "a" / f"{job}.jsonl").read_text().splitlines()]
    assert len(ids) == 7 and first["sample"]["rows"] == 7
    # Rewrite the rows in another physical order: the same seed picks the same records.
    conn.execute("CREATE TEMP TABLE keep AS SELECT * FROM bi.results WHERE job_version = %s ORDER BY record_id DESC",
                 (job,))
    conn.execute("DELETE FROM bi.results WHERE job_version = %s", (job,))
    conn.execute("INSERT INTO bi.results SELECT * FROM keep")
    validate(conn, job, sample_dir=tmp_path / "b")
    again = [json.loads(x)["record_id"] for x in (tmp_path / "b" / f"{job}.jsonl").read_text().splitlines()]
    assert again == ids
    conn.execute("UPDATE bi.jobs SET spec = jsonb_set(spec, '{validation,sample_seed}', '4'), "
                 "spec_text = jsonb_set(spec, '{validation,sample_seed}', '4')::text WHERE job_version = %s", (job,))
    validate(conn, job, sample_dir=tmp_path / "c")
    other = [json.loads(x)["record_id"] for x in (tmp_path / "c" / f"{job}.jsonl").read_text().splitlines()]
    assert len(other) == 7 and other != ids


# -- refusals -----------------------------------------------------------------------------

def test_refuses_while_shards_are_pending_or_leased(conn, db_url):
    job = new_job(conn, 25)
    with pytest.raises(NotReady, match="3 shard\\(s\\) pending, 0 leased"):
        validate(conn, job)
    lg = Ledger(conn, job, "w")
    lease = lg.claim()
    assert lease is not None
    with pytest.raises(NotReady, match="2 shard\\(s\\) pending, 1 leased"):
        validate(conn, job)
    assert status_of(conn, job) == "running"                  # nothing recorded
    # The SQL guard holds too: a report cannot be stored while a shard is open.
    r = conn.execute("SELECT bi.record_validation_v1(%s, '{}'::jsonb, true) AS s", (job,)).fetchone()
    assert r["s"] is None and status_of(conn, job) == "running"


# -- coverage -----------------------------------------------------------------------------

def test_coverage_failure_lists_missing_ids(conn, db_url):
    job = new_job(conn, 30)
    finish(db_url, job)
    # Results lost after the shards completed (a bad manual fix, a partition restore).
    conn.execute("DELETE FROM bi.results WHERE job_version = %s AND record_id IN ('t00003', 't00017', 't00029')",
                 (job,))
    report = validate(conn, job)
    assert not report.passed and report["status"] == "failed_validation"
    cov = report["coverage"]
    assert (cov["snapshot"], cov["stored"], cov["missing"]) == (30, 27, 3)
    assert cov["missing_ids"] == ["t00003", "t00017", "t00029"]
    assert report["failures"] == ["coverage: 3 of 30 snapshot records have neither a result nor a dead letter "
                                  "(t00003, t00017, t00029)"]
    assert status_of(conn, job) == "failed_validation"


def test_coverage_catches_double_outcomes_and_strangers(conn, db_url):
    job = new_job(conn, 12)
    finish(db_url, job)
    conn.execute("""INSERT INTO bi.dead_letters (job_version, record_id, reason, attempts, stage, model_name,
                                                 model_digest, prompt_version)
                    VALUES (%s, 't00004', 'x', 3, 'worker', 'noop', '0', 'v1'),
                           (%s, 'not-a-record', 'x', 3, 'worker', 'noop', '0', 'v1')""", (job, job))
    report = validate(conn, job)
    cov = report["coverage"]
    assert cov["in_both"] == 1 and cov["in_both_ids"] == ["t00004"]
    assert cov["not_in_snapshot"] == 1 and cov["not_in_snapshot_ids"] == ["not-a-record"]
    assert any("both a result and a dead letter" in f for f in report["failures"])
    assert any("not in the snapshot" in f for f in report["failures"])


# -- schema -------------------------------------------------------------------------------

def _corrupt(conn, job: str, outputs: dict[str, Any]) -> None:
    for rid, out in outputs.items():
        conn.execute("UPDATE bi.results SET output = %s::jsonb WHERE job_version = %s AND record_id = %s",
                     (json.dumps(out), job, rid))


def test_invalid_stored_outputs_fail_with_examples(conn, db_url):
    job = new_job(conn, 20)
    finish(db_url, job)
    _corrupt(conn, job, {"t00002": {"category": "nope", "summary": "x"}, "t00011": {"category": "bug"},
                         "t00015": [1, 2]})
    report = validate(conn, job)
    s = report["schema"]
    assert (s["checked"], s["invalid"], s["checked_in_python"]) == (20, 3, 3)
    reasons = {e["record_id"]: e["reason"] for e in s["examples"]}
    assert "'nope' is not one of" in reasons["t00002"]
    assert "'summary' is a required property" in reasons["t00011"]
    assert set(reasons) == {"t00002", "t00011", "t00015"}
    assert not report.passed and report["failures"][0].startswith("schema: 3 of 20 stored outputs fail")


def test_a_schema_sql_cannot_express_is_checked_in_python(conn, db_url):
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                       "summary": {"type": "string", "pattern": "^[a-z ]+$"}}}
    job = new_job(conn, 15, output_schema=schema)
    finish(db_url, job)
    _corrupt(conn, job, {"t00005": {"category": "bug", "summary": "UPPER CASE"}})
    report = validate(conn, job)
    s = report["schema"]
    assert s["sql_check"] is False and s["checked_in_python"] == 15 and s["invalid"] == 1
    assert "pattern" in " ".join(report["notes"])
    assert s["examples"][0]["record_id"] == "t00005"


def test_rules_are_checked_again(conn, db_url):
    job = new_job(conn, 10, rules=[{"field": "category", "one_of": ["billing", "bug"]},
                                   {"field": "summary", "not_empty": True, "max_length": 20}])
    finish(db_url, job)
    _corrupt(conn, job, {"t00001": {"category": "account", "summary": "ok"},     # schema-valid, rule-invalid
                         "t00002": {"category": "bug", "summary": "   "},
                         "t00003": {"category": "bug", "summary": "x" * 21}})
    report = validate(conn, job)
    reasons = {e["record_id"]: e["reason"] for e in report["schema"]["examples"]}
    assert report["schema"]["invalid"] == 3
    assert "is not one of" in reasons["t00001"] and "must not be empty" in reasons["t00002"]
    assert "above max_length" in reasons["t00003"]


# -- dead-letter gate ---------------------------------------------------------------------

@pytest.mark.parametrize("gate, passed", [(0.01, False), (0.05, True)])
def test_dead_letter_rate_gate(conn, db_url, gate, passed):
    job = new_job(conn, 100, max_attempts=1, validation={"max_dead_letter_rate": gate})
    finish(db_url, job, fail={"t00010", "t00020", "t00030"})
    assert job_counts(conn, job)["dead_letters"] == 3
    report = validate(conn, job)
    assert report["dead_letter_rate"] == pytest.approx(0.03)
    assert report["coverage"]["stored"] == 97 and report["coverage"]["dead_letters"] == 3
    assert report.passed is passed
    if not passed:
        assert report["failures"] == ["dead letters: 3.00% of the snapshot (3 of 100) is over the gate of 1.00%"]


# -- drift --------------------------------------------------------------------------------

def labels(share_bug: float, n: int) -> Callable[[str], dict[str, Any]]:
    """Outputs whose category is 'bug' for the first share_bug of n records, else 'billing'."""
    return lambda rid: {"category": "bug" if int(rid[1:]) % n < share_bug * n else "billing", "summary": "s"}


def test_a_category_shift_past_the_threshold_fails_with_a_per_category_report(conn, db_url):
    v1 = new_job(conn, 100)
    finish(db_url, v1, labels(0.5, 100))
    assert validate(conn, v1).passed
    publish(conn, v1)

    v2 = new_job(conn, 100, start=100)                          # tomorrow's records
    finish(db_url, v2, lambda rid: {"category": "bug" if int(rid[1:]) % 10 == 0 else
                                    ("account" if int(rid[1:]) % 10 < 4 else "billing"), "summary": "s"})
    report = validate(conn, v2)
    d = report["drift"]
    assert d["against"] == v1 and d["threshold"] == 0.2
    # v1: billing .5, bug .5; v2: billing .6, account .3, bug .1 -> TVD = (.1 + .3 + .4) / 2 = .4
    assert d["distance"] == pytest.approx(0.4)
    assert d["per_category"]["bug"] == {"current": 0.1, "published": 0.5, "shift": -0.4}
    assert d["per_category"]["account"] == {"current": 0.3, "published": 0.0, "shift": 0.3}
    assert d["per_category"]["billing"]["shift"] == pytest.approx(0.1)
    assert not report.passed and report["status"] == "failed_validation"
    assert report["failures"] == [f"drift: category distribution moved 0.40 (total variation) against {v1}, "
                                  "over the gate of 0.20 (bug -0.40, account +0.30, billing +0.10)"]

    v3 = new_job(conn, 100, start=200)
    finish(db_url, v3, labels(0.45, 100))
    ok = validate(conn, v3)
    assert ok.passed and ok["drift"]["distance"] == pytest.approx(0.05)


def test_drift_reads_the_published_rows_when_its_report_lacks_counts(conn, db_url):
    v1 = new_job(conn, 40)
    finish(db_url, v1, labels(0.5, 40))
    validate(conn, v1)
    publish(conn, v1)
    conn.execute("UPDATE bi.jobs SET validation = validation - 'categories' WHERE job_version = %s", (v1,))
    v2 = new_job(conn, 40, start=40)
    finish(db_url, v2, labels(0.5, 40))
    assert validate(conn, v2)["drift"]["distance"] == pytest.approx(0.0)


# -- CLI ----------------------------------------------------------------------------------

def test_cli_validate_json_and_exit_codes(conn, db_url, tmp_path, capsys):
    job = new_job(conn, 20)
    assert cli_main(["--db", db_url, "validate", job, "--json"]) == 2          # not finished
    assert "not finished" in capsys.readouterr().err
    finish(db_url, job)
    assert cli_main(["--db", db_url, "validate", job, "--json", "--sample-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and {"coverage", "dead_letter_rate", "drift", "schema", "sample"} <= set(out)
    _corrupt(conn, job, {"t00001": {"category": "nope", "summary": ""}})
    assert cli_main(["--db", db_url, "validate", job, "--sample-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "FAIL schema: 1 of 20" in captured.err


# -- the SQL check against the Python check -------------------------------------------------

RICH_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["billing", "bug", "account", "other"]},
        "summary": {"type": "string", "minLength": 1, "maxLength": 12},
        "score": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "count": {"type": "integer", "minimum": -2, "maximum": 5},
        "flag": {"type": ["boolean", "null"]},
        "entities": {"type": "array", "maxItems": 3,
                     "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
                               "required": ["name"], "additionalProperties": False}},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 2},
        "either": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]},
        "fixed": {"const": {"a": [1, 2]}},
    },
    "required": ["category", "summary"],
    "additionalProperties": False,
}
RICH_RULES = [{"field": "summary", "not_empty": True}, {"field": "category", "one_of": ["billing", "bug", "other"]},
              {"field": "entities", "min_length": 1}]

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 8),
                        st.floats(-2, 2, allow_nan=False, allow_infinity=False),
                        st.sampled_from([1.0, 0.999999, 5.0, 1e-9, 0.0, -0.0]),
                        st.text(alphabet=st.sampled_from("ab \u00a0\u2003xé%'\"{}"), max_size=14),
                        st.sampled_from(["billing", "bug", "account", "other", "nope", ""]))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["name", "a", "x", "category"]), inner, max_size=3)), max_leaves=8)


def near(good: st.SearchStrategy, bad: st.SearchStrategy = json_scalar) -> st.SearchStrategy:
    """Mostly values of the right shape, near the limits; now and then anything."""
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: good if ok else bad)


short_text = st.text(alphabet=st.sampled_from("ab \u00a0\u2003\t%é"), max_size=14)
outputs = st.one_of(
    json_value,
    st.fixed_dictionaries(
        {"category": near(st.sampled_from(["billing", "bug", "other", "account"])),
         "summary": near(short_text)},
        optional={"score": near(st.sampled_from([0, 0.0, -0.0, 0.5, 0.999999, 1, 1.0, -1e-9, 0.9999999999999999])),
                  "count": near(st.sampled_from([-3, -2, 0, 5, 5.0, 6, 2.5, -2.0])),
                  "flag": near(st.sampled_from([True, False, None])),
                  "either": near(st.one_of(st.integers(-3, 3), st.sampled_from(["", "ab", "abc", 1.0, 1.5]))),
                  "fixed": st.sampled_from([{"a": [1, 2]}, {"a": [1.0, 2]}, {"a": [1, 2.0]}, {"a": [2, 1]}, [1, 2]]),
                  "entities": near(st.lists(near(st.fixed_dictionaries({"name": short_text.filter(lambda t: len(t) < 7)})),
                                            max_size=4)),
                  "meta": near(st.dictionaries(st.sampled_from(["k", "l", "m"]), near(short_text), max_size=3))}),
    st.builds(lambda o, v: {**o, "extra": v}, st.fixed_dictionaries({"category": st.just("bug"),
                                                                     "summary": st.just("s")}), json_scalar))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(outputs, min_size=20, max_size=20))
def test_the_sql_check_vouches_only_for_outputs_the_python_check_accepts(conn, batch):
    """Soundness: whatever the SQL predicate accepts, check_output accepts. (It
    may send a valid row to Python; it must never wave an invalid one through.)"""
    spec = make_spec(output_schema=RICH_SCHEMA, rules=RICH_RULES)
    vouch, why = output_predicate(spec, conn)
    assert why is None
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS probe (i int, output jsonb)")
    conn.execute("TRUNCATE probe")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO probe VALUES (%s, %s::jsonb)", [(i, json.dumps(o)) for i, o in enumerate(batch)])
    from psycopg import sql
    rows = conn.execute(sql.SQL("SELECT r.i, {} AS ok FROM probe r ORDER BY r.i").format(vouch)).fetchall()
    for row, out in zip(rows, batch, strict=True):
        _obj, reason = check_output(spec, json.dumps(out))
        if row["ok"]:
            assert reason is None, (out, reason)


def test_the_sql_check_vouches_for_ordinary_valid_outputs(conn):
    """Completeness where it matters for speed: typical valid outputs never go to Python."""
    spec = make_spec(output_schema=RICH_SCHEMA, rules=RICH_RULES)
    vouch, _ = output_predicate(spec, conn)
    good = [{"category": "bug", "summary": "crash", "score": 0.5, "count": 5, "flag": None,
             "entities": [{"name": "ann"}], "meta": {"k": "v"}, "either": 7, "fixed": {"a": [1, 2]}},
            {"category": "billing", "summary": "x", "count": 2.0, "flag": True, "entities": [{"name": "é"}],
             "either": "ab"},
            {"category": "other", "summary": "100% off", "entities": [{"name": "bob"}, {"name": "al"}]}]
    for out in good:
        assert check_output(spec, json.dumps(out))[1] is None
        from psycopg import sql
        r = conn.execute(sql.SQL("SELECT {} AS ok FROM (SELECT %s::jsonb AS output) r").format(vouch),
                         (json.dumps(out),)).fetchone()
        assert r["ok"] is True, out


LENGTH_SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5},
                   "e": {"type": ["string", "null"], "enum": ["a", "é"]},
                   "t": {"minLength": 2, "maxLength": 2}},
    "required": ["s"],
}
LENGTH_RULES = [{"field": "s", "min_length": 2, "max_length": 4}, {"field": "list", "min_length": 1, "max_length": 2}]


def test_length_bounds_and_string_enums_agree_with_python_exactly(conn):
    """The length tests evaluate each length once (not BETWEEN) and a string
    enum stands for its type test: at and around every bound, in characters
    of one to four bytes, the SQL verdict is exactly the Python one."""
    from psycopg import sql
    spec = make_spec(output_schema=LENGTH_SCHEMA, rules=LENGTH_RULES)
    vouch, why = output_predicate(spec, conn)
    assert why is None
    cases = [{"s": ch * n} for ch in ("a", "é", "日", "😀") for n in range(0, 7)]
    cases += [{"s": "abc", "list": [1] * n} for n in range(0, 4)] + [{"s": "abc", "list": "xyz"}, {"s": "abc", "list": 3}]
    cases += [{"s": "abc", "e": v} for v in ("a", "é", "b", None, 1, ["a"])]
    cases += [{"s": "abc", "t": v} for v in ("ab", "a", "abc", "日本", 12, None)] + [{"s": 12345}]
    for out in cases:
        ok = check_output(spec, json.dumps(out))[1] is None
        r = conn.execute(sql.SQL("SELECT {} AS ok FROM (SELECT %s::jsonb AS output) r").format(vouch),
                         (json.dumps(out),)).fetchone()
        assert r["ok"] is ok, out
