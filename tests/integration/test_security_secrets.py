"""Secrets in output, tried as an attacker reading logs would.

Every database URL in this suite carries a password (``TEST_PASSWORD``, see
``tests.fixtures.password_check``, which also fails any test whose output
shows it). Here each way a URL or connection string reaches a message is
tried with its own vectors: SQLAlchemy dialect forms (accepted), unusable
URLs (one line, exit 2 from the CLI, exit 4 from the worker), an unreachable
server, the chaos command and its report, the Airflow hook, the openai
engine's endpoint URL (httpx logs every request URL) and the on-call webhook.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batch_inference import cli, db
from batch_inference.callbacks import build_message, deliver
from batch_inference.exits import ExitCode
from batch_inference.plan import submit
from gpu_runner import worker
from tests.conftest import make_source, make_spec, tickets
from tests.process.test_engines import scripted  # noqa: F401 (a fixture: a loopback chat-completions server)
from tests.fixtures.password_check import TEST_PASSWORD

REPO = Path(__file__).resolve().parents[2]
SECRET = "Xq9-s3cr3t-Vv2"      # the password the unusable URLs carry (never a working one)


def _dialect(db_url: str, scheme: str) -> str:
    assert db_url.startswith("postgresql://") and TEST_PASSWORD in db_url
    return scheme + "://" + db_url[len("postgresql://"):]


def _socket(db_url: str) -> str:
    return re.search(r"host=([^&]+)", db_url).group(1)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=str(REPO),
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _no_secret(text: str, *secrets: str) -> None:
    for s in (TEST_PASSWORD, SECRET, *secrets):
        assert s not in text, text[-2000:]


# -- dialect forms: accepted everywhere a URL comes in -----------------------------

DIALECTS = ["postgresql+psycopg2", "postgresql+psycopg", "postgres", "postgresql", "PostgreSQL+Psycopg2",
            "postgres+asyncpg"]


@pytest.mark.parametrize("scheme", DIALECTS)
def test_dialect_urls_work_in_process(conn, db_url, scheme, capsys):
    make_source(conn, tickets(3))
    job = submit(conn, make_spec()).job_version
    url = _dialect(db_url, scheme)
    assert cli.main(["--db", url, "status", job, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 3
    assert cli.main(["--db", url, "db", "url"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("postgres") and "***" in printed       # printed, without the password
    assert worker.run_worker(worker.WorkerConfig(job_version=job, db_url=url, wait_for_leases=False)) == 0


def test_a_sqlalchemy_url_works_for_the_cli_and_a_worker_process(conn, db_url):
    """The finding: ``postgresql+psycopg2://user:pw@...`` made both exit with a
    traceback that printed the password."""
    make_source(conn, tickets(5))
    job = submit(conn, make_spec()).job_version
    url = _dialect(db_url, "postgresql+psycopg2")
    p = _run(["-m", "batch_inference.cli", "--db", url, "status", job])
    assert p.returncode == 0 and "5 outstanding" in p.stdout, p.stderr[-2000:]
    w = _run(["-m", "gpu_runner", job, "--no-wait"], env={db.DB_ENV: url})
    assert w.returncode == 0, w.stderr[-2000:]
    assert "Traceback" not in p.stderr + w.stderr
    _no_secret(p.stdout + p.stderr + w.stdout + w.stderr)


# -- unusable URLs: one line, no password ---------------------------------------------

def _unusable(db_url: str) -> dict[str, str]:
    sock = _socket(db_url)
    return {
        "other_dialect": f"mysql://u:{SECRET}@localhost/ledger",
        "unknown_parameter": f"postgresql://u:{SECRET}@/ledger?host={sock}&badopt=1",
        "bad_percent_in_password": f"postgresql://u:{SECRET}%zz@/ledger?host={sock}",
        "raw_at_in_password": f"postgresql://u:{SECRET}@x@/ledger?host=/nonexistent",
        "conninfo_unknown_keyword": f"host={sock} password={SECRET} nosuch=1",
        "conninfo_unterminated_quote": f"host={sock} password='{SECRET}",
        "no_scheme": f"u:{SECRET}@localhost/ledger",
        "password_parameter": f"postgresql:///ledger?host={sock}&password={SECRET}&sslmode=bogus",
        "bad_sslmode": f"postgresql://u:{SECRET}@/ledger?host={sock}&sslmode=bogus",
        "refused_port": f"postgresql://u:{SECRET}@127.0.0.1:1/ledger?connect_timeout=2",
        "no_such_socket": f"postgresql://u:{SECRET}@/ledger?host=/nonexistent-bi",
    }


UNUSABLE = ["other_dialect", "unknown_parameter", "bad_percent_in_password", "raw_at_in_password",
            "conninfo_unknown_keyword", "conninfo_unterminated_quote", "no_scheme", "password_parameter",
            "bad_sslmode", "refused_port", "no_such_socket"]


@pytest.mark.parametrize("name", UNUSABLE)
def test_an_unusable_url_is_one_line_without_the_password(db_url, name, capsys, caplog):
    url = _unusable(db_url)[name]
    assert cli.main(["--db", url, "status", "jv_x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("batch-inference status: error: "), err
    assert "database" in err and "Traceback" not in err
    with caplog.at_level(logging.INFO):
        code = worker.run_worker(worker.WorkerConfig(job_version="jv_x", db_url=url, db_retries=0))
    assert code in (ExitCode.CONFIG, ExitCode.DB)
    fatal = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(fatal) == 1 and fatal[0].startswith("fatal: ") and "\n" not in fatal[0], fatal
    _no_secret(err + caplog.text, *([f"{SECRET}%zz"] if "percent" in name else []))


def test_unusable_urls_from_the_environment_in_a_worker_and_cli_process(db_url):
    url = _unusable(db_url)["bad_percent_in_password"]
    w = _run(["-m", "gpu_runner", "jv_x"], env={db.DB_ENV: url})
    c = _run(["-m", "batch_inference.cli", "status", "jv_x"], env={db.DB_ENV: url})
    assert (w.returncode, c.returncode) == (ExitCode.CONFIG, 2), w.stderr + c.stderr
    assert "Traceback" not in w.stderr + c.stderr and len(c.stderr.strip().splitlines()) == 1
    _no_secret(w.stdout + w.stderr + c.stdout + c.stderr)


# -- the one redaction ---------------------------------------------------------------------

REDACT = [
    ("postgresql+psycopg2://u:{s}@h/d", "postgresql+psycopg2://u:***@h/d"),
    ("postgres://u:{s}@h:5432/d", "postgres://u:***@h:5432/d"),
    ("postgresql://u:{s}@/d?host=/tmp/x", "postgresql://u:***@/d?host=/tmp/x"),
    ("postgresql://u:p@{s}/x@h/d", "postgresql://u:***@h/d"),
    ("postgresql:///d?host=/tmp/x&password={s}", "postgresql:///d?host=/tmp/x&password=***"),
    ("postgresql:///d?sslpassword={s}&sslmode=require", "postgresql:///d?sslpassword=***&sslmode=require"),
    ("host=/tmp/x password={s} dbname=d", "host=/tmp/x password=*** dbname=d"),
    ("host=/tmp/x password = '{s} \\' x' dbname=d", "host=/tmp/x password = *** dbname=d"),
    ("host=/tmp/x password='{s}", "host=/tmp/x password=***"),
    ("u:{s}@host/d", "u:***@host/d"),
    ("https://api.example.com/v1?key={s}&v=2", "https://api.example.com/v1?key=***&v=2"),
    ("https://user:{s}@api.example.com/v1", "https://user:***@api.example.com/v1"),
    ("postgresql://u@h/d", "postgresql://u@h/d"),
    ("host=h dbname=d", "host=h dbname=d"),
]


@pytest.mark.parametrize("raw,expected", REDACT)
def test_redact_removes_the_password_from_every_form(raw, expected):
    assert db.redact(raw.format(s=SECRET)) == expected


# -- the chaos command ------------------------------------------------------------------

@pytest.mark.chaos
def test_chaos_on_a_given_database_logs_and_reports_it_without_the_password(db_url):
    url = _dialect(db_url, "postgresql+psycopg")
    p = _run(["-m", "batch_inference.cli", "--db", url, "chaos", "--workers", "2", "--records", "60",
              "--shard-size", "20", "--faults", "1", "--seed", "1", "--json"])
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["config"]["db_url"].startswith("postgresql+psycopg://") and "***" in report["config"]["db_url"]
    assert "chaos on --db" in p.stderr and "***" in p.stderr
    _no_secret(p.stdout + p.stderr)


# -- the Airflow hook ---------------------------------------------------------------------

def test_the_hook_logs_and_reports_the_connection_without_its_password(db_url, monkeypatch, capfd, caplog):
    from batch_inference.hooks import BatchInferenceHook

    monkeypatch.setenv("AIRFLOW_CONN_BI_SECRET_LEDGER", db.airflow_connection_json(db_url))
    with caplog.at_level(logging.INFO):
        with BatchInferenceHook("bi_secret_ledger").get_conn() as conn:
            assert conn.execute("SELECT 1 AS one").fetchone()["one"] == 1
    logged = "".join(capfd.readouterr()) + caplog.text     # the hook logs through Airflow's structlog
    assert "connecting to the batch-inference ledger" in logged and "password=***" in logged
    monkeypatch.setenv("AIRFLOW_CONN_BI_SECRET_DOWN", json.dumps(
        {"conn_type": "postgres", "host": "127.0.0.1", "port": 1, "login": "u", "password": SECRET,
         "schema": "d", "extra": {"connect_timeout": "2"}}))
    ok, message = BatchInferenceHook("bi_secret_down").test_connection()
    assert ok is False and "unreachable" in message
    _no_secret(logged + message)


# -- HTTP endpoints: the engine's base URL and the on-call webhook ---------------------

def test_an_engine_url_with_credentials_never_reaches_the_worker_log(conn, db_url, scripted):
    make_source(conn, tickets(4))
    job = submit(conn, make_spec()).job_version
    port = scripted().server_address[1]
    base = f"http://bi:{SECRET}@127.0.0.1:{port}/v1"
    w = _run(["-m", "gpu_runner", job, "--no-wait", "--engine", "openai", "--engine-option", f"base_url={base}",
              "--engine-option", "response_format_style=json_object"], env={db.DB_ENV: db_url})
    assert w.returncode == 0, w.stderr[-2000:]
    assert f"HTTP Request: POST http://127.0.0.1:{port}/v1/chat" in w.stderr     # httpx's own line, redacted
    _no_secret(w.stdout + w.stderr)


def test_an_unreachable_engine_url_is_reported_without_credentials(conn, db_url):
    make_source(conn, tickets(4))
    job = submit(conn, make_spec()).job_version
    base = f"http://bi:{SECRET}@127.0.0.1:1/v1?token={SECRET}T"
    w = _run(["-m", "gpu_runner", job, "--no-wait", "--engine", "openai", "--engine-option", f"base_url={base}",
              "--engine-option", "max_retries=0", "--engine-option", "breaker_failures=2"],
             env={db.DB_ENV: db_url})
    assert w.returncode == ExitCode.ENDPOINT, w.stderr[-2000:]
    assert "endpoint http://127.0.0.1:1/v1?token=***" in w.stderr
    _no_secret(w.stdout + w.stderr, f"{SECRET}T")


@pytest.mark.parametrize("status", [500, 404, None])
def test_a_failing_webhook_never_logs_its_secret_path(scripted, status, caplog):
    port = scripted([(status, {}, {})]).server_address[1] if status else 1
    url = f"http://hook:{SECRET}@127.0.0.1:{port}/services/T0/B0/{SECRET}W?token={SECRET}Q"
    message = build_message(dag_id="d", run_id="r", task_id="t", job_version=None, counts=None, error="e")
    with caplog.at_level(logging.DEBUG):
        deliver(message, webhook_url=url)
    assert "on-call webhook http://127.0.0.1:" in caplog.text
    _no_secret(caplog.text, f"{SECRET}W", f"{SECRET}Q", "/services/")


# -- the suite-wide check itself ---------------------------------------------------------

LEAKY_TESTS = '''
import subprocess, sys
from tests.fixtures.password_check import TEST_PASSWORD

def test_prints_it():
    print("connecting to", TEST_PASSWORD)

def test_logs_it():
    import logging
    logging.getLogger("x").warning("url %s", TEST_PASSWORD)

def test_reads_it_back(capsys):
    print(TEST_PASSWORD)
    capsys.readouterr()

def test_a_subprocess_says_it():
    subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1])", TEST_PASSWORD], capture_output=True)

def test_a_log_file_holds_it(tmp_path):
    (tmp_path / "worker.log").write_text(TEST_PASSWORD)

def test_clean():
    print("nothing secret")
'''


def test_the_suite_fails_a_test_whose_output_shows_the_password(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    p = _run(["-m", "pytest", "-p", "tests.fixtures.password_check", "-q", "--tb=line", "--show-capture=no",
              "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
             env={"PYTHONPATH": str(REPO)})
    assert p.returncode == 1, p.stdout[-2000:]
    # pytest adds the reason after " - " when the terminal is wide enough; the test name is what counts
    flagged = {m.group(1) for line in p.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))
               for m in [re.search(r"::(\w+)", line)] if m}
    assert flagged == {"test_prints_it", "test_logs_it", "test_reads_it_back", "test_a_subprocess_says_it",
                       "test_a_log_file_holds_it"}, p.stdout[-2000:]   # the log file: at teardown
    assert "the test database password appears in" in p.stdout
