"""The ledger on the real embedded PostgreSQL: leases, fencing epochs, keyed
results, attempts and dead letters."""

from __future__ import annotations

import threading

import pytest

from batch_inference import db
from batch_inference.drift import NO_CATEGORY, category_counts
from batch_inference.exceptions import SpecError
from batch_inference.ledger import Failure, Ledger, StaleLease
from batch_inference.plan import drop_job_version, submit
from batch_inference.status import dead_letters, fence_counts, job_counts
from tests.conftest import make_source, make_spec, tickets

OUT = {"category": "billing", "summary": "charged twice"}
# Each database test runs directly and through PgBouncer in transaction mode (tests/conftest.py).
DB_ROUTES = ("direct", "pgbouncer")


@pytest.fixture
def job(conn):
    make_source(conn, tickets(25))
    return submit(conn, make_spec()).job_version


def expire(conn, job: str, shard: int) -> None:
    """The holder's lease runs out (as if it died), without waiting for the clock."""
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (job, shard))


def ledger(db_url, job, owner, **kw):
    return Ledger(db.connect(db_url), job, owner, **kw)


def test_two_workers_never_hold_the_same_shard(db_url, job):
    held: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def grab(owner: str) -> None:
        lg = ledger(db_url, job, owner)
        while (lease := lg.claim()) is not None:
            with lock:
                held.append((owner, lease.shard_no, lease.epoch))

    threads = [threading.Thread(target=grab, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shard_nos = [s for _, s, _ in held]
    assert sorted(shard_nos) == [0, 1, 2]          # 25 records in shards of 10: 3 shards, each claimed once
    assert all(e == 1 for _, _, e in held)


def test_stale_epoch_cannot_renew_complete_or_write(db_url, conn, job):
    a = ledger(db_url, job, "a")
    b = ledger(db_url, job, "b")
    la = a.claim()
    assert la is not None and la.epoch == 1
    expire(conn, job, la.shard_no)                   # a stalls past its lease
    lb = b.claim()
    assert lb is not None and lb.shard_no == la.shard_no and lb.epoch == la.epoch + 1

    ids = [r["record_id"] for r in a.records(la)]
    assert ids == []                                 # a stale holder cannot even read the shard's records
    with pytest.raises(StaleLease):
        a.renew(la)
    with pytest.raises(StaleLease):
        a.put_results(la, ["t00000"], [OUT], ["billing"])
    with pytest.raises(StaleLease):
        a.fail(la, [Failure("t00001", "boom")])
    with pytest.raises(StaleLease):
        a.complete(la)
    assert a.release(la) is False
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts").fetchone()["n"] == 0
    assert fence_counts(conn, job) == {"complete": 1, "fail_records": 1, "put_results": 1, "release": 1,
                                       "renew": 1}
    # the current holder is unaffected
    assert b.renew(lb) == "batch"
    rows = b.records(lb)
    assert len(rows) == 10
    assert b.put_results(lb, [r["record_id"] for r in rows], [OUT] * 10, ["billing"] * 10) == 10
    assert b.complete(lb) == "done"


def test_expired_lease_is_reclaimed_with_next_epoch(db_url, conn, job):
    a = ledger(db_url, job, "a")
    first = [a.claim() for _ in range(3)]
    assert [l.epoch for l in first] == [1, 1, 1]
    assert a.claim() is None                         # all leased, none expired
    for lease in first:
        expire(conn, job, lease.shard_no)
    again = ledger(db_url, job, "b").claim()
    assert again is not None and again.shard_no == 0 and again.epoch == 2


def test_release_makes_the_shard_pending_at_once(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    assert a.release(la) is True
    lb = ledger(db_url, job, "b").claim()
    assert lb.shard_no == la.shard_no and lb.epoch == la.epoch + 1


def test_results_are_put_if_absent_and_done_keys_resume(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    ids = [r["record_id"] for r in a.records(la)]
    assert a.put_results(la, ids[:4], [OUT] * 4, ["billing"] * 4) == 4
    assert a.put_results(la, ids[:6], [OUT] * 6, ["billing"] * 6) == 2      # 4 were present already
    assert a.release(la)
    b = ledger(db_url, job, "b")
    lb = b.claim()
    assert b.done_keys(job, lb.shard_no) == set(ids[:6])
    todo = [r["record_id"] for r in b.records(lb)]
    assert todo == ids[6:]                           # the new holder skips what is done
    assert b.put_results(lb, todo, [OUT] * 4, ["billing"] * 4) == 4
    assert b.complete(lb) == "done"
    c = job_counts(conn, job)
    assert c["stored"] == 10 and c["outstanding"] == 15
    assert conn.execute("SELECT count(*) AS n FROM bi.results").fetchone()["n"] == 10


def test_a_put_stores_each_row_as_given_sent_as_one_text_or_as_arrays(db_url, conn, job, monkeypatch):
    """A put goes as one text a column (put_results_joined) unless an element holds the separator
    or a category the NULL mark (put_results, arrays): either way each row holds its own output and
    category (None, '' and marks in text included), a repeat stores nothing, and the counts follow."""
    from batch_inference import ledger as ledger_module

    sent: list[str] = []
    monkeypatch.setattr(ledger_module, "q", lambda name: sent.append(name) or db.q(name))
    a = ledger(db_url, job, "a")
    la = a.claim()
    ids = [r["record_id"] for r in a.records(la)]
    escaped = '{"category": "billing", "summary": "a\\u001eb\\u001fc"}'   # the marks escaped: valid JSON
    batches = [(ids[:3], [OUT, escaped, OUT], ["billing", None, ""]),
               (ids[3:5], [OUT, OUT], ["x\x1fy", None]),      # a category holding the NULL mark
               (ids[5:6], [OUT], ["a\x1eb"]),                 # a category holding the separator
               (ids[6:7], [OUT], [None])]
    for b_ids, outs, cats in batches:
        assert a.put_results(la, b_ids, outs, cats) == len(b_ids)
    assert [n for n in sent if n.startswith("put_")] == ["put_results_joined", "put_results", "put_results",
                                                          "put_results_joined"]
    assert a.put_results(la, *batches[0]) == 0 and a.put_results(la, *batches[1]) == 0   # I1: once a key
    rows = {r["record_id"]: (r["category"], r["output"]) for r in conn.execute(
        "SELECT record_id, category, output FROM bi.results WHERE job_version = %s", (job,))}
    assert rows == {ids[0]: ("billing", OUT), ids[1]: (None, {"category": "billing", "summary": "a\x1eb\x1fc"}),
                    ids[2]: ("", OUT), ids[3]: ("x\x1fy", OUT), ids[4]: (None, OUT), ids[5]: ("a\x1eb", OUT),
                    ids[6]: (None, OUT)}
    assert job_counts(conn, job)["stored"] == 7
    assert category_counts(conn, job)[0] == {"billing": 1, NO_CATEGORY: 3, "": 1, "x\x1fy": 1, "a\x1eb": 1}


@pytest.mark.parametrize("page", [1, 3, 4, 10])
def test_a_shard_is_read_in_pages_that_add_up_to_the_one_read(db_url, conn, job, page):
    """Each page starts after the last id of the page before: every record to
    do once, in id order, whatever the page size (3 does not divide the 6 left,
    4 leaves a short last page, 10 is the whole shard in one call)."""
    a = ledger(db_url, job, "a")
    la = a.claim()
    assert a.claim() and a.claim()                   # the other two shards held: b can take only la's
    ids = a.record_columns(la, page=1000)[0]
    assert len(ids) == 10 and ids == sorted(ids)
    assert a.put_results(la, ids[1:5], [OUT] * 4, ["billing"] * 4) == 4   # stored ones drop out of the pages
    todo = [ids[0], *ids[5:]]
    got = a.record_columns(la, page=page)
    assert got[0] == todo and len(got[1]) == len(todo) and got[2] == [0] * 6 == got[3]
    expire(conn, job, la.shard_no)
    b = ledger(db_url, job, "b")
    lb = b.claim()
    assert lb.shard_no == la.shard_no and a.record_columns(la, page=page) == ([], [], [], [])   # stale: nothing
    assert b.record_columns(lb, page=page)[0] == todo


def test_a_record_outside_the_shard_is_not_written(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()                                   # shard 0: t00000..t00009
    assert a.put_results(la, ["t00024"], [OUT], ["billing"]) == 0


def test_third_failure_dead_letters_with_error_and_raw_output(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    for attempt in (1, 2):
        got = a.fail(la, [Failure("t00003", f"output is not valid JSON (try {attempt})", '{"category": "bil')])
        assert got[0].attempts == attempt and not got[0].dead
    a.release(la)
    b = ledger(db_url, job, "b")                      # attempts survive the lease
    lb = b.claim()
    rec = {r["record_id"]: r["attempts"] for r in b.records(lb)}
    assert rec["t00003"] == 2
    got = b.fail(lb, [Failure("t00003", "output is not valid JSON (try 3)", '{"category": "bil')])
    assert got[0].attempts == 3 and got[0].dead
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"], d["stage"]) for d in dl] == [("t00003", 3, "worker")]
    assert dl[0]["raw_output"] == '{"category": "bil'
    assert "failed 3 attempts" in dl[0]["reason"] and "try 3" in dl[0]["error"]
    assert "t00003" not in {r["record_id"] for r in b.records(lb)}       # never loops
    assert b.put_results(lb, ["t00003"], [OUT], ["billing"]) == 0         # and is never also stored
    assert job_counts(conn, job)["dead_letters"] == 1


def test_complete_refused_while_records_are_left(db_url, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    assert a.complete(la) == "incomplete"


def test_same_spec_same_snapshot_same_version(conn):
    make_source(conn, tickets(25))
    m1 = submit(conn, make_spec())
    m2 = submit(conn, make_spec())
    assert m1.job_version == m2.job_version and m1.created and not m2.created
    assert conn.execute("SELECT count(*) AS n FROM bi.snapshot_rows").fetchone()["n"] == 25
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 1


def test_changed_prompt_params_schema_or_model_is_a_new_version(conn):
    make_source(conn, tickets(5))
    base = submit(conn, make_spec()).job_version
    changed = [
        make_spec(prompt={"system": "Classify it, differently."}),
        make_spec(prompt={"version": "v2"}),
        make_spec(params={"max_tokens": 65}),
        make_spec(model={"digest": "1" * 64}),
        make_spec(output_schema={"type": "object", "properties": {"category": {"type": "string"}}}),
    ]
    versions = {submit(conn, s).job_version for s in changed}
    assert base not in versions and len(versions) == len(changed)
    # sharding and leases do not change results, so they do not change the version: a lease is applied
    # to it, a shard size (planned already) is refused in one line
    again = submit(conn, make_spec(lease_seconds=120))
    assert again.job_version == base and again.applied == ["lease_seconds: 60 -> 120"]
    with pytest.raises(SpecError, match=f"^job version {base} already exists with other settings .*shard_size: 10 -> 3"):
        submit(conn, make_spec(shard_size=3, lease_seconds=120))


def test_changed_input_is_a_new_version(conn):
    make_source(conn, tickets(5))
    v1 = submit(conn, make_spec()).job_version
    conn.execute("UPDATE public.tickets SET body = body || '!' WHERE id = 't00002'")
    assert submit(conn, make_spec()).job_version != v1


def test_drop_job_version_drops_partitions(conn, job):
    assert drop_job_version(conn, job)
    left = conn.execute("SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'bi' AND tablename LIKE "
                        "'results_%'").fetchone()["n"]
    assert left == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.shards").fetchone()["n"] == 0


RESULT_LEAVES = """
SELECT t.relid::regclass::text AS leaf, (SELECT count(*) FROM bi.results r
                                          WHERE r.job_version = %(job)s AND r.tableoid = t.relid) AS n
  FROM pg_partition_tree(format('bi.%%I', 'results_' || substr(md5(%(job)s), 1, 16))::regclass) t
 WHERE t.isleaf ORDER BY 1"""


def left_of(conn, job: str) -> int:
    """Relations of the job's results partition still there: its tables and their indexes."""
    return conn.execute("SELECT count(*) AS n FROM pg_class WHERE relname LIKE 'results_' || substr(md5(%s), 1, 16) "
                        "|| '%%'", (job,)).fetchone()["n"]


def put_the_whole_job(conn, job: str) -> int:
    """Every shard claimed, put twice (the second put stores nothing) and completed; the rows stored."""
    lg = Ledger(conn, job, "w", engine="noop", endpoint="local")
    stored = 0
    while (lease := lg.claim()) is not None:
        ids = [r["record_id"] for r in lg.records(lease)]
        stored += lg.put_results(lease, ids, [OUT] * len(ids), ["billing"] * len(ids))
        assert lg.put_results(lease, ids, [OUT] * len(ids), ["billing"] * len(ids)) == 0
        assert lg.complete(lease) == "done"
    return stored


def test_a_jobs_results_are_hash_partitioned_by_record_id_and_stored_once(conn, job):
    assert left_of(conn, job) == 18       # the partition, its 8 leaves, and the primary key of each
    assert put_the_whole_job(conn, job) == 25
    leaves = conn.execute(RESULT_LEAVES, {"job": job}).fetchall()
    # eight tables, each with its own extension lock, the job's rows spread over them
    assert len(leaves) == 8 and sum(x["n"] for x in leaves) == 25
    assert sum(1 for x in leaves if x["n"]) > 1
    r = conn.execute("SELECT count(*) AS n, count(DISTINCT record_id) AS d FROM bi.results WHERE job_version = %s",
                     (job,)).fetchone()
    assert r["n"] == r["d"] == 25
    assert job_counts(conn, job)["stored"] == 25
    assert drop_job_version(conn, job)
    assert left_of(conn, job) == 0


def test_a_flat_results_partition_from_before_0018_still_takes_puts_and_drops(conn, job):
    # the shape create_job_partitions_v1 made before migration 0018: one table
    part = conn.execute("SELECT 'results_' || substr(md5(%s), 1, 16) AS p", (job,)).fetchone()["p"]
    conn.execute(f"ALTER TABLE bi.results DETACH PARTITION bi.{part}")
    conn.execute(f"DROP TABLE bi.{part}")
    conn.execute(f"CREATE TABLE bi.{part} (LIKE bi.results INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    conn.execute(f"ALTER TABLE bi.results ATTACH PARTITION bi.{part} FOR VALUES IN ('{job}')")
    assert [x["leaf"] for x in conn.execute(RESULT_LEAVES, {"job": job})] == [f"bi.{part}"]
    assert put_the_whole_job(conn, job) == 25
    assert conn.execute(RESULT_LEAVES, {"job": job}).fetchone()["n"] == 25
    assert drop_job_version(conn, job)
    assert left_of(conn, job) == 0


# -- crash poison (sql/schema/ledger.sql) -----------------------------------

def attempts_row(conn, job: str, rid: str):
    return conn.execute("SELECT attempts, crashes FROM bi.attempts WHERE job_version = %s AND record_id = %s",
                        (job, rid)).fetchone()


def test_a_lease_taken_over_after_expiry_is_a_lost_lease_a_release_is_not(db_url, conn, job):
    a, b = ledger(db_url, job, "a"), ledger(db_url, job, "b")
    la = a.claim()
    assert la.lost_leases == 0 and not la.careful
    assert a.release(la)
    lb = b.claim()
    assert lb.shard_no == la.shard_no and lb.lost_leases == 0         # a release is not a loss
    expire(conn, job, lb.shard_no)
    lc = a.claim()
    assert lc.shard_no == lb.shard_no and lc.epoch == lb.epoch + 1
    assert lc.lost_leases == 1 and lc.careful


def test_deaths_count_only_the_last_marked_batch_and_dead_letter_at_max(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()                                    # shard 0: t00000..t00009
    a.mark_in_flight(la, ["t00000", "t00001"])
    a.mark_in_flight(la, ["t00002", "t00003", "t00004"])   # replaces the first batch: that one got through
    a.put_results(la, ["t00002"], [OUT], ["billing"])       # stored: not a suspect
    a.fail(la, [Failure("t00003", "invalid output", "{", attempt=1)])   # had an outcome: not a suspect
    expire(conn, job, 0)
    lb = a.claim()
    assert lb.shard_no == 0 and lb.careful
    crashes = {r["record_id"]: r["crashes"] for r in a.records(lb)}
    assert {rid for rid, n in crashes.items() if n} == {"t00004"}
    assert attempts_row(conn, job, "t00003") == {"attempts": 1, "crashes": 0}
    for died in (2, 3):
        a.mark_in_flight(lb, ["t00004"])              # run alone, dies again
        expire(conn, job, 0)
        lb = a.claim()
        assert lb.lost_leases == died
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"], d["stage"], d["raw_output"]) for d in dl] == [("t00004", 3, "worker", None)]
    assert "worker died 3 times" in dl[0]["reason"]
    assert "died 3 times while this record was in flight" in dl[0]["error"]
    assert "t00004" not in {r["record_id"] for r in a.records(lb)}            # never loops
    assert conn.execute("SELECT dead FROM bi.shards WHERE job_version = %s AND shard_no = 0",
                        (job,)).fetchone()["dead"] == 1
    rest = [r["record_id"] for r in a.records(lb)]
    assert a.put_results(lb, rest, [OUT] * len(rest), ["billing"] * len(rest)) == len(rest)
    assert a.complete(lb) == "done"                   # the dead letter counts toward completion


def test_no_death_after_a_release_or_for_a_stale_mark(db_url, conn, job):
    a, b = ledger(db_url, job, "a"), ledger(db_url, job, "b")
    la = a.claim()
    a.mark_in_flight(la, ["t00005"])
    assert a.release(la)                              # the preemption notice: alive, nothing died
    lb = b.claim()
    expire(conn, job, lb.shard_no)                    # b dies before marking anything
    lc = b.claim()
    assert lc.lost_leases == 1
    assert attempts_row(conn, job, "t00005") is None  # a's mark was a's epoch, which ended by a release
    with pytest.raises(StaleLease):
        a.mark_in_flight(la, ["t00006"])
    assert fence_counts(conn, job)["mark_in_flight"] == 1


def test_the_sweep_and_an_abandoned_shard_count_deaths_too(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    a.mark_in_flight(la, ["t00007"])
    expire(conn, job, la.shard_no)
    assert conn.execute("SELECT bi.sweep_expired_v1(%s) AS n", (job,)).fetchone()["n"] == 1
    assert attempts_row(conn, job, "t00007") == {"attempts": 0, "crashes": 1}
    lb = a.claim()
    assert lb.shard_no == la.shard_no and lb.lost_leases == 1
    assert attempts_row(conn, job, "t00007")["crashes"] == 1          # the claim of a swept shard adds none
    a.mark_in_flight(lb, ["t00007"])
    assert a.abandon(lb)                              # the engine raised: given back at once, but counted
    shard = conn.execute("SELECT state, lost_leases FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (job, lb.shard_no)).fetchone()
    assert shard == {"state": "pending", "lost_leases": 2}
    assert attempts_row(conn, job, "t00007")["crashes"] == 2
    assert a.abandon(lb) is False                     # once only


def test_the_claim_function_counts_lost_leases_and_deaths_on_takeover(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    a.mark_in_flight(la, ["t00001"])
    expire(conn, job, la.shard_no)
    r = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'other', 'batch', 60)", (job,)).fetchone()
    assert r["shard_no"] == la.shard_no and r["lost_leases"] == 1
    assert set(r) == {"shard_no", "epoch", "lease_expires_at", "records", "lost_leases"}
    assert attempts_row(conn, job, "t00001")["crashes"] == 1


def test_a_failed_attempt_retried_after_a_lost_reply_counts_once(db_url, conn, job):
    a = ledger(db_url, job, "a")
    la = a.claim()
    first = Failure("t00003", "invalid output (try 1)", "{", attempt=1)
    assert a.fail(la, [first]) == a.fail(la, [first])        # the reply was lost; the worker sends it again
    assert attempts_row(conn, job, "t00003")["attempts"] == 1
    second = Failure("t00003", "invalid output (try 2)", "{", attempt=2)
    assert [f.attempts for f in a.fail(la, [second])] == [2]
    third = Failure("t00003", "invalid output (try 3)", "{", attempt=3)
    got = a.fail(la, [third])
    again = a.fail(la, [third])
    assert [(f.attempts, f.dead) for f in got] == [(3, True)] == [(f.attempts, f.dead) for f in again]
    dl = dead_letters(conn, job)
    assert [(d["record_id"], d["attempts"]) for d in dl] == [("t00003", 3)]
    assert "try 3" in dl[0]["error"]
    assert conn.execute("SELECT dead FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                        (job, la.shard_no)).fetchone()["dead"] == 1   # the counter moved once too
    # an attempt number the ledger is behind on still counts one (never more, never stuck)
    a.fail(la, [Failure("t00004", "boom", attempt=5)])
    assert attempts_row(conn, job, "t00004")["attempts"] == 1
    a.fail(la, [Failure("t00004", "boom", attempt=5)])
    assert attempts_row(conn, job, "t00004")["attempts"] == 2


def test_counters_decide_which_probes_run_and_never_the_answer(db_url, conn, job):
    """0009 skips the result/dead-letter probes while the shard's counters are 0;
    once something is stored or dead, a re-claim must still leave it out."""
    a = ledger(db_url, job, "a")
    la = a.claim()
    first = [r["record_id"] for r in a.records(la)]
    assert len(first) == 10                                   # fresh shard: every record
    assert a.put_results(la, first[:3], [OUT] * 3, ["billing"] * 3) == 3
    for attempt in (1, 2, 3):
        got = a.fail(la, [Failure(first[3], "bad", None, attempt)])
    assert got[0].dead
    a.release(la)
    b = ledger(db_url, job, "b")
    lb = b.claim()
    assert lb.shard_no == la.shard_no
    assert [r["record_id"] for r in b.records(lb)] == first[4:]
    assert b.put_results(lb, [first[3]], [OUT], ["billing"]) == 0    # dead: never also stored
    assert b.put_results(lb, first[4:], [OUT] * 6, ["billing"] * 6) == 6
    assert b.complete(lb) == "done"
