"""Nightly incremental runs end to end, with the real worker (noop engine) on
the real embedded PostgreSQL: only changed and added records are leased and
computed, unchanged ones are carried over from the published version, deleted
ones disappear, and a spec change starts from nothing."""

from __future__ import annotations

from batch_inference.drift import category_counts, category_key
from batch_inference.plan import submit
from batch_inference.publish import publish, view_name
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets

VIEW = view_name("tickets_triage")
N, K, A, D = 60, 7, 9, 5


def run(conn, db_url, spec, **cfg) -> str:
    m = submit(conn, spec)
    assert run_worker(WorkerConfig(job_version=m.job_version, db_url=db_url, **cfg)) == 0
    return m.job_version


def one(conn, sql: str, *params) -> dict:
    return conn.execute(sql, params).fetchone()


def tonight() -> tuple[list[tuple[str, str, list[str]]], set[str], set[str], set[str]]:
    """Yesterday's N tickets with K changed (one of them only in its ACL), D deleted, A added."""
    rows = {r[0]: r for r in tickets(N)}
    ids = sorted(rows)
    changed, deleted = set(ids[3:3 + K]), set(ids[40:40 + D])
    for rid in changed:
        _, text, acl = rows[rid]
        rows[rid] = (rid, text, ["team-moved"]) if rid == ids[3] else (rid, text + " Update: still not fixed.", acl)
    for rid in deleted:
        del rows[rid]
    added = tickets(A, start=1000)
    rows.update({r[0]: r for r in added})
    return list(rows.values()), changed, deleted, {r[0] for r in added}


def test_a_nightly_run_computes_only_changed_and_added_records(conn, db_url):
    spec = make_spec(incremental=True)
    make_source(conn, tickets(N))
    base = run(conn, db_url, spec)
    assert validate(conn, base).passed
    publish(conn, base)

    rows, changed, deleted, added = tonight()
    make_source(conn, rows)
    m = submit(conn, spec)
    job = m.job_version
    assert m.reused == N - D - K and m.records == N - D + A
    assert one(conn, "SELECT base_job_version AS b FROM bi.jobs WHERE job_version = %s", job)["b"] == base
    # Only K + A records are planned into shards: the rest never reach a worker.
    assert one(conn, "SELECT sum(records) AS n FROM bi.shards WHERE job_version = %s", job)["n"] == K + A
    leased = {r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no IS NOT NULL", (job,))}
    assert leased == changed | added

    assert run_worker(WorkerConfig(job_version=job, db_url=db_url)) == 0
    by_transport = {r["transport"]: r["n"] for r in conn.execute(
        "SELECT transport, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY transport", (job,))}
    assert by_transport == {"batch": K + A, "reused": N - D - K}
    computed = {r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.results WHERE job_version = %s AND transport = 'batch'", (job,))}
    assert computed == changed | added
    # The category counts count the reused rows as well as the computed ones.
    grouped = {category_key(r["category"]): r["n"] for r in conn.execute(
        "SELECT category, count(*) AS n FROM bi.results WHERE job_version = %s GROUP BY category", (job,))}
    assert category_counts(conn, job) == (grouped, "results") and sum(grouped.values()) == N - D + A

    report = validate(conn, job)
    assert report.passed and report["reused"] == N - D - K and report["coverage"]["stored"] == N - D + A
    publish(conn, job)
    stats = one(conn, f"SELECT count(*) AS n, count(DISTINCT record_id) AS ids, count(DISTINCT job_version) AS v "
                      f"FROM {VIEW}")
    assert (stats["n"], stats["ids"], stats["v"]) == (N + A - D, N + A - D, 1)
    in_view = {r["record_id"] for r in conn.execute(f"SELECT record_id FROM {VIEW}")}
    assert in_view == {r[0] for r in rows} and not (in_view & deleted)
    # A record whose ACL alone changed was recomputed, and carries the new ACL.
    moved = one(conn, f"SELECT acl, transport FROM {VIEW} WHERE record_id = 't00003'")
    assert moved["acl"] == ["team-moved"] and moved["transport"] == "batch"
    # Reused rows carry tonight's ACL and content hash, not yesterday's row verbatim.
    bad = one(conn, "SELECT count(*) AS n FROM bi.results r JOIN bi.snapshot_rows s USING (job_version, record_id) "
                    "WHERE r.job_version = %s AND (r.acl IS DISTINCT FROM s.acl OR r.content_hash <> s.content_hash)",
              job)["n"]
    assert bad == 0


def test_a_spec_change_forces_a_full_run(conn, db_url):
    make_source(conn, tickets(N))
    base = run(conn, db_url, make_spec(incremental=True))
    assert validate(conn, base).passed
    publish(conn, base)
    rows, *_ = tonight()
    make_source(conn, rows)
    new_prompt = make_spec(incremental=True, prompt={"version": "v2"})
    m = submit(conn, new_prompt)
    assert m.reused == 0
    assert one(conn, "SELECT base_job_version AS b FROM bi.jobs WHERE job_version = %s", m.job_version)["b"] is None
    assert one(conn, "SELECT sum(records) AS n FROM bi.shards WHERE job_version = %s", m.job_version)["n"] == N - D + A
    assert run_worker(WorkerConfig(job_version=m.job_version, db_url=db_url)) == 0
    assert one(conn, "SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND transport = 'batch'",
               m.job_version)["n"] == N - D + A


def test_without_incremental_nothing_is_reused(conn, db_url):
    make_source(conn, tickets(20))
    base = run(conn, db_url, make_spec())
    validate(conn, base)
    publish(conn, base)
    make_source(conn, tickets(21))
    assert submit(conn, make_spec()).reused == 0


def test_dead_letters_of_the_base_are_tried_again(conn, db_url):
    spec = make_spec(incremental=True, validation={"max_dead_letter_rate": 0.1})
    rows = tickets(20)
    rows[4] = ("t00004", "[[engine-error]] please", ["team1"])
    make_source(conn, rows)
    base = run(conn, db_url, spec, backoff=(0.01, 0.01, 0.01))
    assert validate(conn, base).passed
    publish(conn, base)
    make_source(conn, rows + tickets(2, start=500))
    m = submit(conn, spec)
    # Unchanged but dead-lettered: no result to reuse, so it is leased again.
    assert m.reused == 19
    leased = {r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no IS NOT NULL", (m.job_version,))}
    assert leased == {"t00004", "t00500", "t00501"}
