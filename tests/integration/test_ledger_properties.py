"""Random interleavings of claim, renew, expire, release, complete, write and
fail from several workers, against the real database.

Properties: at most one result per key; an operation under a stale epoch has
no effect; after a clean drain every record ends stored or dead-lettered.
A lease "expires" by moving its expiry into the past (the test's stand-in for
the clock passing); everything else goes through the ledger functions.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_inference import db
from batch_inference.ledger import Failure, Ledger, StaleLease
from batch_inference.plan import submit
from batch_inference.status import job_counts
from tests.conftest import make_source, make_spec, tickets

RECORDS, SHARD, WORKERS, MAX_ATTEMPTS = 12, 4, 3, 3

op = st.one_of(
    st.tuples(st.just("claim"), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("renew"), st.integers(0, WORKERS - 1), st.integers(0, 5)),
    st.tuples(st.just("expire"), st.integers(0, RECORDS // SHARD - 1)),
    st.tuples(st.just("release"), st.integers(0, WORKERS - 1), st.integers(0, 5)),
    st.tuples(st.just("complete"), st.integers(0, WORKERS - 1), st.integers(0, 5)),
    st.tuples(st.just("write"), st.integers(0, WORKERS - 1), st.integers(0, 5), st.integers(1, SHARD)),
    st.tuples(st.just("fail"), st.integers(0, WORKERS - 1), st.integers(0, 5), st.integers(0, SHARD - 1)),
)

OUT = {"category": "bug", "summary": "s"}


def _snapshot(conn) -> tuple:
    """Everything a worker's write can change."""
    results = conn.execute("SELECT record_id, epoch FROM bi.results ORDER BY record_id").fetchall()
    attempts = conn.execute("SELECT record_id, attempts FROM bi.attempts ORDER BY record_id").fetchall()
    dead = conn.execute("SELECT record_id FROM bi.dead_letters ORDER BY record_id").fetchall()
    shards = conn.execute("SELECT shard_no, state, epoch, lease_owner, stored, dead FROM bi.shards "
                          "ORDER BY shard_no").fetchall()
    return (tuple(map(tuple, (r.values() for r in results))), tuple(map(tuple, (r.values() for r in attempts))),
            tuple(r["record_id"] for r in dead), tuple(tuple(s.values()) for s in shards))


@pytest.mark.timeout(600)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=5, max_size=30))
def test_random_interleavings_keep_the_invariants(pg_server, template_db, ops):
    name = "p_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    url = pg_server.get_uri(name)
    try:
        with db.connect(url) as conn:
            _run(conn, url, ops)
    finally:
        with psycopg.connect(pg_server.get_uri(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _run(conn, url: str, ops: list[tuple]) -> None:
    make_source(conn, tickets(RECORDS))
    job = submit(conn, make_spec(shard_size=SHARD, lease_seconds=600, renew_seconds=5,
                                 max_attempts=MAX_ATTEMPTS)).job_version
    workers = [Ledger(db.connect(url), job, f"w{i}") for i in range(WORKERS)]
    held: list[list] = [[] for _ in range(WORKERS)]          # leases each worker believes it holds
    epoch = {s: 0 for s in range(RECORDS // SHARD)}           # the model of the shard table
    state = {s: "pending" for s in epoch}
    expired = {s: False for s in epoch}

    def current(lease) -> bool:
        return lease.epoch == epoch[lease.shard_no] and state[lease.shard_no] == "leased"

    for o in ops:
        kind, w = o[0], o[1]
        if kind == "expire":
            conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                         "WHERE job_version = %s AND shard_no = %s AND state = 'leased'", (job, w))
            if state[w] == "leased":
                expired[w] = True
            continue
        if kind == "claim":
            lease = workers[w].claim()
            claimable = [s for s in epoch if state[s] == "pending" or (state[s] == "leased" and expired[s])]
            if lease is None:
                assert not claimable
                continue
            assert lease.shard_no == min(claimable)           # lowest claimable shard, nothing else
            assert lease.epoch == epoch[lease.shard_no] + 1    # +1 on every claim, never reset
            epoch[lease.shard_no], state[lease.shard_no], expired[lease.shard_no] = lease.epoch, "leased", False
            held[w].append(lease)
            continue
        if not held[w]:
            continue
        lease = held[w][o[2] % len(held[w])]
        live = current(lease)
        before = _snapshot(conn)
        try:
            if kind == "renew":
                workers[w].renew(lease)
                expired[lease.shard_no] = False
            elif kind == "release":
                ok = workers[w].release(lease)
                assert ok == live
                if ok:
                    state[lease.shard_no] = "pending"
            elif kind == "complete":
                if workers[w].complete(lease) == "done":
                    state[lease.shard_no] = "done"
            elif kind == "write":
                ids = [f"t{i:05d}" for i in range(lease.shard_no * SHARD, lease.shard_no * SHARD + o[3])]
                workers[w].put_results(lease, ids, [OUT] * len(ids), ["bug"] * len(ids))
            elif kind == "fail":
                rid = f"t{lease.shard_no * SHARD + o[3]:05d}"
                workers[w].fail(lease, [Failure(rid, "invalid output", "{")])
            if kind != "release":                               # release answers False instead of raising
                assert live, f"{kind} under a stale epoch was accepted"
        except StaleLease:
            assert not live, f"{kind} by the current holder was refused"
            assert _snapshot(conn) == before, f"stale {kind} changed state"

    # A clean drain: one honest worker finishes what is left.
    drain = Ledger(db.connect(url), job, "drain")
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND state = 'leased'", (job,))
    while (lease := drain.claim()) is not None:
        rows = drain.records(lease)
        good = [r["record_id"] for r in rows if int(r["record_id"][1:]) % 5 != 0]
        drain.put_results(lease, good, [OUT] * len(good), ["bug"] * len(good))
        for r in rows:
            if r["record_id"] in good:
                continue
            for _ in range(MAX_ATTEMPTS - r["attempts"]):     # poison: fails until dead-lettered
                drain.fail(lease, [Failure(r["record_id"], "poison", "raw")])
        assert drain.complete(lease) == "done"

    c = job_counts(conn, job)
    assert c["outstanding"] == 0 and c["stored"] + c["dead_letters"] == RECORDS
    dup = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results").fetchone()["d"]
    assert dup == 0
    both = conn.execute("SELECT count(*) AS n FROM bi.results r JOIN bi.dead_letters d USING (job_version, record_id)"
                        ).fetchone()["n"]
    assert both == 0                                          # stored and dead-lettered are disjoint
    assert conn.execute("SELECT max(attempts) AS m FROM bi.attempts").fetchone()["m"] in (None, 1, 2, 3)
    for lg in workers + [drain]:
        lg.conn.close()
