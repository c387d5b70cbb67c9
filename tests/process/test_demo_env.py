"""The demo says what it does, and a DAG of one's own runs as the demo ran its own (issue 39, item 3).

As a user types it: the installed ``batch-inference demo`` (noop engine, a few tickets) on an embedded
PostgreSQL under a home of its own, then ``eval "$(batch-inference demo env --dags-folder DIR)"`` and
``airflow dags test`` of a DAG that is not an example, over a SQLite table of the user's own behind an
``AIRFLOW_CONN_...`` connection, then ``batch-inference db down``."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import yaml

from batch_inference.data import NOOP_MODEL

BIN = Path(sys.executable).parent
BI = str(BIN / "batch-inference")
DAG_ID = "my_reviews_triage"
SCHEMA = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]},
                                           "rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
          "required": ["sentiment", "rating"], "additionalProperties": False}


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: nothing of the test process's Airflow settings or ledger URL."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "BATCH_INFERENCE_DB", "BATCH_INFERENCE_HOME", "_AIRFLOW"))}
    return {**env, "BATCH_INFERENCE_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


def own_reviews(tmp_path: Path) -> tuple[Path, Path, str]:
    """A SQLite file of 12 reviews (title, body), the spec over it, and the user's own DAG folder."""
    path = tmp_path / "reviews.db"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE reviews (review_id TEXT, title TEXT, body TEXT)")
        c.executemany("INSERT INTO reviews VALUES (?, ?, ?)",
                      [(f"r{i:02d}", f"Blender {i}", f"Loud but it works, day {i}.") for i in range(12)])
    spec = {"dataset": "my_reviews",
            "source": {"kind": "sql", "conn_id": "my_reviews", "table": "reviews", "id_column": "review_id",
                       "columns": ["title", "body"]},
            "model": dict(NOOP_MODEL), "engine": {"name": "noop"},
            "prompt": {"version": "v1", "system": "Label the review.",
                       "template": "Title: <<<{title}>>>\nReview: <<<{body}>>>"},
            "output_schema": SCHEMA, "shard_size": 5}
    spec_path = tmp_path / "my_reviews.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    dags = tmp_path / "my_dags"
    dags.mkdir()
    (dags / f"{DAG_ID}.py").write_text(textwrap.dedent(f'''
        # A user's own DAG (airflow, dag): the pipeline over their spec.
        from airflow.sdk import DAG

        from batch_inference.operators.pipeline import (
            batch_inference_pipeline, local_workers, pipeline_dag_args, pipeline_params)

        with DAG(dag_id="{DAG_ID}", schedule=None, params=pipeline_params(spec_path={str(spec_path)!r}, workers=1),
                 **pipeline_dag_args()):
            batch_inference_pipeline(dataset="my_reviews", workers=local_workers())
    '''))
    return path, dags, json.dumps({"conn_type": "sqlite", "host": str(path)})


def test_the_demo_says_what_it_does_and_its_env_runs_a_dag_of_ones_own(tmp_path):
    home = tmp_path / "home"
    env = user_env(home)
    try:
        demo = subprocess.run([BI, "demo", "--engine", "noop", "--records", "8"], env=env, capture_output=True,
                              text=True, timeout=600)
        said = demo.stdout + demo.stderr
        assert demo.returncode == 0, said[-3000:]
        # One migration list; the cutoff with its date, in plain words; the fallback without jargon.
        assert said.count("0001_initial.sql") == 1, said
        assert "so the cutoff is 20" in said and " UTC for the deadline 20" in said, said
        assert "not needed, every record is done" in said and "re-drive" not in said, said
        # Where its PostgreSQL keeps running and how to stop it; how to run one's own DAG the same way.
        assert f"The embedded PostgreSQL keeps running (data under {home.resolve() / 'pg'})" in demo.stdout
        assert f"stop it with: BATCH_INFERENCE_HOME={home} batch-inference db down" in demo.stdout
        assert 'eval "$(batch-inference demo env --dags-folder YOUR_DAGS)"' in demo.stdout

        _, dags, conn_json = own_reviews(tmp_path)
        printed = subprocess.run([BI, "demo", "env", "--dags-folder", str(dags)], env=env, capture_output=True,
                                 text=True, timeout=300)
        assert printed.returncode == 0, printed.stderr
        exports = [ln for ln in printed.stdout.splitlines() if not ln.startswith("#")]
        assert all(ln.startswith("export ") for ln in exports) and any(
            ln.startswith(("export AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT=")) for ln in exports), printed.stdout
        assert f"export AIRFLOW__CORE__DAGS_FOLDER={dags}" in exports
        run = subprocess.run(["bash", "-c", f'eval "$("{BI}" demo env --dags-folder "{dags}")" && '
                                            f"airflow dags test {DAG_ID}"],
                             env={**env, "AIRFLOW_CONN_MY_REVIEWS": conn_json}, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        url = subprocess.run([BI, "db", "url"], env=env, capture_output=True, text=True, timeout=60).stdout.strip()
        with psycopg.connect(url) as c:
            rows = c.execute("SELECT count(*) FROM published.my_reviews").fetchone()[0]
        assert rows == 12
        shown = subprocess.run([BI, "published", "my_reviews", "--json"], env=env, capture_output=True, text=True,
                               timeout=60)
        assert json.loads(shown.stdout)["view"] == "published.my_reviews"
    finally:
        down = subprocess.run([BI, "db", "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.stderr.strip().endswith(("stopped", "not running")), down.stderr
