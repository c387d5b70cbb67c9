"""Planning on the real embedded PostgreSQL: which records are rejected, and
how the rest are cut into shards.

snapshot_insert tests blank and over-long texts in a form that reads as little
of each text as it can (docs/performance.md); these tests hold it to the plain
definitions it replaced, ``btrim(text, E' \\t\\n\\r\\f\\x0b') = ''`` and
``length(text) > cap``, evaluated by PostgreSQL on the same texts, including
Unicode spaces btrim does not strip, multibyte characters at the cap and long
texts stored compressed or out of line. Shard sizes are computed from counts
rather than counted; they are checked here against the snapshot rows.
"""

from __future__ import annotations

import psycopg
import pytest

from batch_inference.plan import submit
from batch_inference.status import dead_letters
from tests.conftest import make_source, make_spec, tickets

CAP = 12
BLANKS = " \t\n\r\f\x0b"

TEXTS = {
    "empty": "",
    "space": " ",
    "ascii-blanks": BLANKS * 3,
    "vt-ff-only": "\x0b\x0c",
    "nbsp": "\u00a0",                       # Unicode spaces btrim's set does not hold: not blank
    "em-space": "\u2003",
    "ideographic-space": "\u3000",
    "nel": "\u0085",
    "zero-width": "\u200b",
    "line-separator": " \u2028 ",
    "blank-then-letter": BLANKS + "a",
    "blank-then-nbsp": "\t\u00a0",
    "letter-then-blank": "a" + BLANKS,
    "letter": "v",
    "long-blank": " " * 30_000,              # compressed in the snapshot: the slice and the full test
    "long-blank-then-letter": " " * 30_000 + "x",
    "long-tab-then-nbsp": "\t" * 30_000 + "\u00a0",
    "at-cap-ascii": "a" * CAP,
    "over-cap-ascii": "a" * (CAP + 1),
    "at-cap-2-bytes": "é" * CAP,            # 2 * CAP bytes, CAP characters: not over
    "over-cap-2-bytes": "é" * (CAP + 1),
    "at-cap-4-bytes": "😀" * CAP,
    "over-cap-4-bytes": "😀" * (CAP + 1),
    "at-cap-mixed": "é😀a" * (CAP // 3),
    "under-cap-bytes-over": "日本語" * (CAP // 3),   # 3 * CAP bytes
    "blank-and-over-cap": " " * (CAP + 1),      # blank wins, as before
    "long-random": "".join(chr(0x4e00 + (i * 7919) % 20000) for i in range(9000)),  # out of line, incompressible
}


def _expected(conn, cap: int) -> dict[str, str]:
    """The reject reasons of the old, plain definitions, computed by PostgreSQL."""
    rows = conn.execute(
        """SELECT id, CASE WHEN body IS NULL OR btrim(body, E' \\t\\n\\r\\f\\x0b') = '' THEN 'empty text'
                           WHEN length(body) > %(cap)s
                           THEN format('input over the length cap (%%s characters > %%s)', length(body), %(cap)s)
                      END AS reason
             FROM public.tickets""", {"cap": cap}).fetchall()
    return {r["id"]: r["reason"] for r in rows if r["reason"] is not None}


@pytest.mark.parametrize("cap", [CAP, 100_000])
def test_blank_and_over_cap_rejects_match_btrim_and_length(conn, cap):
    make_source(conn, [*tickets(2), *((k, v, None) for k, v in TEXTS.items()), ("null", None, None)])
    m = submit(conn, make_spec(max_input_chars=cap))
    dl = {d["record_id"]: d for d in dead_letters(conn, m.job_version)}
    got = {k: d["reason"] for k, d in dl.items()}
    want = _expected(conn, cap)
    assert got == want
    assert m.dead_letters == len(want) and m.records == len(TEXTS) + 3
    # Spot checks of the definitions themselves, so the test cannot pass vacuously.
    assert want["null"] == want["long-blank"] == want["vt-ff-only"] == want["blank-and-over-cap"] == "empty text"
    for key in ("nbsp", "em-space", "ideographic-space", "nel", "zero-width", "line-separator",
                "blank-then-letter", "long-blank-then-letter", "long-tab-then-nbsp", "long-random"):
        assert got.get(key) != "empty text", key
    for key in ("at-cap-ascii", "at-cap-2-bytes", "at-cap-4-bytes", "at-cap-mixed", "under-cap-bytes-over"):
        assert key not in got, key
    if cap == CAP:
        assert got["over-cap-4-bytes"] == f"input over the length cap ({CAP + 1} characters > {CAP})"
        assert got["long-random"] == f"input over the length cap (9000 characters > {CAP})"
        assert dl["over-cap-2-bytes"]["stage"] == "plan" and dl["empty"]["stage"] == "snapshot"
    else:
        assert "long-random" not in got and "long-blank-then-letter" not in got


def test_rejects_from_rows_read_in_python_keep_their_reason(conn):
    rows = [{"record_id": "nul", "text": "a\x00b"}, {"record_id": "blank", "text": "\u3000"},
            {"record_id": "tab", "text": "\t"}, {"record_id": "ok", "text": "fine"}]
    m = submit(conn, make_spec(max_input_chars=CAP), rows)
    got = {d["record_id"]: d["reason"] for d in dead_letters(conn, m.job_version)}
    assert got == {"nul": "text contains NUL bytes", "tab": "empty text"}


def _shards(conn, job: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    planned = [(r["shard_no"], r["records"]) for r in conn.execute(
        "SELECT shard_no, records FROM bi.shards WHERE job_version = %s ORDER BY shard_no", (job,))]
    actual = [(r["shard_no"], r["n"]) for r in conn.execute(
        "SELECT shard_no, count(*) AS n FROM bi.snapshot_rows WHERE job_version = %s AND shard_no IS NOT NULL "
        "GROUP BY shard_no ORDER BY shard_no", (job,))]
    return planned, actual


@pytest.mark.parametrize("n,shard_size,rejects", [
    (1, 10, 0), (10, 10, 0), (11, 10, 0), (95, 10, 7), (100, 7, 30), (50, 1, 3), (40, 1000, 5)])
def test_shard_sizes_are_the_counted_ones(conn, n, shard_size, rejects):
    blank = set(range(0, n, max(1, n // rejects))[:rejects]) if rejects else set()   # spread over the source
    rows = [(rid, "" if i in blank else text, acl) for i, (rid, text, acl) in enumerate(tickets(n))]
    make_source(conn, rows)
    m = submit(conn, make_spec(shard_size=shard_size))
    planned, actual = _shards(conn, m.job_version)
    assert planned == actual
    assert [s for s, _ in planned] == list(range(len(planned)))          # numbered 0..n-1
    assert all(size == shard_size for _, size in planned[:-1])
    assert m.shards == len(planned) and m.dead_letters == rejects
    assert sum(size for _, size in planned) + m.dead_letters + m.reused == m.records == n


def test_a_source_with_nothing_to_run_plans_no_shards(conn):
    make_source(conn, [("a", "", None), ("b", " \t", None), ("c", None, None)])
    m = submit(conn, make_spec())
    assert (m.records, m.shards, m.dead_letters) == (3, 0, 3)
    assert _shards(conn, m.job_version) == ([], [])


def test_the_snapshot_keeps_its_keys_and_constraints(conn):
    make_source(conn, tickets(25))
    m = submit(conn, make_spec())
    part = conn.execute("SELECT 'snapshot_rows_' || substr(md5(%s), 1, 16) AS p", (m.job_version,)).fetchone()["p"]
    idx = {r["indexdef"].split(" USING ", 1)[1] for r in conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'bi' AND tablename = %s", (part,))}
    # Keyed by the partition itself: it holds one job version, so no index starts with it; both compare
    # record ids as bytes (0023).
    assert idx == {"btree (record_id text_pattern_ops)", "btree (shard_no, record_id text_pattern_ops)"}
    notnull = {r["attname"] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnotnull", (f"bi.{part}",))}
    assert {"job_version", "record_id", "text", "content_hash"} <= notnull
    # The key the ledger probes is the partition's unique index on record_id, and a probe uses it.
    assert conn.execute("SELECT count(*) AS n FROM pg_index WHERE indrelid = %s::regclass AND indisunique",
                        (f"bi.{part}",)).fetchone()["n"] == 1
    conn.execute("SET enable_seqscan = off")     # 25 rows: make the planner show the index it can use
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
        f"EXPLAIN SELECT * FROM bi.{part} WHERE record_id = ANY (ARRAY['t00001', 't00002'])"))
    assert f"{part}_key" in plan, plan
    # A duplicate id is still refused by the key.
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(f"INSERT INTO bi.{part} (record_id, shard_no, text, content_hash, job_version) "
                     f"SELECT record_id, shard_no, text, content_hash, job_version FROM bi.{part} LIMIT 1")
