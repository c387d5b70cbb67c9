"""The process fleet (batch_inference.fleet) on real processes that stand in for the worker.

Each process runs a short script instead of ``python -m gpu_runner`` (the one
method the test overrides), so every exit code and signal path is exercised
without a database, each both ways the fleet starts a process (``start_method``:
a fork of the warm server, ``subprocess.Popen``; tests/process/test_forkserver.py
checks what a fork gets). LocalWorkersOperator and the chaos harness run the real
worker on it (tests/integration/test_airflow_operators.py, tests/process/test_chaos.py).
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from batch_inference.exits import FATAL, ExitCode
import pytest

from batch_inference.fleet import START_METHODS, Action, Fleet

# argv: exit:N (print, exit N) | hold (print "ready", sleep; SIGTERM exits 143) | deaf (ignore SIGTERM, sleep)
SCRIPT = """
import signal, sys, time
what = sys.argv[1]
print("hello from", sys.argv[2], flush=True)
if what.startswith("exit:"):
    sys.exit(int(what[5:]))
if what == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
print("ready", flush=True)
time.sleep(120)
"""


class ScriptFleet(Fleet):
    def command(self, name: str) -> list[str]:
        argv = self.argv(name) if callable(self.argv) else self.argv
        return [sys.executable, "-c", SCRIPT, *argv, name]


def run_until_settled(fleet: Fleet, on_exit=None, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while fleet.active():
        assert time.monotonic() < end, "the fleet never settled"
        fleet.poll(on_exit=on_exit)
        fleet.wait(5)


def wait_for_line(fleet: Fleet, slot: int, text: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not any(text in line for line in fleet.workers[slot].tail):
        assert time.monotonic() < end, f"no {text!r} from slot {slot}"
        time.sleep(0.05)


def by_generation(*plan: str):
    """argv for a worker named wS-gG: the G-th entry of ``plan`` (the last one from then on)."""
    return lambda name: [plan[min(int(name.rsplit("g", 1)[1]), len(plan) - 1)]]


def gen_name(slot: int, gen: int) -> str:
    return f"w{slot}-g{gen}"


@pytest.fixture(params=START_METHODS)
def start(request):
    """The fleet's start method under test (its log names it at each start)."""
    return request.param


def test_preempted_and_engine_crashed_slots_restart_and_a_clean_exit_ends_the_slot(caplog, start):
    caplog.set_level(logging.INFO, logger="batch_inference.fleet")
    fleet = ScriptFleet(by_generation("exit:143", "exit:5", "exit:1", "exit:0"), {}, 2, name=gen_name,
                        fatal=FATAL, max_restarts=3, start_method=start)
    seen = []
    fleet.start_all()
    run_until_settled(fleet, seen.append)
    codes = sorted((e.worker.slot, e.worker.gen, e.code, e.action) for e in seen)
    assert codes == [(s, g, c, a) for s in (0, 1) for g, c, a in (
        (0, 143, Action.RESTART), (1, ExitCode.ENGINE, Action.RESTART), (2, 1, Action.RESTART), (3, 0, Action.DONE))]
    assert fleet.restarts == [3, 3] and fleet.started == 8 and fleet.exits == seen
    assert seen[0].preempted and seen[0].label == "143"
    # each line streamed with the worker's name as prefix
    assert "[w0-g2] hello from w0-g2" in caplog.messages
    # and the start of each, with how it started
    how = "fork of server" if start == "forkserver" else "popen"
    started = [m for m in caplog.messages if " started pid " in m]
    assert len(started) == 8 and all(m.endswith(")") and f"({how}" in m for m in started), started


def test_a_fatal_exit_is_reported_and_not_restarted(start):
    fleet = ScriptFleet(["exit:3"], {}, 1, fatal=FATAL, max_restarts=3, start_method=start)
    fleet.start_all()
    run_until_settled(fleet)
    (e,) = fleet.exits
    assert (e.code, e.action, fleet.restarts, fleet.started) == (ExitCode.DIGEST, Action.FATAL, [0], 1)
    assert list(e.worker.tail) == ["hello from w0"]


def test_a_slot_out_of_restarts_gives_up(start):
    fleet = ScriptFleet(["exit:1"], {}, 1, fatal=FATAL, max_restarts=2, start_method=start)
    fleet.start_all()
    run_until_settled(fleet)
    assert [e.action for e in fleet.exits] == [Action.RESTART, Action.RESTART, Action.GAVE_UP]
    assert not fleet.exits[-1].expected


def test_stop_terms_then_kills_after_the_grace_and_restarts_nothing(tmp_path, start):
    fleet = ScriptFleet(lambda name: ["deaf" if name == "w1" else "hold"], {}, 2, log_dir=tmp_path,
                        start_method=start)
    fleet.start_all()
    for slot in (0, 1):
        wait_for_line(fleet, slot, "ready")
    t0 = time.monotonic()
    exits = fleet.stop(grace=1.0)
    assert time.monotonic() - t0 < 30
    got = {e.worker.name: (e.label, e.action, e.expected) for e in exits}
    assert got == {"w0": ("143", Action.STOPPED, True), "w1": ("SIGKILL", Action.STOPPED, True)}
    assert not fleet.alive() and not fleet.active() and fleet.started == 2
    assert fleet.start(0) is None                         # nothing starts once stopping
    assert (tmp_path / "w0.log").read_text() == "hello from w0\nready\n"


def test_a_stopped_worker_is_continued_before_its_sigterm(start):
    fleet = ScriptFleet(["hold"], {}, 1, start_method=start)
    fleet.start_all()
    wait_for_line(fleet, 0, "ready")
    w = fleet.workers[0]
    assert fleet.signal(w, signal.SIGSTOP) and w.stopped
    (e,) = fleet.stop(grace=20)
    assert (e.code, e.expected, w.stopped) == (143, True, False)


def test_wait_wakes_when_a_worker_exits(start):
    fleet = ScriptFleet(["exit:0"], {}, 1, start_method=start)
    fleet.start_all()
    t0 = time.monotonic()
    fleet.wait(60)                  # woken by the end of the worker's output, not the timeout
    assert time.monotonic() - t0 < 30
    run_until_settled(fleet)
    assert [e.action for e in fleet.exits] == [Action.DONE]


def test_the_fleet_and_the_chaos_harness_do_not_import_airflow():
    import subprocess

    code = ("import sys, batch_inference.fleet, batch_inference.chaos; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'airflow'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_a_worker_ended_by_force_has_its_leases_released_by_the_fleet_under_load(conn, db_url):
    """A worker that does not leave on SIGTERM in time (a loaded machine: here it ignores SIGTERM) is
    killed at the end of the grace; the launcher's ``on_killed`` then releases what it still held, in
    one statement fenced by owner and epoch: its two shards are pending at once, and a shard that
    another worker re-claimed after its lease expired is left to that worker."""
    import subprocess

    from batch_inference.fleet import release_leases
    from batch_inference.ledger import Ledger, new_owner_id
    from batch_inference.plan import submit
    from tests.conftest import make_source, make_spec, tickets

    make_source(conn, tickets(30))
    job = submit(conn, make_spec(shard_size=10, lease_seconds=600)).job_version
    owners: dict[str, str] = {}
    fleet = ScriptFleet(["deaf"], {}, 1, worker_ids=lambda name: owners.setdefault(name, new_owner_id("local-w")),
                        on_killed=lambda w: released.extend(release_leases(conn, job, w.owner)))
    released: list[int] = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]   # the load
    try:
        fleet.start_all()
        wait_for_line(fleet, 0, "ready")
        assert fleet.workers[0].owner == owners["w0"]
        mine = Ledger(conn, job, owners["w0"], "batch", 600)
        held = [mine.claim(), mine.claim(), mine.claim()]
        # The third lease expired and another worker claimed that shard: a new epoch, not ours to release.
        conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                     "WHERE job_version = %s AND shard_no = %s", (job, held[2].shard_no))
        other = Ledger(conn, job, "other-worker", "batch", 600).claim()
        assert other.shard_no == held[2].shard_no and other.epoch == held[2].epoch + 1
        (e,) = fleet.stop(grace=0.5)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert e.code == -signal.SIGKILL
    assert released == sorted(lease.shard_no for lease in held[:2])
    states = {r["shard_no"]: (r["state"], r["lease_owner"]) for r in conn.execute(
        "SELECT shard_no, state, lease_owner FROM bi.shards WHERE job_version = %s", (job,))}
    assert states[held[0].shard_no] == states[held[1].shard_no] == ("pending", None)
    assert states[held[2].shard_no] == ("leased", "other-worker")
