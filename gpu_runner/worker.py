"""The worker: leased shards in, keyed results out.

One process, one engine; for each shard:

    claim -> list what is left -> submit it all -> validate each outcome ->
    put-if-absent in batches (every ``flush_every`` results or
    ``flush_seconds``; each put written behind, by a thread, while the
    engine goes on: ``Worker.flush``) -> retry failures with backoff -> complete

An engine that streams (``Engine.queue_depth() > 0``: vLLM, its batch of
``max_num_seqs``) runs several shards at once (``gpu_runner.overlap``): the
worker claims and reads the next shard while the current one's last records
still generate, so the engine's batch does not drain at a shard boundary.
Every shard keeps its own lease, renewal and epoch fence. Other engines, and
any ``--no-overlap`` worker, run one shard at a time.

A shard that lost a lease before (its holder died or stalled: maybe a record
in it kills the process) is run carefully: engine batches of
``careful_batch`` records, each marked in flight in the ledger before it is
generated, and records that were in flight at an earlier death run alone.
The ledger counts those deaths and dead-letters a record at the job's
``max_attempts`` (sql/schema/ledger.sql); a shard that never lost a lease
pays nothing for it. A streaming worker runs such a shard alone, after the
shards it holds have finished.

A background thread renews every held lease every ``renew_seconds`` on its
own connection; a refused renewal (stale epoch) halts that shard, and a
renewal that reports the job in fallback mode drains it. SIGTERM (the
preemption notice) stops taking records and, at once, from a thread of its
own on a connection of its own (``release_all``: an engine step may be
running for seconds in the main thread), writes every outcome already
finished and releases every lease it holds, each fenced by its epoch, so
the shards are pending again at once; only the records still generating
are lost. The step then ends, and the process exits within the grace
period. Outcomes reach the ledger as records finish (every ``flush_every``
results or ``flush_seconds``, also while a streaming engine keeps the
shard's other records generating). When the engine's endpoint is down (the engine raises
``EndpointUnavailable``, see ``batch_inference.breaker``) the shard is
released with its records' attempts untouched and the worker exits
``ExitCode.ENDPOINT``: the outage is no record's fault. Does not import
Airflow: the same code runs in a pod, on the Airflow worker and from the CLI.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import typing
from dataclasses import dataclass, field
from typing import Any

import psycopg

from batch_inference import db, provenance
from batch_inference.breaker import EndpointUnavailable
from batch_inference.engines import load_engine
from batch_inference.engines.base import TRUNCATED, Engine, Outcome, Request
from batch_inference.exceptions import (
    BadDatabaseURL,
    BatchInferenceError,
    BudgetSpent,
    DatabaseUnavailable,
    DigestMismatch,
    InvalidValue,
    UnknownJob,
)
from batch_inference.exits import HALTING, ExitCode
from batch_inference.ledger import FailedAttempt, Failure, Lease, Ledger, StaleLease, new_owner_id
from batch_inference.outputs import check_for_storage, to_storage
from batch_inference.pinning import verify_weights
from batch_inference.spec import MAX_LEASE_SECONDS, JobSpec
from batch_inference.status import Progress, duration, job_counts, job_mode, job_spec
from gpu_runner.overlap import ShardStream
from gpu_runner.shard import Shard, same_inputs

log = logging.getLogger("batch_inference.worker")

# The shortest renewal wait, as a fraction of renew_seconds (_renew_loop).
RENEW_JITTER = 0.8
# Failures that come from a setting, not from the record: the setting each names. After HALT_AFTER_DEAD
# records in a row dead-lettered for one of them, nothing stored between, the worker halts the job
# (a halt the cutoff watch and `status` report) instead of spending every record's attempts.
SETTING_FAILURES = {TRUNCATED: "params.max_tokens"}
HALT_AFTER_DEAD = 5
# While a put is in flight, ``flush`` holds up to this many times ``flush_every`` results for the next
# put instead of waiting for it: the put grows to what the engine made meanwhile.
HOLD_WHILE_IN_FLIGHT = 4


class Fatal(BatchInferenceError, RuntimeError):
    """The worker cannot go on; ``code`` is the exit status that says why."""

    def __init__(self, message: str, code: ExitCode):
        super().__init__(message)
        self.code = code


def _flag(default: Any = None, help: str | None = None, *, env: str | None = None,
          shown: bool = True, **argparse_kwargs: Any) -> Any:
    """A ``WorkerConfig`` field that is also a worker flag (``--field-name``).

    ``help`` gains "(default X)" when ``shown``; ``env`` names a variable
    whose value replaces the default on the command line (not in the
    dataclass); the rest goes to ``add_argument`` as it is."""
    return field(default=default, metadata={"flag": {"help": help, "env": env, "shown": shown, **argparse_kwargs}})


@dataclass
class WorkerConfig:
    job_version: str
    db_url: str | None = None
    engine: str | None = _flag(help="engine name or dotted path (default: the spec's)", shown=False)
    engine_options: dict[str, Any] | None = _flag(
        help="engine option (JSON value)", shown=False, flag="--engine-option", action="append",
        metavar="KEY=VALUE")
    worker_id: str | None = _flag()
    transport: str = _flag("batch", shown=False, choices=["batch", "fallback"])
    # Preemption notice: AWS gives 120 s, GCP about 30 s.
    grace_seconds: float = _flag(20.0, "preemption notice: time to finish in-flight records before releasing",
                                 env="BATCH_INFERENCE_GRACE_SECONDS")
    lease_seconds: int | None = _flag(help="override the spec's lease length", shown=False)  # default: the spec's
    flush_every: int = _flag(1000, "write results at least every N")
    flush_seconds: float = _flag(2.0, "... or every S seconds")
    backoff: tuple[float, ...] = (1.0, 4.0, 10.0)
    max_shards: int | None = _flag()
    # Poll while other workers hold the last shards.
    wait_for_leases: bool = _flag(True, "exit when nothing is claimable now", shown=False, flag="--no-wait",
                                  action="store_false")
    poll_seconds: float = _flag(5.0, "while others hold the last shards, look for an expired one this often")
    # The pod operator passes batch_inference.ledger.FLEET_START_JITTER_SECONDS.
    start_jitter_seconds: float = _flag(0.0, "before the first claim, wait a random 0..S seconds (a fleet "
                                        "started at once spreads its first claims)")
    db_retries: int = _flag(8, "reconnect attempts on a lost database")
    progress_seconds: float = 30.0
    progress_every: int = 500
    careful_batch: int = _flag(32, "engine batch size on a shard whose earlier holder died")
    # Shards overlap when the engine streams (gpu_runner.overlap); off: one shard at a time.
    overlap: bool = _flag(True, "run one shard at a time even when the engine streams", shown=False,
                          flag="--no-overlap", action="store_false")
    # A version placed over regions (batch_inference.regions): the worker's ledger is its region's view.
    region: str | None = _flag(help="the region this worker runs in: claim the shards whose replica is "
                               "there first and read records from replicas (a placed version)", shown=False)
    result_files: bool = _flag(False, "with --region: hand in each shard's results as one file in the "
                               "region's store, merged by key near the ledger", shown=False, action="store_true")
    steal: bool = _flag(True, "with --region: never take another region's shard", shown=False,
                        flag="--no-steal", action="store_false")

    def __post_init__(self) -> None:
        """Refuse values no worker can run with (InvalidValue, one line), before it connects."""
        def need(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise InvalidValue(f"--{name.replace('_', '-')} must be {what}, got {getattr(self, name)!r}")

        need("db_retries", 0 <= self.db_retries <= 1000, "between 0 and 1000")
        need("flush_every", 1 <= self.flush_every <= 1_000_000, "between 1 and 1,000,000")
        need("careful_batch", 1 <= self.careful_batch <= 1_000_000, "between 1 and 1,000,000")
        need("lease_seconds", self.lease_seconds is None or 1 <= self.lease_seconds <= MAX_LEASE_SECONDS,
             f"between 1 and {MAX_LEASE_SECONDS:,}")
        # 0 starts, loads the engine and exits without claiming (the memory benchmark's baseline).
        need("max_shards", self.max_shards is None or self.max_shards >= 0, "at least 0")
        for name in ("grace_seconds", "flush_seconds", "poll_seconds", "start_jitter_seconds"):
            value = getattr(self, name)
            need(name, math.isfinite(value) and 0 <= value <= 86_400, "between 0 and 86,400 seconds")


class Worker:
    """``own_process``: this worker is the whole process (``python -m gpu_runner``,
    ``batch-inference worker``), so what is alive once the engine has loaded
    lives as long as the process (see ``_run``)."""

    # Where the line saying why the worker stops goes (``_fatal``): None, the log.
    fatal_to: typing.Callable[[str], None] | None = None

    def __init__(self, cfg: WorkerConfig, own_process: bool = False,
                 around_shard: typing.Callable[[Worker], contextlib.AbstractContextManager[object]] | None = None):
        self.cfg = cfg
        self.own_process = own_process
        # The extension point of a worker run inside something larger: ``around_shard(worker)`` is entered
        # before each shard this worker runs alone and left when it is over (the fallback pool puts its
        # shared bucket, breaker and allowance on the engine there, and counts its busy time).
        self.around_shard = around_shard or (lambda worker: contextlib.nullcontext())
        self.job_counts_at = -math.inf         # when _Progress last read the job's counts
        self.owner = cfg.worker_id or new_owner_id("fallback" if cfg.transport == "fallback" else "worker")
        self.stop = threading.Event()          # the preemption notice
        self.conn: psycopg.Connection | None = None
        self.ledger: Ledger | None = None
        self.spec: JobSpec | None = None
        self.engine: Engine | None = None
        self.held: tuple[Shard, ...] = ()     # every shard whose lease this worker holds (replaced, never mutated)
        self.transport = cfg.transport
        self.stats = {"shards": 0, "stored": 0, "failed": 0, "dead": 0, "stale": 0, "claims_held_back": 0}
        self.startup: dict[str, float] = {}    # start-up phase -> seconds (_phase)
        self._phase_at = 0.0
        self.made_by: tuple[Any, ...] = ()
        # Held while outcomes are taken or written, and while a preemption notice writes and releases
        # (from its own thread): a shard's buffer is never written twice or after its release.
        self.writing = threading.Lock()
        self._released_on_notice = False
        self._dead_in_a_row: tuple[str, int] = ("", 0)   # (a SETTING_FAILURES error, records dead of it in a row)
        self.halting: str | None = None                   # why this worker halts the job (_count_dead)
        # The thread that writes a shard's results behind its generation (``flush``); None: every write waits.
        self.putter: concurrent.futures.ThreadPoolExecutor | None = None

    # -- connections ------------------------------------------------------
    def _connect(self) -> psycopg.Connection:
        return db.connect(self.cfg.db_url, retries=self.cfg.db_retries, application_name=self.owner[:60])

    def _db(self, fn, *args):
        """Run a ledger call; on a lost connection reconnect (the database may be
        restarting) and retry, up to ``db_retries`` times: a second restart, or
        a stalled worker waking into one, can break the new connection too.
        Every ledger write is safe to repeat: results are put-if-absent, and a
        failed-attempt count carries the attempt number it records, which the
        ledger counts once. Still failing: DatabaseUnavailable. From the second
        loss on it backs off first (``db.backoff``): through PgBouncer the
        reconnect succeeds at once while the server behind it is still down
        ("server login has been failing"), and only time helps."""
        for attempt in range(self.cfg.db_retries + 1):
            try:
                return fn(*args)
            except psycopg.OperationalError as exc:
                reason = db.first_line(exc)
                if attempt >= self.cfg.db_retries:
                    raise DatabaseUnavailable(f"database connection lost {attempt + 1} times in a row: "
                                                 f"{reason}") from None
                log.warning("database connection lost (%s); reconnecting", reason)
                if attempt > 0:
                    self.stop.wait(db.backoff(attempt))
            old = self.conn
            try:
                if self.conn is not None:
                    self.conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass
            self.conn = self._connect()
            if self.ledger is not None:    # None before the first claim (reading the spec)
                self.ledger.conn = self.conn
            # A call that was handed the connection (job_mode(self.conn, ...))
            # must be retried on the new one, not on the one just closed.
            args = tuple(self.conn if a is old else a for a in args)
        raise AssertionError("unreachable")

    # -- lifecycle --------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        except Fatal as exc:
            self._fatal(str(exc))
            if exc.code in HALTING and self.spec is not None:
                self._halt_job(str(exc))
            return exc.code
        except DatabaseUnavailable as exc:
            self._fatal(f"fatal: {exc}")
            return ExitCode.DB
        except BadDatabaseURL as exc:
            self._fatal(f"fatal: {exc}")
            return ExitCode.CONFIG
        except psycopg.errors.InsufficientPrivilege as exc:
            self._fatal(f"fatal: this worker's database role may not work on {self.cfg.job_version}: "
                        f"{str(exc).strip().splitlines()[0]} (the owner grants it with "
                        f"`batch-inference grant ROLE {self.cfg.job_version}`)")
            return ExitCode.CONFIG
        finally:
            self._restore_signals()
            if self.putter is not None:
                self.putter.shutdown(wait=True)
            if self.engine is not None:
                self.engine.close()
            if self.conn is not None:
                self.conn.close()

    def _fatal(self, line: str) -> None:
        """Say why the worker stops: logged (``python -m gpu_runner``: its launcher reads the log), or
        handed to ``fatal_to`` (``batch-inference worker``: its one error line)."""
        if self.fatal_to is None:
            log.error("%s", line)
        else:
            self.fatal_to(line)

    def _halt_job(self, reason: str) -> None:
        """Record on the job that its workers cannot work, so the cutoff watch ends the run now."""
        try:
            self.conn.execute(db.q("halt_job"), {"job": self.cfg.job_version, "reason": reason})
        except psycopg.Error as exc:  # the exit code still says it; the operator records it too
            log.warning("could not record the halt on %s: %s", self.cfg.job_version, str(exc).strip()[:200])

    def _phase(self, name: str) -> None:
        """Close a start-up phase in ``self.startup`` (seconds since the last one closed)."""
        now = time.perf_counter()
        self.startup[name] = now - self._phase_at
        self._phase_at = now

    def _run(self) -> int:
        cfg = self.cfg
        self._phase_at = time.perf_counter()
        self.conn = self._connect()
        self._phase("connect")
        try:
            self.spec = self._db(job_spec, self.conn, cfg.job_version)
        except UnknownJob as exc:
            raise Fatal(f"fatal: {exc}", ExitCode.CONFIG) from None
        self._phase("spec")
        spec = self.spec
        name = cfg.engine or spec.engine.name
        # Options given at run time go over the spec's, as LocalWorkersOperator's do (a speed option such as
        # vLLM's enforce_eager is not lost by giving another); another engine than the spec's takes only these.
        options = cfg.engine_options if cfg.engine_options is None or name != spec.engine.name \
            else {**spec.engine.options, **cfg.engine_options}
        try:
            self.engine = load_engine(name, spec, options)
            made_by = provenance.made_by(spec, self.engine)   # refuses an engine that cannot serve the pinned model
        except (ValueError, ImportError) as exc:
            named, said = f"engine {name!r}: ", str(exc)
            raise Fatal(f"fatal: {'' if said.startswith(named) else named}{said}",   # an engine's own names it
                        ExitCode.CONFIG) from None
        self._phase("engine_import")
        try:
            verify_weights(self.engine, spec)   # before load, before any claim: a mismatch writes nothing
        except DigestMismatch as exc:
            raise Fatal(f"fatal: refusing to start: {exc}", ExitCode.DIGEST) from None
        self._phase("weights_digest")
        if self.own_process:
            gc.enable()   # off while ``python -m gpu_runner`` imports; on while the engine loads its model
        try:
            self.engine.load()
        except (ValueError, ImportError, OSError) as exc:
            raise Fatal(f"fatal: engine {name!r} could not load: {exc}", ExitCode.CONFIG) from None
        self._phase("engine_load")
        log.info("%s: engine %s loaded in %.2fs for %s (model %s, prompt %s)", self.owner, name,
                 self.startup["engine_load"], cfg.job_version, spec.model.name, spec.prompt.version)
        if self.own_process:
            # Modules, the spec, the engine and its model stay until exit:
            # frozen out of the cyclic collector, so each full collection
            # walks what the shards allocate, not the whole heap again. No
            # collection first: it walks the whole heap to find next to no
            # garbage (none after a llama.cpp load).
            gc.freeze()
            self._phase("gc_freeze")
        log.info("%s: start-up %.2fs: %s", self.owner, sum(self.startup.values()),
                 ", ".join(f"{k} {v:.2f}s" for k, v in self.startup.items()))
        # A batch worker's transport is its engine's ('hosted_batch' for the hosted batch engines).
        self.transport = cfg.transport if cfg.transport == "fallback" else self.engine.transport
        self.made_by = tuple(made_by)
        self.ledger = Ledger(self.conn, cfg.job_version, self.owner, self.transport, cfg.lease_seconds, *made_by)
        self.ledger.call = self._db   # an engine's calls through it (the ladder's answers) reconnect as ours do
        if not cfg.region and type(self.engine).begin_shard is Engine.begin_shard:
            # The engine makes no ledger calls of its own, so a put may be in flight on the connection while it
            # generates: the worker and its database backend work at once instead of taking turns.
            self.putter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"put-{self.owner[:20]}")
        if cfg.region:
            from batch_inference.regions import RegionLedger

            try:   # a region the version was not placed in: one line, before any claim
                self.ledger = RegionLedger.wrap(self.ledger, cfg.region, result_files=cfg.result_files,
                                                steal=cfg.steal)
            except BatchInferenceError as exc:
                raise Fatal(f"fatal: --region {cfg.region}: {exc}", ExitCode.CONFIG) from None
        self._install_signals()
        overlap = cfg.overlap and self.engine.queue_depth() > 0
        if overlap:
            log.info("%s: shards overlap: the engine keeps %d requests queued across shard boundaries", self.owner,
                     self.engine.queue_depth())
        if cfg.start_jitter_seconds:
            self.stop.wait(random.uniform(0.0, cfg.start_jitter_seconds))   # a preemption notice ends it

        while not self.stop.is_set():
            if self.halting is not None:
                raise Fatal(f"fatal: {self.halting}", ExitCode.CONFIG)
            if cfg.max_shards is not None and self.stats["shards"] >= cfg.max_shards:
                break
            lease = self.claim_next()
            if lease is None:
                if self.stop.is_set():
                    break
                if not self._should_wait():
                    break
                self.stop.wait(cfg.poll_seconds)
                continue
            if overlap and not lease.careful:
                lease = ShardStream(self, lease).run()   # a careful shard it claimed comes back, to run alone
                if lease is None:
                    continue
            with self.around_shard(self):
                self._process(lease)
        log.info("%s: exiting: %d shards, %d stored, %d failed attempts, %d dead letters, %d stale refusals, "
                 "%d claims held back", self.owner, self.stats["shards"], self.stats["stored"], self.stats["failed"],
                 self.stats["dead"], self.stats["stale"], self.stats["claims_held_back"])
        return ExitCode.PREEMPTED if self.stop.is_set() else ExitCode.OK

    def _should_wait(self) -> bool:
        """No shard to claim: wait while others hold leases that may still expire."""
        assert self.conn is not None
        if not self.cfg.wait_for_leases:     # told not to wait: nothing to ask the ledger
            return False
        mode, status = self._db(job_mode, self.conn, self.cfg.job_version)
        if status != "running" or (mode == "fallback" and self.transport != "fallback"):
            log.info("%s: job is %s/%s; nothing for this worker", self.owner, status, mode)
            return False
        counts = self._db(job_counts, self.conn, self.cfg.job_version)
        if counts["shards"]["leased"] == 0 and counts["shards"]["pending"] == 0:
            return False
        return self.cfg.wait_for_leases

    def _install_signals(self) -> None:
        """SIGTERM / SIGINT (the preemption notice). Python runs a signal handler in the main thread only
        between bytecodes, which an engine step (a model forward in C) may hold off for seconds; the
        C-level handler also writes the signal's number to a socket at once, and a thread of its own
        (``_watch_signals``) writes what has finished and releases every lease from there."""
        self._signals: tuple[Any, ...] | None = None
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, _frame):
            self._notice(signum)

        before = (signal.signal(signal.SIGTERM, on_term), signal.signal(signal.SIGINT, on_term))
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._signals = (before, old_fd, reader, writer)
        threading.Thread(target=self._watch_signals, args=(reader,), daemon=True, name="preemption").start()

    def _restore_signals(self) -> None:
        """Put back what ``_install_signals`` replaced (an in-process worker leaves its caller's handlers)."""
        installed, self._signals = getattr(self, "_signals", None), None
        if installed is None:
            return
        (term, intr), old_fd, reader, writer = installed
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, intr)
        writer.close()
        reader.close()    # ends _watch_signals

    def _watch_signals(self, reader: socket.socket) -> None:
        notices = {int(signal.SIGTERM), int(signal.SIGINT)}
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            signum = next((b for b in data if b in notices), None)
            if signum is not None:
                self._notice(signum)
                self.release_all("preemption notice")
                return

    def _notice(self, signum: int) -> None:
        """The preemption notice: take no more records, stop every held shard, and leave within the grace."""
        if self.stop.is_set():
            return
        self.stop.set()
        for shard in self.held:
            shard.halt.set()
        log.warning("%s: preemption notice (signal %d): writing finished records and releasing every lease now;"
                    " exiting within %.0fs", self.owner, signum, self.cfg.grace_seconds)
        threading.Thread(target=self._grace_deadline, daemon=True).start()

    def release_all(self, why: str) -> int:
        """Write every held shard's finished outcomes and release its lease, on a connection of this
        call's own (the worker's may be inside a write or the engine inside a step); each write and
        release fenced by the shard's epoch. Returns the shards released."""
        with self.writing:
            if self._released_on_notice:
                return 0
            self._released_on_notice = True
            held = [shard for shard in self.held if not shard.closed]
            if not held or self.spec is None:
                return 0
            released = 0
            try:
                with self._connect() as conn:
                    ledger = self.ledger.with_conn(conn)   # what the worker's own ledger holds, on this connection
                    for shard in held:
                        try:
                            self._write(shard, ledger, _direct)
                        except StaleLease as exc:
                            self.drop(shard, exc)
                            continue
                        ok = ledger.release(shard.lease)
                        self.let_go(shard)
                        released += ok
                        log.info("%s: released shard %d (epoch %d, %s)%s", self.owner, shard.lease.shard_no,
                                 shard.lease.epoch, why, "" if ok else " - release refused, lease was stale")
            except Exception as exc:  # noqa: BLE001 - the main thread releases what is left, or the leases expire
                log.error("%s: could not release shards at once: %s", self.owner, db.first_line(exc))
            return released

    def _grace_deadline(self) -> None:
        """The grace period ran out: release every held lease from a fresh connection and leave."""
        time.sleep(self.cfg.grace_seconds)
        held = [shard for shard in self.held if not shard.closed]
        if held:
            try:
                with self._connect() as conn:
                    ledger = Ledger(conn, self.cfg.job_version, self.owner, self.transport)
                    for shard in held:
                        ledger.release(shard.lease)
                        log.warning("%s: grace period over; released shard %d", self.owner, shard.lease.shard_no)
            except Exception as exc:  # noqa: BLE001 - the leases will expire instead
                log.error("%s: could not release shards on exit: %s", self.owner, exc)
        os._exit(ExitCode.PREEMPTED)

    # -- leases -----------------------------------------------------------
    def _renew_loop(self, held: typing.Callable[[], typing.Iterable[Shard]], done: threading.Event) -> None:
        """Renew each lease ``held()`` names, every ``renew_seconds``, until ``done``: one
        fenced renewal per shard, so a stale epoch halts that shard alone."""
        assert self.spec is not None and self.ledger is not None
        interval = self.spec.renew_seconds
        conn: psycopg.Connection | None = None
        try:
            # Each wait is jittered down by up to a fifth (never later than
            # renew_seconds): renewals of workers that started, or came back
            # from a database restart, together spread out instead of arriving
            # at the ledger in one burst every interval.
            while not done.wait(interval * random.uniform(RENEW_JITTER, 1.0)):
                for shard in held():
                    if shard.halt.is_set() or shard.closed:
                        continue
                    try:
                        if conn is None:
                            conn = self._connect()
                        # The worker's own ledger on this connection: a region's far worker reports what it holds.
                        mode = self.ledger.with_conn(conn).renew(shard.lease)
                    except StaleLease as exc:
                        if not shard.closed:
                            log.warning("%s: %s; abandoning the shard", self.owner, exc)
                            shard.stale.set()
                            shard.halt.set()
                        continue
                    except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                        log.warning("%s: lease renewal failed (%s); will retry", self.owner, exc.__class__.__name__)
                        if conn is not None:
                            conn.close()
                        conn = None
                        break
                    if mode == "fallback" and self.transport != "fallback" and not shard.drain.is_set():
                        log.warning("%s: cutoff fired: draining shard %d (in-flight records, then release)",
                                    self.owner, shard.lease.shard_no)
                        shard.drain.set()
                        shard.halt.set()
        finally:
            if conn is not None:
                conn.close()

    def renewer(self, held: typing.Callable[[], typing.Iterable[Shard]], done: threading.Event,
                 name: str) -> threading.Thread:
        thread = threading.Thread(target=self._renew_loop, args=(held, done), daemon=True, name=name)
        thread.start()
        return thread

    def _hold(self, shard: Shard) -> None:
        self.held = (*self.held, shard)
        if self.stop.is_set():
            shard.halt.set()

    def let_go(self, shard: Shard) -> None:
        """The shard is over for this worker (completed, released, abandoned or dropped)."""
        shard.closed = True
        self.held = tuple(s for s in self.held if s is not shard)

    # -- the seam a shard stream uses (gpu_runner.shard.ShardHost) ----------
    def settings(self) -> tuple[float, int, float]:
        assert self.spec is not None
        return self.cfg.lease_seconds or self.spec.lease_seconds, self.cfg.flush_every, self.cfg.flush_seconds

    def claim_next(self) -> Lease | None:
        """The next shard, unless a preemption notice came or ``max_shards`` (completed and held) is reached."""
        assert self.ledger is not None
        if self.stop.is_set():
            return None
        if self.cfg.max_shards is not None and self.stats["shards"] + len(self.held) >= self.cfg.max_shards:
            return None
        return self._db(self.ledger.claim)

    def open_shard(self, lease: Lease) -> tuple[Shard, dict[str, str]]:
        assert self.engine is not None
        shard = Shard(lease)
        self._hold(shard)
        if lease.careful:     # run alone later (_process), which reads it then
            return shard, {}
        self.engine.begin_shard(self.ledger, lease, shard.drain)
        texts, _ = self._read(shard)
        return shard, texts

    def finish(self, shard: Shard) -> None:
        assert self.engine is not None
        self.engine.end_shard(shard.lease)
        self._complete(shard)

    def hand_back(self, shard: Shard) -> None:
        self._release(shard, self._why_released(shard, "halted"))

    def _release(self, shard: Shard, why: str) -> None:
        assert self.ledger is not None
        if shard.closed:      # released already (a preemption notice, release_all)
            return
        released = self._db(self.ledger.release, shard.lease)
        self.let_go(shard)
        log.info("%s: released shard %d (epoch %d, %s)%s", self.owner, shard.lease.shard_no, shard.lease.epoch,
                 why, "" if released else " - release refused, lease was stale")

    def _why_released(self, shard: Shard, outcome: str) -> str:
        return "drain" if shard.drain.is_set() else "preemption notice" if self.stop.is_set() else outcome

    def _complete(self, shard: Shard) -> str:
        """Complete the shard: 'done', 'incomplete' (released: records left) or 'stale' (dropped)."""
        assert self.ledger is not None
        lease = shard.lease
        if shard.closed:      # released already (a preemption notice, release_all)
            return "released"
        try:
            result = self._db(self.ledger.complete, lease)
        except StaleLease as exc:   # stalled after the last write: the new holder completes it
            self.drop(shard, exc)
            return "stale"
        if result == "done":
            self.let_go(shard)
            self.stats["shards"] += 1
            log.info("%s: shard %d complete (epoch %d)", self.owner, lease.shard_no, lease.epoch)
        else:
            self._release(shard, self._why_released(shard, result))
        return result

    # -- one shard at a time ----------------------------------------------
    def _process(self, lease: Lease) -> None:
        assert self.ledger is not None and self.spec is not None and self.engine is not None
        shard = Shard(lease)
        self._hold(shard)
        renewer = self.renewer(lambda: (shard,), shard.halt, f"renew-{lease.shard_no}")
        try:
            self.engine.begin_shard(self.ledger, lease, shard.drain)
            outcome = self._work(shard)
            self.engine.end_shard(lease)
        except StaleLease as exc:
            self.drop(shard, exc)
            outcome = "stale"
        except (psycopg.OperationalError, DatabaseUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - the endpoint is down, or the engine broke: give the shard back
            shard.halt.set()
            renewer.join(timeout=5)
            self.give_back([shard], exc)
        finally:
            shard.halt.set()
            renewer.join(timeout=5)
        if outcome == "finished":
            self._complete(shard)
        elif outcome == "halted":
            self._release(shard, self._why_released(shard, outcome))

    def give_back(self, shards: list[Shard], exc: Exception) -> typing.NoReturn:
        """The engine raised: give every held shard back and stop (Fatal). An endpoint that
        is down is no engine's or record's fault: a plain release, no lost lease, no crash and
        no attempt counted; so is a budget that pays for no more rows (exit OK: nothing left for this
        worker). Anything else broke the engine itself (lost GPU, OOM): abandon,
        counted like a death, so a record that breaks the engine every time ends
        dead-lettered, not looping."""
        assert self.ledger is not None
        if isinstance(exc, EndpointUnavailable):
            for shard in shards:
                self._release(shard, "endpoint unavailable")
            raise Fatal(f"fatal: {exc}", ExitCode.ENDPOINT) from None
        if isinstance(exc, BudgetSpent):     # the rows stay pending for a larger budget: nothing left for us
            for shard in shards:
                self._release(shard, "budget spent")
            raise Fatal(f"stopped at the budget: {exc}", ExitCode.OK) from None
        try:
            for shard in shards:
                self._db(self.ledger.abandon, shard.lease)
                self.let_go(shard)
        finally:
            numbers = ", ".join(str(s.lease.shard_no) for s in shards)
            raise Fatal(f"fatal: engine failed on shard {numbers}: {exc.__class__.__name__}: {exc}; "
                        f"shard{'s' if len(shards) > 1 else ''} given back (counted as a lost lease)",
                        ExitCode.ENGINE) from exc

    def drop(self, shard: Shard, exc: StaleLease) -> None:
        """Our epoch ended: what this shard has not written is dropped (the new holder finishes it)."""
        self.let_go(shard)
        for buffered in (shard.ok_ids, shard.ok_out, shard.ok_cat, shard.ok_vec, shard.failures):
            buffered.clear()
        self.stats["stale"] += 1
        log.warning("%s: %s; dropping shard %d (the new holder finishes it)", self.owner, exc, shard.lease.shard_no)

    def _read(self, shard: Shard) -> tuple[dict[str, str], set[str]]:
        """The shard's records still to do (id -> text, in id order) and the suspects among them
        (in flight at an earlier death); sets the shard's attempts and progress."""
        assert self.ledger is not None
        lease = shard.lease
        ids, record_texts, attempts, crashes = self._db(self.ledger.record_columns, lease)
        log.info("%s: shard %d epoch %d: %d of %d records done already, %d to do", self.owner, lease.shard_no,
                 lease.epoch, lease.records - len(ids), lease.records, len(ids))
        shard.attempts = dict(zip(ids, attempts))
        shard.progress = _Progress(self, lease, len(ids))
        return dict(zip(ids, record_texts)), {rid for rid, n in zip(ids, crashes) if n}

    def retry_wait(self, shard: Shard, round_no: int, n: int) -> float:
        """The wait before retry round ``round_no`` (1, 2, ...): it grows, so a restarting server is not hammered."""
        wait = self.cfg.backoff[min(round_no, len(self.cfg.backoff)) - 1]
        log.info("%s: shard %d: retrying %d failed record(s) in %.0fs", self.owner, shard.lease.shard_no, n, wait)
        return wait

    def _work(self, shard: Shard) -> str:
        """Drive the shard's records to stored or dead. Returns 'finished' or 'halted'."""
        assert self.ledger is not None and self.spec is not None and self.engine is not None
        spec, lease, ledger = self.spec, shard.lease, self.ledger
        texts, suspects = self._read(shard)
        if lease.careful:
            log.warning("%s: shard %d lost its lease %d time(s) before: careful mode (batches of %d marked in "
                        "flight; %d record(s) in flight at an earlier death run alone)", self.owner,
                        lease.shard_no, lease.lost_leases, self.cfg.careful_batch, len(suspects))
        todo = list(texts)
        round_no = 0
        while todo:
            if shard.halt.is_set():
                return "halted"
            if round_no and shard.halt.wait(self.retry_wait(shard, round_no, len(todo))):
                return "halted"
            round_no += 1
            retry: list[str] = []
            for batch in self._engine_batches(lease, todo, suspects):
                if shard.halt.is_set():
                    return "halted"
                if lease.careful:
                    self._db(ledger.mark_in_flight, lease, batch)
                requests = [shard.request(spec, rid, texts[rid]) for rid in batch]
                retry += self._generate(shard, requests)
            todo = [rid for rid in retry if rid in texts]
        return "halted" if shard.stale.is_set() else "finished"

    def _engine_batches(self, lease: Lease, todo: list[str], suspects: set[str]) -> list[list[str]]:
        """The whole list at once normally. On a careful shard: each suspect
        alone first (the next death then names the culprit), the rest in
        batches of ``careful_batch`` (a death implicates only one batch)."""
        if not lease.careful or self.engine.whole_shard:
            return [todo]
        n = max(1, self.cfg.careful_batch)
        rest = [rid for rid in todo if rid not in suspects]
        return [[rid] for rid in todo if rid in suspects] + [rest[i:i + n] for i in range(0, len(rest), n)]

    def _generate(self, shard: Shard, requests: list[Request]) -> list[str]:
        """One pass over ``requests``; returns the ids that failed and may be retried. Records asked
        the same thing are generated once (``gpu_runner.shard.same_inputs``): each of them gets that
        outcome, a failed one counting as an attempt of each."""
        assert self.engine is not None
        retry: list[str] = []
        # Read once: the loop below runs per record.
        take, flush_every, flush_seconds = self.take, self.cfg.flush_every, self.cfg.flush_seconds
        flush = self.write if self.putter is None or shard.lease.careful else self.flush
        stale, lease = shard.stale.is_set, shard.lease
        requests, same = same_inputs(self.engine, requests)
        try:
            for outcome in self.engine.generate(requests, shard.halt):
                take(shard, outcome)
                for rid in same.get(outcome.record_id, ()):
                    shard.shared.add(rid)
                    take(shard, dataclasses.replace(outcome, record_id=rid))
                if shard.due(flush_every, flush_seconds):
                    retry += flush(shard)
                if stale():
                    raise StaleLease(f"lease on shard {lease.shard_no} epoch {lease.epoch} went stale")
        except EndpointUnavailable:
            self.write(shard)   # what the endpoint did answer before it went down is kept
            raise
        finally:
            self.settled(shard)
        return retry + self.write(shard)

    def take(self, shard: Shard, outcome: Outcome) -> None:
        """Check one outcome and hold it for the shard's next write: a result, or a failed attempt."""
        with self.writing:
            if not shard.closed:   # a released or dropped shard's outcome is not ours to write
                self._hold_outcome(shard, outcome)

    def _hold_outcome(self, shard: Shard, outcome: Outcome) -> None:
        vector = None
        if outcome.error is not None:
            obj, text, err = None, None, outcome.error
        elif self.spec.task == "embed":   # a vector, checked and kept as float32 bytes (batch_inference.embed)
            vector, text, err = to_storage(self.spec, outcome.vector)
            obj = {} if vector is not None else None
        else:
            obj, text, err = check_for_storage(self.spec, outcome.text)
        if obj is not None:
            category_field = self.spec.category_field
            cat = obj.get(category_field) if category_field else None
            shard.ok_ids.append(outcome.record_id)
            shard.ok_out.append(text)
            shard.ok_cat.append(cat if isinstance(cat, str) else None if cat is None else str(cat))
            if vector is not None:
                shard.ok_vec.append(vector)
        else:
            shard.failed(outcome.record_id, err or "unknown error", outcome.text)

    def write(self, shard: Shard) -> list[str]:
        """Write what the shard holds: put-if-absent results, then failed attempts. Returns the
        ids that failed and may be retried (not dead). A stale epoch raises StaleLease."""
        with self.writing:
            if shard.closed:       # released with what it had (release_all), or dropped
                return []
            return self._write(shard, self.ledger, self._db)

    def flush(self, shard: Shard) -> list[str]:
        """``write`` while the shard is still generating, its results written behind: the put of the
        results held goes to the writer thread (``putter``) and the engine goes on at once. The put before
        is answered first (waited for if still in flight: one put at a time; its rows stored, results
        refused as data, a stale epoch raised here). Failed attempts make it a ``write``. Every put is
        answered before the shard completes or is released: ``write`` (and ``settled``) wait for it.
        While the put before is still in flight the results stay held, up to ``HOLD_WHILE_IN_FLIGHT``
        flushes' worth, and the next put takes them all: the engine waits on a put only past that."""
        behind, every = shard.behind, self.cfg.flush_every
        if (behind is not None and not shard.failures
                and shard.buffered < HOLD_WHILE_IN_FLIGHT * every and not behind[0].done()):
            shard.held_over = shard.buffered - every + max(1, every // 16)   # look again after a few more
            return []
        shard.held_over = 0
        if shard.failures:
            return self.write(shard)
        with self.writing:
            if shard.closed:
                return []
            self._take_behind(shard, self.ledger, self._db)
            if shard.failures:     # the put before refused results: their failed attempts, now
                return self._write(shard, self.ledger, self._db)
            if shard.ok_ids:
                batch = (shard.ok_ids, shard.ok_out, shard.ok_cat, shard.ok_vec or None)
                shard.ok_ids, shard.ok_out, shard.ok_cat, shard.ok_vec = [], [], [], []
                shard.behind = (self.putter.submit(self._put_results, self.ledger, self._db, shard.lease, *batch),
                                batch)
            shard.last_flush = time.monotonic()
            return []

    def settled(self, shard: Shard) -> None:
        """Wait for the shard's put in flight, if any (its answer is taken by the next write)."""
        behind = shard.behind
        if behind is not None:
            concurrent.futures.wait([behind[0]])

    def _take_behind(self, shard: Shard, ledger: Ledger, call: typing.Callable[..., Any]) -> None:
        """Wait for the shard's put in flight and take its answer (StaleLease, or any error of the put,
        raised here)."""
        behind, shard.behind = shard.behind, None
        if behind is not None:
            future, (ids, _, _, _) = behind
            self._stored(shard, ledger, call, ids, *future.result())

    def _stored(self, shard: Shard, ledger: Ledger, call: typing.Callable[..., Any], ids: list[str], n: int,
                refused: list[tuple[str, str, str]]) -> None:
        """Count a put of the results ``ids``: ``n`` rows new, ``refused`` failed attempts now."""
        lease, progress = shard.lease, shard.progress
        for rid, out, reason in refused:
            shard.failed(rid, reason, out)
        if shard.shared:   # stored with another record's result: counted for `status`
            kept = shard.shared.difference(rid for rid, _, _ in refused)
            n_shared = sum(1 for rid in ids if rid in kept)
            if n_shared:
                call(ledger.note_shared, lease, n_shared)
        self.stats["stored"] += n
        if n:
            self._dead_in_a_row = ("", 0)
        if progress is not None:
            progress.add(len(ids) - len(refused))

    def _write(self, shard: Shard, ledger: Ledger, call: typing.Callable[..., Any]) -> list[str]:
        """``write`` through ``ledger``, each ledger call made by ``call`` (``_db``: reconnect and retry)."""
        lease, progress = shard.lease, shard.progress
        retry: list[str] = []
        self._take_behind(shard, ledger, call)
        if shard.ok_ids:
            ids = shard.ok_ids
            self._stored(shard, ledger, call, ids, *self._put_results(ledger, call, lease, ids, shard.ok_out,
                                                                      shard.ok_cat, shard.ok_vec or None))
            shard.ok_ids.clear(); shard.ok_out.clear(); shard.ok_cat.clear(); shard.ok_vec.clear()
        if shard.failures:
            errors = {f.record_id: f.error for f in shard.failures.values()}
            counted = self._fail_records(ledger, call, lease, list(shard.failures.values()))
            for f in counted:
                shard.attempts[f.record_id] = f.attempts
                self.stats["failed"] += 1
                if f.dead:
                    self.stats["dead"] += 1
                    if progress is not None:
                        progress.add(1)
                    log.warning("%s: record %s dead-lettered after %d attempts", self.owner, f.record_id,
                                f.attempts)
                    self._count_dead(errors.get(f.record_id, ""), f.attempts)
                else:
                    retry.append(f.record_id)
            shard.failures.clear()
        shard.last_flush, shard.held_over = time.monotonic(), 0
        return retry

    def _count_dead(self, error: str, attempts: int) -> None:
        """Count a dead letter toward a halt: HALT_AFTER_DEAD in a row for the same setting's failure
        (``SETTING_FAILURES``), while this worker has stored nothing at all (every record it finished met
        it), stop every held shard, and the worker then halts the job naming the setting; the records not
        yet dead keep their attempts. A batch engine finishes the records that reach ``max_tokens`` in the
        same step, so a run of them in a row after stored ones is a share of the job, not every record."""
        reason = error.split("\n", 1)[0]
        setting = SETTING_FAILURES.get(reason)
        if setting is None:
            self._dead_in_a_row = ("", 0)
            return
        same, n = self._dead_in_a_row
        n = n + 1 if same == reason else 1
        self._dead_in_a_row = (reason, n)
        if n >= HALT_AFTER_DEAD and self.halting is None and not self.stats["stored"]:
            value = getattr(self.spec.params, setting.rpartition(".")[2], None) if self.spec else None
            self.halting = (f"{n} records in a row dead-lettered '{reason}' after {attempts} attempts each, none "
                            f"stored between: {setting} ({value}) is too small for what the output schema asks; "
                            f"raise {setting} in the spec and submit it again (a new job version)")
            for held in self.held:
                held.halt.set()

    def _put_results(self, ledger: Ledger, call: typing.Callable[..., Any], lease: Lease, ids: list[str],
                     outputs: list[str], categories: list[str | None], vectors: list[bytes] | None = None
                     ) -> tuple[int, list[tuple[str, str, str]]]:
        """Write a batch of results: (rows new, [(record_id, output, reason)] the database refused).

        A batch PostgreSQL refuses as data (an output jsonb will not take that
        ``check_for_storage`` let through) is written again one result at a
        time: the results it takes are kept, each it refuses becomes a failed
        attempt of its record, and the worker carries on."""
        try:
            return call(ledger.put_results, lease, ids, outputs, categories, vectors), []
        except _DATA_ERRORS as exc:
            log.warning("%s: shard %d: the database refused a batch of %d results (%s); writing them one by one",
                        self.owner, lease.shard_no, len(ids), db.first_line(exc))
        n, refused = 0, []
        for i, (rid, out, cat) in enumerate(zip(ids, outputs, categories)):
            try:
                n += call(ledger.put_results, lease, [rid], [out], [cat], vectors[i:i + 1] if vectors else None)
            except _DATA_ERRORS as exc:
                refused.append((rid, out, f"output cannot be stored: {db.first_line(exc)}"[:300]))
        return n, refused

    def _fail_records(self, ledger: Ledger, call: typing.Callable[..., Any], lease: Lease,
                      failures: list[Failure]) -> list[FailedAttempt]:
        """Count failed attempts; a batch the database refuses as data is sent
        one by one, and a failure it still refuses is counted without its raw
        output and error text."""
        try:
            return call(ledger.fail, lease, failures)
        except _DATA_ERRORS as exc:
            log.warning("%s: shard %d: the database refused %d failed attempts (%s); sending them one by one",
                        self.owner, lease.shard_no, len(failures), db.first_line(exc))
        counted: list[FailedAttempt] = []
        for f in failures:
            try:
                counted += call(ledger.fail, lease, [f])
            except _DATA_ERRORS as exc:
                bare = Failure(f.record_id, f"failure details could not be stored: {db.first_line(exc)}"[:300],
                               None, f.attempt)
                counted += call(ledger.fail, lease, [bare])
        return counted


def _direct(fn: typing.Callable[..., Any], *args: Any) -> Any:
    """A ledger call made once (``Worker._db`` retries on the worker's own connection)."""
    return fn(*args)


# What PostgreSQL (DataError) or the client's encoder (UnicodeEncodeError) refuses as data.
_DATA_ERRORS = (psycopg.DataError, UnicodeEncodeError)


class _Progress:
    """A log line every N records or every few seconds (``status.Progress``): shard progress, rate, ETA,
    and the job's progress when its counts were read (at most every few seconds, and at the shard's end)."""

    def __init__(self, worker: Worker, lease: Lease, total: int):
        self.w, self.lease, self.total = worker, lease, total
        self.meter = Progress(total, worker.cfg.progress_every, worker.cfg.progress_seconds)

    def add(self, n: int) -> None:
        m = self.meter
        if not m.add(n):
            return
        now = m.last
        job = ""
        # The job's counts (a query) at most every progress_seconds, and at the shard's end; none for a far worker
        # (--result-files): a round trip to a far ledger, for counts that leave out the results far workers hold.
        if not self.w.cfg.result_files and (m.done >= self.total
                                            or now - self.w.job_counts_at >= self.w.cfg.progress_seconds):
            self.w.job_counts_at = now
            try:
                assert self.w.conn is not None
                c = job_counts(self.w.conn, self.lease.job_version)
                job_eta = c["outstanding"] / m.rate if m.rate > 0 else float("inf")
                job = (f"; job {c['stored']}/{c['records']} stored, {c['dead_letters']} dead, "
                       f"{c['outstanding']} outstanding (ETA {duration(job_eta)} at this worker's rate)")
            except psycopg.Error:
                pass
        log.info("%s: shard %d: %s%s", self.w.owner, self.lease.shard_no, m.text(), job)


def run_worker(cfg: WorkerConfig, own_process: bool = False,
               fatal_to: typing.Callable[[str], None] | None = None) -> int:
    """Run a worker to its exit status; ``fatal_to``, when given, gets the line saying why it stops
    (``Worker._fatal``) instead of the log."""
    worker = Worker(cfg, own_process)
    worker.fatal_to = fatal_to
    return worker.run()


def _flags() -> list[tuple[dataclasses.Field, dict[str, Any]]]:
    """``WorkerConfig``'s flag fields with their argparse settings, in declaration order."""
    hints = typing.get_type_hints(WorkerConfig)
    out = []
    for f in dataclasses.fields(WorkerConfig):
        meta = f.metadata.get("flag")
        if meta is None:
            continue
        meta = dict(meta)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        help_text, env, shown = meta.pop("help"), meta.pop("env"), meta.pop("shown")
        kwargs: dict[str, Any] = {"dest": f.name, **meta}
        if "action" not in kwargs:
            kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
            if kind is not str:
                kwargs["type"] = kind
            default = f.default if env is None else kind(os.environ.get(env, f.default))
            if default is not None:
                kwargs["default"] = default
        elif kwargs["action"] == "store_false":
            kwargs["default"] = f.default
        if help_text and shown:
            help_text += f" (default {f.default:g})"
        if help_text:
            kwargs["help"] = help_text
        out.append((f, {"flag": flag, **kwargs}))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's flags, from ``WorkerConfig``: shared by ``batch-inference worker`` and ``python -m gpu_runner``."""
    p.add_argument("job_version")
    for _, kwargs in _flags():
        kwargs = dict(kwargs)
        p.add_argument(kwargs.pop("flag"), **kwargs)


def parse_engine_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags to an options dict; a VALUE that parses as JSON is taken as JSON."""
    opts: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise InvalidValue(f"--engine-option {item!r}: expected KEY=VALUE")
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return opts


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    values = {f.name: getattr(args, f.name) for f, _ in _flags()}
    values["engine_options"] = parse_engine_options(values["engine_options"]) if values["engine_options"] else None
    return WorkerConfig(job_version=args.job_version, db_url=getattr(args, "db", None), **values)


def main(argv: list[str] | None = None) -> int:
    """``python -m gpu_runner JOB_VERSION [flags]``: the container entrypoint. It
    builds only the worker's own parser, so nothing else in the CLI can stop a
    worker from starting."""
    p = argparse.ArgumentParser(prog="gpu_runner", description="a batch-inference worker")
    p.add_argument("--db", default=None, help="PostgreSQL URL (default: $BATCH_INFERENCE_DB, else embedded)")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except InvalidValue as exc:
        print(f"gpu_runner: error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    return run_worker(cfg, own_process=True)
