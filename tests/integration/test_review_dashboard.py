"""The dashboard's review screen on the real embedded PostgreSQL, with Airflow's
real token machinery and the simple auth manager (as in
test_security_dashboard.py): the sample is read as the user's reader role
(row-level security), a verdict is stored with the user's Airflow identity
and moves the review gate, and only a user with the edit right on the DAG
that ran the version may record one (a viewer gets 403)."""

from __future__ import annotations

import uuid

import pytest

from batch_inference import db
from batch_inference.exceptions import PublishRefused
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.validate import validate
from tests.conftest import make_source, make_spec
from tests.integration.test_dashboard_api import reader_role
from tests.integration.test_security_dashboard import app_client, module_database
from tests.integration.test_validate import finish

DAG = "triage_review"
USERS = "admin:admin,rita:user,vera:viewer,uma:user"
ROLES = {"admin": "admin", "rita": "user", "vera": "viewer", "uma": "user"}
SECRET = "REVIEW-CANARY-51c2"


@pytest.fixture(scope="module")
def ledger(pg_server, template_db):
    with module_database(pg_server, template_db, "review_") as url:
        with db.connect(url) as conn:
            # Six records: 0-3 team0, 4-5 team1.
            make_source(conn, [(f"r{i}", f"{SECRET} ticket {i}: charged twice", ["team0"] if i < 4 else ["team1"])
                               for i in range(6)])
            job = submit(conn, make_spec(dataset="review_dash", validation={"sample_size": 6},
                                         evaluation={"review": {"min_reviewed": 2, "min_right": 0.5}})).job_version
            finish(url, job)
            assert validate(conn, job).passed
            conn.execute(db.q("job_run_record"), {"dag_id": DAG, "run_id": "run_1", "job": job, "created": True})
            team0 = reader_role(conn, f"rev_team0_{uuid.uuid4().hex[:6]}", principals=("team0",))
            for user in ("rita", "vera"):
                conn.execute("SELECT bi.map_dashboard_reader_v1(%s, %s)", (user, team0))
        yield url, job


@pytest.fixture(scope="module")
def client(ledger, airflow_home):
    with app_client(ledger[0], USERS, "airflow.api_fastapi.auth.managers.simple.simple_auth_manager."
                                      "SimpleAuthManager") as c:
        yield c


def auth(user: str) -> dict[str, str]:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=user, role=ROLES[user]))
    return {"Authorization": "Bearer " + token}


def post(client, job: str, user: str, body: dict, **headers: str):
    return client.post(f"/api/jobs/{job}/review", json=body, headers={**auth(user), **headers})


def test_a_review_is_stored_with_the_airflow_user_and_moves_the_gate(client, ledger):
    url, job = ledger
    page = client.get(f"/api/jobs/{job}/review", headers=auth("rita")).json()
    assert page["may_review"] and page["reads_text"] and not page["publishable"]
    assert page["review"]["problem"] == "review: 0 of 2 required sample rows reviewed"
    # Row-level security: team0's four rows, not team1's two.
    assert [r["record_id"] for r in page["rows"]] == ["r0", "r1", "r2", "r3"] and page["hidden"] == 2
    assert all(SECRET in r["text"] and r["output"]["category"] for r in page["rows"])

    r = post(client, job, "rita", {"record_id": "r0", "verdict": "right", "comment": "fits"})
    assert r.status_code == 200, r.text
    assert r.json()["recorded"]["reviewer"] == "airflow:rita"
    with db.connect(url) as conn:
        with pytest.raises(PublishRefused, match="review: 1 of 2 required sample rows reviewed"):
            publish(conn, job)
    assert post(client, job, "rita", {"record_id": "r1", "verdict": "wrong"}).json()["review"]["passed"]
    page = client.get(f"/api/jobs/{job}/review", headers=auth("rita")).json()
    assert page["publishable"] and page["review"]["right"] == 1 and page["review"]["wrong"] == 1
    row = {r["record_id"]: r for r in page["rows"]}["r0"]
    assert (row["verdict"], row["comment"], row["reviewer"]) == ("right", "fits", "airflow:rita")
    with db.connect(url) as conn:
        assert conn.execute("SELECT reviewer FROM bi.reviews WHERE job_version = %s AND record_id = 'r0'",
                            (job,)).fetchone()["reviewer"] == "airflow:rita"


def test_a_viewer_cannot_record_a_review(client, ledger):
    url, job = ledger
    with db.connect(url) as conn:
        before = conn.execute("SELECT count(*) AS n FROM bi.reviews").fetchone()["n"]
    page = client.get(f"/api/jobs/{job}/review", headers=auth("vera")).json()
    assert page["may_review"] is False and len(page["rows"]) == 4       # she reads the sample ...
    r = post(client, job, "vera", {"record_id": "r2", "verdict": "right"})
    assert r.status_code == 403 and "may not edit the DAG" in r.json()["detail"]   # ... and cannot sign it off
    # Edit right without a reader role: no text was shown, so no verdict either.
    r = post(client, job, "uma", {"record_id": "r2", "verdict": "right"})
    assert r.status_code == 403 and "no reader role" in r.json()["detail"]
    assert SECRET not in client.get(f"/api/jobs/{job}/review", headers=auth("uma")).text
    # A row of the sample her role may not read, a forged origin, a bad verdict.
    assert post(client, job, "rita", {"record_id": "r4", "verdict": "right"}).status_code == 404
    assert post(client, job, "rita", {"record_id": "r2", "verdict": "right"},
                Origin="https://evil.example").status_code == 403
    r = post(client, job, "rita", {"record_id": "r2", "verdict": "fine"})
    assert r.status_code == 422 and r.json()["detail"] == "verdict must be one of right, wrong, unsure, not 'fine'"
    assert post(client, job, "rita", {"record_id": 7, "verdict": "right"}).status_code == 422
    assert client.post(f"/api/jobs/{job}/review", json={"record_id": "r2", "verdict": "right"}).status_code == 401
    with db.connect(url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM bi.reviews").fetchone()["n"] == before


def test_an_unknown_job_version_is_404_on_the_review_routes(client):
    r = client.get("/api/jobs/jv_0000000000000000/review", headers=auth("admin"))
    assert r.status_code == 404 and "jv_0000000000000000" in r.json()["detail"], r.text


def test_a_full_page_of_the_sample_does_not_call_the_rest_hidden(ledger):
    from batch_inference.ui import data

    url, job = ledger
    with db.connect(url) as conn:
        role, _why = data.reader_role(conn, "rita")
        page = data.review(conn, job, role=role, limit=2)
        assert [r["record_id"] for r in page["rows"]] == ["r0", "r1"] and page["hidden"] is None
        assert data.review(conn, job, role=role)["hidden"] == 2        # team1's two rows


def test_a_reject_on_the_review_screen_is_in_the_ledger_and_refuses_publish_until_withdrawn(client, ledger):
    from batch_inference import evaluation

    url, job = ledger
    reject = lambda user, body, **h: client.post(f"/api/jobs/{job}/reject", json=body,  # noqa: E731
                                                 headers={**auth(user), **h})
    assert reject("vera", {"reason": "wrong labels"}).status_code == 403           # a viewer may not
    assert reject("rita", {"reason": "x"}, Origin="https://evil.example").status_code == 403
    assert reject("rita", {"reason": "  "}).status_code == 422
    r = reject("rita", {"reason": "priorities are all urgent"})
    assert r.status_code == 200, r.text
    assert r.json()["rejected"]["reviewer"] == "airflow:rita" and not r.json()["review"]["passed"]
    page = client.get(f"/api/jobs/{job}/review", headers=auth("rita")).json()
    assert not page["publishable"] and page["review"]["problem"].startswith("review: rejected by airflow:rita at ")
    assert [(x["reviewer"], x["reason"], x["standing"]) for x in page["rejections"]] == \
        [("airflow:rita", "priorities are all urgent", True)]
    hist = client.get("/api/datasets/review_dash/history", headers=auth("rita")).json()
    assert [(x["job_version"], x["reason"]) for x in hist["rejections"]] == [(job, "priorities are all urgent")]
    with db.connect(url) as conn:
        with pytest.raises(PublishRefused, match=f"^job version {job} was rejected by airflow:rita at .*: priorities "
                                                 "are all urgent; refused, even forced"):
            publish(conn, job, force=True, reason="ship it")
        assert evaluation.withdraw_rejections(conn, job, actor="cli:ana", reason="labels fixed upstream") == 1
    page = client.get(f"/api/jobs/{job}/review", headers=auth("rita")).json()
    assert page["rejections"][0]["withdrawn_by"] == "cli:ana" and page["review"]["rejection"] is None
