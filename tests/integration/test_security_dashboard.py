"""The dashboard tried as an attacker would: who reads what, forged writes, bad input.

The real app runs under Starlette's TestClient against the embedded
PostgreSQL, with Airflow's real token machinery: each user signs in with a
JWT the auth manager itself issued (``generate_jwt``) and decodes
(``get_user``); nothing in the app is overridden. The auth manager is the
simple one (users from ``SIMPLE_AUTH_MANAGER_USERS``), except that per-DAG
read permissions, which only production auth managers (FAB, Keycloak) have,
come from ``PerDagAuthManager`` below: the simple auth manager with a table
of which DAGs a user may read.

The ledger holds three datasets, each with customer text (``CANARY``) in
dead letters (reason, error, raw output) and in validation examples, under
per-record ACLs (team0, team1, none, empty):

- ``sec_dash_a`` run by DAG ``triage_a``, published (forced past its failed validation);
- ``sec_dash_b`` run by DAG ``triage_b``, whose records without an ACL are for nobody;
- ``sec_dash_c`` submitted from the CLI: no DAG run.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from batch_inference import db, publish, validate
from batch_inference.plan import submit
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec
from tests.integration.test_dashboard_api import reader_role
from tests.integration.test_privileges import url_as

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

CANARY = "CANARY-7f3e"
A, B, C = "sec_dash_a", "sec_dash_b", "sec_dash_c"
DAG_A, DAG_B = "triage_a", "triage_b"
USERS = "admin:admin,vera:viewer,alice:viewer,carol:viewer,pat:viewer,bob:viewer,mallory:viewer"
# Which DAGs a user may read, for users with per-DAG permissions; anyone else: the simple auth manager's roles.
DAG_READERS = {"bob": {DAG_A}}


class PerDagAuthManager(SimpleAuthManager):
    """The simple auth manager, with per-DAG read permissions for the users in DAG_READERS."""

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        allowed = DAG_READERS.get(user.get_name())
        if allowed is None:
            return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
        return method == "GET" and details is not None and details.id in allowed


def _rows(prefix: str) -> list[tuple[str, str, list[str] | None]]:
    """Ten records: 0-3 team0, 4-6 team1, 7-8 no ACL, 9 an empty ACL; 1, 5, 7 and 9 fail every attempt."""
    acls: list[list[str] | None] = [["team0"]] * 4 + [["team1"]] * 3 + [None, None, []]
    out = []
    for i, acl in enumerate(acls):
        poison = " [[invalid-output]]" if i in (1, 5, 7, 9) else ""
        out.append((f"{prefix}{i}", f"{CANARY} {prefix}{i}: my card 4111 was charged twice{poison}", acl))
    return out


def _night(conn, url: str, dataset: str, prefix: str, dag: str | None) -> str:
    """One finished job version with customer text in its dead letters and validation examples."""
    table = f"public.{dataset}_src"
    make_source(conn, _rows(prefix), table=table)
    jv = submit(conn, make_spec(dataset=dataset, source={"table": table}, max_attempts=1,
                                validation={"max_dead_letter_rate": 0.9})).job_version
    assert run_worker(WorkerConfig(job_version=jv, db_url=url, backoff=(0.0, 0.0, 0.0), flush_seconds=0.2)) == 0
    # An engine that echoes its input: the customer's words land in the dead letter.
    conn.execute(f"UPDATE bi.dead_letters d SET reason = 'failed 1 attempts: ' || left(s.body, 24), "
                 f"error = 'engine said: ' || s.body, raw_output = s.body "
                 f"FROM {table} s WHERE d.job_version = %s AND d.record_id = s.id", (jv,))
    # Outputs that quote the record fail the schema: the validator's examples carry them.
    conn.execute("UPDATE bi.results SET output = jsonb_build_object('category', %s || ' ' || record_id, "
                 "'summary', 'x') WHERE job_version = %s AND record_id = ANY(%s)",
                 (CANARY, jv, [f"{prefix}0", f"{prefix}4", f"{prefix}8"]))
    report = validate.validate(conn, jv, sample_dir=tempfile.mkdtemp())
    assert not report.passed and len(report["schema"]["examples"]) == 3
    if dag:
        conn.execute(db.q("job_run_record"), {"dag_id": dag, "run_id": f"run_{dataset}", "job": jv, "created": True})
    return jv


@contextmanager
def module_database(pg_server, template_db, prefix: str) -> Iterator[str]:
    """A ledger database of the module's own (from the migrated template), dropped at the end."""
    name = prefix + uuid.uuid4().hex[:10]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    try:
        yield pg_server.get_uri(name)
    finally:
        with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextmanager
def app_client(url: str, users: str, auth_manager: str):
    """The dashboard app under TestClient on ledger ``url``, with Airflow's auth manager ``auth_manager``
    (a class path) and its users ``users`` (SIMPLE_AUTH_MANAGER_USERS)."""
    from fastapi.testclient import TestClient

    from airflow.api_fastapi import app as airflow_app
    from batch_inference.ui import app as appmod

    mp = pytest.MonkeyPatch()
    mp.setenv("BATCH_INFERENCE_DB", url)
    mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", users)
    mp.setenv("AIRFLOW__CORE__AUTH_MANAGER", auth_manager)
    airflow_app._AuthManagerState.instance = None
    airflow_app.init_auth_manager()
    appmod.app.dependency_overrides.clear()
    try:
        with TestClient(appmod.app, base_url="http://airflow.test") as c:
            yield c
    finally:
        mp.undo()
        airflow_app._AuthManagerState.instance = None      # the next module builds its own


@pytest.fixture(scope="module")
def ledger(pg_server, template_db):
    with module_database(pg_server, template_db, "secdash_") as url:
        yield from _seed(url)


def _seed(url: str):
    suffix = uuid.uuid4().hex[:6]
    with db.connect(url) as conn:
        jobs = {A: _night(conn, url, A, "a", DAG_A), B: _night(conn, url, B, "b", DAG_B),
                C: _night(conn, url, C, "c", None)}
        publish.publish(conn, jobs[A], actor="seed", force=True, reason="test night")
        conn.execute("SELECT bi.set_null_acl_v1(%s, 'nobody')", (B,))
        team0 = reader_role(conn, f"sec_team0_{suffix}", principals=("team0",))
        group = reader_role(conn, f"sec_grp_{suffix}", login=False, principals=("team1",))
        member = reader_role(conn, f"sec_member_{suffix}", member_of=(group,))       # team1 through its group
        plain = reader_role(conn, f"sec_plain_{suffix}")                             # a reader with no principals
        users = {"alice": team0, "carol": member, "pat": plain, "bob": team0}
        for user, role in users.items():
            conn.execute("SELECT bi.map_dashboard_reader_v1(%s, %s)", (user, role))
    yield url, jobs, users


@pytest.fixture(scope="module")
def client(ledger, airflow_home):
    from airflow.api_fastapi import app as airflow_app

    with app_client(ledger[0], USERS, f"{__name__}.{PerDagAuthManager.__name__}") as c:
        assert isinstance(airflow_app.get_auth_manager(), PerDagAuthManager)
        yield c


def auth(user: str) -> dict[str, str]:
    """A Bearer token issued by the auth manager for a user of SIMPLE_AUTH_MANAGER_USERS."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    role = "admin" if user == "admin" else "viewer"
    return {"Authorization": "Bearer " + get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=user, role=role))}


def _one_line(r) -> str:
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and detail, r.text
    return detail


# -- every route, for a viewer with no reader role ------------------------------------------


def _requests(jobs: dict[str, str]) -> dict[tuple[str, str], list[tuple[str, dict[str, Any]]]]:
    """One or more concrete requests for every route of the app (route path -> requests)."""
    a = jobs[A]
    body = {"json": {"expected_current": a, "reason": "try"}}
    jv = lambda path: [(path.format(job_version=j), {}) for j in jobs.values()]  # noqa: E731
    return {
        ("GET", "/"): [("/", {})],
        ("GET", "/jobs/{job_version}"): jv("/jobs/{job_version}"),
        ("GET", "/run"): [(f"/run?dag_id={DAG_A}&run_id=run_{A}", {}), (f"/run?job_version={a}", {})],
        ("GET", "/static/{name}"): [("/static/dashboard.js", {}), ("/static/dashboard.css", {}),
                                    ("/static/page.html", {}), ("/static/..%2Fapp.py", {})],
        ("GET", "/openapi.json"): [("/openapi.json", {})],
        ("GET", "/api/jobs"): [("/api/jobs", {}), (f"/api/jobs?dataset={A}", {})],
        ("GET", "/api/jobs/{job_version}"): jv("/api/jobs/{job_version}"),
        ("GET", "/api/jobs/{job_version}/progress"): jv("/api/jobs/{job_version}/progress"),
        ("GET", "/api/jobs/{job_version}/shards"): jv("/api/jobs/{job_version}/shards"),
        ("GET", "/api/jobs/{job_version}/dead-letters"): jv("/api/jobs/{job_version}/dead-letters"),
        ("GET", "/api/jobs/{job_version}/cost"): jv("/api/jobs/{job_version}/cost"),
        ("GET", "/api/jobs/{job_version}/drift"): jv("/api/jobs/{job_version}/drift"),
        ("GET", "/api/jobs/{job_version}/ladder"): jv("/api/jobs/{job_version}/ladder"),
        ("GET", "/api/datasets/{dataset}/estimates"): [(f"/api/datasets/{d}/estimates", {}) for d in (A, B, C)],
        ("GET", "/jobs/{job_version}/review"): jv("/jobs/{job_version}/review"),
        ("GET", "/api/jobs/{job_version}/review"): jv("/api/jobs/{job_version}/review"),
        ("POST", "/api/jobs/{job_version}/review"): [(f"/api/jobs/{a}/review",
                                                      {"json": {"record_id": "a0", "verdict": "right"}})],
        ("POST", "/api/jobs/{job_version}/reject"): [(f"/api/jobs/{a}/reject", {"json": {"reason": "try"}})],
        ("GET", "/api/datasets/{dataset}/history"): [(f"/api/datasets/{d}/history", {}) for d in (A, B, C)],
        ("POST", "/api/datasets/{dataset}/rollback"): [(f"/api/datasets/{A}/rollback", body)],
        ("GET", "/api/runs/job"): [(f"/api/runs/job?dag_id={DAG_A}&run_id=run_{A}", {})],
    }


def test_the_route_table_is_every_route_of_the_app(client, ledger):
    from batch_inference.ui.app import app

    routes = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert routes == set(_requests(ledger[1])), "a route was added: give it a request in _requests"


def test_a_viewer_without_a_reader_role_reads_no_customer_text_on_any_route(client, ledger):
    _, jobs, _ = ledger
    vera = auth("vera")
    tried = 0
    for (method, _path), reqs in _requests(jobs).items():
        for path, kw in reqs:
            r = client.request(method, path, headers=vera, **kw)
            tried += 1
            assert r.status_code < 500, (path, r.status_code, r.text)
            assert CANARY not in r.text, (path, r.text[:400])
    assert tried >= 30
    for jv in jobs.values():
        dl = client.get(f"/api/jobs/{jv}/dead-letters", headers=vera).json()
        assert (dl["total"], dl["visible"], dl["hidden"], dl["dead_letters"], dl["reasons"]) == (4, 0, 4, [], [])
        val = client.get(f"/api/jobs/{jv}", headers=vera).json()["validation"]
        assert val["schema"]["invalid"] == 3 and val["schema"]["examples"] == [] and val["schema"]["examples_hidden"] == 3
        assert val["failed_checks"] == ["schema"] and val["passed"] is False


def test_a_signed_out_caller_and_a_forged_token_read_nothing(client, ledger):
    _, jobs, _ = ledger
    forged = {"Authorization": "Bearer " + auth("alice")["Authorization"].split()[1][:-4] + "AAAA"}
    for (method, path), reqs in _requests(jobs).items():
        if not path.startswith("/api/"):
            continue
        for p, kw in reqs:
            for headers in ({}, forged, {"Cookie": "_token=not-a-jwt"}):
                r = client.request(method, p, headers=headers, **kw)
                assert r.status_code in (401, 403), (p, headers, r.status_code)
                assert CANARY not in r.text


# -- a reader sees what its role sees through SQL ------------------------------------------------


def _sql_dead_letters(url: str, role: str, jv: str) -> list[tuple]:
    """What ``role``, logged in itself, reads from bi.dead_letters."""
    with db.connect(url_as(url, role)) as c:
        return [tuple(r.values()) for r in c.execute(
            "SELECT record_id, reason, left(error, 500) AS error, left(raw_output, 500) AS raw_output "
            "FROM bi.dead_letters WHERE job_version = %s ORDER BY record_id", (jv,))]


def _sql_dead_letter_counts(url: str, role: str, jv: str) -> int:
    """How many dead letters ``role``, logged in itself, counts in bi.dead_letter_counts."""
    with db.connect(url_as(url, role)) as c:
        return int(c.execute("SELECT coalesce(sum(n), 0) AS n FROM bi.dead_letter_counts WHERE job_version = %s",
                             (jv,)).fetchone()["n"])


def _sql_published(url: str, role: str, dataset: str) -> set[str]:
    with db.connect(url_as(url, role)) as c:
        return {r["record_id"] for r in c.execute(f"SELECT record_id FROM published.{dataset}")}


def test_a_reader_sees_through_the_dashboard_exactly_what_its_role_sees_through_sql(client, ledger):
    url, jobs, users = ledger
    expected = {  # who sees which dead letters (1 team0, 5 team1, 7 no ACL, 9 empty ACL)
        ("alice", A): {"a1", "a7"}, ("carol", A): {"a5", "a7"}, ("pat", A): {"a7"},
        ("alice", B): {"b1"}, ("carol", B): {"b5"}, ("pat", B): set(),          # B: no ACL is for nobody
        ("alice", C): {"c1", "c7"}, ("carol", C): {"c5", "c7"}, ("pat", C): {"c7"},
    }
    for (user, dataset), ids in expected.items():
        jv, role = jobs[dataset], users[user]
        dl = client.get(f"/api/jobs/{jv}/dead-letters", headers=auth(user)).json()
        shown = [(d["record_id"], d["reason"], d["error"], d["raw_output"]) for d in dl["dead_letters"]]
        assert shown == _sql_dead_letters(url, role, jv), (user, dataset)
        assert {d[0] for d in shown} == ids, (user, dataset)
        assert (dl["visible"], dl["hidden"]) == (len(ids), 4 - len(ids))
        assert _sql_dead_letter_counts(url, role, jv) == len(ids)     # the counts follow the same rule
        assert sum(r["n"] for r in dl["reasons"]) == len(ids)
        assert all(CANARY in d[2] for d in shown)
        # Validation examples: those of records the role reads (only A is published: results of
        # unpublished versions are no reader's), the same rows as its SELECT on the published view.
        val = client.get(f"/api/jobs/{jv}", headers=auth(user)).json()["validation"]
        examples = {e["record_id"] for e in val["schema"]["examples"]}
        readable = _sql_published(url, role, A) if dataset == A else set()
        assert examples == readable & {f"{dataset[-1]}0", f"{dataset[-1]}4", f"{dataset[-1]}8"}, (user, dataset)
        assert val["schema"]["examples_hidden"] == 3 - len(examples)
        assert all(CANARY in e["reason"] for e in val["schema"]["examples"])


def test_paging_dead_letters_pages_what_the_role_sees(client, ledger):
    _, jobs, _ = ledger
    page = client.get(f"/api/jobs/{jobs[A]}/dead-letters?limit=1&offset=1", headers=auth("alice")).json()
    assert [d["record_id"] for d in page["dead_letters"]] == ["a7"]
    far = client.get(f"/api/jobs/{jobs[A]}/dead-letters?offset=1000000", headers=auth("alice")).json()
    assert far["dead_letters"] == [] and far["visible"] == 2


# -- per-DAG permissions of the auth manager -------------------------------------------------------


def test_a_user_reads_only_jobs_and_datasets_of_dags_it_may_read(client, ledger):
    _, jobs, _ = ledger
    bob = auth("bob")                                  # may read DAG triage_a only
    listed = {j["job_version"] for j in client.get("/api/jobs", headers=bob).json()["jobs"]}
    assert listed == {jobs[A]}
    assert {j["job_version"] for j in client.get("/api/jobs", headers=auth("vera")).json()["jobs"]} == set(jobs.values())
    for path in ("", "/progress", "/shards", "/dead-letters", "/cost", "/drift"):
        assert client.get(f"/api/jobs/{jobs[A]}{path}", headers=bob).status_code == 200, path
        for other in (B, C):                           # another DAG's job; a job no DAG ran (needs every DAG)
            r = client.get(f"/api/jobs/{jobs[other]}{path}", headers=bob)
            assert r.status_code == 403, (path, other, r.text)
            assert _one_line(r) == f"user 'bob' may not read the DAG runs of job version {jobs[other]}"
            assert CANARY not in r.text
    assert client.get(f"/api/datasets/{A}/history", headers=bob).status_code == 200
    for other in (B, C):
        r = client.get(f"/api/datasets/{other}/history", headers=bob)
        assert r.status_code == 403 and _one_line(r) == f"user 'bob' may not read the DAG runs of dataset {other}"
    dl = client.get(f"/api/jobs/{jobs[A]}/dead-letters", headers=bob).json()
    assert {d["record_id"] for d in dl["dead_letters"]} == {"a1", "a7"}   # and then RLS, as alice


# -- the reader mapping cannot borrow the owner's eyes ----------------------------------------------


def test_a_user_cannot_be_mapped_to_a_role_that_sees_past_row_level_security(ledger):
    url, _, _ = ledger
    suffix = uuid.uuid4().hex[:6]
    with db.connect(url) as conn:
        owner = conn.execute("SELECT nspowner::regrole::text AS o FROM pg_namespace WHERE nspname = 'bi'").fetchone()["o"]
        cases = {
            owner: "superuser or BYPASSRLS",                                          # the owner itself (superuser here)
            reader_role(conn, f"sec_bypass_{suffix}", extra="BYPASSRLS"): "superuser or BYPASSRLS",
            reader_role(conn, f"sec_super_{suffix}", extra="SUPERUSER"): "superuser or BYPASSRLS",
            reader_role(conn, f"sec_owns_{suffix}", member_of=("bi_reader", owner)): "member of the owner of schema bi",
            reader_role(conn, f"sec_stranger_{suffix}", member_of=()): "not a member of bi_reader",
            f"sec_missing_{suffix}": "no role",
        }
        for role, why in cases.items():
            with pytest.raises(psycopg.errors.InvalidGrantOperation, match=why):
                conn.execute("SELECT bi.map_dashboard_reader_v1('mallory', %s)", (role,))
        assert conn.execute("SELECT count(*) AS n FROM bi.dashboard_readers WHERE airflow_user = 'mallory'"
                            ).fetchone()["n"] == 0


def test_a_mapped_role_that_gains_bypassrls_later_reads_nothing(client, ledger):
    url, jobs, _ = ledger
    with db.connect(url) as conn:
        role = reader_role(conn, f"sec_later_{uuid.uuid4().hex[:6]}", principals=("team0",))
        conn.execute("SELECT bi.map_dashboard_reader_v1('mallory', %s)", (role,))
        assert client.get(f"/api/jobs/{jobs[A]}/dead-letters", headers=auth("mallory")).json()["visible"] == 2
        conn.execute(f'ALTER ROLE "{role}" BYPASSRLS')
        try:
            dl = client.get(f"/api/jobs/{jobs[A]}/dead-letters", headers=auth("mallory")).json()
            assert (dl["visible"], dl["dead_letters"]) == (0, [])
            assert CANARY not in client.get(f"/api/jobs/{jobs[A]}", headers=auth("mallory")).text
        finally:
            conn.execute("SELECT bi.unmap_dashboard_reader_v1('mallory')")


def test_other_roles_read_dead_letters_only_through_the_policy(ledger):
    """bi.dead_letters for a role outside bi_reader: no privilege at all; a worker neither."""
    url, jobs, _ = ledger
    with db.connect(url) as conn:
        stranger = reader_role(conn, f"sec_nobody_{uuid.uuid4().hex[:6]}", member_of=())
        worker = reader_role(conn, f"sec_worker_{uuid.uuid4().hex[:6]}", member_of=("bi_worker",))
    for role in (stranger, worker):
        with db.connect(url_as(url, role)) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT * FROM bi.dead_letters WHERE job_version = %s", (jobs[A],))
        with db.connect(url_as(url, role)) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT * FROM bi.dashboard_readers")


# -- forged writes and framing ----------------------------------------------------------------------


def test_rollback_refuses_foreign_and_null_origins(client, ledger):
    url, jobs, _ = ledger
    path = f"/api/datasets/{A}/rollback"
    body = {"expected_current": jobs[A], "reason": "forged"}
    vectors = [{"Origin": "null"}, {"Origin": "https://evil.example"}, {"Origin": "http://airflow.test.evil.example"},
               {"Origin": "file://"}, {"Origin": "http://airflow.test@evil.example"},
               {"Origin": "javascript://airflow.test"}, {"Sec-Fetch-Site": "cross-site"},
               {"Sec-Fetch-Site": "same-site"}, {"Origin": "http://airflow.test", "Sec-Fetch-Site": "cross-site"}]
    for extra in vectors:
        r = client.post(path, json=body, headers={**auth("admin"), **extra})
        assert r.status_code == 403, (extra, r.text)
        assert "refused" in _one_line(r)
    # The same origin passes this check (and gets the next answer: nothing before the first publish).
    r = client.post(path, json=body, headers={**auth("admin"), "Origin": "http://airflow.test",
                                              "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 422 and "nothing to roll back" in _one_line(r)
    with db.connect(url) as conn:
        assert publish.published(conn, A)["job_version"] == jobs[A]


def test_every_response_forbids_framing_by_other_sites_and_foreign_scripts(client, ledger):
    _, jobs, _ = ledger
    for (method, _p), reqs in _requests(jobs).items():
        for path, kw in reqs:
            for headers in ({}, auth("vera")):
                r = client.request(method, path, headers=headers, **kw)
                csp = r.headers.get("content-security-policy", "")
                assert "frame-ancestors 'self'" in csp and "default-src 'none'" in csp, (path, r.status_code)
                assert "script-src 'self'" in csp and "unsafe-inline" not in csp
                assert r.headers.get("x-frame-options") == "SAMEORIGIN" and r.headers["x-content-type-options"] == "nosniff"


# -- bad input: a 4xx with one line, never a 500 -----------------------------------------------------


def test_bad_rollback_bodies_get_one_line_and_change_nothing(client, ledger):
    url, jobs, _ = ledger
    path = f"/api/datasets/{A}/rollback"
    a = jobs[A]
    vectors = [
        ({"json": {"expected_current": a, "reason": 5}}, "reason must be a string, not int"),
        ({"json": {"expected_current": 5}}, "expected_current must be a string, not int"),
        ({"json": {"expected_current": [a]}}, "expected_current must be a string, not list"),
        ({"json": {"expected_current": {"$ne": None}}}, "expected_current must be a string, not dict"),
        ({"json": {"expected_current": True}}, "expected_current must be a string, not bool"),
        ({"json": {"expected_current": a, "reason": ["x"]}}, "reason must be a string, not list"),
        ({"json": {"expected_current": a + "\x00"}}, "expected_current contains a NUL character"),
        ({"json": {"expected_current": a, "reason": "bad\x00reason"}}, "reason contains a NUL character"),
        ({"json": {"expected_current": a, "reason": "x" * 100_000}}, "reason is longer than 2,000 characters"),
        ({"json": {"expected_current": "jv_" + "f" * 10_000}}, "expected_current is longer than 200 characters"),
        ({"json": {}}, "name the version you are rolling back from (expected_current)"),
        ({"json": {"expected_current": ""}}, "name the version you are rolling back from (expected_current)"),
        ({"json": [a]}, None),
        ({"json": "jv"}, None),
        ({"json": None}, None),
        ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, None),
        ({"content": b"\xff\xfe", "headers": {"Content-Type": "application/json"}}, None),
    ]
    for kw, want in vectors:
        headers = {**auth("admin"), **kw.pop("headers", {})}
        r = client.post(path, headers=headers, **kw)
        assert 400 <= r.status_code < 500, (kw, r.status_code, r.text)
        line = _one_line(r)
        if want:
            assert line == want, (kw, line)
    with db.connect(url) as conn:
        assert publish.published(conn, A)["job_version"] == a
        assert conn.execute("SELECT count(*) AS n FROM bi.publish_history WHERE dataset = %s",
                            (A,)).fetchone()["n"] == 1


def test_bad_paging_and_nul_characters_get_one_line(client, ledger):
    _, jobs, _ = ledger
    a = jobs[A]
    vectors = [
        f"/api/jobs/{a}/dead-letters?offset={10**30}", f"/api/jobs/{a}/shards?offset={10**30}",
        f"/api/jobs/{a}/dead-letters?offset={2**31}", f"/api/jobs/{a}/shards?offset={2**63}",
        f"/api/jobs/{a}/dead-letters?offset=-1", f"/api/jobs/{a}/dead-letters?offset=abc",
        f"/api/jobs/{a}/dead-letters?offset=1e3", f"/api/jobs/{a}/dead-letters?limit=0",
        f"/api/jobs/{a}/dead-letters?limit={10**30}", f"/api/jobs/{a}/shards?limit=-5",
        f"/api/jobs?limit={10**30}", f"/api/jobs?limit=nan", f"/api/datasets/{A}/history?limit={10**30}",
        "/api/jobs?dataset=a%00b", f"/api/datasets/{A}%00/history", "/api/jobs/jv%00x/progress",
        f"/api/runs/job?dag_id={DAG_A}%00&run_id=x", "/api/runs/job",
    ]
    for path in vectors:
        r = client.get(path, headers=auth("alice"))
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        line = _one_line(r)
        assert "Traceback" not in line and CANARY not in line
    r = client.get(f"/api/jobs/{a}/dead-letters?offset={10**30}", headers=auth("alice"))
    assert _one_line(r) == "offset: Input should be less than or equal to 2147483647"
