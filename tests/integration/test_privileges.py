"""Least privilege (sql/schema/roles.sql) on the real embedded PostgreSQL.

A worker logs in as its own role, a member of the NOLOGIN group bi_worker.
The embedded server trusts local connections, so a LOGIN role without a
password can connect over the Unix socket: the tests log in as the worker
exactly as a pod would, and use SET SESSION AUTHORIZATION (which, unlike SET
ROLE, also changes session_user) where a bare group role is enough.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from batch_inference import db
from batch_inference.ladder import audit as ladder_audit
from batch_inference.ladder.rungs import Answer
from batch_inference.ledger import Failure, Ledger
from batch_inference.plan import submit
from batch_inference.status import job_counts
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets

OUT = {"category": "billing", "summary": "charged twice"}
OUT_TEXT = '{"category": "billing", "summary": "charged twice"}'

# Exactly the functions the worker process calls (gpu_runner/worker.py,
# batch_inference/ledger.py, status.job_spec/job_mode/job_counts), plus the
# read-only "may I?" check.
WORKER_FUNCTIONS = {
    "claim_shard_v2", "renew_lease_v2", "release_shard_v2", "complete_shard_v2", "shard_records_v4",
    "mark_in_flight_v2", "abandon_shard_v2", "put_results_v3", "fail_records_v3", "halt_job_v1",
    "job_spec_v2", "job_counts_v1", "may_work_on_v1",
    # the hosted batch transports' provider batches (batch_inference/hosted/core.py)
    "hosted_open_v1", "hosted_intents_v1", "hosted_update_v1",
    # what the job's provider batches cost and hold, under the budget's lock (hosted/core.py, cost.budget)
    "hosted_spend_v1",
    # embedding jobs: results with their vectors (batch_inference/ledger.py)
    "put_embeddings_v1",
    # the model ladder: every rung's answers under the lease (batch_inference/ladder/audit.py)
    "ladder_put_answers_v1", "ladder_answers_v1",
    # regions: near shards first, replicas read (and rebuilt), results handed in (batch_inference/regions/ledger.py)
    "claim_shard_region_v2", "region_store_v1", "region_shard_state_v1", "replica_rows_v1", "replica_rebuilt_v1",
    "hand_in_results_v1", "renew_lease_held_v1",
    # identical rendered inputs computed once: the records stored with another's result (gpu_runner/worker.py)
    "note_shared_v1",
    # the tiered fallback: the price tier that answered each row, under the lease (batch_inference/tiers/engine.py)
    "fallback_tier_put_v1",
}


def url_as(url: str, role: str) -> str:
    """The same database, logged in as ``role`` (trust auth on the local socket)."""
    params = conninfo_to_dict(url)
    params["user"] = role
    params.pop("password", None)
    return make_conninfo(**params)


@pytest.fixture
def worker_role(conn):
    """A LOGIN role in bi_worker, as a worker pod's credentials would be."""
    role = "bi_w_" + uuid.uuid4().hex[:10]
    conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE bi_worker')
    yield role
    conn.execute(f'DROP ROLE IF EXISTS "{role}"')


@pytest.fixture
def two_jobs(conn):
    """Two job versions of different datasets; the worker is given only the first."""
    make_source(conn, tickets(25), table="public.mine")
    make_source(conn, [(f"s{i:03d}", f"secret ticket {i}", ["hr"]) for i in range(12)], table="public.theirs")
    mine = submit(conn, make_spec(source={"table": "public.mine"})).job_version
    theirs = submit(conn, make_spec(dataset="hr_cases", source={"table": "public.theirs"})).job_version
    return mine, theirs


def worker_conn(db_url: str, role: str) -> psycopg.Connection:
    return db.connect(url_as(db_url, role))


def test_worker_role_executes_exactly_the_ledger_functions(conn):
    rows = conn.execute("""
        SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'bi' AND has_function_privilege('bi_worker', p.oid, 'EXECUTE')""").fetchall()
    assert {r["proname"] for r in rows} == WORKER_FUNCTIONS
    # and PUBLIC (every role that can connect) executes nothing in bi
    public = conn.execute("""
        SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace,
               aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
         WHERE n.nspname = 'bi' AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'""").fetchall()
    assert public == []
    # every one of them checks the per-job grant first
    for name in WORKER_FUNCTIONS - {"may_work_on_v1"}:
        src = conn.execute("SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                           "WHERE n.nspname = 'bi' AND p.proname = %s", (name,)).fetchone()["prosrc"]
        assert "assert_may_work_on_v1" in src, f"bi.{name} lost its job guard"


def test_worker_role_has_no_table_privilege_in_bi(conn, two_jobs):
    rows = conn.execute("""
        SELECT c.relname,
               has_table_privilege('bi_worker', c.oid, 'SELECT,INSERT,UPDATE,DELETE,TRUNCATE,REFERENCES,TRIGGER') AS any
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'bi' AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')""").fetchall()
    assert len(rows) > 10                          # the job partitions are in the list too
    assert [r["relname"] for r in rows if r["any"]] == []


def test_worker_cannot_select_update_or_delete_directly(db_url, conn, worker_role, two_jobs):
    mine, _ = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    admin = Ledger(conn, mine, "admin")
    lease = admin.claim()
    admin.put_results(lease, ["t00000"], [OUT], ["billing"])
    with worker_conn(db_url, worker_role) as w:
        for stmt in ("SELECT * FROM bi.snapshot_rows",
                     "SELECT * FROM bi.results",
                     "SELECT * FROM bi.jobs",
                     "SELECT * FROM bi.worker_grants",
                     "SELECT * FROM bi.publish_pointer",
                     "UPDATE bi.results SET output = '{}'",
                     "DELETE FROM bi.results",
                     "UPDATE bi.shards SET epoch = epoch + 1",
                     f"INSERT INTO bi.publish_pointer (dataset, job_version) VALUES ('tickets_triage', '{mine}')",
                     "UPDATE bi.publish_pointer SET job_version = job_version",
                     "INSERT INTO bi.worker_grants (role_name, job_version) SELECT current_user, job_version "
                     "FROM bi.jobs"):
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute(stmt)
    # the one stored row is untouched
    row = conn.execute("SELECT output FROM bi.results WHERE job_version = %s", (mine,)).fetchone()
    assert row["output"] == OUT


def test_worker_cannot_call_owner_functions(db_url, conn, worker_role, two_jobs):
    mine, theirs = two_jobs
    with worker_conn(db_url, worker_role) as w:
        for stmt, args in (("SELECT bi.drop_job_version_v1(%s)", (mine,)),
                           ("SELECT bi.enter_fallback_v1(%s)", (mine,)),
                           ("SELECT bi.sweep_expired_v1(%s)", (mine,)),
                           ("SELECT bi.grant_job_v1(%s, %s)", (worker_role, theirs)),
                           ("SELECT bi.create_job_partitions_v1(%s)", ("jv_evil",)),
                           ("SELECT bi.record_fence_v1(%s, 0, 'x', 0, 'w')", (mine,)),
                           ("SELECT bi.record_deaths_v1(%s, 0, 1, 'batch', ARRAY['t00000'])", (mine,)),
                           ("SELECT bi.dead_letter_records_v1(%s, 0, 'batch', ARRAY['s000'], ARRAY[9], "
                            "ARRAY['x'], ARRAY['x'], ARRAY['x'])", (theirs,)),
                           ("SELECT bi.drop_job_version_v1(%s)", (theirs,)),
                           ("SELECT bi.attach_snapshot_v2(%s)", (theirs,))):
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute(stmt, args)
    assert conn.execute("SELECT count(*) AS n FROM bi.worker_grants").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.fence_events").fetchone()["n"] == 0
    assert {r["mode"] for r in conn.execute("SELECT mode FROM bi.jobs")} == {"batch"}


def test_worker_reads_and_writes_only_the_jobs_it_is_given(db_url, conn, worker_role, two_jobs):
    mine, theirs = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    # the owner holds a lease on the other job, so its epoch is real
    other = Ledger(conn, theirs, "admin").claim()
    assert other is not None
    with worker_conn(db_url, worker_role) as w:
        assert w.execute("SELECT bi.may_work_on_v1(%s) AS ok", (mine,)).fetchone()["ok"] is True
        assert w.execute("SELECT bi.may_work_on_v1(%s) AS ok", (theirs,)).fetchone()["ok"] is False
        lg = Ledger(w, mine, "w1")
        lease = lg.claim()
        assert lease is not None and len(lg.records(lease)) == 10
        assert lg.put_results(lease, ["t00000"], [OUT], ["billing"]) == 1

        stranger = Ledger(w, theirs, "w1")
        # the snapshot rows of a job it was not given, even with the right epoch
        with pytest.raises(errors.InsufficientPrivilege, match="may not work on job version"):
            stranger.records(other)
        for call in (stranger.claim, lambda: stranger.put_results(other, ["s000"], [OUT], ["billing"]),
                     lambda: stranger.complete(other), lambda: stranger.release(other),
                     lambda: stranger.renew(other), lambda: stranger.mark_in_flight(other, ["s000"]),
                     lambda: stranger.abandon(other),
                     lambda: stranger.fail(other, [Failure("s000", "boom", attempt=1)]),
                     lambda: ladder_audit.stored(stranger, other, ["s000"]),
                     lambda: ladder_audit.put(stranger, other, [(1, Answer("s000", OUT_TEXT, True, 0.9), False)])):
            with pytest.raises(errors.InsufficientPrivilege):
                call()
        for stmt in ("SELECT * FROM bi.job_spec_v2(%s)", "SELECT * FROM bi.job_counts_v1(%s)"):
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute(stmt, (theirs,))
    # nothing of the other job moved: no new epoch, no result, no fence event
    shard = conn.execute("SELECT state, epoch, lease_owner FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (theirs, other.shard_no)).fetchone()
    assert (shard["state"], shard["epoch"], shard["lease_owner"]) == ("leased", other.epoch, "admin")
    assert conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s", (theirs,)).fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM bi.fence_events").fetchone()["n"] == 0


def test_grant_to_a_group_role_covers_its_members_and_revoke_ends_it(db_url, conn, worker_role, two_jobs):
    mine, _ = two_jobs
    conn.execute("SELECT bi.grant_job_v1('bi_worker', %s)", (mine,))
    with worker_conn(db_url, worker_role) as w:
        assert w.execute("SELECT bi.may_work_on_v1(%s) AS ok", (mine,)).fetchone()["ok"] is True
        conn.execute("SELECT bi.revoke_job_v1('bi_worker', %s)", (mine,))
        with pytest.raises(errors.InsufficientPrivilege):
            Ledger(w, mine, "w1").claim()


def test_grants_only_to_existing_worker_roles(conn, two_jobs):
    mine, _ = two_jobs
    with pytest.raises(errors.UndefinedObject):
        conn.execute("SELECT bi.grant_job_v1('no_such_role_xyz', %s)", (mine,))
    # a role outside bi_worker is refused: it could not use the grant anyway
    role = "bi_x_" + uuid.uuid4().hex[:10]
    conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        with pytest.raises(errors.InvalidGrantOperation):
            conn.execute("SELECT bi.grant_job_v1(%s, %s)", (role, mine))
    finally:
        conn.execute(f'DROP ROLE "{role}"')


def test_grants_go_with_the_job_version(conn, worker_role, two_jobs):
    mine, _ = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    conn.execute("SELECT bi.drop_job_version_v1(%s)", (mine,))
    assert conn.execute("SELECT count(*) AS n FROM bi.worker_grants").fetchone()["n"] == 0


def test_session_authorization_as_the_bare_group_role(db_url, two_jobs):
    """bi_worker itself (NOLOGIN) as the session user: granted nothing, it can do nothing."""
    mine, _ = two_jobs
    with db.connect(db_url) as c:
        c.execute("SET SESSION AUTHORIZATION bi_worker")
        assert c.execute("SELECT session_user AS s").fetchone()["s"] == "bi_worker"
        with pytest.raises(errors.InsufficientPrivilege):
            c.execute("SELECT * FROM bi.job_spec_v2(%s)", (mine,))
        with pytest.raises(errors.InsufficientPrivilege):
            c.execute("SELECT count(*) FROM bi.snapshot_rows")


def test_set_role_limits_tables_but_not_the_owners_identity(conn, two_jobs):
    """SET ROLE changes current_user (table privileges) but not session_user:
    the owner who steps down to bi_worker still passes the job guard. The
    guard is about credentials, which SET ROLE cannot borrow."""
    mine, _ = two_jobs
    conn.execute("SET ROLE bi_worker")
    try:
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM bi.results")
        assert conn.execute("SELECT bi.may_work_on_v1(%s) AS ok", (mine,)).fetchone()["ok"] is True
    finally:
        conn.execute("RESET ROLE")


def test_worker_process_with_worker_credentials_completes_its_job(db_url, conn, worker_role, two_jobs):
    mine, theirs = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    cfg = WorkerConfig(job_version=mine, db_url=url_as(db_url, worker_role), worker_id="least-priv-1")
    assert run_worker(cfg) == 0
    c = job_counts(conn, mine)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (25, 0, 0)
    assert c["shards"]["done"] == 3
    who = conn.execute("SELECT DISTINCT worker_id FROM bi.results WHERE job_version = %s", (mine,)).fetchall()
    assert [r["worker_id"] for r in who] == ["least-priv-1"]
    # the same credentials on the other job: refused before any claim, a config error (exit 4), not a traceback
    assert run_worker(WorkerConfig(job_version=theirs, db_url=url_as(db_url, worker_role))) == 4
    assert conn.execute("SELECT max(epoch) AS e FROM bi.shards WHERE job_version = %s", (theirs,)).fetchone()["e"] == 0


def test_worker_cannot_read_published_views(db_url, conn, worker_role, two_jobs):
    if not conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'published'").fetchone():
        pytest.skip("schema 'published' does not exist yet (sql/schema/core.sql)")
    mine, _ = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    assert run_worker(WorkerConfig(job_version=mine, db_url=url_as(db_url, worker_role))) == 0
    # publish through the SQL functions of sql/schema/publish.sql (the owner's credentials)
    view = conn.execute("SELECT bi.ensure_published_view_v2('tickets_triage', 'text', '[[\"summary\", \"text\"]]') AS v"
                        ).fetchone()["v"]
    conn.execute("SELECT * FROM bi.publish_v1('tickets_triage', %s, 'test', true, 'privilege test')", (mine,))
    rels = _published_relations(conn)
    assert view in rels
    reader = "bi_r_" + uuid.uuid4().hex[:10]
    conn.execute(f'CREATE ROLE "{reader}" LOGIN IN ROLE bi_reader')
    try:
        # control: the view is readable with reader credentials, so the refusal below is about the role
        with db.connect(url_as(db_url, reader)) as r:
            r.execute(f"SELECT count(*) FROM {view}").fetchone()
        with worker_conn(db_url, worker_role) as w:
            for rel in rels:
                with pytest.raises(errors.InsufficientPrivilege):
                    w.execute(f"SELECT * FROM {rel} LIMIT 1")
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute("SELECT * FROM bi.publish_v1('tickets_triage', %s, 'w', true, 'evil')", (mine,))
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute("SELECT * FROM bi.rollback_v1('tickets_triage')")
    finally:
        conn.execute(f'DROP ROLE "{reader}"')
    assert conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = 'tickets_triage'"
                        ).fetchone()["job_version"] == mine


def _published_relations(conn) -> list[str]:
    rows = conn.execute("""
        SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS rel
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'published' AND c.relkind IN ('v', 'm', 'r', 'p')
         ORDER BY 1""").fetchall()
    return [r["rel"] for r in rows]


def test_a_worker_halts_only_a_job_granted_to_it(conn, db_url, worker_role, two_jobs):
    mine, theirs = two_jobs
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker_role, mine))
    with worker_conn(db_url, worker_role) as w:
        assert w.execute(db.q("halt_job"), {"job": mine, "reason": "fatal: digest"}).fetchone()["halted_at"]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            w.execute(db.q("halt_job"), {"job": theirs, "reason": "fatal: digest"})
    assert conn.execute(db.q("job_halt"), {"job": theirs}).fetchone()["halted_at"] is None
