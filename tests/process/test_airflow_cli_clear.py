"""``airflow tasks clear`` from the command line on a DAG with a ``DAGRUN_QUEUED_AT`` Deadline Alert.

Airflow 3.3.2's clear recomputes the run's deadlines and fails on the stored
interval (apache/airflow#70368, "unsupported type for timedelta seconds
component: dict"). The dashboard plugin applies
``batch_inference.airflow_fixes`` when Airflow loads it, which every Airflow
process does before it reads a DAG (the CLI included), so the command works.
Real processes of this interpreter's ``airflow`` command on a SQLite metadata
database (the session's, as ``airflow db migrate`` left it, copied in); the DAGs
folder holds a copy of the backfill DAG with its alert on.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

from tests.fixtures.airflow_env import DAGS, airflow_env

AIRFLOW = str(Path(sys.executable).with_name("airflow"))
DAG_ID = "batch_inference_backfill"
LOGICAL = "2026-11-01T22:00:00+00:00"


def cli_env(home: Path, dags: Path) -> dict[str, str]:
    """A clean environment for ``home``: the test process's own Airflow settings left out, the
    Deadline Alert on (as a deployed DAG processor has it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "BATCH_INFERENCE_"))}
    env.update({k: v for k, v in airflow_env(home).items() if not k.startswith("BATCH_INFERENCE_")})
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags)
    return env


def airflow(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AIRFLOW, *args], env=env, capture_output=True, text=True, timeout=300)


def test_airflow_tasks_clear_works_on_a_dag_with_a_queued_at_deadline_alert(tmp_path, migrated_airflow_db):
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAGS / f"{DAG_ID}.py", dags)
    env = cli_env(tmp_path / "home", dags)
    (tmp_path / "home").mkdir()
    shutil.copyfile(migrated_airflow_db, tmp_path / "home" / "airflow.db")     # `airflow db migrate`, once a session
    for step in (("dags", "reserialize"),
                 ("dags", "trigger", DAG_ID, "-r", "cli_clear", "-l", LOGICAL)):
        out = airflow(env, *step)
        assert out.returncode == 0, f"airflow {' '.join(step)}: {out.stdout[-1500:]}{out.stderr[-3000:]}"

    # The command docs/airflow.md gives: one run (by its logical date), the task and what follows it.
    out = airflow(env, "tasks", "clear", DAG_ID, "-t", "workers", "-d", "-s", LOGICAL, "-e", LOGICAL, "-y")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unsupported type for timedelta" not in out.stdout + out.stderr
    assert "workaround for apache/airflow#70368" in out.stdout + out.stderr     # the plugin applied it

    # The run as the metadata database holds it after the clear (what `airflow dags list-runs` prints).
    with closing(sqlite3.connect(tmp_path / "home" / "airflow.db")) as db:
        runs = db.execute("SELECT run_id, state FROM dag_run WHERE dag_id = ?", (DAG_ID,)).fetchall()
    assert runs == [("cli_clear", "queued")]
