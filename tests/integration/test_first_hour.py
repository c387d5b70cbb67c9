"""A new user's first hour, as each step went wrong when tried (issue 33, item 8), on the real
embedded PostgreSQL and the real CLI: every problem of a spec listed, one line each; a misspelled
engine refused at submit; a second statement in source.query refused as such; `status` showing the
workers' halt and its reason."""

from __future__ import annotations

import json

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
        "'llama-cpp'? use one of llama-cpp, vllm, openai, noop, openai-batch, anthropic-batch, bedrock-batch, or a "
        "dotted path package.module:ClassName\n")
    assert jobs(conn) == 0
    # A dotted path keeps its form check here and its import where the engine runs.
    assert cli_main(["--db", db_url, "submit", write_spec(tmp_path, engine={"name": "tests.fixtures:Nope"})]) == 0


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
