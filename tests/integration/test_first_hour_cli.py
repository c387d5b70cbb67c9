"""A new user's first hour, as each step went wrong when tried (issue 39, items 2 and 3), typed as a
user types it: the installed ``batch-inference`` entry point in a subprocess, on the real embedded
PostgreSQL, SQLite files, a second PostgreSQL server, Debian's MariaDB and fakesnow.

The Airflow connections are passed the way docs/sources.md shows (``AIRFLOW_CONN_...`` in the JSON and
the URI form); stdout carries only the JSON line; every refusal is one line on stderr. A step that only sets
up what the next command shows (a submit before a status, a worker run, a second refusal of the same
kind) runs the CLI in this process (``bi_here``): each installed command is a new interpreter (0.4-0.9
CPU-s, 2-3 with Airflow), and each test keeps the commands it is about in a subprocess."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import pytest
import yaml

from batch_inference import db
from batch_inference import deadline as watchlib
from tests.conftest import make_source, spec_dict, tickets
from tests.fixtures.cli import cli_here
from tests.fixtures.sources import TICKETS, two_column_spec
from tests.integration.test_source_sql import _load_mariadb, _load_pg, _load_sqlite

BI = str(Path(sys.executable).parent / "batch-inference")   # the installed entry point, as a user runs it
ROOT = Path(__file__).resolve().parents[2]


def bi(*argv: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([BI, *argv], env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def bi_here(capfd, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``bi`` in this process (tests/fixtures/cli.py), for the steps a test is not about; read a JSON
    answer with ``json_here``."""
    return cli_here(capfd, argv, env)


def json_here(p: subprocess.CompletedProcess) -> dict[str, Any]:
    """The JSON line a command run by ``bi_here`` printed last."""
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


def write(tmp_path: Path, data: dict[str, Any], name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def one_json_line(p: subprocess.CompletedProcess) -> dict[str, Any]:
    """stdout is exactly one JSON line (so `| jq` works), whatever went to stderr."""
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout
    return json.loads(lines[0])


def one_error_line(p: subprocess.CompletedProcess, command: str = "submit") -> str:
    assert p.returncode != 0 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"batch-inference {command}: error: "), p.stderr
    return lines[0]


def jobs(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"]


def sql_source_spec(conn_id: str, table: str = "tickets") -> dict[str, Any]:
    return two_column_spec({"kind": "sql", "conn_id": conn_id, "table": table}).model_dump(mode="json")


# -- a SQLite source, and a connection in each form docs/sources.md shows ---------------------------------


def submit_here(capsys, monkeypatch, db_url: str, spec: str, conn_env: dict[str, str]) -> dict[str, Any]:
    """``batch-inference submit`` in this process, for a connection form a subprocess beside it has shown
    prints only its JSON line (each process imports Airflow again, about 2-3 CPU-s); here Airflow's logging
    may have gone to the captured stdout before the CLI started, so the JSON is its last line."""
    from batch_inference.cli import main as cli_main

    for name, value in conn_env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = cli_main(["--db", db_url, "submit", spec])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return {**json.loads(captured.out.splitlines()[-1]), "_output": captured.out + captured.err}


def test_a_sqlite_source_in_json_and_uri_form_prints_only_its_json_line(conn, db_url, tmp_path, capsys, monkeypatch):
    path = tmp_path / "reviews.db"
    _load_sqlite(path, TICKETS)
    spec = write(tmp_path, sql_source_spec("my_reviews"))
    p = bi("--db", db_url, "submit", spec, env={"AIRFLOW_CONN_MY_REVIEWS": json.dumps({"conn_type": "sqlite",
                                                                                      "host": str(path)})})
    out = one_json_line(p)                                       # no Airflow log line before it
    assert out["records"] == len(TICKETS)
    uri = f"sqlite://{quote(str(path), safe='')}"                # the path is the host: every '/' as %2F
    by_uri = submit_here(capsys, monkeypatch, db_url, spec, {"AIRFLOW_CONN_MY_REVIEWS": uri})
    assert by_uri["records"] == len(TICKETS)
    assert by_uri["job_version"] == out["job_version"]
    with sqlite3.connect(path) as c:                             # the file is as it was
        assert c.execute("SELECT count(*) FROM tickets").fetchone()[0] == len(TICKETS)


def test_a_postgres_and_a_mariadb_connection_as_the_docs_show_them(conn, db_url, tmp_path, second_pg, mariadb, capsys,
                                                                   monkeypatch):
    from psycopg.conninfo import conninfo_to_dict

    uri = second_pg.get_uri()
    _load_pg(uri, TICKETS)
    p = conninfo_to_dict(uri)
    port, database = int(p.get("port") or 5432), p.get("dbname") or "postgres"
    pg_json = json.dumps({"conn_type": "postgres", "host": p["host"], "port": port, "login": p["user"],
                          "schema": database})
    pg_uri = f"postgres://{p['user']}@{quote(p['host'], safe='')}:{port}/{database}"   # a socket directory as host
    m = mariadb
    _load_mariadb(m, TICKETS)
    maria_uri = f"mysql://{m['user']}:{quote(m['password'], safe='')}@{m['host']}:{m['port']}/{m['database']}" \
                "?charset=utf8mb4"
    maria_json = json.dumps({"conn_type": "mysql", "host": m["host"], "port": m["port"], "login": m["user"],
                             "password": m["password"], "schema": m["database"], "extra": {"charset": "utf8mb4"}})
    # The MariaDB connection with its password through the installed entry point; the other forms in this
    # process (a connection id each, so no form reads another's).
    spec = write(tmp_path, sql_source_spec("warehouse_maria", "tickets"), "warehouse_maria.yaml")
    p = bi("--db", db_url, "submit", spec, env={"AIRFLOW_CONN_WAREHOUSE_MARIA": maria_json})
    out = one_json_line(p)
    assert out["records"] == len(TICKETS)
    assert m["password"] not in p.stdout + p.stderr
    seen = {out["job_version"]}
    for conn_id, value, table in (("warehouse_pg", pg_json, "public.tickets"), ("warehouse_pg_uri", pg_uri, "public.tickets"),
                                  ("warehouse_maria_uri", maria_uri, "tickets")):
        spec = write(tmp_path, sql_source_spec(conn_id, table), f"{conn_id}.yaml")
        out = submit_here(capsys, monkeypatch, db_url, spec, {f"AIRFLOW_CONN_{conn_id.upper()}": value})
        assert out["records"] == len(TICKETS), conn_id
        assert m["password"] not in out["_output"]
        seen.add(out["job_version"])
    assert len(seen) == 1                                         # the same rows: the same version


def test_a_snowflake_connection_as_the_docs_show_it(conn, db_url, tmp_path, monkeypatch, capsys, fakesnow_server):
    """fakesnow speaks HTTP, which the Snowflake hook has no field for: the CLI runs in this process, with
    the hook's connection parameters given ``protocol: http`` (the one thing a real account does not need)."""
    SnowflakeHook = pytest.importorskip("airflow.providers.snowflake.hooks.snowflake").SnowflakeHook
    from batch_inference.cli import main as cli_main
    from tests.integration.test_source_sql import FAKESNOW_PARAMS, _load_snowflake

    s = fakesnow_server
    _load_snowflake(s, TICKETS)
    real = SnowflakeHook._get_conn_params
    monkeypatch.setattr(SnowflakeHook, "_get_conn_params", lambda self: {**real(self), **FAKESNOW_PARAMS})
    monkeypatch.setenv("AIRFLOW_CONN_SUPPORT_SNOWFLAKE", json.dumps({
        "conn_type": "snowflake", "login": "fake", "password": "snow", "schema": "PUBLIC",
        "extra": {"account": "fakesnow", "database": "BI_SRC", "warehouse": "WH", "host": s["host"],
                  "port": s["port"]}}))
    spec = write(tmp_path, sql_source_spec("support_snowflake", "TICKETS"))
    assert cli_main(["--db", db_url, "submit", spec]) == 0
    # In this process Airflow's logging went to the stdout pytest captures before the CLI started; the
    # subprocess tests above show a command's stdout alone.
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["records"] == len(TICKETS)


def test_a_placeholder_no_column_fills_is_refused_at_submit(conn, db_url, tmp_path):
    make_source(conn, tickets(3))
    data = spec_dict(prompt={"template": "Title: <<<{text}>>>\nBody: <<<{body}>>>"})
    line = one_error_line(bi("--db", db_url, "submit", write(tmp_path, data)))
    assert line == ("batch-inference submit: error: spec field '(top level)': 'prompt.template' names {body}, which "
                    "no column fills (the record is one column, source.text_column 'body', filled in as {text}): "
                    "add it to source.columns or take it out of the template")
    assert jobs(conn) == 0


# -- engines, halts, datasets, dead-letter counts, validate -------------------------------------------------


def test_an_engine_name_is_checked_at_submit_whatever_its_form(conn, db_url, tmp_path, capfd):
    make_source(conn, tickets(3))
    line = one_error_line(bi("--db", db_url, "submit", write(tmp_path, spec_dict(engine={"name": "llama.cpp"}))))
    assert line.startswith("batch-inference submit: error: spec field 'engine.name': unknown engine 'llama.cpp': "
                           "did you mean 'llama-cpp'?"), line
    # A dotted path resolves at submit: a module without the class is refused here, not first in a worker.
    line = one_error_line(bi_here(capfd, "--db", db_url, "submit",
                                  write(tmp_path, spec_dict(engine={"name": "tests.fixtures:Nope"}))))
    assert line == ("batch-inference submit: error: spec field 'engine.name': engine 'tests.fixtures:Nope': module "
                    "'tests.fixtures' has no attribute 'Nope'")
    line = one_error_line(bi_here(capfd, "--db", db_url, "submit",
                                  write(tmp_path, spec_dict(engine={"name": "mycorp.engines:Fast"}))))
    assert "module 'mycorp.engines' is not in the allowed engine modules" in line
    assert jobs(conn) == 0
    ok = json_here(bi_here(capfd, "--db", db_url, "submit",
                           write(tmp_path, spec_dict(engine={"name": "tests.fixtures.sources:EchoEngine"}))))
    assert ok["records"] == 3


def test_status_shows_a_halt_that_later_work_cleared_as_past(conn, db_url, tmp_path, capfd):
    make_source(conn, tickets(5))
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec_dict())))["job_version"]
    conn.execute(db.q("halt_job"), {"job": job, "reason": "engine 'llama.cpp' cannot be loaded"})
    p = bi_here(capfd, "--db", db_url, "status", job)
    assert "HALTED by its workers at " in p.stdout, p.stdout
    # The cause fixed, a worker runs the version to the end: the halt is past, not current.
    w = bi_here(capfd, "--db", db_url, "worker", job)
    assert w.returncode == 0, w.stderr
    p = bi("--db", db_url, "status", job)
    assert p.returncode == 0 and "HALTED" not in p.stdout, p.stdout
    assert "5/5 stored" in p.stdout and "an earlier halt at " in p.stdout and " is past (workers worked on it " \
        "again from " in p.stdout and p.stdout.rstrip().endswith(": engine 'llama.cpp' cannot be loaded"), p.stdout
    shown = json_here(bi_here(capfd, "--db", db_url, "status", job, "--json"))
    assert shown["halted_at"] and shown["halt_cleared_at"] and shown["halt_cleared_at"] > shown["halted_at"]


def test_status_shows_a_halt_a_later_resubmit_cleared_as_past(conn, db_url, tmp_path, capfd):
    """The engine misconfigured, the worker halts the version; the user fixes the spec and submits it again.
    From that resubmit the halt is past, with when it was cleared (before, status showed it as current
    until a worker ran), and the version runs to the end."""
    make_source(conn, tickets(5))
    job = json_here(bi_here(capfd, "--db", db_url, "submit",
                            write(tmp_path, spec_dict(engine={"name": "noop", "options": {"bogus": 1}}))))["job_version"]
    w = bi_here(capfd, "--db", db_url, "worker", job)
    assert w.returncode == 4, w.stderr                       # a configuration error: the worker halts the version
    p = bi_here(capfd, "--db", db_url, "status", job)
    assert "; HALTED by its workers at " in p.stdout and "unknown option 'bogus'" in p.stdout, p.stdout
    fixed = bi("--db", db_url, "submit", write(tmp_path, spec_dict(), "fixed.yaml"))
    assert one_json_line(fixed)["job_version"] == job and "applied: engine.options.bogus: 1 -> null" in fixed.stderr, fixed.stderr
    p = bi("--db", db_url, "status", job)
    assert p.returncode == 0 and "HALTED" not in p.stdout, p.stdout
    assert "0/5 stored" in p.stdout and "an earlier halt at " in p.stdout and \
        " is past (cleared by a resubmit that changed its settings at " in p.stdout, p.stdout
    shown = json_here(bi_here(capfd, "--db", db_url, "status", job, "--json"))
    assert shown["halt_cleared_by"] == "resubmit" and shown["halt_cleared_at"] > shown["halted_at"], shown
    # The cutoff watch with no run start to go by (the CLI's) no longer ends on the cleared halt.
    cfg = watchlib.WatchConfig(job_version=job, deadline=datetime.now(UTC) + timedelta(hours=2), warned=True)
    watched = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url), cfg, max_polls=1))
    assert watched["status"] == watchlib.WAIT, watched
    w = bi_here(capfd, "--db", db_url, "worker", job)
    assert w.returncode == 0, w.stderr
    p = bi_here(capfd, "--db", db_url, "status", job)
    assert "5/5 stored" in p.stdout and " is past (cleared by a resubmit that changed its settings at " in p.stdout


def test_published_of_an_unknown_dataset_is_one_line_and_non_zero(conn, db_url, tmp_path, capfd):
    make_source(conn, tickets(3))
    json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec_dict())))
    line = one_error_line(bi("--db", db_url, "published", "tickets_triag"), "published")
    assert line == ("batch-inference published: error: no dataset 'tickets_triag': no job version was ever "
                    "submitted for it; did you mean 'tickets_triage'?")
    p = bi_here(capfd, "--db", db_url, "published", "tickets_triage")   # known, nothing published yet: an answer
    assert p.returncode == 0 and p.stdout == "tickets_triage: nothing published\n", p.stdout


def test_the_submit_json_names_what_its_dead_letter_counts_count(conn, db_url, tmp_path, capfd):
    rows = tickets(4) + [("poison", "[[invalid-output]] always wrong", ["team0"]), ("long", "x" * 150, ["team0"])]
    make_source(conn, rows)
    spec = write(tmp_path, spec_dict(max_input_chars=100))
    first = one_json_line(bi("--db", db_url, "submit", spec))
    assert (first["dead_letters_at_planning"], first["dead_letters_total"]) == (1, 1) and "dead_letters" not in first
    assert bi_here(capfd, "--db", db_url, "worker", first["job_version"]).returncode == 0
    again = json_here(bi_here(capfd, "--db", db_url, "submit", spec))        # the workers dead-lettered one more
    assert again["job_version"] == first["job_version"] and not again["created"]
    assert (again["dead_letters_at_planning"], again["dead_letters_total"]) == (1, 2)


def test_validate_says_its_reason_once_and_its_help_whole(conn, db_url, tmp_path, capfd):
    rows = tickets(4) + [("poison", "[[invalid-output]] always wrong", ["team0"])]
    make_source(conn, rows)
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec_dict())))["job_version"]
    assert bi_here(capfd, "--db", db_url, "worker", job).returncode == 0
    p = bi("--db", db_url, "validate", job)
    assert p.returncode == 1
    text = p.stdout + p.stderr
    assert text.count("dead-letter rate") + text.count("dead letters: 20.00%") == 1, text
    h = bi_here(capfd, "validate", "--help", env={"COLUMNS": "100"})
    assert "coverage, schema, dead letters, drift and a sample; exit 0 if the version passed, 1 if it failed" in \
        " ".join(h.stdout.split()), h.stdout


# -- issue 45, item 4: the traps a new user met, each refused in one line with the next step --------------


def test_a_wrong_model_digest_is_refused_at_submit_where_the_weights_are_here(conn, db_url, tmp_path, capfd):
    """The worker's own check (``pinning.verify_weights``) runs at submit where the weights are: a wrong
    digest is one line and no job version; weights that are elsewhere (a pod's mount) are said to be
    unchecked, in the JSON line and a note on stderr."""
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256, default_gguf_path

    make_source(conn, tickets(3))
    model, llama = {"name": "SmolLM2-135M-Instruct", "digest": "1" * 64}, {"name": "llama-cpp"}
    line = one_error_line(bi("--db", db_url, "submit", write(tmp_path, spec_dict(model=model, engine=llama))))
    assert line == (f"batch-inference submit: error: model 'SmolLM2-135M-Instruct' weights digest mismatch: expected "
                    f"sha256 {'1' * 64}, got {SMOLLM2_GGUF_SHA256} for {default_gguf_path()}; nothing submitted: "
                    "set model.digest to their `sha256sum`")
    assert jobs(conn) == 0
    away = tmp_path / "mounted-in-the-pod" / "model.gguf"
    p = bi("--db", db_url, "submit", write(tmp_path, spec_dict(model={**model, "path": str(away)}, engine=llama)))
    out = one_json_line(p)
    assert out["weights"] == (f"not checked here (model weights file not found: {away}): each worker checks them "
                              "before it loads"), out
    assert p.stderr.splitlines()[-1] == f"note: model weights {out['weights']}"
    right = spec_dict(model={**model, "digest": SMOLLM2_GGUF_SHA256}, engine=llama)
    assert json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, right)))["weights"] == \
        f"verified sha256 {SMOLLM2_GGUF_SHA256}"


def test_max_tokens_too_small_for_the_schema_halts_the_job_naming_the_setting(conn, db_url, tmp_path, capfd):
    """The real model with max_tokens 4: no answer fits the output schema. After HALT_AFTER_DEAD records
    in a row dead-lettered 'output truncated', the worker halts the version (exit 4) with one page naming
    params.max_tokens; the records after them stay pending with no attempt spent."""
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256
    from gpu_runner.worker import HALT_AFTER_DEAD

    make_source(conn, tickets(HALT_AFTER_DEAD + 5))
    spec = spec_dict(model={"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
                     engine={"name": "llama-cpp", "options": {"n_ctx": 512}}, params={"temperature": 0, "max_tokens": 4},
                     shard_size=5)
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec)))["job_version"]
    w = bi("--db", db_url, "worker", job, timeout=600)
    page = (f"{HALT_AFTER_DEAD} records in a row dead-lettered 'output truncated at max_tokens' after 3 attempts "
            "each, none stored between: params.max_tokens (4) is too small for what the output schema asks; raise "
            "params.max_tokens in the spec and submit it again (a new job version)")
    assert w.returncode == 4 and w.stderr.splitlines()[-1] == f"batch-inference worker: error: {page}", \
        w.stderr[-2000:]
    shown = json_here(bi_here(capfd, "--db", db_url, "status", job, "--json"))
    assert shown["halt_reason"] == f"fatal: {page}" and shown["halted_at"] and not shown["halt_cleared_at"], shown
    assert (shown["dead_letters"], shown["stored"], shown["outstanding"]) == (HALT_AFTER_DEAD, 0, 5), shown
    spent = conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s AND attempts > 0 AND "
                         "record_id NOT IN (SELECT record_id FROM bi.dead_letters WHERE job_version = %s)",
                         (job, job)).fetchone()["n"]
    assert spent == 0


def test_an_unknown_job_version_and_an_unknown_connection_name_the_next_step(conn, db_url, tmp_path, empty_db,
                                                                           capfd):
    fresh = empty_db()                  # a database nothing was submitted to: the worker migrates nothing
    line = one_error_line(bi("--db", fresh, "worker", "jv_0000000000000000"), "worker")
    assert line == ("batch-inference worker: error: schema \"bi\" does not exist: this database has no ledger yet; "
                    "`batch-inference submit SPEC` creates it (with the same --db)")
    w = bi_here(capfd, "--db", db_url, "worker", "jv_0000000000000000")
    assert w.returncode == 4 and one_error_line(w, "worker") == (
        "batch-inference worker: error: no job version 'jv_0000000000000000' in this database: `batch-inference "
        "submit SPEC` creates one and prints its id; pass that id (and the same --db) here and to "
        "`batch-inference status`"), w.stderr
    line = one_error_line(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, sql_source_spec("my_reviews"))))
    assert "Airflow connection 'my_reviews': " in line and line.endswith(
        "; define it as the environment variable AIRFLOW_CONN_MY_REVIEWS (a URI or JSON, docs/sources.md) or with "
        "`airflow connections add my_reviews --conn-uri URI`"), line
    assert jobs(conn) == 0


def test_a_null_or_duplicate_id_read_through_a_connection_is_one_line_with_nothing_before_it(conn, db_url, tmp_path,
                                                                                               empty_db, capfd):
    """The source's own 'row(s) read' line is debug, not info, and so is the line naming the migrations a
    first command applies to a new database: the refusal is the only line on stderr (the installed
    command's on the new database; estimate's and the duplicate's in this process)."""
    path = tmp_path / "reviews.db"
    env = {"AIRFLOW_CONN_MY_REVIEWS": json.dumps({"conn_type": "sqlite", "host": str(path)})}
    spec = write(tmp_path, sql_source_spec("my_reviews"))
    for n, (url, extra, said) in enumerate((
            (empty_db(), (None, "No id", "a row without an id", None), "row(s) with a NULL id"),
            (db_url, (TICKETS[0][0], "Again", "the first id once more", None), "duplicate ids in column 'id'"))):
        _load_sqlite(path, [*TICKETS, extra])
        line = one_error_line(bi("--db", url, "submit", spec, env=env) if n == 0 else
                              bi_here(capfd, "--db", url, "submit", spec, env=env))
        assert said in line, line
        if extra[0] is None:          # estimate, run first, refuses what submit will
            assert one_error_line(bi_here(capfd, "--db", url, "estimate", spec, env=env), "estimate") == \
                line.replace("submit: error", "estimate: error")
    assert jobs(conn) == 0


def test_an_embedding_size_the_model_does_not_make_is_one_line_with_no_llama_cpp_log_before_it(conn, db_url, tmp_path):
    from tests.integration.test_embed import embed_spec

    make_source(conn, tickets(3))
    line = one_error_line(bi("--db", db_url, "submit", write(tmp_path, embed_spec(embedding={"dimensions": 384}))))
    assert "makes 576-dimensional embeddings; the spec's embedding.dimensions is 384" in line, line
    assert jobs(conn) == 0


def test_a_ladder_job_is_billed_rung_by_rung_in_cost_and_the_dashboard(conn, db_url, tmp_path, capfd):
    """Each rung's answers (bi.ladder_answers) times its price, not the stored rows at one per-row price."""
    from batch_inference.ui import data as dashboard
    from benchmarks.ladder import PRICES, known_ladder, ticket_rows, ticket_tables

    ticket_tables(conn, ticket_rows(30, hard_share=0.4), [])
    env = {"BATCH_INFERENCE_ENGINE_MODULES": "benchmarks.ladder"}
    spec = write(tmp_path, known_ladder("public.tickets", None, thresholds=(0.9,), shard_size=10))
    job = json_here(bi_here(capfd, "--db", db_url, "submit", spec, env=env))["job_version"]
    assert bi_here(capfd, "--db", db_url, "worker", job, env=env).returncode == 0
    answered = {r["rung"]: r["n"] for r in conn.execute(
        "SELECT rung, count(*) AS n FROM bi.ladder_answers WHERE job_version = %s GROUP BY rung", (job,))}
    assert answered[1] == 30 and 0 < answered[2] < 30, answered          # some records went on to rung 2
    bill = answered[1] * PRICES["cheap"] + answered[2] * PRICES["dear"]
    out = one_json_line(bi("--db", db_url, "cost", job, "--json"))
    so_far = out["so_far"]
    assert [(r["rung"], r["answers"], r["cost_per_row"]) for r in so_far["rungs"]] == \
        [(1, answered[1], PRICES["cheap"]), (2, answered[2], PRICES["dear"])]
    assert so_far["batch_cost"] == round(bill, 2) and so_far["total"] == round(bill, 2), so_far
    assert abs(sum(r["cost"] for r in so_far["rungs"]) - bill) < 1e-9
    text = bi_here(capfd, "--db", db_url, "cost", job).stdout
    assert f"rung 2 known-dear {answered[2]:,} answers x $0.004 = ${answered[2] * PRICES['dear']:,.4f}" in text, text
    assert dashboard.cost(conn, job)["so_far"] == so_far                 # the dashboard reads the same bill


def test_estimate_says_which_prices_its_bill_took(conn, db_url, tmp_path, capfd):
    make_source(conn, tickets(4))
    p = bi("--db", db_url, "estimate", write(tmp_path, spec_dict()))
    out = one_json_line(p)
    said = ("batch rows at cost.batch_per_row $0.003625 (default); fallback rows at cost.fallback_per_row $0.00725 "
            "(default): the defaults are the seed workload's prices for a GPU fleet and a hosted API, not what this "
            "run costs on this machine; set cost.batch_per_row and cost.fallback_per_row in the spec (0 for rows run "
            "on your own CPU) to price yours")
    assert out["bill"]["prices"] == said and f"  prices        {said}" in p.stderr.splitlines(), p.stderr
    own = json_here(bi_here(capfd, "--db", db_url, "estimate", write(tmp_path, spec_dict(
        cost={"batch_per_row": 0, "fallback_per_row": 0.002}))))
    assert own["bill"]["prices"] == "batch rows at cost.batch_per_row $0; fallback rows at cost.fallback_per_row $0.002"
    assert own["bill"]["planned"]["total"] == "0.00"


def test_estimate_counts_a_ladder_with_each_rungs_tokenizer_and_prices_it_rung_by_rung(conn, db_url, tmp_path):
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256
    from batch_inference.estimate.tokens import LlamaCppCounter
    from batch_inference.ladder.rungs import rung_spec
    from batch_inference.prompting import build_messages
    from batch_inference.spec import parse_spec

    rows = tickets(5)
    make_source(conn, rows)

    def rung(n_ctx: int, price: float) -> dict[str, Any]:
        return {"model": {"name": "SmolLM2-135M-Instruct", "digest": SMOLLM2_GGUF_SHA256},
                "engine": {"name": "llama-cpp", "options": {"n_ctx": n_ctx}},
                "params": {"temperature": 0, "max_tokens": 32}, "cost_per_row": price}

    d = {k: v for k, v in spec_dict(models=[rung(512, 0.0005), rung(1024, 0.0015)]).items()
         if k not in ("model", "engine", "params")}
    p = bi("--db", db_url, "estimate", write(tmp_path, d))
    out = one_json_line(p)
    spec = parse_spec(d)
    assert out["exact"] is True and out["tokenizer"] == ("rung 1: llama.cpp vocabulary of SmolLM2-135M-Instruct.Q4_1.gguf; "
                                                         "rung 2: llama.cpp vocabulary of SmolLM2-135M-Instruct.Q4_1.gguf")
    lad = out["bill"]["ladder"]
    assert lad["reach_source"] == "no thresholds: every record is asked at every rung"
    for no, r in enumerate(lad["rungs"], 1):
        counter = LlamaCppCounter(rung_spec(spec, spec.models[no - 1]))
        try:
            exact = sum(len(counter.count(build_messages(spec, text))) for _, text, _ in rows)
        finally:
            counter.close()
        assert (r["answered"], r["answers"], r["input_tokens"]) == (5, 5, exact), r
    assert [r["cost"] for r in lad["rungs"]] == ["0.00", "0.01"]              # 5 x $0.0005, 5 x $0.0015
    assert out["bill"]["all_batch"]["batch"] == "0.01"                         # $0.01 in all, not 5 x $0.003625
    assert out["bill"]["prices"].startswith("each rung's answers at its models[].cost_per_row; ")
    assert "  rungs         rung 1 SmolLM2-135M-Instruct: 5 records asked, " in p.stderr, p.stderr


def test_calibrate_out_writes_the_spec_as_written_with_its_thresholds(conn, db_url, tmp_path):
    """--out keeps the spec's comments, order and layout: only each rung's threshold changes. On the way
    calibrate says how far it is, as the worker does (status.Progress): records done, rate, time left."""
    import re

    from benchmarks.ladder import known_ladder, ticket_rows, ticket_tables

    ticket_tables(conn, ticket_rows(20, hard_share=0.3), ticket_rows(20, hard_share=0.3, prefix="g"))
    data = known_ladder("public.tickets", "public.golden")
    for rung in data["models"]:
        del rung["threshold"]
    text = ("# our ladder: the cheap model first, the dear one for what it is unsure of\n"
            + yaml.safe_dump(data, sort_keys=False).replace("cost_per_row: 0.004\n", "cost_per_row: 0.004  # dear\n"))
    spec = tmp_path / "ladder.yaml"
    spec.write_text(text)
    out = tmp_path / "calibrated.yaml"
    p = bi("--db", db_url, "calibrate", str(spec), "--out", str(out), "--json",
           env={"BATCH_INFERENCE_ENGINE_MODULES": "benchmarks.ladder"})
    report = one_json_line(p)
    assert re.search(r"calibrate: rung 2 of 2 \(known-dear\), golden records asked at every rung: 40/40 \(100%\), "
                     r"[\d.]+ records/s, ETA 0m00s$", p.stderr, re.M), p.stderr
    threshold = report["thresholds"][0]
    assert threshold is not None
    written = out.read_text()
    lines, before = written.splitlines(), text.splitlines()
    added = [line for line in lines if line not in before]
    assert added == [f"  threshold: {float(threshold)!r}"], added          # one line, in the first rung
    assert [line for line in lines if line not in added] == before           # everything else as written
    from batch_inference.spec import load_spec

    assert load_spec(out).spec_hash == report["spec_hash"]


def test_a_golden_set_for_source_columns_is_read_and_rendered_as_the_job_reads_a_record(conn, db_url, tmp_path,
                                                                                         capfd):
    """One reader of a golden set (evaluation.golden_rows, calibrate's too): with source.columns a golden
    record is those columns, rendered by the golden run as the job renders a record; a golden set of one
    text column does not fit such a spec and validate says so in one line naming it and its shape, not
    prompt.template."""
    from batch_inference.evaluation import golden_rows
    from batch_inference.exceptions import InvalidValue
    from batch_inference.ladder.calibrate import golden_rows as calibrate_rows
    from batch_inference.prompting import columns_text, render_record
    from batch_inference.spec import parse_spec
    from psycopg.types.json import Jsonb
    from tests.fixtures.sources import expected_turn

    conn.execute("CREATE TABLE public.tickets (id text, subject text, body text, acl text[])")
    conn.execute("CREATE TABLE public.golden (id text, subject text, body text, expected jsonb)")
    conn.execute("CREATE TABLE public.golden_text (id text, body text, expected jsonb)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO public.tickets VALUES (%s, %s, %s, %s)", TICKETS)
        cur.executemany("INSERT INTO public.golden VALUES (%s, %s, %s, %s)",
                        [(f"g{rid}", subject, body, Jsonb({"category": "other"})) for rid, subject, body, _ in TICKETS])
        cur.executemany("INSERT INTO public.golden_text VALUES (%s, %s, %s)",
                        [(f"g{rid}", body, Jsonb({"category": "other"})) for rid, _, body, _ in TICKETS])
    base = two_column_spec({"table": "public.tickets"}).model_dump(mode="json", exclude_none=True)

    def with_golden(table: str, **golden: Any) -> dict[str, Any]:
        return {**base, "evaluation": {"golden": {"table": table, "run": "engine", **golden},
                                       "min_accuracy": {"category": 0.5}}}

    good = with_golden("public.golden")
    spec = parse_spec(good)
    rows = golden_rows(conn, spec)
    assert rows == calibrate_rows(conn, spec)
    for (rid, subject, body, _), row in zip(TICKETS, rows):
        assert row["text"] == columns_text([subject, body])
        assert render_record(spec, row["text"])[:200] == expected_turn(subject, body)
    env = {"BATCH_INFERENCE_ENGINE_MODULES": "tests.fixtures"}
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, good), env=env))["job_version"]
    assert bi_here(capfd, "--db", db_url, "worker", job, env=env).returncode == 0
    report = one_json_line(bi("--db", db_url, "validate", job, "--json", env=env))
    golden = report["evaluation"]["golden"]
    assert golden["mode"] == "engine" and golden["graded"] == len(TICKETS), golden
    seen = {r["record_id"]: r["output"]["summary"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (golden["job_version"],))}
    assert seen == {f"g{rid}": expected_turn(subject, body) for rid, subject, body, _ in TICKETS}

    plain = with_golden("public.golden_text", text_column="body")
    shape = ("golden set public.golden_text does not fit the spec: column \"subject\" does not exist; it needs the "
             "columns id, subject, body, expected (a JSON object with some or all of the output's fields): with "
             "source.columns a golden record is the same columns as a source record, not one text "
             "(docs/evaluation.md, a golden set for columns)")
    with pytest.raises(InvalidValue) as info:
        calibrate_rows(conn, parse_spec(plain))
    assert str(info.value) == f"calibrate: {shape}"
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, plain, "plain.yaml"), env=env))[
        "job_version"]
    assert bi_here(capfd, "--db", db_url, "worker", job, env=env).returncode == 0
    p = bi("--db", db_url, "validate", job, env=env)
    assert p.returncode == 1 and f"evaluation: {shape}" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "prompt.template" not in p.stdout + p.stderr


def test_estimate_says_how_far_it_is(conn, monkeypatch, caplog):
    """Progress for the long commands, made as the worker's (status.Progress): records done, rate, time left
    (calibrate's line is checked on test_calibrate_out_writes_the_spec_as_written_with_its_thresholds's run)."""
    import logging

    import importlib

    from batch_inference.spec import parse_spec
    from benchmarks.ladder import ticket_rows, ticket_tables

    ticket_tables(conn, ticket_rows(20, hard_share=0.3), ticket_rows(20, hard_share=0.3, prefix="g"))
    preview_mod = importlib.import_module("batch_inference.estimate.preview")
    monkeypatch.setattr(preview_mod, "PROGRESS_EVERY", 8)
    with caplog.at_level(logging.INFO, logger="batch_inference.estimate"):
        preview_mod.preview(conn, parse_spec(spec_dict(source={"table": "public.tickets", "text_column": "body",
                                                              "acl_column": None})))
    lines = [r.getMessage() for r in caplog.records if r.name == "batch_inference.estimate"]
    assert [line.split(",")[0] for line in lines] == ["estimate: 8", "estimate: 16"], lines
    assert all(line.endswith("records/s records read, judged and counted so far") for line in lines), lines


def test_identical_inputs_in_a_job_are_embedded_once_and_share_their_vector(conn, db_url, tmp_path, capfd):
    """llama.cpp's vector for a text depends on the batch it lands in: identical rendered inputs are computed
    once and the result is stored under each record id (one row each, I1), counted in status."""
    from tests.integration.test_embed import embed_spec

    same = "My card was charged twice for one order."
    rows = [("d1", same, ["a"]), ("u1", "The app crashes when I save.", ["a"]), ("d2", same, ["b"]),
            ("u2", "I cannot log in since the update.", ["a"]), ("d3", same, ["a"])]
    make_source(conn, rows)
    spec = embed_spec(embedding={"dimensions": 576, "pooling": "last"})
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec)))["job_version"]
    w = bi_here(capfd, "--db", db_url, "worker", job)
    assert w.returncode == 0, w.stderr
    stored = {r["record_id"]: bytes(r["embedding"]) for r in conn.execute(
        "SELECT record_id, embedding FROM bi.results WHERE job_version = %s", (job,))}
    assert sorted(stored) == ["d1", "d2", "d3", "u1", "u2"]                   # one row a record id
    assert stored["d1"] == stored["d2"] == stored["d3"] and stored["u1"] != stored["d1"]
    shown = json_here(bi_here(capfd, "--db", db_url, "status", job, "--json"))
    assert (shown["stored"], shown["computed_once"]) == (5, 2), shown
    assert "5/5 stored (0 by fallback, 0 reused, 2 computed once for an identical input)" in \
        bi("--db", db_url, "status", job).stdout


def test_identical_inputs_fail_together_each_with_its_own_dead_letter(conn, db_url, tmp_path, capfd):
    """An answer that fails is a failed attempt of each record asked the same thing: identical records are
    dead-lettered together after the same attempts, each with its error and raw output."""
    rows = tickets(3) + [("p1", "[[invalid-output]] the same", ["team0"]), ("p2", "[[invalid-output]] the same",
                                                                            ["team1"])]
    make_source(conn, rows)
    job = json_here(bi_here(capfd, "--db", db_url, "submit", write(tmp_path, spec_dict())))["job_version"]
    assert bi_here(capfd, "--db", db_url, "worker", job).returncode == 0
    dead = {r["record_id"]: r for r in conn.execute(
        "SELECT record_id, attempts, reason, raw_output FROM bi.dead_letters WHERE job_version = %s", (job,))}
    assert sorted(dead) == ["p1", "p2"] and dead["p1"]["attempts"] == dead["p2"]["attempts"] == 3
    assert dead["p1"]["reason"] == dead["p2"]["reason"] and dead["p1"]["raw_output"] == dead["p2"]["raw_output"]
    shown = one_json_line(bi("--db", db_url, "status", job, "--json"))
    assert (shown["stored"], shown["dead_letters"], shown["computed_once"]) == (3, 2, 0), shown


def test_a_worker_that_refuses_to_start_says_so_in_one_plain_line_with_its_exit_status(conn, db_url, tmp_path,
                                                                                       capfd):
    """Each start-up refusal of `batch-inference worker` is one line on stderr as every command's is, nothing
    before it and no log prefix, with the worker's exit status (exits.ExitCode) unchanged; a configuration
    error in the spec still halts the version with the reason; a flag the worker refuses is the CLI's bad
    input (exit 2)."""
    make_source(conn, tickets(3))
    job = json_here(bi_here(capfd, "--db", db_url, "submit",
                            write(tmp_path, spec_dict(engine={"name": "noop", "options": {"bogus": 1}}))))["job_version"]
    w = bi("--db", db_url, "worker", job)
    assert w.returncode == 4 and one_error_line(w, "worker").startswith(
        "batch-inference worker: error: engine 'noop': unknown option 'bogus' (known: "), w.stderr
    assert json_here(bi_here(capfd, "--db", db_url, "status", job, "--json"))["halt_reason"].startswith(
        "fatal: engine 'noop'")
    w = bi("--db", db_url, "worker", job, "--engine-option", "delay_s")
    assert w.returncode == 2 and one_error_line(w, "worker") == (
        "batch-inference worker: error: --engine-option 'delay_s': expected KEY=VALUE"), w.stderr
    w = bi("--db", "postgresql://nobody@127.0.0.1:1/none", "worker", job, "--db-retries", "0")
    assert w.returncode == 2 and one_error_line(w, "worker").startswith("batch-inference worker: error: "), w.stderr
