"""Publish, rollback and the published view on the real embedded PostgreSQL:
the pointer switch under concurrent readers, the guards, the history, and
row-level access control for reader roles (roles are cluster-wide, so each
test makes uniquely named ones and drops them)."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import errors

from batch_inference import db
from batch_inference.cli import main as cli_main
from batch_inference.plan import submit
from batch_inference.publish import (
    PointerMoved,
    PublishRefused,
    publish,
    published,
    rollback,
    set_null_acl,
    view_name,
)
from batch_inference.status import UnknownJob
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.integration.test_validate import finish, status_of

DATASET = "tickets_triage"
VIEW = view_name(DATASET)


def version(conn, db_url: str, n: int, start: int = 0, *, validated: bool = True, rows=None, **spec_over: Any) -> str:
    """A finished job version of ``n`` tickets (validated unless told otherwise)."""
    make_source(conn, rows if rows is not None else tickets(n, start))
    job = submit(conn, make_spec(**spec_over)).job_version
    finish(db_url, job)
    if validated:
        assert validate(conn, job).passed
    return job


def view_state(conn) -> tuple[int, int, str | None]:
    r = conn.execute(f"SELECT count(*) AS n, count(DISTINCT job_version) AS v, min(job_version) AS j FROM {VIEW}"
                     ).fetchone()
    return r["n"], r["v"], r["j"]


def history(conn) -> list[dict[str, Any]]:
    return conn.execute("SELECT * FROM bi.publish_history WHERE dataset = %s ORDER BY id", (DATASET,)).fetchall()


@pytest.fixture
def roles(conn):
    """Make roles with unique names; drop them (and their memberships) afterwards."""
    made: list[str] = []

    def make(prefix: str, *, login: bool = False, member_of: tuple[str, ...] = ()) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {name} {'LOGIN' if login else 'NOLOGIN'}")
        made.append(name)
        for group in member_of:
            conn.execute(f"GRANT {group} TO {name}")
        return name

    yield make
    for name in reversed(made):
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
        conn.execute(f"DROP OWNED BY {name}")
        conn.execute(f"DROP ROLE IF EXISTS {name}")


def as_role(db_url: str, role: str) -> str:
    user, sep, rest = db_url.partition("@")
    assert sep and user.startswith("postgresql://")
    return f"postgresql://{role}:@{rest}"


# -- publish ------------------------------------------------------------------------------

def test_publish_switches_the_pointer_and_the_view_shows_one_version(conn, db_url):
    v1 = version(conn, db_url, 30)
    out = publish(conn, v1)
    assert out == {"dataset": DATASET, "from_version": None, "to_version": v1, "action": "publish", "forced": False,
                   "changed": True, "history_id": out["history_id"], "view": VIEW}
    assert view_state(conn) == (30, 1, v1)
    assert status_of(conn, v1) == "published"
    cols = [r["column_name"] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = 'published' AND table_name = %s "
        "ORDER BY ordinal_position", (DATASET,))]
    assert cols == ["record_id", "output", "category", "summary", "model_name", "model_digest", "prompt_version",
                    "transport", "job_version", "created_at", "acl"]
    row = conn.execute(f"SELECT * FROM {VIEW} WHERE record_id = 't00007'").fetchone()
    assert row["summary"] == "charged twice" and row["output"]["category"] == "billing" and row["acl"] == ["team1"]
    # The view checks RLS against its reader, and only bi_reader may read it.
    opts = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (VIEW,)).fetchone()["reloptions"]
    assert "security_invoker=true" in opts
    grants = {(r["grantee"], r["privilege_type"]) for r in conn.execute(
        "SELECT grantee, privilege_type FROM information_schema.role_table_grants "
        "WHERE table_schema = 'published' AND table_name = %s", (DATASET,))}
    assert ("bi_reader", "SELECT") in grants and not any(g == "PUBLIC" for g, _ in grants)

    again = publish(conn, v1)                                       # an Airflow retry
    assert again["changed"] is False and len(history(conn)) == 1

    v2 = version(conn, db_url, 50, start=100)
    out2 = publish(conn, v2, actor="nightly-dag", reason="nightly run")
    assert out2["from_version"] == v1 and out2["to_version"] == v2
    assert view_state(conn) == (50, 1, v2)
    assert (status_of(conn, v1), status_of(conn, v2)) == ("validated", "published")
    h = history(conn)
    assert [(x["from_version"], x["to_version"], x["action"], x["actor"], x["reason"]) for x in h] == [
        (None, v1, "publish", "postgres", None), (v1, v2, "publish", "nightly-dag", "nightly run")]
    ptr = conn.execute("SELECT * FROM bi.publish_pointer WHERE dataset = %s", (DATASET,)).fetchone()
    assert ptr["job_version"] == v2 and ptr["switched_by"] == "nightly-dag"


def test_the_view_reads_only_the_published_partition(conn, db_url):
    v1 = version(conn, db_url, 20)
    version(conn, db_url, 20, start=50)
    publish(conn, v1)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(f"EXPLAIN (ANALYZE, COSTS OFF) SELECT count(*) FROM {VIEW}"))
    # Pruned at run time from the pointer's value: the published version's partition read (its
    # 8 hash leaves), every leaf of the other never executed.
    scans = [line for line in plan.splitlines() if "Scan" in line and " on results_" in line]
    v1_part = conn.execute("SELECT 'results_' || substr(md5(%s), 1, 16) AS p", (v1,)).fetchone()["p"]
    read = [line for line in scans if f" on {v1_part}_" in line]
    assert len(scans) == 16 and len(read) == 8, plan
    assert not any("(never executed)" in line for line in read), plan
    assert all("(never executed)" in line for line in scans if line not in read), plan


def test_a_failed_version_is_refused_unless_forced_with_a_reason(conn, db_url):
    v1 = version(conn, db_url, 20)
    publish(conn, v1)
    v2 = version(conn, db_url, 20, start=100, validated=False)
    conn.execute("DELETE FROM bi.results WHERE job_version = %s AND record_id = 't00105'", (v2,))
    assert not validate(conn, v2).passed

    with pytest.raises(PublishRefused, match=f"^job version {v2} failed validation: refused "
                                             r"\(publish --force --reason TEXT to override\)$"):
        publish(conn, v2)
    with pytest.raises(PublishRefused, match="^a forced publish needs a reason$"):
        publish(conn, v2, force=True, reason="  ")
    assert view_state(conn) == (20, 1, v1) and len(history(conn)) == 1       # nothing moved

    out = publish(conn, v2, force=True, reason="missing record accepted by the owner", actor="alice")
    assert out["forced"] is True and view_state(conn) == (19, 1, v2)
    last = history(conn)[-1]
    assert (last["forced"], last["reason"], last["actor"]) == (True, "missing record accepted by the owner", "alice")

    # Replaced, the forced version goes back to failed_validation, not to validated.
    v3 = version(conn, db_url, 20, start=200)
    publish(conn, v3)
    assert status_of(conn, v2) == "failed_validation"
    with pytest.raises(PublishRefused, match="failed validation: refused"):
        publish(conn, v2)


def test_never_validated_or_unfinished_versions(conn, db_url):
    v1 = version(conn, db_url, 20, validated=False)                    # finished, never validated
    with pytest.raises(PublishRefused, match=f"^job version {v1} has not been validated: refused"):
        publish(conn, v1)
    make_source(conn, tickets(30, 500))
    open_job = submit(conn, make_spec()).job_version                   # shards still pending
    with pytest.raises(PublishRefused, match=r"is not finished \(3 shard\(s\) not done\); it cannot be published, "
                                             "even forced"):
        publish(conn, open_job, force=True, reason="deadline")
    assert publish(conn, v1, force=True, reason="validator down tonight")["forced"] is True
    with pytest.raises(UnknownJob):
        publish(conn, "jv_nope")


def test_a_version_of_another_dataset_is_refused(conn, db_url):
    other = version(conn, db_url, 10, dataset="other_dataset")
    with pytest.raises(PublishRefused, match=f"^job version {other} belongs to dataset other_dataset, not {DATASET}$"):
        publish(conn, other, dataset=DATASET)
    assert conn.execute("SELECT to_regclass(%s) AS v", (VIEW,)).fetchone()["v"] is None   # the DDL rolled back too
    assert publish(conn, other)["view"] == "published.other_dataset"


# -- rollback -----------------------------------------------------------------------------

def test_rollback_restores_the_previous_version_and_walks_back(conn, db_url):
    with pytest.raises(PublishRefused, match=f"dataset {DATASET} has never been published"):
        rollback(conn, DATASET)
    v1, v2, v3 = (version(conn, db_url, n, start=s) for n, s in ((10, 0), (20, 100), (30, 200)))
    for v in (v1, v2, v3):
        publish(conn, v)
    out = rollback(conn, DATASET, reason="bad labels in v3", actor="oncall")
    assert (out["from_version"], out["to_version"], out["action"]) == (v3, v2, "rollback")
    assert view_state(conn) == (20, 1, v2)
    assert (status_of(conn, v2), status_of(conn, v3)) == ("published", "validated")
    rollback(conn, DATASET)
    assert view_state(conn) == (10, 1, v1)
    with pytest.raises(PublishRefused, match=f"nothing to roll back to: {v1} was the first version published"):
        rollback(conn, DATASET)
    publish(conn, v3)                                                   # forward again, then back to v1
    assert rollback(conn, DATASET)["to_version"] == v1
    h = history(conn)
    assert [x["action"] for x in h] == ["publish"] * 3 + ["rollback"] * 2 + ["publish", "rollback"]
    assert h[3]["reason"] == "bad labels in v3" and h[3]["actor"] == "oncall"


def test_cli_publish_rollback_published(conn, db_url, capsys):
    v1 = version(conn, db_url, 10)
    v2 = version(conn, db_url, 12, start=50, validated=False)
    assert cli_main(["--db", db_url, "publish", v1]) == 0
    assert f"(nothing) -> {v1}" in capsys.readouterr().out
    assert cli_main(["--db", db_url, "publish", v2]) == 2
    assert "has not been validated: refused" in capsys.readouterr().err
    assert cli_main(["--db", db_url, "publish", v2, "--force"]) == 2
    assert "--force needs --reason" in capsys.readouterr().err
    assert cli_main(["--db", db_url, "publish", v2, "--force", "--reason", "hotfix", "--actor", "bob", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forced"] is True
    assert cli_main(["--db", db_url, "rollback", DATASET, "--reason", "oops"]) == 0
    assert f"{v2} -> {v1}" in capsys.readouterr().out
    assert cli_main(["--db", db_url, "published", DATASET, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["job_version"] == v1 and out["view"] == VIEW and out["null_acl"] == "all_readers"
    assert [h["action"] for h in out["history"]] == ["rollback", "publish", "publish"]
    assert out["history"][1]["forced"] is True and out["history"][1]["actor"] == "bob"
    assert cli_main(["--db", db_url, "published", "nothing_here", "--json"]) == 2   # no such dataset: one line
    assert capsys.readouterr().out == ""


# -- expected current version (sql/schema/publish.sql) --------------------------------------

def pointer(conn) -> str | None:
    row = conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s", (DATASET,)).fetchone()
    return row["job_version"] if row else None


def test_a_publish_between_read_and_rollback_refuses_the_rollback(conn, db_url):
    v1, v2, v3 = (version(conn, db_url, n, start=s) for n, s in ((10, 0), (20, 100), (30, 200)))
    publish(conn, v1)
    publish(conn, v2)
    seen = published(conn, DATASET)["job_version"]                   # on-call looks: v2 is live, v2 is bad
    with db.connect(db_url) as other:
        publish(other, v3, actor="nightly")                          # ...and the nightly publishes v3 meanwhile
    n_history = len(history(conn))

    with pytest.raises(PointerMoved) as refused:
        rollback(conn, DATASET, expected_current=seen, actor="oncall", reason="v2 is bad")
    assert str(refused.value) == (f"rollback of dataset {DATASET} refused: expected {v2} to be published, "
                                  f"but {v3} is; nothing was changed")
    assert (refused.value.dataset, refused.value.expected, refused.value.actual) == (DATASET, v2, v3)
    assert pointer(conn) == v3 and len(history(conn)) == n_history   # nothing switched, nothing recorded
    assert view_state(conn) == (30, 1, v3)
    assert (status_of(conn, v2), status_of(conn, v3)) == ("validated", "published")

    out = rollback(conn, DATASET, expected_current=v3, actor="oncall")   # from what is really live: fine
    assert (out["from_version"], out["to_version"], out["changed"]) == (v3, v2, True)
    with pytest.raises(PointerMoved, match=f"expected {v3} to be published, but {v2} is"):
        rollback(conn, DATASET, expected_current=v3)                 # a retry does not walk back twice
    assert pointer(conn) == v2


def waits_on_a_lock(conn: psycopg.Connection, application_name: str, running=lambda: True) -> bool:
    """Whether the session named ``application_name`` comes to wait for a lock (within 10 s, and
    while ``running()``: a thread that finished without waiting ends the watch)."""
    for _ in range(200):
        waiting = conn.execute("SELECT wait_event_type FROM pg_stat_activity "
                               "WHERE application_name = %s AND state = 'active'", (application_name,)).fetchone()
        if waiting and waiting["wait_event_type"] == "Lock":
            return True
        if not running():
            return False
        time.sleep(0.05)
    return False


def test_a_rollback_waiting_on_a_publish_in_flight_sees_it_and_is_refused(conn, db_url):
    """The guard is under the publish lock: a rollback that starts while a publish is uncommitted
    waits for it, then checks against the version it published, never against what it read before."""
    v1, v2, v3 = (version(conn, db_url, n, start=s) for n, s in ((10, 0), (20, 100), (30, 200)))
    publish(conn, v1)
    publish(conn, v2)
    result: dict[str, Any] = {}

    def oncall_rollback() -> None:
        with db.connect(db_url, application_name="oncall-rollback") as c:
            try:
                result["out"] = rollback(c, DATASET, expected_current=v2, actor="oncall")
            except PublishRefused as exc:
                result["error"] = exc

    with db.connect(db_url) as publisher, publisher.transaction():
        publish(publisher, v3, actor="nightly")                      # holds the lock, not yet committed
        t = threading.Thread(target=oncall_rollback)
        t.start()
        if not waits_on_a_lock(conn, "oncall-rollback", t.is_alive):  # the rollback is queued on the lock
            pytest.fail("the rollback did not wait for the publish in flight")
        assert pointer(conn) == v2                                   # others still read v2
    t.join(timeout=30)
    assert "out" not in result, result
    assert isinstance(result["error"], PointerMoved)
    assert f"expected {v2} to be published, but {v3} is" in str(result["error"])
    assert pointer(conn) == v3
    assert [h["action"] for h in history(conn)] == ["publish"] * 3


def test_the_v2_functions_in_sql(conn, db_url):
    v1, v2 = version(conn, db_url, 10), version(conn, db_url, 12, start=50)
    # publish_v2: NULL expects a first publish; the same version again is a no-op whatever was expected.
    first = conn.execute("SELECT * FROM bi.publish_v2(%s, %s, NULL, 'me')", (DATASET, v1)).fetchone()
    assert (first["from_version"], first["to_version"], first["changed"]) == (None, v1, True)
    retry = conn.execute("SELECT * FROM bi.publish_v2(%s, %s, NULL, 'me')", (DATASET, v1)).fetchone()
    assert retry["changed"] is False
    with pytest.raises(psycopg.Error) as moved:
        conn.execute("SELECT * FROM bi.publish_v2(%s, %s, NULL)", (DATASET, v2))
    assert moved.value.sqlstate == "BI409" and moved.value.diag.message_detail == v1
    assert moved.value.diag.message_primary == (f"publish of {v2} of dataset {DATASET} refused: "
                                                f"expected nothing to be published, but {v1} is; nothing was changed")
    assert conn.execute("SELECT * FROM bi.publish_v2(%s, %s, %s)", (DATASET, v2, v1)).fetchone()["changed"]
    # rollback_v2 refuses a wrong expectation; v1 of 0003 still rolls back unguarded.
    with pytest.raises(psycopg.Error, match=f"rollback of dataset {DATASET} refused: expected {v1}"):
        conn.execute("SELECT * FROM bi.rollback_v2(%s, %s)", (DATASET, v1))
    assert conn.execute("SELECT * FROM bi.rollback_v1(%s)", (DATASET,)).fetchone()["to_version"] == v1
    assert conn.execute("SELECT * FROM bi.publish_v1(%s, %s)", (DATASET, v2)).fetchone()["changed"]
    out = conn.execute("SELECT * FROM bi.rollback_v2(%s, %s, 'x', 'why')", (DATASET, v2)).fetchone()
    assert (out["from_version"], out["to_version"], out["action"]) == (v2, v1, "rollback")
    # The other guards of v1 still apply behind v2's.
    with pytest.raises(psycopg.Error, match="nothing to roll back to"):
        conn.execute("SELECT * FROM bi.rollback_v2(%s, %s)", (DATASET, v1))
    with pytest.raises(psycopg.Error, match="never been published"):
        conn.execute("SELECT * FROM bi.rollback_v2('nothing_here', NULL)")


def test_cli_expect(conn, db_url, capsys):
    v1, v2 = version(conn, db_url, 10), version(conn, db_url, 12, start=50)
    assert cli_main(["--db", db_url, "publish", v1, "--expect", "none"]) == 0      # the first publish
    assert cli_main(["--db", db_url, "publish", v2, "--expect", "none"]) == 2      # ... stays the first
    assert (f"refused: expected nothing to be published, but {v1} is; nothing was changed"
            in capsys.readouterr().err)
    assert cli_main(["--db", db_url, "publish", v2, "--expect", v2]) == 2
    assert (f"refused: expected {v2} to be published, but {v1} is; nothing was changed"
            in capsys.readouterr().err)
    assert cli_main(["--db", db_url, "publish", v2, "--expect", v1]) == 0
    assert f"{v1} -> {v2}" in capsys.readouterr().out
    assert cli_main(["--db", db_url, "rollback", DATASET, "--expect", v1, "--reason", "stale"]) == 2
    err = capsys.readouterr().err
    assert f"rollback of dataset {DATASET} refused: expected {v1} to be published, but {v2} is" in err
    assert cli_main(["--db", db_url, "rollback", DATASET, "--expect", v2, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["to_version"] == v1


# -- readers during switches -----------------------------------------------------------------

def test_concurrent_readers_never_see_a_mix_a_gap_or_an_error(conn, db_url, roles):
    sizes = {}
    for n, start in ((30, 0), (50, 1000), (70, 2000)):
        sizes[version(conn, db_url, n, start=start)] = n
    jobs = list(sizes)
    publish(conn, jobs[0])
    reader = roles("reader", login=True, member_of=("bi_reader",))
    for team in ("team0", "team1", "team2"):                         # sees every row through RLS
        conn.execute("INSERT INTO bi.reader_principals VALUES (%s, %s)", (reader, team))

    stop = threading.Event()
    seen: dict[str, set[str]] = {"owner": set(), "reader": set()}
    reads = {"owner": 0, "reader": 0}
    problems: list[str] = []

    def read_loop(who: str, url: str) -> None:
        with db.connect(url) as c:
            while not stop.is_set():
                try:
                    n, v, j = view_state(c)
                except psycopg.Error as exc:
                    problems.append(f"{who}: {exc}")
                    return
                reads[who] += 1
                if v != 1 or j not in sizes or n != sizes[j]:
                    problems.append(f"{who}: saw {n} rows of {v} version(s) ({j})")
                seen[who].add(j)

    threads = [threading.Thread(target=read_loop, args=("owner", db_url)),
               threading.Thread(target=read_loop, args=("reader", as_role(db_url, reader)))]
    for t in threads:
        t.start()
    rng = random.Random(11)
    switches = 0
    with db.connect(db_url) as admin:
        deadline = time.monotonic() + 60
        while switches < 60 and time.monotonic() < deadline:
            cur = admin.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s", (DATASET,)
                                ).fetchone()["job_version"]
            prev = [h for h in history(admin) if h["to_version"] == cur and h["action"] == "publish"]
            if prev and prev[-1]["from_version"] and rng.random() < 0.4:
                rollback(admin, DATASET)
            else:
                publish(admin, rng.choice([j for j in jobs if j != cur]))
            switches += 1
            time.sleep(0.01)
    time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert problems == []
    assert switches == 60 and reads["owner"] > 60 and reads["reader"] > 60
    assert seen["owner"] == set(jobs) and seen["reader"] == set(jobs)
    assert len(history(conn)) == 61


def test_a_submit_does_not_block_readers_of_the_view(conn, db_url):
    v1 = version(conn, db_url, 10)
    publish(conn, v1)
    with db.connect(db_url) as long_reader, db.connect(db_url) as other:
        with long_reader.transaction():
            long_reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            assert view_state(long_reader)[0] == 10                    # holds its lock on bi.results
            # A submit creates the new version's partitions: with CREATE TABLE ...
            # PARTITION OF it needed ACCESS EXCLUSIVE on bi.results and would wait here.
            other.execute("SET lock_timeout = '2s'")
            make_source(other, tickets(15, 300), table="public.tickets_b")
            v2 = submit(other, make_spec(source={"table": "public.tickets_b"})).job_version
            other.execute("RESET lock_timeout")
            finish(db_url, v2)
            assert validate(other, v2).passed
            publish(other, v2)                                         # and the switch does not wait either
            assert view_state(long_reader) == (10, 1, v1)              # its snapshot: still one whole version
        assert view_state(long_reader) == (15, 1, v2)


def test_the_first_publish_gives_up_on_a_lock_instead_of_queueing(conn, db_url):
    v1 = version(conn, db_url, 10)
    with db.connect(db_url) as locker:
        with locker.transaction():
            locker.execute("LOCK TABLE bi.results IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(PublishRefused, match="could not get a lock within 100ms after 2 attempts"):
                publish(conn, v1, lock_timeout="100ms", attempts=2)
    assert publish(conn, v1)["changed"] is True
    v2 = version(conn, db_url, 12, start=40)
    with db.connect(db_url) as locker:
        with locker.transaction():
            locker.execute("LOCK TABLE bi.results IN ACCESS EXCLUSIVE MODE")
            # Once the view exists a switch touches only the pointer: no lock on bi.results at all.
            assert publish(conn, v2, lock_timeout="100ms", attempts=1)["to_version"] == v2


# -- access control ---------------------------------------------------------------------------

def acl_rows(group: str) -> list[tuple[str, str, list[str] | None]]:
    rows: list[tuple[str, str, list[str] | None]] = []
    for i in range(30):
        acl: list[str] | None
        if i < 10:
            acl = [f"team{i % 3}"]
        elif i < 15:
            acl = None                      # no ACL: the dataset's default decides
        elif i < 18:
            acl = []                        # an empty ACL: nobody
        else:
            acl = [group, "auditors"]
        rows.append((f"r{i:03d}", f"record {i}", acl))
    return rows


def visible(conn, role: str, sql: str = f"SELECT record_id FROM {VIEW}") -> set[str]:
    with conn.transaction():
        conn.execute(f"SET LOCAL ROLE {role}")
        return {r["record_id"] for r in conn.execute(sql)}


def test_a_reader_sees_only_rows_whose_acl_names_one_of_its_principals(conn, db_url, roles):
    group = roles("grp", member_of=("bi_reader",))                    # a team, as a database role
    alice = roles("alice", member_of=(group,))                         # reader through the group
    bob = roles("bob", member_of=("bi_reader",))                       # reader with a mapped principal
    mallory = roles("mallory")                                         # not a reader at all
    conn.execute("INSERT INTO bi.reader_principals VALUES (%s, 'team1')", (bob,))

    v1 = version(conn, db_url, 0, rows=acl_rows(group))
    publish(conn, v1)
    nulls = {f"r{i:03d}" for i in range(10, 15)}
    team1 = {f"r{i:03d}" for i in range(10) if i % 3 == 1}
    grp_rows = {f"r{i:03d}" for i in range(18, 30)}

    assert visible(conn, alice) == grp_rows | nulls                     # its group's name is in the ACL
    assert visible(conn, bob) == team1 | nulls                          # mapped: bob -> team1
    with conn.transaction():
        conn.execute(f"SET LOCAL ROLE {alice}")
        principals = conn.execute("SELECT bi.current_principals() AS p").fetchone()["p"]
    assert {alice, group, "bi_reader"} <= set(principals) and "team1" not in principals
    # Rows with an empty ACL are nobody's; the owner (migrating superuser) sees all 30.
    assert len(conn.execute(f"SELECT 1 FROM {VIEW}").fetchall()) == 30

    # The default for records without an ACL is per dataset.
    set_null_acl(conn, DATASET, "nobody")
    assert visible(conn, bob) == team1
    assert published(conn, DATASET)["null_acl"] == "nobody"
    set_null_acl(conn, DATASET, "all_readers")

    # Not a reader: the view is closed, and so is bi.results.
    for stmt in (f"SELECT * FROM {VIEW}", "SELECT * FROM bi.results"):
        with pytest.raises(errors.InsufficientPrivilege):
            visible(conn, mallory, stmt)
    # A reader reading bi.results directly still sees only the published version's rows.
    v2 = version(conn, db_url, 0, rows=[(f"n{i}", f"new {i}", [group]) for i in range(5)], validated=False)
    direct = visible(conn, alice, "SELECT record_id FROM bi.results")
    assert direct == grp_rows | nulls and not any(r.startswith("n") for r in direct)
    # ... and cannot publish.
    with pytest.raises(errors.InsufficientPrivilege):
        visible(conn, alice, f"SELECT * FROM bi.publish_v1('{DATASET}', '{v2}', NULL, true, 'x') AS record_id")
    with pytest.raises(errors.InsufficientPrivilege):
        visible(conn, alice, f"UPDATE bi.publish_pointer SET job_version = '{v2}' RETURNING dataset AS record_id")


def test_workers_write_through_rls_but_read_no_published_data(conn, db_url, roles):
    v1 = version(conn, db_url, 10)
    publish(conn, v1)
    worker = roles("gpu", login=True, member_of=("bi_worker",))
    make_source(conn, tickets(25, 100))
    job = submit(conn, make_spec()).job_version
    conn.execute("SELECT bi.grant_job_v1(%s, %s)", (worker, job))
    # The ledger's SECURITY DEFINER functions run as their owner, whom RLS does not restrict.
    assert run_worker(WorkerConfig(job_version=job, db_url=as_role(db_url, worker))) == 0
    n = conn.execute("SELECT count(*) AS n FROM bi.results WHERE job_version = %s AND worker_id IS NOT NULL",
                     (job,)).fetchone()["n"]
    assert n == 25
    with db.connect(as_role(db_url, worker)) as w:
        for stmt in (f"SELECT * FROM {VIEW}", "SELECT * FROM bi.results",
                     f"SELECT * FROM bi.publish_v1('{DATASET}', '{job}', NULL, true, 'x')"):
            with pytest.raises(errors.InsufficientPrivilege):
                w.execute(stmt)


def test_a_dataset_named_like_a_keyword_gets_a_quoted_view(conn, db_url):
    v1 = version(conn, db_url, 5, dataset="order")
    assert publish(conn, v1)["view"] == 'published."order"'
    assert conn.execute('SELECT count(*) AS n FROM published."order"').fetchone()["n"] == 5
    assert published(conn, "order")["view"] == 'published."order"'
