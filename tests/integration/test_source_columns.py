"""Records of several columns: the template names each column, each is delimited and escaped as
{text} is, max_input_chars bounds the whole record, and the content hash covers every column and
the ACL, whether the ledger reads the columns in SQL or a reader brings them as Python rows."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import pytest

from batch_inference.exceptions import SpecError
from batch_inference.plan import submit
from batch_inference.prompting import render_record
from batch_inference.sources import record
from batch_inference.spec import parse_spec
from tests.conftest import spec_dict
from tests.fixtures.sources import TICKETS, expected_turn, run_end_to_end, two_column_spec

# Characters whose JSON escapes must be written alike by PostgreSQL and Python.
AWKWARD = 'q"uote \\ back\nline\ttab\rcr\x01\x1f\x7f ünï ✓ 😀 \u2028 </script> {body} %s %%'


def make_tickets(conn, rows=TICKETS, table="public.tickets2"):
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute(f"CREATE TABLE {table} (id text, subject text, body text, acl text[])")
    with conn.cursor() as cur:
        cur.executemany(f"INSERT INTO {table} VALUES (%s, %s, %s, %s)", rows)
    return table


def python_rows(spec, rows=TICKETS):
    return [record(spec, r[0], [r[1], r[2]], r[3]) for r in rows]


def test_a_two_column_job_runs_end_to_end_and_the_model_sees_both_columns(conn, db_url):
    spec = two_column_spec({"table": make_tickets(conn)})
    job, seen = run_end_to_end(conn, db_url, spec)
    assert seen == {r[0]: expected_turn(r[1], r[2]) for r in TICKETS}
    assert "> > >" in seen["t2"] and seen["t2"].count(">>>") == 2   # only where the template puts it
    stored = conn.execute("SELECT text FROM bi.snapshot_rows WHERE job_version = %s AND record_id = 't1'",
                          (job,)).fetchone()["text"]
    assert stored == '["Charged twice", "My card was charged twice for one order."]'


def test_sql_and_python_reads_of_the_same_columns_are_one_job_version(conn):
    rows = [*TICKETS, ("t4", AWKWARD, AWKWARD[::-1], ["x"]), ("t5", None, "only a body", None)]
    spec = two_column_spec({"table": make_tickets(conn, rows)})
    in_sql = submit(conn, spec)
    from_python = submit(conn, spec, rows=python_rows(spec, rows))
    assert from_python.job_version == in_sql.job_version and not from_python.created
    query = two_column_spec({"query": "SELECT id, subject, body, acl FROM public.tickets2"})
    assert submit(conn, query).job_version == in_sql.job_version


@pytest.mark.parametrize("change", ["subject", "body", "acl"])
def test_the_content_hash_covers_every_column_and_the_acl(conn, change):
    spec = two_column_spec({"table": make_tickets(conn)})
    before = submit(conn, spec).job_version
    if change == "acl":
        conn.execute("UPDATE public.tickets2 SET acl = ARRAY['other'] WHERE id = 't3'")
    else:
        conn.execute(f"UPDATE public.tickets2 SET {change} = {change} || '!' WHERE id = 't3'")
    assert submit(conn, spec).job_version != before


@pytest.mark.parametrize("where", ["sql", "python"])
def test_max_input_chars_bounds_the_whole_record_and_a_blank_record_is_empty(conn, where):
    rows = [("ok", "a" * 10, "b" * 10, None), ("long", "a" * 10, "b" * 11, None), ("blank", " ", None, None)]
    spec = two_column_spec({"table": make_tickets(conn, rows)}, max_input_chars=20)
    m = submit(conn, spec) if where == "sql" else submit(conn, spec, rows=python_rows(spec, rows))
    assert (m.records, m.dead_letters) == (3, 2)
    reasons = {r["record_id"]: r["reject"] for r in conn.execute(
        "SELECT record_id, reject FROM bi.snapshot_rows WHERE job_version = %s", (m.job_version,))}
    assert reasons == {"ok": None, "long": "input over the length cap (21 characters > 20)",
                       "blank": "empty text"}


def test_render_cuts_the_record_as_a_whole_and_leaves_braces_in_values_alone():
    spec = two_column_spec({"table": "public.t"}, max_input_chars=17)
    spec = spec.with_overrides(prompt={**spec.prompt.model_dump(), "template": "{subject} | {body}"})
    text = record(spec, "1", ["subject-1", "{body} text"], None)["text"]
    assert render_record(spec, text) == "subject-1 | {body} t"
    # A placeholder no column fills is refused (it would reach the model as written).
    with pytest.raises(SpecError, match=r"names \{other\}, \{text\}, which no column fills \(source.columns are "
                                        r"subject, body\)"):
        spec.with_overrides(prompt={**spec.prompt.model_dump(), "template": "{subject} | {body} | {other} {text}"})


def test_a_template_must_name_each_column_and_a_text_template_needs_text():
    d = spec_dict()
    d["source"] = {**d["source"], "columns": ["subject", "body"]}
    d["prompt"] = {**d["prompt"], "template": "<<<{subject}>>>"}
    with pytest.raises(SpecError, match=r"\{body\} missing"):
        parse_spec(d)
    d = spec_dict(prompt={"template": "<<<{subject}>>>"})
    with pytest.raises(SpecError, match=r"'prompt.template' must contain the placeholder \{text\}"):
        parse_spec(d)
