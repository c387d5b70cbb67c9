"""The rule a value becomes text by (``sources.to_text``, docs/sources.md) is PostgreSQL's own ``::text``:
each value below, read back from the real server by psycopg as a Python value, becomes the text the
server writes for it, so the same rows give the same snapshot whether PostgreSQL or Python casts them."""

from __future__ import annotations

import pytest

from batch_inference.sources import to_acl, to_text

CASES = [
    "42::int8", "-7::int4", "1.50::numeric", "100::numeric", "1e20::numeric", "0.000001::numeric",
    "0.1::float8", "1::float8", "123.456::float8", "1e15::float8", "1e16::float8", "1.5e20::float8",
    "1e-5::float8", "0.0001::float8", "-2.5e-7::float8", "'NaN'::float8", "'Infinity'::float8",
    "'-Infinity'::float8", "5e-324::float8", "1.7976931348623157e308::float8",
    "true", "false", "'2026-12-05'::date", "'2026-12-05 22:00:00'::timestamp",
    "'2026-12-05 22:00:00.5'::timestamp", "'2026-12-05 22:00:00.123456'::timestamp",
    "'2026-12-05 22:00:00.25+02'::timestamptz", "'22:00:00.5'::time",
    "'123e4567-e89b-12d3-a456-426614174000'::uuid",
    """'{"b": [1, 2.5, "x"], "aa": {"z": null, "y": true}, "a": "ü"}'::jsonb""", "'[1, {\"k\": \"v\"}]'::jsonb",
    "'plain text ✓'::text",
]


@pytest.mark.parametrize("expr", CASES)
def test_a_value_becomes_the_text_postgresql_writes_for_it(conn, expr):
    conn.execute("SET TIME ZONE 'UTC'")
    row = conn.execute(f"SELECT {expr} AS v, ({expr})::text AS t").fetchone()
    assert to_text(row["v"]) == row["t"]


@pytest.mark.parametrize("value", [b"\x00\xff", memoryview(b"ab"), object()])
def test_what_cannot_become_text_is_refused(value):
    with pytest.raises(TypeError, match="cannot become text"):
        to_text(value)


def test_an_acl_is_a_list_a_json_array_as_text_or_one_value():
    assert to_acl(["a", 1]) == ["a", "1"]
    assert to_acl('["a", "b"]') == ["a", "b"]
    assert to_acl("support") == ["support"]
    assert to_acl(None) is None
