"""The dashboard in headless Chromium, served by a real ``airflow api-server``.

Airflow runs as it would in production, with a SQLite metadata database in a
temporary AIRFLOW_HOME: the plugin is found through the package's
``airflow.plugins`` entry point, and the ledger is the conftest's embedded
PostgreSQL, named to the plugin by the Airflow connection
``batch_inference_default`` (AIRFLOW_CONN_...). One server, the simple auth
manager with two users and passwords: the page tests sign the browser in as
the admin (the UI's ``_token`` cookie: the page renders, its numbers are the
ledger's, the chart has the cutoff, the DAG-run view finds the run's job,
rollback works); the auth tests are what a signed-out caller or a viewer may
not do.

Chromium is Debian's (/usr/bin/chromium), driven by Playwright without a
browser download. A screenshot of the seeded job lands in artifacts/; set
BI_UPDATE_DOCS_SCREENSHOT=1 to refresh docs/img/dashboard.png as well.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg
import pytest

from batch_inference import db
from batch_inference.status import job_counts
from tests.integration.test_dashboard_api import DATASET, map_night_readers, seed_night

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
ARTIFACTS = ROOT / "artifacts"
USERS = {"admin": ("admin", "admin-pw-1"), "vera": ("viewer", "viewer-pw-1")}
# Customer text in the night's dead letters: only a user with a reader role may see it.
CANARY = "CANARY-customer-words"

PROBE_DAG = '''
"""A DAG run whose XCom names a batch-inference job version (the submit task's manifest)."""
import os
from datetime import datetime

from airflow.sdk import dag, task


@dag(dag_id="bi_dashboard_probe", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bi_dashboard_probe():
    @task
    def submit():
        return {"job_version": os.environ["BI_PROBE_JOB"], "dataset": "tickets_triage", "records": 120}

    submit()


bi_dashboard_probe()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def night(pg_server, template_db):
    """A seeded ledger database of its own (the page tests change its pointer)."""
    name = "dashui_" + uuid.uuid4().hex[:10]
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    url = pg_server.get_uri(name)
    with db.connect(url) as c:
        info = seed_night(c, url)
        c.execute("UPDATE bi.dead_letters SET error = %s || ': ' || error, raw_output = %s WHERE job_version = %s",
                  (CANARY, CANARY, info["v3"]))
        # The admin reads it; vera, a viewer, has no reader role.
        map_night_readers(c, "admin")
    yield url, info
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def dashboard_home(night, migrated_airflow_db):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (scripts/test.sh does it)")
    home = Path(tempfile.mkdtemp(prefix="bi-af-"))
    (home / "dags").mkdir()
    (home / "dags" / "bi_dashboard_probe.py").write_text(PROBE_DAG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != db.DB_ENV}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, (r, _) in USERS.items()),
        # Known passwords: the simple auth manager keeps existing entries of this file.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "PYTHONUNBUFFERED": "1",
    })
    (home / "passwords.json").write_text(json.dumps({u: pw for u, (_, pw) in USERS.items()}))
    shutil.copyfile(migrated_airflow_db, home / "airflow.db")     # `airflow db migrate`, done once a session
    url, info = night
    env["AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT"] = db.airflow_connection_json(url)
    env["BI_PROBE_JOB"] = info["v3"]
    yield home, env
    shutil.rmtree(home, ignore_errors=True)


class _Server:
    def __init__(self, env: dict[str, str], home: Path, name: str):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = home / f"{name}.log"
        env = {**env, "AIRFLOW__API__BASE_URL": self.base}
        self.proc = subprocess.Popen([AIRFLOW, "api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float = 300) -> "_Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"api-server exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.base + "/api/v2/monitor/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"api-server not healthy after {timeout}s:\n{self.log.read_text()[-4000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its worker

    def join(self, timeout: float = 2) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A test server need not drain its connections (an api-server went on for more than 8 s
            # after its SIGTERM).
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(dashboard_home):
    """The api-server and the probe DAG run, started together: their start-ups
    (imports, mostly) overlap instead of queueing."""
    home, env = dashboard_home
    t0 = time.monotonic()
    api = _Server(env, home, "api")
    # A real DAG run with the job version in its XCom, made while the server starts.
    probe = subprocess.Popen([AIRFLOW, "dags", "test", "bi_dashboard_probe"], env=env,
                             stdout=(home / "probe.log").open("w"), stderr=subprocess.STDOUT)
    try:
        api.wait()
        print(f"api-server healthy after {time.monotonic() - t0:.1f}s")
        assert probe.wait(timeout=300) == 0, (home / "probe.log").read_text()[-4000:]
        yield api
    finally:
        t1 = time.monotonic()
        api.terminate()
        api.join()
        print(f"api-server stopped in {time.monotonic() - t1:.1f}s")
        if probe.poll() is None:
            probe.kill()
            probe.wait()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """A browser signed in as the admin (the cookie the UI's login sets)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="UTC")
    ctx.add_cookies([{"name": "_token", "value": _token(server, "admin"), "url": server.base}])
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, errors


def _num(text: str) -> int:
    return int(text.replace(",", "").strip())


def _open_job(page, server: _Server, job: str) -> None:
    page.goto(f"{server.base}/batch-inference/jobs/{job}")
    page.wait_for_selector("body[data-loaded=true]", timeout=30000)


# -- the pages -------------------------------------------------------------------------


def test_plugin_is_registered_with_its_nav_and_dag_run_views(server):
    plugins = httpx.get(server.base + "/api/v2/plugins", headers=_admin(server)).json()["plugins"]
    ours = next(p for p in plugins if p["name"] == "batch_inference")
    assert ours["fastapi_apps"][0]["url_prefix"] == "/batch-inference"
    views = {v["destination"]: v for v in ours["external_views"]}
    assert views["nav"]["href"] == "/batch-inference/" and views["nav"]["category"] == "browse"
    assert "{RUN_ID}" in views["dag_run"]["href"] and "{DAG_ID}" in views["dag_run"]["href"]


def test_job_page_numbers_are_the_ledgers_and_the_chart_has_the_cutoff(server, night, page):
    url, info = night
    job = info["v3"]
    _open_job(page, server, job)
    with db.connect(url) as conn:
        c = job_counts(conn, job)
    shown = {k: _num(page.text_content(f"#count-{k}")) for k in ("records", "stored", "dead", "outstanding")}
    assert shown == {"records": c["records"], "stored": c["stored"], "dead": c["dead_letters"],
                     "outstanding": c["outstanding"]}
    assert _num(page.text_content("#shards-done")) == c["shards"]["done"]
    assert _num(page.text_content("#shards-pending")) == c["shards"]["pending"]
    assert _num(page.text_content("#dead-total")) == c["dead_letters"]

    # The moving cutoff and the deadline on the burn-down's time axis.
    assert page.locator("svg#timeline #cutoff-line line").count() == 1
    assert page.locator("svg#timeline #deadline-line line").count() == 1
    assert page.locator("svg#timeline .cutoff-sample").count() == 6
    assert page.locator("svg#timeline #lane-fallback rect.planned").count() == 1
    cut_x = float(page.get_attribute("svg#timeline #cutoff-line line", "x1"))
    dl_x = float(page.get_attribute("svg#timeline #deadline-line line", "x1"))
    assert cut_x < dl_x                                        # the fallback starts before the deadline
    assert page.text_content("#deadline-clock") == info["deadline"].strftime("%H:%M")
    assert page.get_attribute("svg#timeline #deadline-line", "data-at").startswith(
        info["deadline"].strftime("%Y-%m-%dT%H:%M"))
    # Which constants the cutoff uses, and why (no fallback history here: the spec's).
    assert page.text_content("#constants-source").startswith("constants: configured constants: rate ")

    # Drift bars per category, the dead-letter reasons and the cost by transport.
    assert page.locator("svg#drift-chart .drift-row").count() == 3
    assert "schema" in page.text_content("#dead-reasons")
    assert _num(page.text_content("#cost-batch td:nth-child(2)")) == c["stored_batch"]
    # The seeded night has rows outstanding: the panel says what firing now would cost, in the API's words.
    from batch_inference.ui.data import cost as cost_view

    with db.connect(url) as conn:
        fired = cost_view(conn, job)["if_fallback_now"]
    assert c["outstanding"] > 0
    assert f"If the fallback fired now: ${fired['total']:,.2f} ({fired['overage_text']})." in page.text_content("body")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    if os.environ.get("BI_UPDATE_DOCS_SCREENSHOT") == "1":
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ARTIFACTS / "dashboard.png", ROOT / "docs" / "img" / "dashboard.png")


def test_jobs_list_links_every_version(server, night, page):
    url, info = night
    page.goto(f"{server.base}/batch-inference/")
    page.wait_for_selector("#jobs-table")
    rows = page.locator("#jobs-table tbody tr")
    assert rows.count() == 3
    with db.connect(url) as conn:
        for jv in (info["v1"], info["v2"], info["v3"]):
            cells = page.locator(f'#jobs-table tr[data-job="{jv}"] td')
            assert _num(cells.nth(4).text_content()) == job_counts(conn, jv)["stored"]
    page.click(f'#jobs-table a:text("{info["v3"]}")')
    page.wait_for_selector("body[data-loaded=true]")
    assert page.text_content("#job-version") == info["v3"]


def test_dag_run_view_finds_the_runs_job_version(server, night, page):
    _, info = night
    runs = httpx.get(server.base + "/api/v2/dags/bi_dashboard_probe/dagRuns", headers=_admin(server)).json()[
        "dag_runs"]
    run_id = runs[0]["dag_run_id"]
    # The UI fills {RUN_ID} with encodeURIComponent; a manual run id holds a "+".
    page.goto(f"{server.base}/batch-inference/run?dag_id=bi_dashboard_probe&run_id={quote(run_id, safe='')}")
    page.wait_for_selector("body[data-loaded=true]", timeout=30000)
    assert page.text_content("#job-version") == info["v3"]
    assert run_id in page.text_content("#run-note")


def test_rollback_from_the_page_switches_the_pointer(server, night, page):
    url, info = night
    _open_job(page, server, info["v3"])
    assert page.text_content("#pointer-version") == info["v2"]
    page.click("#rollback-button")
    page.fill("#rollback-reason", "v2 labels look wrong")
    page.click("#rollback-confirm")
    # A selector wait, not wait_for_function: the page's CSP forbids the eval that one needs.
    page.locator("#pointer-version", has_text=info["v1"]).wait_for(timeout=30000)
    with db.connect(url) as conn:
        row = conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s", (DATASET,)).fetchone()
        last = conn.execute("SELECT * FROM bi.publish_history WHERE dataset = %s ORDER BY id DESC LIMIT 1",
                            (DATASET,)).fetchone()
    assert row["job_version"] == info["v1"]
    assert (last["action"], last["from_version"], last["to_version"]) == ("rollback", info["v2"], info["v1"])
    assert last["reason"] == "v2 labels look wrong" and last["actor"].startswith("airflow:")
    top = page.locator("#history-table tbody tr").first
    assert top.get_attribute("data-action") == "rollback" and "v2 labels look wrong" in top.text_content()
    # v1 was the first version published: there is nothing left to roll back to.
    assert page.locator("#rollback-button").count() == 0


# -- auth against the real token machinery ------------------------------------------------


def _token(server: _Server, user: str) -> str:
    r = httpx.post(server.base + "/auth/token", json={"username": user, "password": USERS[user][1]})
    assert r.status_code in (200, 201), r.text
    return r.json()["access_token"]


def _admin(server: _Server) -> dict[str, str]:
    return {"Authorization": "Bearer " + _token(server, "admin")}


def test_signed_out_callers_and_viewers_cannot_roll_back(server, night):
    url, info = night
    base = server.base + "/batch-inference"
    with db.connect(url) as conn:
        before = conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s",
                              (DATASET,)).fetchone()["job_version"]
        n_hist = conn.execute("SELECT count(*) AS n FROM bi.publish_history").fetchone()["n"]
    body = {"expected_current": before}
    assert httpx.get(base + "/api/jobs").status_code == 401
    assert httpx.post(f"{base}/api/datasets/{DATASET}/rollback", json=body).status_code == 401
    page = httpx.get(base + "/", follow_redirects=False)
    assert page.status_code == 303 and "/auth/login" in page.headers["location"]

    viewer = {"Authorization": "Bearer " + _token(server, "vera")}
    assert httpx.get(base + "/api/jobs", headers=viewer).status_code == 200
    r = httpx.post(f"{base}/api/datasets/{DATASET}/rollback", json=body, headers=viewer)
    assert r.status_code == 403, r.text

    # The UI's cookie signs a browser in, but a form post riding on it is refused.
    cookie = {"_token": _token(server, "admin")}
    assert httpx.get(f"{base}/jobs/{info['v3']}", cookies=cookie).status_code == 200
    forged = httpx.post(f"{base}/api/datasets/{DATASET}/rollback", data=body, cookies=cookie)
    assert forged.status_code == 415
    with db.connect(url) as conn:
        assert conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s",
                            (DATASET,)).fetchone()["job_version"] == before
        assert conn.execute("SELECT count(*) AS n FROM bi.publish_history").fetchone()["n"] == n_hist


def test_a_viewer_without_a_reader_role_sees_counts_and_no_customer_text(server, night, browser):
    """Signed in as vera (the UI's cookie), the job page counts the dead letters but shows none of their text."""
    _, info = night
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, timezone_id="UTC")
    try:
        ctx.add_cookies([{"name": "_token", "value": _token(server, "vera"), "url": server.base}])
        page = ctx.new_page()
        page.goto(f"{server.base}/batch-inference/jobs/{info['v3']}")
        page.wait_for_selector("body[data-loaded=true]", timeout=30000)
        assert _num(page.text_content("#dead-total")) == 3
        assert "no reader role" in page.text_content("#dead-hidden")
        assert page.locator("#dead-letters").count() == 0 and page.locator("#dead-reasons").count() == 0
        assert CANARY not in page.content()
        for path in ("dead-letters", ""):
            r = httpx.get(f"{server.base}/batch-inference/api/jobs/{info['v3']}/{path}".rstrip("/"),
                          cookies={"_token": _token(server, "vera")})
            assert r.status_code == 200 and CANARY not in r.text
        # The admin, mapped to a reader role, sees the same records' text.
        admin = httpx.get(f"{server.base}/batch-inference/api/jobs/{info['v3']}/dead-letters",
                          headers={"Authorization": "Bearer " + _token(server, "admin")}).json()
        assert admin["visible"] == 3 and all(CANARY in d["error"] for d in admin["dead_letters"])
        csp = httpx.get(f"{server.base}/batch-inference/jobs/{info['v3']}",
                        cookies={"_token": _token(server, "vera")}).headers["content-security-policy"]
        assert "frame-ancestors 'self'" in csp
    finally:
        ctx.close()


def test_airflow_ui_embeds_the_dashboard_in_browse_and_on_the_dag_run(server, night, page):
    """Airflow's own React UI: the Browse item and the DAG-run tab load our pages in an iframe."""
    _, info = night
    page.goto(f"{server.base}/plugin/batch-inference")
    frame = page.frame_locator("iframe")
    frame.locator("#jobs-table").wait_for(timeout=60000)
    assert frame.locator(f'#jobs-table tr[data-job="{info["v3"]}"]').count() == 1

    run_id = httpx.get(server.base + "/api/v2/dags/bi_dashboard_probe/dagRuns",
                       headers=_admin(server)).json()["dag_runs"][0]["dag_run_id"]
    page.goto(f"{server.base}/dags/bi_dashboard_probe/runs/{quote(run_id, safe='')}/plugin/batch-inference-run")
    frame = page.frame_locator("iframe")
    frame.locator("body[data-loaded=true]").wait_for(timeout=60000)
    assert frame.locator("#job-version").text_content() == info["v3"]


# -- the review screen ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reviewed(night):
    """A finished, validated version whose spec asks for two reviewed sample rows, half of them right."""
    from batch_inference import validate
    from batch_inference.plan import submit
    from gpu_runner.worker import WorkerConfig, run_worker
    from tests.conftest import make_source, make_spec, tickets

    url, _ = night
    with db.connect(url) as conn:
        make_source(conn, tickets(10))
        job = submit(conn, make_spec(dataset="tickets_review", validation={"sample_size": 3},
                                     evaluation={"review": {"min_reviewed": 2, "min_right": 0.5}})).job_version
        assert run_worker(WorkerConfig(job_version=job, db_url=url, backoff=(0.0, 0.0, 0.0), flush_seconds=0.2)) == 0
        assert validate.validate(conn, job, sample_dir=tempfile.mkdtemp()).passed
    return url, job


def test_a_review_recorded_in_the_dashboard_moves_the_gate(server, reviewed, page):
    url, job = reviewed
    page.goto(f"{server.base}/batch-inference/jobs/{job}/review")
    page.wait_for_selector("body[data-loaded=true]", timeout=30000)
    assert page.text_content("#review-problem") == "review: 0 of 2 required sample rows reviewed"
    assert page.text_content("#review-publish").startswith("Publish: refused")
    rows = page.locator("#review-rows tbody tr")
    assert rows.count() == 3
    first, second = rows.nth(0).get_attribute("data-record"), rows.nth(1).get_attribute("data-record")
    assert "charged twice" in rows.nth(0).locator(".review-text").text_content()     # input beside output
    assert '"category"' in rows.nth(0).locator(".review-output").text_content()

    page.fill(f'#review-rows tr[data-record="{first}"] .review-comment', "label fits")
    page.click(f'#review-rows tr[data-record="{first}"] button[data-verdict="right"]')
    page.locator("#review-progress", has_text="1 of 3 sample rows reviewed").wait_for(timeout=30000)
    assert page.text_content("#review-problem") == "review: 1 of 2 required sample rows reviewed"
    page.click(f'#review-rows tr[data-record="{second}"] button[data-verdict="wrong"]')
    page.locator("#review-problem", has_text="The review gate is met.").wait_for(timeout=30000)
    assert page.text_content("#review-publish") == "Publish: allowed."
    assert page.get_attribute(f'#review-rows tr[data-record="{first}"]', "data-verdict") == "right"
    with db.connect(url) as conn:
        stored = {r["record_id"]: r for r in conn.execute(
            "SELECT record_id, verdict, comment, reviewer FROM bi.reviews WHERE job_version = %s", (job,))}
    assert (stored[first]["verdict"], stored[first]["comment"]) == ("right", "label fits")
    assert stored[second]["verdict"] == "wrong"
    assert all(r["reviewer"].startswith("airflow:") for r in stored.values())

    # A Reject after the gate is met: in the ledger, on the screen, and publish is refused even forced.
    page.fill("#reject-reason", "priorities are all urgent")
    page.click("#reject-button")
    page.locator("#review-publish", has_text="even forced").wait_for(timeout=30000)
    assert page.text_content("#review-problem").endswith(": priorities are all urgent")
    assert page.get_attribute("#review-rejections tbody tr", "data-standing") == "true"
    from batch_inference import evaluation

    with db.connect(url) as conn:
        assert evaluation.review_state(conn, job)["rejection"].startswith("rejected by airflow:")
        assert evaluation.withdraw_rejections(conn, job, actor="test", reason="checked") == 1


def test_a_viewer_cannot_record_a_review(server, reviewed):
    url, job = reviewed
    base = server.base + "/batch-inference"
    with db.connect(url) as conn:
        record = conn.execute("SELECT record_id FROM bi.review_sample WHERE job_version = %s ORDER BY record_id "
                              "DESC LIMIT 1", (job,)).fetchone()["record_id"]
        before = conn.execute("SELECT count(*) AS n FROM bi.reviews WHERE job_version = %s", (job,)).fetchone()["n"]
    body = {"record_id": record, "verdict": "right"}
    assert httpx.post(f"{base}/api/jobs/{job}/review", json=body).status_code == 401
    viewer = {"Authorization": "Bearer " + _token(server, "vera")}
    shown = httpx.get(f"{base}/api/jobs/{job}/review", headers=viewer).json()
    assert shown["may_review"] is False and shown["rows"] == []          # no reader role: no text either
    r = httpx.post(f"{base}/api/jobs/{job}/review", json=body, headers=viewer)
    assert r.status_code == 403 and "review refused" in r.text, r.text
    with db.connect(url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM bi.reviews WHERE job_version = %s",
                            (job,)).fetchone()["n"] == before


def test_a_companion_version_is_shown_under_the_version_it_serves_not_in_the_list(server, night, page):
    url, info = night
    v1, v2, v3 = info["v1"], info["v2"], info["v3"]
    with db.connect(url) as conn:                     # v1 recorded as v3's golden run, as run_companion does
        conn.execute(db.q("companion_link"), {"job": v3, "companion": v1, "kind": "golden"})
    try:
        page.goto(f"{server.base}/batch-inference/")
        page.wait_for_selector("#jobs-table")
        rows = page.locator("#jobs-table tbody tr")
        listed = {rows.nth(i).get_attribute("data-job") for i in range(rows.count())}
        assert v1 not in listed and {v2, v3} <= listed
        page.click("#companions-toggle")
        page.wait_for_selector(f'#jobs-table tr[data-job="{v1}"]')
        assert page.locator("#jobs-table tbody tr").count() == len(listed) + 1
        _open_job(page, server, v3)
        companions = page.locator("#companions-table tbody tr")
        assert companions.count() == 1 and companions.first.get_attribute("data-job") == v1
        assert companions.first.locator("td").first.text_content() == "golden"
        _open_job(page, server, v1)
        assert page.text_content("#serves") == f"Companion version: the golden run of {v3}"
    finally:
        with db.connect(url) as conn:
            conn.execute("DELETE FROM bi.companion_versions WHERE companion = %s", (v1,))
