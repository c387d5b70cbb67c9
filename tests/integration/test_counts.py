"""The job's live counts come from bi.shard_stripes (sql/schema/counts.sql):
after every kind of shard change they equal the sums over the shard table,
and the migration fills the stripes of jobs submitted before it."""

from __future__ import annotations

from unittest import mock

import psycopg
import pytest

from batch_inference import db, plan
from batch_inference.ledger import Failure, Ledger
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.conftest import make_source, make_spec, tickets

OUT = {"category": "billing", "summary": "charged twice"}

# What bi.job_counts_v1 summed before the stripes: the shard table itself.
FROM_SHARDS = """
    SELECT j.reused + coalesce(sum(s.stored), 0) AS stored, coalesce(sum(s.stored_fallback), 0) AS stored_fallback,
           j.planned_dead + coalesce(sum(s.dead), 0) AS dead_letters,
           j.records - j.reused - j.planned_dead - coalesce(sum(s.stored + s.dead), 0) AS outstanding,
           count(*) FILTER (WHERE s.state = 'pending') AS pending, count(*) FILTER (WHERE s.state = 'leased') AS leased,
           count(*) FILTER (WHERE s.state = 'done') AS done, min(s.first_claim_at) AS first_claim_at
      FROM bi.jobs j LEFT JOIN bi.shards s ON s.job_version = j.job_version
     WHERE j.job_version = %s GROUP BY j.job_version, j.records, j.reused, j.planned_dead"""


def same_as_shards(conn: psycopg.Connection, job: str) -> dict:
    c = job_counts(conn, job)
    want = conn.execute(FROM_SHARDS, (job,)).fetchone()
    got = {"stored": c["stored"], "stored_fallback": c["stored_fallback"], "dead_letters": c["dead_letters"],
           "outstanding": c["outstanding"], **c["shards"], "first_claim_at": c["first_claim_at"]}
    assert got == dict(want)
    # the dashboard's shard and record counts by state, from the stripes
    states = {r["state"]: (r["shards"], r["records"]) for r in conn.execute(db.q("shard_states"), {"job": job})}
    grouped = {r["state"]: (r["n"], r["records"]) for r in conn.execute(
        "SELECT state, count(*) AS n, sum(records) AS records FROM bi.shards WHERE job_version = %s GROUP BY state",
        (job,))}
    assert states == {st: grouped.get(st, (0, 0)) for st in ("pending", "leased", "done")}
    return c


def test_counts_follow_every_shard_change(conn, db_url):
    make_source(conn, tickets(25))
    job = submit(conn, make_spec(max_attempts=1)).job_version
    c = same_as_shards(conn, job)
    assert (c["shards"]["pending"], c["outstanding"]) == (3, 25)
    a = Ledger(db.connect(db_url), job, "a", lease_seconds=1)
    la = a.claim()
    ids = sorted(r["record_id"] for r in a.records(la))
    assert a.put_results(la, ids[:4], [OUT] * 4, ["billing"] * 4) == 4
    assert a.put_results(la, ids[:4], [OUT] * 4, ["billing"] * 4) == 0        # nothing new: no change
    a.fail(la, [Failure(ids[4], "bad output", "{")])                          # max_attempts 1: dead
    c = same_as_shards(conn, job)
    assert (c["stored"], c["dead_letters"], c["shards"]["leased"]) == (4, 1, 1)
    assert a.release(la)
    same_as_shards(conn, job)
    lb = a.claim()
    assert lb.shard_no == la.shard_no
    rest = sorted(r["record_id"] for r in a.records(lb))
    a.put_results(lb, rest, [OUT] * len(rest), ["billing"] * len(rest))
    assert a.complete(lb) == "done"
    c = same_as_shards(conn, job)
    assert (c["shards"]["done"], c["stored"], c["dead_letters"]) == (1, 9, 1)
    lc = a.claim()                      # left to expire, then swept back to pending
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (job, lc.shard_no))
    assert conn.execute(db.q("sweep_expired"), {"job": job}).fetchone() is not None
    c = same_as_shards(conn, job)
    assert c["shards"]["leased"] == 0 and lc is not None
    conn.execute("DELETE FROM bi.shards WHERE job_version = %s AND shard_no = 2", (job,))
    same_as_shards(conn, job)


def test_two_jobs_and_a_dropped_one_keep_their_own_counts(conn):
    make_source(conn, tickets(30))
    one = submit(conn, make_spec()).job_version
    two = submit(conn, make_spec(prompt={"version": "v2"})).job_version
    assert same_as_shards(conn, one)["outstanding"] == same_as_shards(conn, two)["outstanding"] == 30
    conn.execute(db.q("drop_job_version"), {"job": one})
    assert conn.execute("SELECT count(*) AS n FROM bi.shard_stripes WHERE job_version = %s", (one,)).fetchone()["n"] == 0
    same_as_shards(conn, two)


def test_concurrently_held_shards_fall_in_different_stripes(conn, db_url):
    make_source(conn, tickets(50))
    job = submit(conn, make_spec(shard_size=5)).job_version
    leases = [Ledger(db.connect(db_url), job, f"w{i}").claim() for i in range(10)]
    stripes = conn.execute("SELECT count(*) AS n FROM bi.shard_stripes WHERE job_version = %s AND leased > 0",
                           (job,)).fetchone()["n"]
    assert stripes == len({lease.shard_no for lease in leases}) == 10


def test_the_migration_fills_the_stripes_of_existing_jobs(empty_db):
    with db.connect(empty_db()) as conn:
        _migrate_before(conn, "0005")
        make_source(conn, tickets(25))
        job = _submit_before_0023(conn, make_spec()).job_version
        conn.execute("UPDATE bi.shards SET stored = 3, state = 'done' WHERE job_version = %s AND shard_no = 1",
                     (job,))
        assert "0005_scale.sql" in db.migrate(conn)
        c = same_as_shards(conn, job)
        assert (c["stored"], c["shards"]["done"], c["shards"]["pending"]) == (3, 1, 2)


def _shard_ids(w: Ledger, lease) -> list[str]:
    """A fresh leased shard's record ids, read from the snapshot itself: a
    database migrated part way has its last migration's ledger functions, not
    the shard read this code calls."""
    return [r["record_id"] for r in w.conn.execute(
        "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no = %s ORDER BY record_id",
        (lease.job_version, lease.shard_no))]


def _migrate_before(conn: psycopg.Connection, first_left_out: str) -> None:
    """Every migration before ``first_left_out``, recorded as db.migrate records them."""
    with conn.transaction():
        conn.execute(db.q("migrations_table"))
        for path in db.migrations():
            if path.name >= first_left_out:
                break
            conn.execute(path.read_text())
            conn.execute(db.q("migration_record"), {"name": path.name, "checksum": _checksum(path)})


def _submit_before_0023(conn: psycopg.Connection, spec):
    """``submit`` on a database migrated part way, before 0023: that release attached a snapshot with
    ``bi.attach_snapshot_v1`` (0023 replaced it with v2)."""
    real = plan.q
    with mock.patch.object(plan, "q", lambda name: "SELECT bi.attach_snapshot_v1(%(job)s);"
                           if name == "snapshot_attach" else real(name)):
        return submit(conn, spec)


def _checksum(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_text().encode()).hexdigest()


@pytest.mark.parametrize("shards", [1, 1500])
def test_the_poll_reads_at_most_one_row_per_stripe(conn, shards):
    """The stripes of a job: as many as its shards, never more than the stripe count."""
    make_source(conn, tickets(shards))
    job = submit(conn, make_spec(shard_size=1)).job_version
    n = conn.execute("SELECT count(*) AS n FROM bi.shard_stripes WHERE job_version = %s", (job,)).fetchone()["n"]
    cap = conn.execute("SELECT bi.shard_stripe_count_v1() AS n").fetchone()["n"]
    assert n == min(shards, cap)
    assert same_as_shards(conn, job)["shards"]["pending"] == shards


HOSTED_FROM_RESULTS = "SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND transport = 'hosted_batch'"
# What hosted_cost_rows summed before the stripes kept the usage: the job's provider batches.
USAGE_FROM_BATCHES = """
    SELECT sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,
           count(*) FILTER (WHERE input_tokens IS NULL AND state <> 'abandoned') AS unpriced_batches
      FROM bi.hosted_batches WHERE job_version = %s"""


def _usage(conn: psycopg.Connection, job: str) -> dict:
    r = conn.execute(db.q("hosted_cost_rows"), {"job": job}).fetchone()
    return {k: r[k] for k in ("input_tokens", "output_tokens", "unpriced_batches")}


def _batch(conn: psycopg.Connection, job: str, shard: int, no: int, tokens: tuple[int, int] | None,
           state: str = "ended") -> None:
    conn.execute("""INSERT INTO bi.hosted_batches (job_version, shard_no, intent_no, idem_key, provider, epoch,
                                                   record_ids, state, input_tokens, output_tokens)
                    VALUES (%s, %s, %s, %s, 'openai', 1, ARRAY['x'], %s, %s, %s)""",
                 (job, shard, no, f"{job}-{shard}-{no}", state, *(tokens or (None, None))))


def _hosted_rows(conn: psycopg.Connection, job: str) -> int:
    return int(conn.execute(db.q("hosted_cost_rows"), {"job": job}).fetchone()["rows"])


def _put_some(db_url: str, job: str, transport: str, n: int) -> None:
    w = Ledger(db.connect(db_url), job, f"w-{transport}", transport=transport)
    lease = w.claim()
    ids = sorted(r["record_id"] for r in w.records(lease))[:n]
    assert w.put_results(lease, ids, [OUT] * n, ["billing"] * n) == n
    assert w.put_results(lease, ids, [OUT] * n, ["billing"] * n) == 0     # nothing new: no count
    w.release(lease)


def test_hosted_rows_are_counted_on_the_shard_and_its_stripe(conn, db_url):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version
    _put_some(db_url, job, "hosted_batch", 4)
    _put_some(db_url, job, "fallback", 3)
    _put_some(db_url, job, "batch", 2)
    assert _hosted_rows(conn, job) == conn.execute(HOSTED_FROM_RESULTS, (job,)).fetchone()["n"] == 4
    by_shards = conn.execute("SELECT sum(stored_hosted) AS n FROM bi.shards WHERE job_version = %s",
                             (job,)).fetchone()["n"]
    assert by_shards == 4
    c = same_as_shards(conn, job)
    assert (c["stored"], c["stored_fallback"], c["stored_batch"]) == (9, 3, 6)   # stored_batch holds the hosted rows


def test_the_stripes_follow_every_change_of_the_provider_batches_usage(conn):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version
    _batch(conn, job, 0, 1, (100, 40))
    _batch(conn, job, 1, 1, None, state="submitted")       # not reported yet: unpriced
    _batch(conn, job, 2, 1, None, state="intent")
    want = lambda: {k: (int(v) if v is not None else None)  # noqa: E731
                    for k, v in conn.execute(USAGE_FROM_BATCHES, (job,)).fetchone().items()}
    assert _usage(conn, job) == want() == {"input_tokens": 100, "output_tokens": 40, "unpriced_batches": 2}
    conn.execute("UPDATE bi.hosted_batches SET input_tokens = 7, output_tokens = 3, state = 'ended' "
                 "WHERE job_version = %s AND shard_no = 1", (job,))
    conn.execute("UPDATE bi.hosted_batches SET state = 'abandoned' WHERE job_version = %s AND shard_no = 2", (job,))
    conn.execute("UPDATE bi.hosted_batches SET state = 'reconciled', total = 9 WHERE job_version = %s "
                 "AND shard_no = 0", (job,))
    assert _usage(conn, job) == want() == {"input_tokens": 107, "output_tokens": 43, "unpriced_batches": 0}
    conn.execute("DELETE FROM bi.hosted_batches WHERE job_version = %s AND shard_no = 0", (job,))
    assert _usage(conn, job) == want() == {"input_tokens": 7, "output_tokens": 3, "unpriced_batches": 0}


def test_the_migration_counts_the_hosted_rows_of_existing_jobs(empty_db):
    url = empty_db()
    with db.connect(url) as conn:
        _migrate_before(conn, "0017")
        make_source(conn, tickets(30))
        job = _submit_before_0023(conn, make_spec(shard_size=10)).job_version
        for transport, n in (("hosted_batch", 5), ("hosted_batch", 2), ("fallback", 1)):
            w = Ledger(db.connect(url), job, f"w-{transport}-{n}", transport=transport)
            lease = w.claim()
            ids = _shard_ids(w, lease)[:n]
            w.put_results(lease, ids, [OUT] * n, ["billing"] * n)
        _batch(conn, job, 0, 1, (50, 20))
        _batch(conn, job, 1, 1, None, state="submitted")
        assert "0017_stored_hosted.sql" in db.migrate(conn)
        assert _hosted_rows(conn, job) == conn.execute(HOSTED_FROM_RESULTS, (job,)).fetchone()["n"] == 7
        assert _usage(conn, job) == {"input_tokens": 50, "output_tokens": 20, "unpriced_batches": 1}
        same_as_shards(conn, job)


def test_the_migration_keys_existing_snapshots_by_their_own_partition(empty_db):
    """0021 rebuilds an existing snapshot's keys without the job version; the
    ledger reads and puts through them, and a duplicate put still stores nothing."""
    url = empty_db()
    with db.connect(url) as conn:
        _migrate_before(conn, "0021")
        make_source(conn, tickets(30))
        job = _submit_before_0023(conn, make_spec(shard_size=10)).job_version
        assert "0021_snapshot_local_keys.sql" in db.migrate(conn)
        part = conn.execute("SELECT 'snapshot_rows_' || substr(md5(%s), 1, 16) AS p", (job,)).fetchone()["p"]
        idx = {r["indexname"]: r["indexdef"].split(" USING ", 1)[1] for r in conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'bi' AND tablename = %s", (part,))}
        # 0021 keyed it by record_id alone; 0023 (applied with it) rebuilds the shard index in byte order.
        assert idx == {f"{part}_pkey": "btree (record_id)",
                       f"{part}_shard": "btree (shard_no, record_id text_pattern_ops)"}
        assert not conn.execute("SELECT 1 FROM pg_indexes WHERE schemaname = 'bi' AND tablename = 'snapshot_rows'"
                                ).fetchall()
        w = Ledger(db.connect(url), job, "w-0021")
        lease = w.claim()
        ids = sorted(r["record_id"] for r in w.records(lease))
        assert len(ids) == 10
        assert w.put_results(lease, ids, [OUT] * 10, ["billing"] * 10) == 10
        assert w.put_results(lease, ids, [OUT] * 10, ["billing"] * 10) == 0
        assert w.records(lease) == []
        same_as_shards(conn, job)


# What dead_letter_reasons grouped before bi.dead_letter_counts: the dead letters themselves.
DEAD_FROM_ROWS = """SELECT acl, reason, stage, count(*) AS n FROM bi.dead_letters WHERE job_version = %s
                     GROUP BY acl, reason, stage ORDER BY 1, 2, 3"""
DEAD_COUNTS = """SELECT acl, reason, stage, n FROM bi.dead_letter_counts WHERE job_version = %s ORDER BY 1, 2, 3"""


def _dead_letter_some(url: str, job: str, reasons: list[str]) -> None:
    w = Ledger(db.connect(url), job, f"w-dead-{len(reasons)}")
    lease = w.claim()
    ids = _shard_ids(w, lease)[:len(reasons)]
    for _ in range(3):    # max_attempts: dead at the third
        w.fail(lease, [Failure(i, reason, "{") for i, reason in zip(ids, reasons)])


def test_dead_letters_are_counted_per_acl_reason_and_stage(conn, db_url):
    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version
    _dead_letter_some(db_url, job, ["bad output", "bad output", "HTTP 400"])
    _dead_letter_some(db_url, job, ["bad output"])
    got = conn.execute(DEAD_COUNTS, (job,)).fetchall()
    assert got == conn.execute(DEAD_FROM_ROWS, (job,)).fetchall()
    assert sum(r["n"] for r in got) == job_counts(conn, job)["dead_letters"] == 4
    by_reason: dict[str, int] = {}
    for r in got:
        by_reason[r["reason"].rsplit(": ", 1)[-1]] = by_reason.get(r["reason"].rsplit(": ", 1)[-1], 0) + r["n"]
    assert by_reason == {"bad output": 3, "HTTP 400": 1}
    # an update (an operator's fix): the counts follow it
    conn.execute("UPDATE bi.dead_letters SET reason = 'relabelled', acl = '{team-z}' WHERE job_version = %s "
                 "AND reason LIKE '%%HTTP 400'", (job,))
    kept = [r for r in conn.execute(DEAD_COUNTS, (job,)).fetchall() if r["n"]]     # a group emptied stays at 0
    assert kept == conn.execute(DEAD_FROM_ROWS, (job,)).fetchall()
    assert any(r["reason"] == "relabelled" and r["acl"] == ["team-z"] for r in kept)


def test_the_migration_counts_the_dead_letters_of_existing_jobs(empty_db):
    url = empty_db()
    with db.connect(url) as conn:
        _migrate_before(conn, "0020")
        make_source(conn, tickets(30))
        job = _submit_before_0023(conn, make_spec(shard_size=10)).job_version
        _dead_letter_some(url, job, ["bad output", "HTTP 400", "bad output"])
        assert "0020_bounded_reads.sql" in db.migrate(conn)
        assert conn.execute(DEAD_COUNTS, (job,)).fetchall() == conn.execute(DEAD_FROM_ROWS, (job,)).fetchall()
        _dead_letter_some(url, job, ["HTTP 400"])
        assert conn.execute(DEAD_COUNTS, (job,)).fetchall() == conn.execute(DEAD_FROM_ROWS, (job,)).fetchall()


# What category_counts grouped before bi.category_stripes: the results themselves.
CATEGORIES_FROM_RESULTS = "SELECT category, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY category"


def _categories(conn: psycopg.Connection, job: str) -> dict:
    from batch_inference.drift import category_counts

    return category_counts(conn, job)[0]


def test_the_categories_of_every_stored_row_are_counted(conn, db_url):
    from batch_inference.drift import category_key

    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10)).job_version
    for transport, cats in (("batch", ["billing", "bug", None]), ("fallback", ["billing", "billing"]),
                            ("hosted_batch", ["account"])):
        w = Ledger(db.connect(db_url), job, f"w-{transport}", transport=transport)
        lease = w.claim()
        ids = sorted(r["record_id"] for r in w.records(lease))[:len(cats)]
        assert w.put_results(lease, ids, [OUT] * len(ids), cats) == len(ids)
        assert w.put_results(lease, ids, [OUT] * len(ids), cats) == 0      # stored already: not counted again
    want = {category_key(r["category"]): r["n"] for r in conn.execute(CATEGORIES_FROM_RESULTS, (job,))}
    assert _categories(conn, job) == want == {"billing": 3, "bug": 1, "(none)": 1, "account": 1}
    stripes = conn.execute("SELECT count(DISTINCT stripe) AS n FROM bi.category_stripes WHERE job_version = %s",
                           (job,)).fetchone()["n"]
    assert stripes == 3                 # a stripe per shard written
    # an update (an operator's fix): the counts follow it
    conn.execute("UPDATE bi.results SET category = 'bug' WHERE job_version = %s AND category = 'billing'", (job,))
    assert _categories(conn, job) == {"bug": 4, "(none)": 1, "account": 1}


def test_the_migration_counts_the_categories_of_existing_jobs(empty_db):
    from batch_inference.drift import category_key

    url = empty_db()
    with db.connect(url) as conn:
        _migrate_before(conn, "0020")
        make_source(conn, tickets(30))
        job = _submit_before_0023(conn, make_spec(shard_size=10)).job_version
        w = Ledger(db.connect(url), job, "w")
        lease = w.claim()
        ids = _shard_ids(w, lease)[:4]
        w.put_results(lease, ids, [OUT] * 4, ["billing", "bug", "bug", None])
        assert "0020_bounded_reads.sql" in db.migrate(conn)
        want = {category_key(r["category"]): r["n"] for r in conn.execute(CATEGORIES_FROM_RESULTS, (job,))}
        assert _categories(conn, job) == want == {"billing": 1, "bug": 2, "(none)": 1}
        lease2 = w.claim()
        more = sorted(r["record_id"] for r in w.records(lease2))[:2]
        w.put_results(lease2, more, [OUT] * 2, ["bug", "account"])      # the migrated put counts too
        assert _categories(conn, job) == {"billing": 1, "bug": 3, "(none)": 1, "account": 1}
