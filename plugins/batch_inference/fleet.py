"""Worker processes: N ``python -m gpu_runner`` processes under one supervisor.

``Fleet`` starts one process per slot with the environment it is given
(the database address goes there, as ``BATCH_INFERENCE_DB``), streams each
process's lines (into a log with a ``[name]`` prefix, into
``log_dir/<name>.log``, or both) and keeps the last ones, and collects exits. An exit in ``done`` ends its slot; one in
``fatal`` is reported for the caller to stop everything; any other exit
(a preemption notice handled, an engine crash with its shard given back, a
crash) restarts the slot, up to ``max_restarts`` per slot, after a backoff
that grows with consecutive unexpected exits. ``stop`` sends SIGTERM to
every process (a worker then releases its lease at once) and SIGKILL after
the grace; with ``worker_ids`` each process is started with a ``--worker-id``
of the fleet's choosing, and ``on_killed`` sees each process the fleet ended
by SIGKILL (``release_leases``: a launcher gives back what that worker still
held, so a kill under load costs no lease time). ``scale_to`` changes the number of slots while it runs: new slots start at
once; a removed slot's process gets SIGTERM (a preemption notice: it releases its lease at
once) and is not restarted. The autopilot's launchers reconcile to the ledger with it
(``autopilot.reconcile``).

A process that a signal ended which the fleet did not send (``Exit.died_by``: a fault in
the engine, an OOM kill) is its launcher's to report: ``last_step`` says what it was doing,
``abandon_dead_worker`` gives back what it held at once with that as each shard's last error,
and ``DeathWatch`` tells the same death at the same step with nothing done since, after
which no restart would get further.

A process is a fork of a warm server (``gpu_runner.forkserver``: psycopg, pydantic, the spec
and the worker's modules already imported, no engine) when ``start_method`` is "forkserver"
(the default; ``BATCH_INFERENCE_WORKER_START=popen`` sets the other), or ``subprocess.Popen``
of a fresh interpreter: either way with its own environment, argv, pipe, pid, exit code and
death by signal. A server that cannot start leaves the fleet on ``Popen``; the log says which
started each process.

``LocalWorkersOperator`` runs its task's workers on it and the chaos harness
its workers under injected faults. Does not import Airflow.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from batch_inference.exits import ExitCode
from gpu_runner.forkserver import ForkedProcess, ForkServerError, server_for

# 143: the worker handled SIGTERM (a preemption notice) and released its lease;
# -15: SIGTERM arrived before its handler was installed. Neither is the worker's fault.
PREEMPTED = frozenset({int(ExitCode.PREEMPTED), -signal.SIGTERM})
_SIGNAL_NAMES = {-signal.SIGKILL: "SIGKILL", -signal.SIGTERM: "SIGTERM"}
# How the fleet starts a process: "forkserver" (a fork of a warm server) or "popen" (a fresh interpreter).
START_ENV = "BATCH_INFERENCE_WORKER_START"
START_METHODS = ("forkserver", "popen")


class Action(Enum):
    """What the fleet did about an exit."""

    DONE = "done"              # the exit code is in ``done``: the slot is finished
    RESTART = "restart"        # the slot is started again (after its backoff)
    STOPPED = "stopped"        # the fleet is stopping, or was told not to restart
    FATAL = "fatal"            # the exit code is in ``fatal``: the caller stops the fleet
    GAVE_UP = "gave up"        # the slot was already restarted ``max_restarts`` times


@dataclass(eq=False)
class Worker:
    """One process of a slot (``gen`` counts the slot's processes from 0)."""

    slot: int
    gen: int
    name: str
    popen: subprocess.Popen[str] | ForkedProcess
    started: float
    tail: collections.deque[str]
    reader: threading.Thread | None = None
    sent: int | None = None          # the last signal the fleet sent it
    stopped: bool = False            # SIGSTOPped by the fleet and not yet SIGCONTinued
    code: int | None = None          # its exit code, once collected
    owner: str | None = None         # the --worker-id it was started with (Fleet.worker_ids)

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass(frozen=True)
class Exit:
    worker: Worker
    code: int
    action: Action

    @property
    def label(self) -> str:
        """The exit code, or the signal's name for SIGKILL and SIGTERM."""
        return _SIGNAL_NAMES.get(self.code, str(self.code))

    @property
    def died_by(self) -> str | None:
        """The signal that ended the process ('SIGSEGV'), None for an exit code."""
        return signal_name(self.code)

    @property
    def preempted(self) -> bool:
        return self.code in PREEMPTED

    @property
    def expected(self) -> bool:
        return _expected(self.worker, self.code)


def _expected(w: Worker, code: int) -> bool:
    """0, or what the signal the fleet sent ``w`` last makes a process return."""
    return (code == ExitCode.OK or (w.sent == signal.SIGKILL and code == -signal.SIGKILL)
            or (w.sent == signal.SIGTERM and code in PREEMPTED))


def _slot_name(slot: int, gen: int) -> str:
    return f"w{slot}"


@dataclass
class Fleet:
    """``size`` slots of ``python -m gpu_runner ARGV`` (``argv`` may depend on the worker's name)."""

    argv: Sequence[str] | Callable[[str], Sequence[str]]
    env: Mapping[str, str]
    size: int
    name: Callable[[int, int], str] = _slot_name
    log: logging.Logger | logging.LoggerAdapter = field(default_factory=lambda: logging.getLogger(__name__))
    echo: bool = True                 # worker lines into ``log`` as ``[name] line``
    log_dir: Path | None = None       # and into ``log_dir/<name>.log``
    tail_lines: int = 15
    done: frozenset[int] = frozenset({int(ExitCode.OK)})
    fatal: frozenset[int] = frozenset()
    max_restarts: int | None = None   # per slot; None: no limit
    backoff_s: float = 0.0            # after n consecutive unexpected exits: backoff_s * 2**(n-1) ...
    backoff_max_s: float = 10.0       # ... at most this
    new_session: bool = False         # a session of their own: a Ctrl-C on the caller does not reach them
    worker_ids: Callable[[str], str] | None = None   # name -> the --worker-id (lease owner) of each new process
    on_killed: Callable[[Worker], None] | None = None  # after the fleet ended a process by SIGKILL
    start_method: str = field(default_factory=lambda: os.environ.get(START_ENV, "forkserver"))

    def __post_init__(self) -> None:
        self.workers: list[Worker | None] = [None] * self.size     # each slot's current process
        self.restarts = [0] * self.size
        self.started = 0
        self.exits: list[Exit] = []
        self._crashes = [0] * self.size                              # consecutive unexpected exits
        self._pending: dict[int, float] = {}                         # slot -> when to start it again
        self._finished: set[int] = set()
        self._retired: set[int] = set()                              # slots removed by scale_to
        self._stopping = threading.Event()
        self._changed = threading.Event()                           # a process exited
        self._lock = threading.RLock()
        if self.start_method not in START_METHODS:
            raise ValueError(f"{START_ENV}/start_method: {self.start_method!r} is not one of "
                             f"{', '.join(START_METHODS)}")
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    # -- starting ----------------------------------------------------------
    def command(self, name: str) -> list[str]:
        argv = self.argv(name) if callable(self.argv) else self.argv
        return [sys.executable, "-m", "gpu_runner", *argv]

    def start_all(self) -> None:
        for slot in range(self.size):
            self.start(slot)

    def start(self, slot: int) -> Worker | None:
        """Start ``slot``'s next process; None once the fleet is stopping."""
        with self._lock:
            if self._stopping.is_set():
                return None
            old = self.workers[slot]
            gen = old.gen + 1 if old is not None else 0
            name = self.name(slot, gen)
            owner = self.worker_ids(name) if self.worker_ids is not None else None
            command = self.command(name) + (["--worker-id", owner] if owner is not None else [])
            popen, how = self._spawn(command, {**self.env, "PYTHONUNBUFFERED": "1"})
            w = Worker(slot, gen, name, popen, time.monotonic(), collections.deque(maxlen=self.tail_lines),
                       owner=owner)
            w.reader = threading.Thread(target=self._read, args=(w,), daemon=True, name=f"bi-{name}-log")
            w.reader.start()
            self.workers[slot] = w
            self.started += 1
        self.log.info("[%s] started pid %d (%s)", name, popen.pid, how)
        return w

    def _spawn(self, command: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str] | ForkedProcess, str]:
        """The process, and how it started: a fork of the warm server, or ``Popen`` (the setting, a
        command the server does not run, or a server that failed: said once in the log)."""
        if self.start_method == "forkserver" and command[1:2] in (["-m"], ["-c"]) and command[0] == sys.executable:
            try:
                server, new = server_for(env, on_output=lambda line: self.log.warning("[fork server] %s", line))
                if new:
                    self.log.info("fork server pid %d started: workers are forks of it", server.pid)
                return server.spawn(command, env, new_session=self.new_session), f"fork of server {server.pid}"
            except ForkServerError as exc:
                self.log.warning("fork server unavailable (%s): this fleet starts workers with subprocess.Popen",
                                 str(exc)[:300])
                self.start_method = "popen"
        popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace", bufsize=1, start_new_session=self.new_session)
        return popen, "popen"

    def _read(self, w: Worker) -> None:
        assert w.popen.stdout is not None
        out = open(self.log_dir / f"{w.name}.log", "a") if self.log_dir is not None else None
        try:
            for line in w.popen.stdout:
                line = line.rstrip("\n")
                w.tail.append(line)
                if out is not None:
                    out.write(line + "\n")
                if self.echo:
                    self.log.info("[%s] %s", w.name, line)
            w.popen.wait()                   # the output ends just before the exit
        finally:
            if out is not None:
                out.close()
            self._changed.set()

    # -- exits -------------------------------------------------------------
    def poll(self, restart: bool = True, on_exit: Callable[[Exit], None] | None = None) -> list[Exit]:
        """Collect the processes that exited since the last call and act on each (see ``Action``);
        ``on_exit`` sees each exit before any restart. Then start the restarts that are due."""
        self._changed.clear()
        now = time.monotonic()
        seen: list[Exit] = []
        with self._lock:
            for w in self.workers:
                if w is None or w.code is not None:
                    continue
                rc = w.popen.poll()
                if rc is None:
                    continue
                w.code = rc
                e = Exit(w, rc, self._decide(w, rc, restart, now))
                self.exits.append(e)
                seen.append(e)
        for e in seen:
            if e.worker.reader is not None:
                e.worker.reader.join(timeout=5)      # the tail holds its last lines
            if on_exit is not None:
                on_exit(e)
        if restart:
            for slot, at in sorted(self._pending.items()):
                if now >= at and not self._stopping.is_set():
                    del self._pending[slot]
                    self.start(slot)
        return seen

    def _decide(self, w: Worker, rc: int, restart: bool, now: float) -> Action:
        slot = w.slot
        self._crashes[slot] = 0 if _expected(w, rc) else self._crashes[slot] + 1
        if slot in self._retired:
            self._finished.add(slot)
            return Action.STOPPED
        if rc in self.done:
            self._finished.add(slot)
            return Action.DONE
        if self._stopping.is_set() or not restart:
            self._finished.add(slot)
            return Action.STOPPED
        if rc in self.fatal:
            self._finished.add(slot)
            return Action.FATAL
        if self.max_restarts is not None and self.restarts[slot] >= self.max_restarts:
            self._finished.add(slot)
            return Action.GAVE_UP
        self.restarts[slot] += 1
        n = self._crashes[slot]
        self._pending[slot] = now + (min(self.backoff_s * 2 ** (n - 1), self.backoff_max_s) if n else 0.0)
        return Action.RESTART

    # -- size ----------------------------------------------------------------
    def slots(self) -> list[int]:
        """The slots still in use: running, or due to restart (not those ``scale_to`` removed)."""
        return [s for s in range(self.size) if s not in self._finished and s not in self._retired]

    @property
    def drained(self) -> bool:
        """A worker exited with a ``done`` code: the job had nothing left for it to claim."""
        return any(e.action is Action.DONE for e in self.exits)

    def scale_to(self, n: int) -> int:
        """Run ``n`` slots: start new ones, or SIGTERM the newest (not restarted). Returns the slots in use."""
        with self._lock:
            if self._stopping.is_set():
                return len(self.slots())
            live = self.slots()
            for _ in range(max(0, n - len(live))):
                slot = self.size
                self.size += 1
                self.workers.append(None)
                self.restarts.append(0)
                self._crashes.append(0)
                self.start(slot)
            for slot in sorted(live, reverse=True)[:max(0, len(live) - n)]:
                self._retired.add(slot)
                self._pending.pop(slot, None)
                w = self.workers[slot]
                if w is not None and w.popen.poll() is None:
                    if w.stopped:
                        self.signal(w, signal.SIGCONT)
                    self.signal(w, signal.SIGTERM)
                    self.log.info("[%s] removed: SIGTERM sent", w.name)
                else:
                    self._finished.add(slot)
            return len(self.slots())

    def active(self) -> bool:
        """True while a slot is running or due to restart."""
        return len(self._finished) < self.size

    def wait(self, timeout: float) -> None:
        """Until a process exits, a restart is due, or ``timeout``; at once when no slot is active."""
        if not self.active():
            return
        if self._pending:
            timeout = max(0.0, min(timeout, min(self._pending.values()) - time.monotonic()))
        self._changed.wait(timeout)

    # -- signals -----------------------------------------------------------
    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w is not None and w.popen.poll() is None]

    def signal(self, w: Worker, sig: int) -> bool:
        """Send ``sig`` to ``w``; False if it is gone."""
        try:
            os.kill(w.pid, sig)
        except ProcessLookupError:
            return False
        w.sent = sig
        if sig == signal.SIGSTOP:
            w.stopped = True
        elif sig == signal.SIGCONT:
            w.stopped = False
        return True

    def stop(self, grace: float) -> list[Exit]:
        """SIGTERM to every process (SIGCONT first to a stopped one), SIGKILL to those still
        running after ``grace`` seconds; no restart after this. Returns the exits collected."""
        with self._lock:
            self._stopping.set()
            self._pending.clear()
            alive = self.alive()
            for w in alive:
                if w.stopped:
                    self.signal(w, signal.SIGCONT)
                self.signal(w, signal.SIGTERM)
        end = time.monotonic() + grace
        for w in alive:
            try:
                w.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(w, signal.SIGKILL)
                w.popen.wait()
                self._killed(w)
        for w in self.workers:
            if w is not None and w.reader is not None:
                w.reader.join(timeout=2)
        return self.poll(restart=False)

    def kill(self) -> None:
        """SIGKILL to every process still running (SIGCONT first, so a stopped one dies now)."""
        with self._lock:
            self._stopping.set()
            killed = self.alive()
            for w in killed:
                self.signal(w, signal.SIGCONT)
                self.signal(w, signal.SIGKILL)
        for w in killed:
            w.popen.wait()
            self._killed(w)

    def _killed(self, w: Worker) -> None:
        if self.on_killed is None:
            return
        try:
            self.on_killed(w)
        except Exception as exc:  # noqa: BLE001 - its leases expire instead
            self.log.warning("[%s] ended by force; could not give back what it held: %s", w.name,
                             str(exc).strip()[:200])


def signal_name(code: int | None) -> str | None:
    """'SIGSEGV' for a process ended by signal 11 (exit code -11); None for an exit code."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


# A worker's log line: its time and level (logging's or structlog's form), the message, structlog's trailer.
_LOG_PREFIX = re.compile(r"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \w+ [\w.]+: |\S+ \[\w+\s*\] )")
_LOG_TRAILER = re.compile(r"\s+\[[\w.]+\](?:\s+[\w.]+=\S+)*\s*$")


def last_step(w: Worker) -> str:
    """What ``w`` was doing: its last log line's message, after its worker id where it names it
    ('' if it said nothing)."""
    for line in reversed(w.tail):
        text = line.strip()
        if not text:
            continue
        if w.owner and f"{w.owner}: " in text:
            text = text.split(f"{w.owner}: ", 1)[1]
        else:
            text = _LOG_PREFIX.sub("", text)
        return _LOG_TRAILER.sub("", text)[:300]
    return ""


def error_line(w: Worker) -> str:
    """The message of ``w``'s last error line (a fatal exit's cause), '' if it logged none."""
    for line in reversed(w.tail):
        if " ERROR " in line or "[error" in line or line.lstrip().startswith("fatal:"):
            text = _LOG_TRAILER.sub("", _LOG_PREFIX.sub("", line.strip()))
            return text[len("fatal: "):] if text.startswith("fatal: ") else text
    return ""


class DeathWatch:
    """The signal deaths a launcher saw. A second death by the same signal at the same step (the
    worker's last line with its id and numbers masked), with nothing stored or dead-lettered since
    the first, means that no restart will get further: ``repeats`` says so."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}

    @staticmethod
    def step_key(step: str, owner: str | None = None) -> str:
        if owner:
            step = step.replace(owner, "<worker>")
        return re.sub(r"\d+(?:\.\d+)?", "#", step)

    def repeats(self, sig: str, step: str, done: int, owner: str | None = None) -> bool:
        """Note a death by ``sig`` at ``step`` with ``done`` records finished so far in the job;
        True when the same death came before at the same ``done``."""
        key = (sig, self.step_key(step, owner))
        before = self._seen.get(key)
        self._seen[key] = done
        return before == done


def abandon_dead_worker(conn: Any, job_version: str, owner: str, error: str) -> list[int]:
    """Give back every lease ``owner`` (a worker that died by a signal) still holds, at once, as an
    engine failure it reported itself would be (pending again, a lost lease, deaths of the records it
    had marked in flight; nothing stored is lost, no attempt is spent), with ``error`` on each shard.
    Returns the shard numbers given back."""
    from batch_inference import db

    rows = conn.execute(db.q("fleet_abandon_dead_owner"), {"job": job_version, "owner": owner,
                                                          "error": error}).fetchall()
    return [r["shard_no"] for r in rows if not r["stale"]]


def worker_death(conn: Any, job_version: str) -> dict[str, Any] | None:
    """The latest worker death a launcher recorded on one of the job's shards (``bi.shards.last_error``:
    which signal, which engine, what it was doing), with that shard's state now; None if none."""
    from batch_inference import db

    return conn.execute(db.q("shard_last_error"), {"job": job_version}).fetchone()


def release_leases(conn: Any, job_version: str, owner: str) -> list[int]:
    """Release every lease ``owner`` (a worker that was ended by force) still holds on the job
    version, each fenced by the epoch it held: a shard re-claimed since by another worker is
    left alone. Returns the shard numbers released."""
    from batch_inference import db

    rows = conn.execute(db.q("fleet_release_owner"), {"job": job_version, "owner": owner}).fetchall()
    return [r["shard_no"] for r in rows if not r["stale"]]
