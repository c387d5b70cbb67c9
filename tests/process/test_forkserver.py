"""The warm start (gpu_runner.forkserver): what a forked worker gets is what ``subprocess.Popen`` of
a fresh interpreter gives it, on real processes.

The fleet's exit codes, restarts, SIGTERM/SIGKILL/SIGSTOP paths run both ways in
tests/process/test_fleet.py; the real ``python -m gpu_runner`` runs as a fork in the chaos, nights
and local-launcher files (tests/process/test_chaos.py, test_nights*.py, test_worker_deaths.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from batch_inference.fleet import Fleet
from gpu_runner import forkserver
from gpu_runner.forkserver import ForkServer, ForkServerError

# What a process says about itself: one JSON line.
REPORT = """
import json, os, subprocess, sys
print(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "stdin": [os.fstat(0).st_dev, os.fstat(0).st_ino],
    "sid": os.getsid(0), "pgid": os.getpgid(0),
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
    "env": {k: os.environ.get(k) for k in ("BI_TEST_ONLY_HERE", "BI_TEST_GONE", "PYTHONUNBUFFERED")},
    "c_env": subprocess.run(["sh", "-c", "echo ${BI_TEST_ONLY_HERE:-unset} ${BI_TEST_GONE:-unset}"],
                            capture_output=True, text=True).stdout.split(),
    "warm": "psycopg" in sys.modules and "batch_inference.spec" in sys.modules,
    "engines": sorted(m for m in ("torch", "vllm", "llama_cpp", "airflow") if m in sys.modules),
    "sigint": str(__import__("signal").getsignal(__import__("signal").SIGINT)),
    "sigterm": str(__import__("signal").getsignal(__import__("signal").SIGTERM)),
}), flush=True)
"""


@pytest.fixture(scope="module")
def server():
    s = ForkServer.start({**os.environ, "PYTHONUNBUFFERED": "1", "BI_TEST_GONE": "server's"})
    yield s
    s.close()
    assert not s.alive()


def run(server: ForkServer, code: str, *args: str, env: dict | None = None, new_session: bool = False):
    env = {**server.env, **(env or {})}
    p = server.spawn([sys.executable, "-c", code, *args], env, new_session=new_session)
    out = p.stdout.read()
    return p, p.wait(30), out


def test_a_fork_gets_its_own_environment_argv_cwd_and_signals_and_none_of_the_servers(server, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in server.env.items() if k != "BI_TEST_GONE"} | {"BI_TEST_ONLY_HERE": "worker's"}
    p = server.spawn([sys.executable, "-c", REPORT, "one", "two"], env)
    r = json.loads(p.stdout.read())
    assert p.wait(30) == 0 and r["pid"] == p.pid != server.pid and r["ppid"] == server.pid
    assert r["stdin"] == [os.fstat(0).st_dev, os.fstat(0).st_ino]     # the caller's, as Popen's child gets it
    assert r["argv"] == ["-c", "one", "two"] and r["cwd"] == str(tmp_path) and r["path0"] == ""
    # os.environ and the C environment (a child of the worker inherits it) are the worker's, not the server's
    assert r["env"] == {"BI_TEST_ONLY_HERE": "worker's", "BI_TEST_GONE": None, "PYTHONUNBUFFERED": "1"}
    assert r["c_env"] == ["worker's", "unset"]
    # warm: the worker's imports are there; no engine is
    assert r["warm"] and r["engines"] == []
    assert r["sigint"] == str(signal.default_int_handler) and r["sigterm"] == str(signal.SIG_DFL)
    # the caller's process group, or a session of its own when asked
    assert r["pgid"] == os.getpgid(0)
    p = server.spawn([sys.executable, "-c", REPORT], env, new_session=True)
    r = json.loads(p.stdout.read())
    assert p.wait(30) == 0 and r["sid"] == r["pid"] == r["pgid"]


def test_exit_codes_signals_and_the_interpreter_exit_are_those_of_a_process_of_its_own(server):
    assert run(server, "import sys; sys.exit(7)")[1] == 7
    p, code, out = run(server, "raise ValueError('boom')")
    assert code == 1 and "ValueError: boom" in out
    # atexit handlers and non-daemon threads finish before the exit, as in a fresh interpreter
    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done', flush=True))).start()\n"
            "sys.exit(3)")
    p, rc, out = run(server, code)
    assert rc == 3 and out.splitlines() == ["thread done", "atexit ran"]
    assert p.cpu_s is not None and p.cpu_s >= 0
    for sig in (signal.SIGSEGV, signal.SIGKILL, signal.SIGTERM):
        p = server.spawn([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"], server.env)
        assert p.stdout.readline() == "up\n"
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.05)
        os.kill(p.pid, sig)
        assert p.wait(30) == -sig
    # the server's own Ctrl-C and SIGTERM are ignored: it outlives them and keeps serving
    os.kill(server.pid, signal.SIGINT)
    os.kill(server.pid, signal.SIGTERM)
    assert run(server, "print('still here')")[2] == "still here\n" and server.alive()


def test_a_child_whose_server_died_is_watched_by_its_pid_until_it_is_gone():
    lone = ForkServer.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    p = lone.spawn([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"], lone.env)
    assert p.stdout.readline() == "up\n"
    os.kill(lone.pid, signal.SIGKILL)
    lone.close()
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(30) == forkserver.LOST


def test_the_environment_the_server_fixed_at_its_start_decides_which_server_a_worker_needs(server, tmp_path):
    # what the interpreter and the preload read at the server's start: its own, and those the preload read
    assert {"PYTHONUNBUFFERED", "PSYCOPG_IMPL"} <= server.fixed
    assert server.fits({**server.env, "BATCH_INFERENCE_DB": "postgresql://elsewhere/x", "BI_TEST_ONLY_HERE": "x"})
    assert not server.fits({**server.env, "PYTHONPATH": str(tmp_path)})
    assert not server.fits({**server.env, "PSYCOPG_IMPL": "python"})
    assert not server.fits({**server.env, "TZ": "BI-test-zone"})
    # a worker whose PYTHONPATH differs gets a server of its own, which imports from there
    (tmp_path / "bi_test_marker.py").write_text("WHERE = 'from the worker PYTHONPATH'\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    other, new = forkserver.server_for(env)
    try:
        assert new and other is not server and other.fits(env)
        assert forkserver.server_for(env) == (other, False)
        p = other.spawn([sys.executable, "-c", "import bi_test_marker; print(bi_test_marker.WHERE)"], env)
        assert p.stdout.read() == "from the worker PYTHONPATH\n" and p.wait(30) == 0
    finally:
        forkserver.close_all()
    assert not other.alive()


def test_the_real_worker_runs_as_a_fork_and_says_what_is_wrong_as_it_would_alone(server):
    """``python -m gpu_runner`` with a bad option: the same one line and exit 2 as a fresh interpreter."""
    argv = ["-m", "gpu_runner", "job", "--flush-every", "many"]
    p = server.spawn([sys.executable, *argv], server.env)
    forked = p.stdout.read(), p.wait(30)
    alone = subprocess.run([sys.executable, *argv], env=server.env, capture_output=True, text=True, timeout=60)
    assert forked == (alone.stderr, alone.returncode) and forked[1] == 2
    assert "--flush-every: invalid int value: 'many'" in forked[0]


def test_a_server_that_cannot_start_safely_leaves_the_fleet_on_popen_and_the_log_says_so(tmp_path, caplog):
    """A preload that starts a thread (here a sitecustomize on the workers' PYTHONPATH does) is not safe to
    fork: the server refuses, naming why, and the fleet starts its workers with ``subprocess.Popen``."""
    caplog.set_level(logging.INFO, logger="batch_inference.fleet")
    (tmp_path / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    with pytest.raises(ForkServerError, match="started 1 thread"):
        ForkServer.start(env)
    fleet = Fleet([], env, 1, echo=False, start_method="forkserver")
    fleet.command = lambda name: [sys.executable, "-c", "print('hello', flush=True)"]   # type: ignore[method-assign]
    fleet.start_all()
    end = time.monotonic() + 60
    while fleet.active():
        assert time.monotonic() < end
        fleet.poll(restart=False)
        fleet.wait(1)
    assert [e.code for e in fleet.exits] == [0] and list(fleet.exits[0].worker.tail) == ["hello"]
    assert fleet.start_method == "popen"
    assert any("fork server unavailable" in m and "started 1 thread" in m for m in caplog.messages), caplog.messages
    assert any(m.endswith("(popen)") and "started pid" in m for m in caplog.messages)
    with pytest.raises(ValueError, match="BATCH_INFERENCE_WORKER_START"):
        Fleet([], env, 1, start_method="spawn")
