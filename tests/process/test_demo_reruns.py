"""The demo run again after one was interrupted, beside another, and on a CPU where llama.cpp cannot run
(issue 45, items 1, 2 and 4's first trap). As a user types it: the installed ``batch-inference demo``
under a home of its own, its embedded PostgreSQL, ``airflow dags test`` on a SQLite metadata database.

* Interrupted with Ctrl-C (SIGINT to its process group) while its DAG run works, the demo leaves that
  run marked running in Airflow's metadata; the next demo names it, marks it failed and finishes,
  instead of waiting at ``submit`` for it without a word.
* A second demo under the same home while one runs is refused in one line.
* Where the CPU probe finds that nothing generates (forced: the probe child dies by SIGSEGV either
  way), the demo ends non-zero at once with one line naming the CPU and the cause.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
BI = str(BIN / "batch-inference")


def user_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "BATCH_INFERENCE_DB", "BATCH_INFERENCE_HOME", "_AIRFLOW"))}
    return {**env, "BATCH_INFERENCE_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


def runs(home: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(home / "airflow" / "airflow.db") as c:
        return c.execute("SELECT run_id, state FROM dag_run WHERE dag_id = 'batch_inference_backfill' "
                         "ORDER BY id").fetchall()


def db_down(env: dict[str, str]) -> None:
    subprocess.run([BI, "db", "down"], env=env, capture_output=True, text=True, timeout=120)


def test_a_rerun_after_an_interrupted_demo_names_and_clears_the_run_it_left_behind(tmp_path):
    home = tmp_path / "home"
    env = user_env(home)
    try:
        args = [BI, "demo", "--engine", "noop", "--records", "40", "--shard-size", "5"]
        first = subprocess.Popen(args, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        seen = []
        assert first.stdout is not None
        for line in first.stdout:
            seen.append(line)
            if "starting task workers" in line or "starting 2 local" in line:
                break
        else:
            pytest.fail("".join(seen)[-3000:])
        os.killpg(first.pid, signal.SIGINT)            # Ctrl-C in the user's terminal
        first.communicate(timeout=120)
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
    finally:
        db_down(env)


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
