"""The demo as a user types it: the installed ``batch-inference demo`` under a home of its own, its
embedded PostgreSQL, ``airflow dags test`` on a SQLite metadata database (issues 39 and 45).

* It says what it does (the migrations listed once, the cutoff with its date, the fallback in plain
  words, where its PostgreSQL keeps running and how to stop it), and ``eval "$(batch-inference demo env
  --dags-folder DIR)"`` runs a DAG of one's own (not an example) the way the demo ran its own, over a
  SQLite table of the user's own behind an ``AIRFLOW_CONN_...`` connection; then ``batch-inference db
  down`` (issue 39, item 3).
* Interrupted with Ctrl-C (SIGINT to its process group) while its DAG run works, the demo leaves that
  run marked running in Airflow's metadata; the next demo names it, marks it failed and finishes,
  instead of waiting at ``submit`` for it without a word (issue 45, item 1).
* A second demo under the same home while one runs is refused in one line (issue 45, item 2).
* Where the CPU probe finds that nothing generates (forced: the probe child dies by SIGSEGV either
  way), the demo ends non-zero at once with one line naming the CPU and the cause (issue 45, item 4's
  first trap).

One demo is interrupted and one run again under the same home, and the second is the one whose words
and environment are checked: a third demo would prove nothing the second does not.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
import yaml

from batch_inference.data import NOOP_MODEL

BIN = Path(sys.executable).parent
BI = str(BIN / "batch-inference")
DAG_ID = "my_reviews_triage"
SCHEMA = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]},
                                           "rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
          "required": ["sentiment", "rating"], "additionalProperties": False}


def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the demo's process: a suite started in the background by a shell
    without job control ignores SIGINT, every child inherits that, and Python then installs no
    KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: nothing of the test process's Airflow settings or ledger URL."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "BATCH_INFERENCE_DB", "BATCH_INFERENCE_HOME", "_AIRFLOW"))}
    return {**env, "BATCH_INFERENCE_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


def runs(home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(home / "airflow" / "airflow.db") as c:
        return c.execute("SELECT run_id, state FROM dag_run WHERE dag_id = 'batch_inference_backfill' "
                         "ORDER BY id").fetchall()


def db_down(env: dict[str, str]) -> None:
    subprocess.run([BI, "db", "down"], env=env, capture_output=True, text=True, timeout=120)


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


def test_the_demo_says_what_it_does_runs_again_after_an_interrupt_and_its_env_runs_a_dag_of_ones_own(tmp_path):
    """Merged from test_a_rerun_after_an_interrupted_demo_names_and_clears_the_run_it_left_behind and
    test_the_demo_says_what_it_does_and_its_env_runs_a_dag_of_ones_own (test_demo_env.py): the words are
    checked on the demo that runs again, the environment under the home both demos used."""
    home = tmp_path / "home"
    env = user_env(home)
    try:
        args = [BI, "demo", "--engine", "noop", "--records", "40", "--shard-size", "5"]
        first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal)
        seen = []
        assert first.stdout is not None
        for line in first.stdout:
            seen.append(line)
            if "starting task workers" in line or "starting 2 local" in line:
                break
        else:
            pytest.fail("".join(seen)[-3000:])
        os.killpg(first.pid, signal.SIGINT)            # Ctrl-C in the user's terminal
        seen.append(first.communicate(timeout=120)[0])
        # The demo ends `airflow dags test` (which goes on after a Ctrl-C of its own) and says so in one line.
        assert first.returncode == 130 and "batch-inference demo: interrupted; `airflow dags test` ended" in seen[-1], \
            "".join(seen)[-3000:]
        # One migration list, on the demo that applied them.
        assert "".join(seen).count("0001_initial.sql") == 1, "".join(seen)
        left = [r for r in runs(home) if r[1] in ("running", "queued")]
        assert left, runs(home)                          # what the interrupted demo left behind

        # Another demo running under this home: refused in one line, nothing done.
        with open(home / "airflow" / ".demo.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lock.seek(0)
            lock.truncate()
            lock.write("4242")
            lock.flush()
            busy = subprocess.run([BI, "demo", "--engine", "noop", "--records", "8"], env=env, capture_output=True,
                                  text=True, timeout=120)
        assert busy.returncode == 1 and busy.stdout == ""
        assert busy.stderr.strip().splitlines() == [
            f"batch-inference demo: error: another demo is running under {home} (pid 4242); wait for it to end "
            "or stop it, then run the demo again"], busy.stderr

        t0 = time.monotonic()
        # The same demo again: the same job version, which the run left behind still works on for Airflow.
        again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        said = again.stdout + again.stderr
        assert again.returncode == 0, said[-3000:]
        assert f"left its Airflow run {left[0][0]}" in again.stderr and "marked it failed" in again.stderr, said
        assert "already submitted" in said and "being worked by the earlier run" not in said, said
        assert "published view: published.ticket_triage" in again.stdout
        assert time.monotonic() - t0 < 300
        states = dict(runs(home))
        assert states[left[0][0]] == "failed" and list(states.values()).count("success") == 1, states
        # The cutoff with its date, in plain words; the fallback without jargon.
        assert "so the cutoff is 20" in said and " UTC for the deadline 20" in said, said
        assert "not needed, every record is done" in said and "re-drive" not in said, said
        # Where its PostgreSQL keeps running and how to stop it; how to run one's own DAG the same way.
        assert f"The embedded PostgreSQL keeps running (data under {home.resolve() / 'pg'})" in again.stdout
        assert f"stop it with: BATCH_INFERENCE_HOME={home} batch-inference db down" in again.stdout
        assert 'eval "$(batch-inference demo env --dags-folder YOUR_DAGS)"' in again.stdout

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


@pytest.mark.slow
def test_the_demo_on_a_cpu_where_llama_cpp_cannot_run_ends_at_once_in_one_line(tmp_path):
    pytest.importorskip("llama_cpp")
    from batch_inference.engines.cpu_probe import CACHE_ENV, FAULT_ENV, this_cpu

    home = tmp_path / "home"
    env = user_env(home, **{FAULT_ENV: "all", CACHE_ENV: str(tmp_path / "cpu-probe.json")})
    try:
        t0 = time.monotonic()
        demo = subprocess.run([BI, "demo", "--records", "4"], env=env, capture_output=True, text=True, timeout=600)
        took = time.monotonic() - t0
        assert demo.returncode == 1, (demo.stdout + demo.stderr)[-3000:]
        errors = [ln for ln in demo.stderr.splitlines() if ln.startswith("batch-inference demo: error:")]
        assert len(errors) == 1, demo.stderr[-3000:]
        assert "halted" in errors[0] and "cannot run SmolLM2-135M-Instruct.Q4_1.gguf on this CPU" in errors[0]
        assert this_cpu().model in errors[0] and "SIGSEGV" in errors[0]
        assert took < 300, took                      # not the 20-hour deadline
        assert "published view" not in demo.stdout
    finally:
        db_down(env)
