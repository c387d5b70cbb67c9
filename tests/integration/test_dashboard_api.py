"""The dashboard's JSON endpoints against the real ledger (embedded PostgreSQL).

The app runs in process under FastAPI's TestClient. Airflow's user lookup is
replaced by a header (the one boundary that needs a running API server and
its token machinery; tests/process/test_dashboard.py covers that against a real
``airflow api-server``), while the rollback permission is decided by Airflow's
real SimpleAuthManager, so a viewer is refused for the reason production
refuses one.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi import HTTPException, Request

# Airflow reads its home at import: keep this module's imports off ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bi-airflow-home-"))

from batch_inference import cutoff, publish, validate  # noqa: E402
from batch_inference.plan import submit  # noqa: E402
from batch_inference.status import job_counts  # noqa: E402
from gpu_runner.worker import WorkerConfig, run_worker  # noqa: E402
from tests.conftest import make_source, make_spec, tickets  # noqa: E402

UTC = timezone.utc
DATASET = "tickets_triage"
# The seeded night: a slow fallback pool makes the cutoff land in the middle
# of the chart (the seed's 85 rows/s would re-drive these 120 rows in 1.4 s).
NIGHT_RATE = 0.02
NIGHT_OVERHEAD_S = 1200.0


def _relabel(conn, job: str, shares: list[tuple[str, int]]) -> None:
    """The noop engine labels every record alike; give a version a mixed
    category distribution (output and column together) so drift has a shape."""
    ids = [r["record_id"] for r in conn.execute(
        "SELECT record_id FROM bi.results WHERE job_version = %s ORDER BY record_id", (job,))]
    at = 0
    for category, n in shares:
        chunk = ids[at:at + n]
        at += n
        conn.execute("UPDATE bi.results SET category = %s, "
                     "output = jsonb_set(output, '{category}', to_jsonb(%s::text)) "
                     "WHERE job_version = %s AND record_id = ANY(%s)", (category, category, job, chunk))


def seed_night(conn, db_url: str, now: datetime | None = None) -> dict[str, Any]:
    """Three versions of one dataset.

    v1 and v2 finished, validated and published in turn (so there is a
    history to roll back); v3 is tonight's run, caught mid-night: 6 of its 12
    shards done (a few poison records dead-lettered), progress samples every
    30 minutes with the moving cutoff, and a deadline 90 minutes from now.
    The worker runs in a second, so v3's shard times are spread over a
    simulated three-hour night afterwards to give the chart the seed's shape.
    """
    now = (now or datetime.now(UTC)).replace(microsecond=0)
    gates = {"max_dead_letter_rate": 0.2, "max_drift": 0.5}
    fallback = {"rate": NIGHT_RATE, "overhead_s": NIGHT_OVERHEAD_S}
    fast = dict(backoff=(0.0, 0.0, 0.0), flush_seconds=0.2)

    make_source(conn, tickets(40))
    v1 = submit(conn, make_spec(validation=gates, fallback=fallback)).job_version
    assert run_worker(WorkerConfig(job_version=v1, db_url=db_url, **fast)) == 0
    _relabel(conn, v1, [("bug", 8), ("account", 4)])                     # 70% billing, 20% bug, 10% account
    assert validate.validate(conn, v1, sample_dir=tempfile.mkdtemp()).passed
    publish.publish(conn, v1, actor="seed")

    v2 = submit(conn, make_spec(validation=gates, fallback=fallback,
                                prompt={"version": "v2"})).job_version
    assert run_worker(WorkerConfig(job_version=v2, db_url=db_url, **fast)) == 0
    assert validate.validate(conn, v2, sample_dir=tempfile.mkdtemp()).passed  # 100% billing: drift 0.3
    publish.publish(conn, v2, actor="seed")

    rows = tickets(120)
    for i in (5, 17, 23):
        rows[i] = (rows[i][0], f"{rows[i][1]} [[invalid-output]]", rows[i][2])
    make_source(conn, rows)
    v3 = submit(conn, make_spec(validation=gates, fallback=fallback, prompt={"version": "v3"},
                                max_attempts=1)).job_version
    assert run_worker(WorkerConfig(job_version=v3, db_url=db_url, max_shards=6, **fast)) == 0
    _relabel(conn, v3, [("bug", 9), ("other", 5)])

    start = now - timedelta(hours=3)
    deadline = now + timedelta(minutes=90)
    done = conn.execute("SELECT shard_no FROM bi.shards WHERE job_version = %s AND state = 'done' ORDER BY shard_no",
                        (v3,)).fetchall()
    for k, r in enumerate(done):
        claimed = start + timedelta(minutes=25 * k)
        conn.execute("UPDATE bi.shards SET first_claim_at = %s, done_at = %s WHERE job_version = %s AND shard_no = %s",
                     (claimed, claimed + timedelta(minutes=24), v3, r["shard_no"]))
    shards = conn.execute("SELECT done_at, stored, dead FROM bi.shards WHERE job_version = %s AND state = 'done'",
                          (v3,)).fetchall()
    total = 120
    for k in range(6):
        at = start + timedelta(minutes=30 * k)
        stored = sum(s["stored"] for s in shards if s["done_at"] <= at)
        dead = sum(s["dead"] for s in shards if s["done_at"] <= at)
        outstanding = total - stored - dead
        lss = cutoff.latest_safe_start(deadline, outstanding, NIGHT_RATE, NIGHT_OVERHEAD_S)
        conn.execute("INSERT INTO bi.progress (job_version, at, stored, dead_letters, outstanding, "
                     "latest_safe_start, deadline) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                     (v3, at, stored, dead, outstanding, lss, deadline))
    return {"v1": v1, "v2": v2, "v3": v3, "dataset": DATASET, "now": now, "deadline": deadline, "start": start}


def reader_role(conn, name: str, *, login: bool = True, member_of: tuple[str, ...] = ("bi_reader",),
                principals: tuple[str, ...] = (), extra: str = "") -> str:
    """A database role (made if absent, roles are cluster-wide) in ``member_of``, standing for ``principals``."""
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is None:
        conn.execute(f'CREATE ROLE "{name}" {"LOGIN" if login else "NOLOGIN"} {extra}')
    for group in member_of:
        conn.execute(f'GRANT "{group}" TO "{name}"')
    for p in principals:
        conn.execute("INSERT INTO bi.reader_principals VALUES (%s, %s) ON CONFLICT DO NOTHING", (name, p))
    return name


def map_night_readers(conn, *airflow_users: str) -> str:
    """Let these Airflow users read the seeded night's customer text on the dashboard (every team's ACL)."""
    role = reader_role(conn, "dash_night_reader", principals=("team0", "team1", "team2"))
    for user in airflow_users:
        conn.execute("SELECT bi.map_dashboard_reader_v1(%s, %s)", (user, role))
    return role


# -- the app under TestClient ---------------------------------------------------------


def _user_from_header(request: Request):
    """Stands in for Airflow's token lookup: ``X-Test-User: name:role`` or nobody."""
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    raw = request.headers.get("x-test-user")
    if not raw:
        raise HTTPException(401, "Not authenticated")
    name, _, role = raw.partition(":")
    return SimpleAuthManagerUser(username=name, role=role)


@pytest.fixture(scope="module")
def ledger_url(pg_server, template_db):
    """One seeded ledger for the read-only tests of this module."""
    import uuid

    import psycopg

    from batch_inference import db

    name = "dash_" + uuid.uuid4().hex[:10]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    url = pg_server.get_uri(name)
    with db.connect(url) as c:
        info = seed_night(c, url)
        map_night_readers(c, "vera")
    yield url, info
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _client(url: str, monkeypatch):
    from fastapi.testclient import TestClient

    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.core_api.security import get_user
    from batch_inference.ui import app as appmod

    monkeypatch.setenv("BATCH_INFERENCE_DB", url)
    create_auth_manager()  # the real SimpleAuthManager decides who may trigger a DAG

    async def optional(request: Request):
        try:
            return _user_from_header(request)
        except HTTPException:
            return None

    appmod.app.dependency_overrides[get_user] = _user_from_header
    appmod.app.dependency_overrides[appmod.optional_user] = optional
    return TestClient(appmod.app, base_url="http://airflow.test")


ADMIN = {"X-Test-User": "admin:admin"}
VIEWER = {"X-Test-User": "vera:viewer"}


@pytest.fixture
def seeded(ledger_url, monkeypatch):
    url, info = ledger_url
    with _client(url, monkeypatch) as client:
        yield client, info, url


def test_every_endpoint_needs_a_signed_in_user(seeded):
    client, info, _ = seeded
    v3 = info["v3"]
    for path in ["/api/jobs", f"/api/jobs/{v3}", f"/api/jobs/{v3}/progress", f"/api/jobs/{v3}/shards",
                 f"/api/jobs/{v3}/dead-letters", f"/api/jobs/{v3}/cost", f"/api/jobs/{v3}/drift",
                 f"/api/datasets/{DATASET}/history"]:
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=VIEWER).status_code == 200, path
    assert client.post(f"/api/datasets/{DATASET}/rollback", json={"expected_current": info["v2"]}).status_code == 401


def test_pages_send_a_signed_out_browser_to_airflow_login(seeded):
    client, info, _ = seeded
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303 and "login" in r.headers["location"]
    page = client.get(f"/jobs/{info['v3']}", headers=VIEWER)
    assert page.status_code == 200 and 'data-view="job"' in page.text and info["v3"] in page.text
    r = client.get(f"/run?job_version={info['v3']}", headers=VIEWER, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].endswith(f"/jobs/{info['v3']}")


def test_jobs_list_counts_are_the_shard_counters(seeded):
    client, info, url = seeded
    from batch_inference import db

    jobs = {j["job_version"]: j for j in client.get("/api/jobs", headers=VIEWER).json()["jobs"]}
    assert set(jobs) == {info["v1"], info["v2"], info["v3"]}
    with db.connect(url) as conn:
        for jv, j in jobs.items():
            c = job_counts(conn, jv)
            assert (j["records"], j["stored"], j["dead_letters"], j["outstanding"]) == \
                (c["records"], c["stored"], c["dead_letters"], c["outstanding"])
    assert jobs[info["v2"]]["published"] and not jobs[info["v1"]]["published"]
    assert jobs[info["v3"]]["deadline"] is not None
    only = client.get("/api/jobs?dataset=nope", headers=VIEWER).json()["jobs"]
    assert only == []


def test_job_header_and_unknown_version(seeded):
    client, info, url = seeded
    from batch_inference import db

    j = client.get(f"/api/jobs/{info['v3']}", headers=VIEWER).json()
    with db.connect(url) as conn:
        c = job_counts(conn, info["v3"])
    assert j["counts"]["stored"] == c["stored"] and j["counts"]["outstanding"] == c["outstanding"] == 60
    assert j["published_version"] == info["v2"] and not j["is_published"]
    assert client.get("/api/jobs/jv_0000000000000000", headers=VIEWER).status_code == 404
    assert client.get("/api/jobs/jv_0000000000000000/progress", headers=VIEWER).status_code == 404


def test_progress_has_the_moving_cutoff_the_deadline_and_a_projection(seeded):
    client, info, _ = seeded
    p = client.get(f"/api/jobs/{info['v3']}/progress", headers=VIEWER).json()
    assert p["source"] == "progress"
    assert len(p["cutoff_history"]) == 6
    moved = [datetime.fromisoformat(c["latest_safe_start"]) for c in p["cutoff_history"]]
    assert moved == sorted(moved) and moved[0] < moved[-1]          # the cutoff moves later as rows settle
    deadline = datetime.fromisoformat(p["deadline"])
    assert deadline == info["deadline"]
    # The cutoff now is the sensor's arithmetic on the live outstanding count.
    assert datetime.fromisoformat(p["cutoff"]) == cutoff.latest_safe_start(deadline, 60, NIGHT_RATE, NIGHT_OVERHEAD_S)
    assert p["samples"][-1]["live"] and p["samples"][-1]["outstanding"] == 60
    # 57 rows in three hours leaves 60 for about three more: after the deadline.
    assert datetime.fromisoformat(p["projected_finish"]) > deadline
    lanes = {(ln["lane"], ln["kind"]) for ln in p["lanes"]}
    assert {("batch", "actual"), ("batch", "projected"), ("fallback", "planned"), ("overhead", "planned")} <= lanes
    over = next(ln for ln in p["lanes"] if ln["lane"] == "overhead")
    assert datetime.fromisoformat(over["end"]) == deadline


def test_job_page_shows_the_constants_the_cutoff_uses_and_why(seeded):
    client, info, url = seeded
    from batch_inference import db

    p = client.get(f"/api/jobs/{info['v3']}/progress", headers=VIEWER).json()
    assert (p["constants"]["rate"], p["constants"]["overhead_s"]) == (NIGHT_RATE, NIGHT_OVERHEAD_S)
    assert p["constants"]["source"].startswith("configured constants")
    # A partial fallback run (no load recorded) that took longer: it may only make the cutoff earlier.
    with db.connect(url) as conn:
        rid = conn.execute("INSERT INTO bi.fallback_runs (job_version, dataset, started_at, finished_at, records, "
                           "rate, overhead_s, drain_s, busy_s) VALUES ('jv_earlier', %s, now() - interval '1 day', "
                           "now() - interval '23 hours', 100, 1.0, 3000, 60, 100) RETURNING id",
                           (DATASET,)).fetchone()["id"]
    try:
        p = client.get(f"/api/jobs/{info['v3']}/progress", headers=VIEWER).json()
        j = client.get(f"/api/jobs/{info['v3']}", headers=VIEWER).json()
    finally:
        with db.connect(url) as conn:
            conn.execute("DELETE FROM bi.fallback_runs WHERE id = %s", (rid,))
    assert p["overhead_s"] == p["constants"]["overhead_s"] == 3000.0
    assert "overhead 3,000 s measured, longer than the configured 1,200 s" in p["constants"]["source"]
    assert "rate 0.02/s configured (0 complete runs of the 5 needed to relax it; history would give 1.0/s)" \
        in p["constants"]["source"]
    deadline = datetime.fromisoformat(p["deadline"])
    assert datetime.fromisoformat(p["cutoff"]) == cutoff.latest_safe_start(deadline, 60, NIGHT_RATE, 3000.0)
    assert j["fallback"] == p["constants"]


def test_progress_without_samples_is_derived_from_shard_times(seeded):
    client, info, _ = seeded
    p = client.get(f"/api/jobs/{info['v1']}/progress", headers=VIEWER).json()
    assert p["source"] == "shards" and p["finished_at"] is not None
    assert p["samples"][0]["outstanding"] == 40 and p["samples"][-1]["outstanding"] == 0
    assert p["cutoff"] is None and p["projected_finish"] is None


def test_progress_without_samples_draws_at_most_the_first_shards_to_finish(seeded, monkeypatch):
    from batch_inference import db
    from batch_inference.ui import data

    client, info, url = seeded
    whole = client.get(f"/api/jobs/{info['v1']}/progress", headers=VIEWER).json()["samples"]
    assert len(whole) > 4                   # more shards finished than the two drawn below
    monkeypatch.setattr(data, "DERIVED_SHARDS", 2)
    p = client.get(f"/api/jobs/{info['v1']}/progress", headers=VIEWER).json()
    with db.connect(url) as conn:
        first = conn.execute("SELECT done_at, stored, dead FROM bi.shards WHERE job_version = %s "
                             "AND done_at IS NOT NULL ORDER BY done_at, shard_no LIMIT 2", (info["v1"],)).fetchall()
    # the first claim, the first two shards to finish (what the whole burn-down has there), then the live point
    assert p["samples"][:3] == whole[:3] and len(p["samples"]) == 4 and p["samples"][-1]["live"]
    assert [datetime.fromisoformat(s["at"]) for s in p["samples"][1:3]] == [r["done_at"] for r in first]
    assert p["samples"][-1]["outstanding"] == 0 and p["finished_at"] is not None


def test_shards_dead_letters_and_cost(seeded):
    client, info, url = seeded
    from batch_inference import db

    sh = client.get(f"/api/jobs/{info['v3']}/shards?limit=5", headers=VIEWER).json()
    assert sh["by_state"]["done"]["shards"] == 6 and sh["by_state"]["pending"]["shards"] == 6
    assert sh["total"] == 12 and len(sh["shards"]) == 5
    dl = client.get(f"/api/jobs/{info['v3']}/dead-letters", headers=VIEWER).json()
    assert dl["total"] == 3 and {d["record_id"] for d in dl["dead_letters"]} == {"t00005", "t00017", "t00023"}
    assert dl["reasons"][0]["n"] == 3 and "schema" in dl["reasons"][0]["reason"]
    cost = client.get(f"/api/jobs/{info['v3']}/cost", headers=VIEWER).json()
    with db.connect(url) as conn:
        c = job_counts(conn, info["v3"])
    assert cost["so_far"]["batch_rows"] == c["stored_batch"] == 57
    assert cost["so_far"]["batch_cost"] == round(57 * 0.003625, 2)
    assert cost["if_fallback_now"]["fallback_rows"] == 60


def test_drift_against_the_published_version(seeded):
    client, info, _ = seeded
    d = client.get(f"/api/jobs/{info['v3']}/drift", headers=VIEWER).json()
    assert d["baseline_version"] == info["v2"]
    shares = {c["category"]: (c["current"], c["baseline"]) for c in d["categories"]}
    assert shares["billing"] == (pytest.approx(43 / 57, abs=1e-5), 1.0)
    assert shares["bug"] == (pytest.approx(9 / 57, abs=1e-5), 0.0)
    assert d["tv_distance"] == pytest.approx(14 / 57, abs=1e-5)
    # The published version is compared with the one it replaced, from the stored reports.
    d2 = client.get(f"/api/jobs/{info['v2']}/drift", headers=VIEWER).json()
    assert d2["baseline_version"] == info["v1"] and d2["source"] == {"current": "validation", "baseline": "validation"}
    assert d2["tv_distance"] == pytest.approx(0.3) and d2["validated"]["passed"] is True


def test_static_assets_load_nothing_from_the_network():
    from pathlib import Path

    import batch_inference.ui as ui

    for f in (Path(ui.__file__).parent / "static").iterdir():
        text = f.read_text()
        for url in ("http://", "https://", "//cdn", "@import", "fonts.googleapis"):
            hits = [ln for ln in text.splitlines() if url in ln and "www.w3.org/2000/svg" not in ln]
            assert not hits, (f.name, hits)


# -- rollback --------------------------------------------------------------------------


@pytest.fixture
def fresh(conn, db_url, monkeypatch):
    info = seed_night(conn, db_url)
    with _client(db_url, monkeypatch) as client:
        yield client, info, conn


def test_rollback_needs_permission_to_trigger_the_dag(fresh, monkeypatch):
    client, info, conn = fresh
    path = f"/api/datasets/{DATASET}/rollback"
    body = {"expected_current": info["v2"], "reason": "bad labels"}
    assert client.post(path, json=body).status_code == 401
    r = client.post(path, json=body, headers=VIEWER)
    assert r.status_code == 403 and "may not trigger" in r.json()["detail"]
    # A mapped DAG is named in the refusal (and checked with its id).
    monkeypatch.setenv("BATCH_INFERENCE_ROLLBACK_DAG", '{"tickets_triage": "triage_nightly"}')
    r = client.post(path, json=body, headers=VIEWER)
    assert r.status_code == 403 and "triage_nightly" in r.json()["detail"]
    assert publish.published(conn, DATASET)["job_version"] == info["v2"]


def test_rollback_refuses_what_a_forged_cross_site_post_would_send(fresh):
    client, info, conn = fresh
    path = f"/api/datasets/{DATASET}/rollback"
    form = client.post(path, data={"expected_current": info["v2"]}, headers=ADMIN)
    assert form.status_code == 415
    other = client.post(path, json={"expected_current": info["v2"]},
                        headers={**ADMIN, "Origin": "https://evil.example"})
    assert other.status_code == 403
    assert client.get(path, headers=ADMIN).status_code == 405
    assert publish.published(conn, DATASET)["job_version"] == info["v2"]


def test_rollback_switches_the_pointer_once_and_only_from_what_the_user_saw(fresh):
    client, info, conn = fresh
    path = f"/api/datasets/{DATASET}/rollback"
    stale = client.post(path, json={"expected_current": info["v1"]}, headers=ADMIN)
    assert stale.status_code == 409
    assert stale.json()["detail"] == (f"rollback of dataset {DATASET} refused: expected {info['v1']} to be "
                                      f"published, but {info['v2']} is; nothing was changed (reload and decide again)")
    assert publish.published(conn, DATASET)["job_version"] == info["v2"]
    assert conn.execute("SELECT count(*) AS n FROM bi.publish_history").fetchone()["n"] == 2  # nothing written

    ok = client.post(path, json={"expected_current": info["v2"], "reason": "labels drifted"},
                     headers={**ADMIN, "Origin": "http://airflow.test"})
    assert ok.status_code == 200, ok.text
    out = ok.json()
    assert (out["from_version"], out["to_version"], out["action"]) == (info["v2"], info["v1"], "rollback")
    assert out["history"][0]["actor"] == "airflow:admin" and out["history"][0]["reason"] == "labels drifted"
    row = conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s", (DATASET,)).fetchone()
    assert row["job_version"] == info["v1"]
    # v1 was the first version ever published: nothing before it.
    again = client.post(path, json={"expected_current": info["v1"]}, headers=ADMIN)
    assert again.status_code == 422 and "nothing to roll back" in again.json()["detail"]



def test_two_rollbacks_clicked_on_the_same_page_undo_one_publish_not_two(fresh):
    """Alice and Bob both see v2 published and both press the button. Alice's rollback lands first;
    Bob's names v2 as the version to roll back from, so bi.rollback_v2 refuses it (409, the dataset and
    both versions in the text) instead of rolling back whatever is live by then."""
    client, info, conn = fresh
    seen = client.get(f"/api/datasets/{DATASET}/history", headers=ADMIN).json()["pointer"]["job_version"]
    assert seen == info["v2"]
    publish.rollback(conn, DATASET, actor="airflow:alice", expected_current=seen)     # Alice's click
    bob = client.post(f"/api/datasets/{DATASET}/rollback", json={"expected_current": seen, "reason": "me too"},
                      headers=ADMIN)
    assert bob.status_code == 409
    assert f"expected {info['v2']} to be published, but {info['v1']} is; nothing was changed" in bob.json()["detail"]
    assert publish.published(conn, DATASET)["job_version"] == info["v1"]
    actions = [h["action"] for h in conn.execute("SELECT action FROM bi.publish_history ORDER BY id")]
    assert actions == ["publish", "publish", "rollback"]


# -- the rollback's asset event ------------------------------------------------------------

TRIAGE_DAGS = '''
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator

from batch_inference.operators.publish import dataset_asset

with DAG("publish_tickets_triage", schedule=None):
    EmptyOperator(task_id="publish", outlets=[dataset_asset("tickets_triage")])

with DAG("refresh_on_tickets_triage", schedule=[dataset_asset("tickets_triage")]):
    EmptyOperator(task_id="refresh")
'''


@pytest.fixture
def triage_asset(airflow_home, tmp_path):
    """The dataset's Asset in Airflow's metadata database, as after the DAG processor parsed a DAG
    that publishes it (and one scheduled on it): the real DagBag and its sync to the database."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db

    (tmp_path / "triage_dags.py").write_text(TRIAGE_DAGS)
    DagBundlesManager().sync_bundles_to_db()
    bag = BundleDagBag(dag_folder=tmp_path, bundle_path=tmp_path, bundle_name="dags-folder")
    assert not bag.import_errors, bag.import_errors
    sync_bag_to_db(bag, "dags-folder", None)


def test_a_dashboard_rollback_records_the_assets_event(fresh, triage_asset):
    from sqlalchemy import select

    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session

    client, info, conn = fresh
    ok = client.post(f"/api/datasets/{DATASET}/rollback", json={"expected_current": info["v2"], "reason": "drift"},
                     headers=ADMIN)
    assert ok.status_code == 200, ok.text
    event_id = ok.json()["asset_event"]
    assert event_id is not None
    with create_session() as session:
        event = session.get(AssetEvent, event_id)
        asset = session.get(AssetModel, event.asset_id)
        assert (asset.name, asset.uri) == (f"batch_inference.{DATASET}", f"batch-inference://published/{DATASET}")
        assert event.extra == {"dataset": DATASET, "action": "rollback", "from_version": info["v2"],
                               "to_version": info["v1"], "changed": True, "view": f"published.{DATASET}"}
        # The DAG scheduled on the asset is queued to run on the restored version.
        queued = session.scalars(select(AssetDagRunQueue.target_dag_id)
                                 .where(AssetDagRunQueue.asset_id == asset.id)).all()
        assert "refresh_on_tickets_triage" in queued


def test_a_rollback_of_a_dataset_airflow_has_no_asset_for_records_no_event(airflow_home, caplog):
    from batch_inference.ui.app import record_asset_event

    switch = {"dataset": "never_parsed", "action": "rollback", "from_version": "jv_b", "to_version": "jv_a",
              "changed": True, "view": "published.never_parsed"}
    assert record_asset_event("never_parsed", switch) is None
    assert "no asset batch-inference://published/never_parsed" in caplog.text


def test_the_estimates_endpoint_shows_the_previews_and_pilots_of_a_dataset(db_url, monkeypatch):
    from psycopg.types.json import Jsonb

    from batch_inference import db

    with db.connect(db_url) as conn:
        conn.execute(db.q("estimate_preview_insert"), {
            "dag_id": "batch_inference_backfill", "run_id": "manual__1", "dataset": DATASET, "spec_hash": "h",
            "verdict": "over_budget", "figures": Jsonb({"eligible": 78, "bill": {"planned": {"total": "0.28"}}})})
        conn.execute(db.q("estimate_pilot_insert"), {
            "dataset": DATASET, "spec_hash": "h", "model_name": "m", "model_digest": "d", "engine": "llama-cpp",
            "records": 4, "stored": 3, "failed": 1, "dead_letters": 0, "seconds": 5.0, "records_per_s": 0.6,
            "input_tokens": 900, "output_tokens": 120, "valid_rate": 0.75})
    with _client(db_url, monkeypatch) as client:
        path = f"/api/datasets/{DATASET}/estimates"
        assert client.get(path).status_code == 401
        out = client.get(path, headers=ADMIN).json()
    (p,) = out["previews"]
    assert p["verdict"] == "over_budget" and p["figures"]["bill"]["planned"]["total"] == "0.28"
    (q,) = out["pilots"]
    assert q["records_per_s"] == 0.6 and q["valid_rate"] == 0.75


def test_the_ladder_endpoint_shows_each_rungs_share_accuracy_and_cost(conn, db_url, monkeypatch):
    from batch_inference.ladder.calibrate import calibrate
    from batch_inference.spec import parse_spec
    from benchmarks.ladder import known_ladder, ticket_rows, ticket_tables

    monkeypatch.setenv("BATCH_INFERENCE_ENGINE_MODULES", "tests,benchmarks.ladder")

    rows = ticket_rows(20, hard_share=0.5)
    ticket_tables(conn, rows, ticket_rows(20, hard_share=0.5, prefix="g"))
    cal = calibrate(conn, parse_spec(known_ladder("public.tickets", "public.golden")))
    job = submit(conn, cal.spec).job_version
    assert run_worker(WorkerConfig(job_version=job, db_url=db_url, wait_for_leases=False)) == 0
    with _client(db_url, monkeypatch) as client:
        path = f"/api/jobs/{job}/ladder"
        assert client.get(path).status_code == 401
        out = client.get(path, headers=ADMIN).json()["ladder"]
    hard = sum(1 for _, t, _ in rows if "[hard]" in t)
    assert [r["kept"] for r in out["rungs"]] == [20 - hard, hard]
    assert [r["answered"] for r in out["rungs"]] == [20, hard]
    assert out["rungs"][1]["golden_accuracy"] == 1.0 and out["calibration"]["thresholds"] == cal.thresholds
    assert out["bill"] == pytest.approx(20 * 0.0004 + hard * 0.004) and out["top_alone_bill"] == pytest.approx(0.08)
