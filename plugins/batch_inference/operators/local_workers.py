"""Local workers: N ``python -m gpu_runner`` processes on the Airflow worker.

``LocalWorkersOperator`` runs them on a ``batch_inference.fleet.Fleet``
until the job has nothing left to claim: the embedded default and the demo.
The workers know nothing of each other; the shard table is the only
coordination. A preempted worker loses only its in-flight records, so
restarting one is always safe. Each worker gets only the environment it
needs (``worker_environment``) and, with ``worker_conn_id``, its own
``bi_worker`` login granted the job version.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.exits import FATAL, ExitCode, describe
from batch_inference.fleet import Action, DeathWatch, Exit, Fleet, abandon_dead_worker, error_line, last_step
from batch_inference.hooks.batch_inference import BatchInferenceHook
from batch_inference.ledger import new_owner_id
from batch_inference.operators.grants import grant_worker_role

# What each fatal exit (``exits.FATAL``) means for the task: it fails without
# retries and the job is halted. Every other exit restarts the slot, up to
# ``max_restarts``: a preemption notice handled (143, or -15 before the handler
# was installed), an engine crash whose shard was given back (5: a new process
# loads the engine afresh), and any other crash.
FATAL_REASONS = {code: describe(code) for code in FATAL}


def _as_int(value: Any, name: str, minimum: int = 0) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise AirflowFailException(f"{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise AirflowFailException(f"{name} must be at least {minimum}, got {n}")
    return n


# What a local worker process inherits from the Airflow worker: enough to run
# Python and reach the engine, nothing of Airflow's configuration or secrets.
WORKER_ENV_KEEP = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CUDA_VISIBLE_DEVICES", "HF_HOME",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "BATCH_INFERENCE_HOME", "BATCH_INFERENCE_GRACE_SECONDS",
    "BATCH_INFERENCE_ENGINE_MODULES", "AIRFLOW__BATCH_INFERENCE__ALLOWED_ENGINE_MODULES",
    "XDG_CACHE_HOME", "BATCH_INFERENCE_CPU_PROBE_CACHE", "BATCH_INFERENCE_CPU_PROBE_FAULT",   # engines.cpu_probe
})


def worker_environment(db_url: str, engine_options: Mapping[str, Any], extra: Mapping[str, str] | None = None,
                       parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a local worker process: ``WORKER_ENV_KEEP`` and ``LC_*`` from
    ``parent`` (default: this process), the engine's API key variable (the ``api_key_env``
    engine option), the operator's ``env``, and the ledger URL as ``BATCH_INFERENCE_DB``."""
    parent = os.environ if parent is None else parent
    env = {k: v for k, v in parent.items() if k in WORKER_ENV_KEEP or k.startswith("LC_")}
    key_env = engine_options.get("api_key_env")
    if isinstance(key_env, str) and key_env in parent:
        env[key_env] = parent[key_env]
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    # The database address goes in the environment, never on the command
    # line, where `ps` would show its password to every user of the machine.
    env["BATCH_INFERENCE_DB"] = db_url
    return env


class LocalWorkersOperator(BaseOperator):
    """Run N worker processes on the Airflow worker until the job has nothing left to claim.

    Each worker is ``python -m gpu_runner JOB_VERSION``; its log lines are
    streamed into the task log with a ``[wN]`` prefix. A worker that exits
    with 143 (preempted: it released its lease), 5 (its engine crashed; the
    shard was given back) or crashes is restarted, up to ``max_restarts`` per
    slot. A fatal exit (2: database unreachable, 3: model digest mismatch,
    4: configuration, 6: endpoint unavailable) stops the other workers, halts
    the job and fails the task without retries, with the worker's last log lines.
    A worker ended by a signal the launcher did not send (a fault in the engine,
    an OOM kill) is named in the log with the signal, the engine and its last
    line; the shards it held are given back at once with that as their last
    error (``fleet.abandon_dead_worker``: pending again, counted as a lost
    lease; what it stored stays, no attempt is spent); and the same death at
    the same step again, with nothing stored or dead-lettered since, stops
    the launcher as a fatal exit does (``fleet.DeathWatch``).

    :param job_version: the job version to work on (usually
        ``submit.output["job_version"]``). Templated.
    :param workers: number of worker processes. Templated.
    :param engine: engine name overriding the spec's (``noop``, ``llama-cpp``...). Templated.
    :param engine_options: engine options merged over the spec's. Templated.
        For ``llama-cpp``, ``n_threads`` defaults to the CPUs divided among the workers.
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param max_restarts: restarts allowed per worker slot after preemption or a crash.
    :param grace_seconds: the worker's grace period after SIGTERM.
    :param env: extra environment for the worker processes. Templated. Nothing else of the
        Airflow worker's environment reaches them but ``WORKER_ENV_KEEP``, ``LC_*`` and the
        variable the ``api_key_env`` engine option names.
    :param poll_seconds: the longest the supervisor waits between looks at its workers (a
        worker's output ending wakes it at once).
    :param worker_conn_id: Airflow connection with the workers' own credentials (a LOGIN role in
        ``bi_worker``); the job version is granted to ``grant_role`` first, over
        ``postgres_conn_id``. None: the workers use ``postgres_conn_id`` (the owner). Templated.
    :param grant_role: the role granted the job version (default: the login of ``worker_conn_id``).
    :param autopilot: when the job's spec enables the autopilot (``autopilot.enabled``), reconcile the
        number of workers to the fleet's desired size in the ledger (``bi.fleet_size``, which the
        autopilot in the cutoff watch sets) every ``reconcile_seconds``, within the spec's
        ``cost.min_workers`` .. ``cost.max_workers``: ``workers`` is the size until the autopilot has
        decided, and a restarted task resumes from the ledger's size. False: a fixed fleet whatever the spec. A removed worker
        gets SIGTERM (it releases its lease at once). Either way each change of size is recorded
        (``bi.fleet_observed``): the batch workers' GPU-hours in the bill.
    :param reconcile_seconds: how often the autopilot's desired size is read and the size recorded.
    :param region: the workers' region, for a job version placed over regions (``python -m gpu_runner
        --region``: its own shards first, records read from its replicas). Templated.
    :param cluster: the cluster they run as (names the launcher in the fleet's record). Templated.
    :param result_files: far from the ledger: each shard's results handed in as one file, merged by the
        DAG's ``merge`` task (``--result-files``). Templated.
    """

    template_fields: Sequence[str] = ("job_version", "workers", "engine", "engine_options", "postgres_conn_id",
                                      "env", "worker_conn_id", "grant_role", "region", "cluster", "result_files")
    template_fields_renderers = {"engine_options": "json", "env": "json"}
    ui_color = "#f5d195"

    def __init__(self, *, job_version: Any, workers: int | str = 2, engine: str | None = None,
                 engine_options: Mapping[str, Any] | None = None,
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name, max_restarts: int = 3,
                 grace_seconds: float = 20.0, env: Mapping[str, str] | None = None,
                 poll_seconds: float = 0.5, worker_conn_id: str | None = None, grant_role: str | None = None,
                 autopilot: bool = True, reconcile_seconds: float = 5.0, region: str | None = None,
                 cluster: str | None = None, result_files: bool | str = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.region = region
        self.cluster = cluster
        self.result_files = result_files
        self.worker_conn_id = worker_conn_id
        self.grant_role = grant_role
        self.job_version = job_version
        self.workers = workers
        self.engine = engine
        self.engine_options = engine_options
        self.postgres_conn_id = postgres_conn_id
        self.max_restarts = max_restarts
        self.grace_seconds = grace_seconds
        self.env = env
        self.poll_seconds = poll_seconds
        self.autopilot = autopilot
        self.reconcile_seconds = reconcile_seconds
        self.fleet: Fleet | None = None
        self._killed = threading.Event()

    def worker_arguments(self, job_version: str, engine: str | None, options: Mapping[str, Any]) -> list[str]:
        """``python -m gpu_runner``'s arguments: the job version, the grace, the engine and its options."""
        import json

        args = [job_version, "--grace-seconds", str(self.grace_seconds)]
        region = str(self.region or "").strip()
        if region and region != "None":
            args += ["--region", region]
            if str(self.result_files).lower() in ("1", "true", "yes", "on"):
                args.append("--result-files")
        if engine:
            args += ["--engine", engine]
        for key, value in options.items():
            args += ["--engine-option", f"{key}={json.dumps(value)}"]
        return args

    def _plan(self, conninfo: str, job_version: str, workers: int) -> tuple[str, dict[str, Any]]:
        """The engine and merged options, read from the job's pinned spec (and, with the autopilot,
        the fleet's bounds into ``self._bounds``)."""
        from batch_inference import autopilot, db
        from batch_inference.status import UnknownJob, job_spec

        try:
            with db.connect(conninfo) as conn:
                spec = job_spec(conn, job_version)
        except UnknownJob as exc:
            raise AirflowFailException(str(exc)) from None
        self._bounds = (spec.cost.min_workers, spec.cost.max_workers)
        self._follow = bool(self.autopilot) and autopilot.steers(spec)   # not a hosted batch transport's workers
        engine = (self.engine or "").strip() or spec.engine.name
        # The merge, so the n_threads default below sees the spec's own.
        options = {**spec.engine.options, **dict(self.engine_options or {})}
        if engine == "llama-cpp" and "n_threads" not in options:
            # Several llama.cpp processes each using every CPU thrash; share them out.
            options["n_threads"] = max(1, (os.cpu_count() or 1) // workers)
        return engine, options

    def _stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop(self.grace_seconds + 5)
            # Deaths by a signal the stop collected, or that came in the same look as the one that
            # failed the task: their shards are given back too.
            for e in self.fleet.exits:
                if e.worker not in self._reported and e.died_by and not (e.expected or e.preempted):
                    self._died_by_signal(e, e.died_by, stopping=True)

    def on_kill(self) -> None:
        # Airflow calls this from the task's SIGTERM handler (the task was marked
        # failed, cleared, or timed out) and then returns to execute(): the flag
        # makes execute() fail the try instead of reporting the stopped workers
        # as a success.
        self._killed.set()
        self._stop()

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference import db
        from batch_inference.status import job_counts

        job_version = str(self.job_version or "").strip()
        if not job_version:
            raise AirflowFailException("no job version (did the submit task push one?)")
        n = _as_int(self.workers, "workers", minimum=1)
        hook = BatchInferenceHook(self.postgres_conn_id, migrate=False)
        conninfo = hook.get_conninfo()
        engine, options = self._plan(conninfo, job_version, n)
        env = worker_environment(self._worker_conninfo(job_version) or conninfo, options, self.env)
        self.log.info("starting %d local worker(s) for %s: engine %s, options %s", n, job_version, engine, options)

        cluster = str(self.cluster or "").strip()
        launcher = f"local:{self.task_id}" + (f"@{cluster}" if cluster and cluster != "None" else "")
        self._conninfo, self._job_version, self._engine = conninfo, job_version, engine
        self._deaths = DeathWatch()
        self._reported: set[Any] = set()      # the workers whose signal death was reported
        if self._follow:
            n = self._resume_size(conninfo, job_version, n)
        fleet = self.fleet = Fleet(self.worker_arguments(job_version, engine, options), env, n, log=self.log,
                                   fatal=FATAL, max_restarts=self.max_restarts,
                                   worker_ids=lambda name: new_owner_id(f"local-{name}"),
                                   on_killed=lambda w: self._give_back_leases(conninfo, job_version, w))
        t0 = time.monotonic()
        next_reconcile = 0.0
        try:
            if not self._killed.is_set():
                fleet.start_all()
            while fleet.active() and not self._killed.is_set():
                fleet.poll(on_exit=self._on_exit)
                if time.monotonic() >= next_reconcile:
                    # What runs is recorded either way: the workers' GPU-hours in the bill. A fixed fleet
                    # follows only the budget's stop (desired size 0: autopilot.stop_at_budget).
                    self._reconcile(conninfo, job_version, launcher, n)
                    next_reconcile = time.monotonic() + self.reconcile_seconds
                fleet.wait(self.poll_seconds)
        except AirflowFailException as exc:
            self._stop()
            self._halt(conninfo, job_version, str(exc).splitlines()[0])
            raise
        except BaseException:
            self._stop()
            raise
        finally:
            self._observe(conninfo, job_version, launcher, 0)
        if self._killed.is_set():
            self._stop()
            raise AirflowException(f"workers of {job_version} stopped from outside (the task was marked failed, "
                                   "cleared or timed out); their shards were released")

        with db.connect(conninfo) as conn:
            counts = job_counts(conn, job_version)
        elapsed = time.monotonic() - t0
        restarts = sum(fleet.restarts)
        self.log.info("workers done in %.1fs (%d restart(s)): %d/%d stored, %d dead letters, %d outstanding, mode %s",
                      elapsed, restarts, counts["stored"], counts["records"], counts["dead_letters"],
                      counts["outstanding"], counts["mode"])
        if counts["outstanding"] and counts["mode"] == "batch":
            self.log.warning("%d record(s) still outstanding although every worker exited cleanly",
                             counts["outstanding"])
        return {"job_version": job_version, "workers": n, "engine": engine, "restarts": restarts,
                "seconds": round(elapsed, 1), "records": counts["records"], "stored": counts["stored"],
                "dead_letters": counts["dead_letters"], "outstanding": counts["outstanding"],
                "mode": counts["mode"]}

    def _on_exit(self, e: Exit) -> None:
        """Fail the task on a fatal exit or a slot out of restarts; log a restart."""
        w, rc = e.worker, e.code
        tail = "\n".join(w.tail)
        if e.action is Action.FATAL:
            # Retrying cannot fix these; the others are stopped so their
            # leases are released now, not at expiry.
            cause = error_line(w)   # the halt's reason is this message's first line: the worker's own cause
            raise AirflowFailException(f"worker {w.name} failed fatally (exit {rc}): {FATAL_REASONS[rc]}"
                                       f"{': ' + cause if cause else ''}. Last lines:\n{tail}")
        sig = e.died_by if not (e.expected or e.preempted) else None
        if sig is not None:
            self._died_by_signal(e, sig)
        why = ("preempted" if e.preempted else f"died by {sig}" if sig else
               "engine crashed" if rc == ExitCode.ENGINE else "crashed")
        if e.action is Action.GAVE_UP:
            raise AirflowException(f"worker {w.name} {why} (exit {rc}) and was already restarted "
                                   f"{self.max_restarts} time(s); giving up. Last lines:\n{tail}")
        if e.action is Action.RESTART:
            assert self.fleet is not None
            self.log.warning("[%s] %s (exit %s); restarting (%d/%d): its shard is pending again, "
                             "only in-flight records are redone", w.name, why, rc, self.fleet.restarts[w.slot],
                             self.max_restarts)

    def _died_by_signal(self, e: Exit, sig: str, stopping: bool = False) -> None:
        """A worker ended by a signal the fleet did not send (a fault in the engine, an OOM kill): say
        which, in which engine, doing what; give back its shards at once with that as their error; and
        fail the task (the job halted: the cutoff watch ends the run) when it is the same death at the
        same step as before with nothing done since, since no restart would get further."""
        from batch_inference import db
        from batch_inference.status import job_counts

        w, job = e.worker, self._job_version
        self._reported.add(w)
        step = last_step(w) or "starting (it logged nothing)"
        error = f"worker {w.name} died by {sig} in engine {self._engine} while: {step}"
        self.log.error("[%s] %s", w.name, error)
        done = None
        try:
            with db.connect(self._conninfo) as conn:
                shards = abandon_dead_worker(conn, job, w.owner, error) if w.owner else []
                c = job_counts(conn, job)
                done = c["stored"] + c["dead_letters"]
        except Exception as exc:  # noqa: BLE001 - its leases expire instead; the restart goes on
            self.log.warning("[%s] could not give back what it held: %s", w.name, str(exc).strip()[:200])
            shards = []
        if shards:
            self.log.warning("[%s] its shard(s) %s pending again at once (what it stored stays; records it had "
                             "in flight are redone)", w.name, ", ".join(map(str, shards)))
        if stopping:
            return
        if done is not None and e.action is Action.RESTART and self._deaths.repeats(sig, step, done, w.owner):
            raise AirflowFailException(f"{error}; the same death as before with nothing done since, so no worker "
                                       f"of {job} can run here: not restarting (see the worker's lines above)")

    # -- the autopilot's launcher ---------------------------------------------
    def _resume_size(self, conninfo: str, job_version: str, n: int) -> int:
        """The ledger's desired size (a restarted task resumes from it), else ``workers``, within the bounds."""
        from batch_inference import autopilot, db

        with db.connect(conninfo) as conn:
            want = autopilot.desired_size(conn, job_version)
        lo, hi = self._bounds
        size = max(lo, min(hi, n if want is None else want))
        self.log.info("autopilot: starting %d worker(s) (%s)", size,
                      "the ledger's desired size" if want is not None else "no decision yet")
        return max(1, size)

    def _reconcile(self, conninfo: str, job_version: str, launcher: str, default: int) -> None:
        """Make the fleet run the ledger's desired size. Once a worker found nothing left to claim,
        no worker is added: the job is draining."""
        from batch_inference import autopilot, db

        fleet = self.fleet
        assert fleet is not None

        def scale(k: int) -> None:
            before = len(fleet.slots())
            k = min(k, before) if fleet.drained else k
            if k != before:
                fleet.scale_to(k)
                self.log.warning("autopilot: %d -> %d worker(s) (the ledger's desired size)", before, k)

        try:
            with db.connect(conninfo) as conn:
                autopilot.reconcile(conn, job_version, launcher, lambda: len(fleet.slots()), scale, default,
                                    self._bounds, follow=self._follow)
        except Exception as exc:  # noqa: BLE001 - the workers go on at their size; the next pass retries
            self.log.warning("autopilot: could not reconcile with the ledger: %s", str(exc).strip()[:200])

    def _observe(self, conninfo: str, job_version: str, launcher: str, running: int) -> None:
        from batch_inference import autopilot, db

        try:
            with db.connect(conninfo) as conn:
                autopilot.observe(conn, job_version, launcher, running)
        except Exception as exc:  # noqa: BLE001 - the bill then counts the last size until now
            self.log.warning("autopilot: could not record the fleet's end: %s", str(exc).strip()[:200])

    def _worker_conninfo(self, job_version: str) -> str | None:
        """The workers' own credentials, granted this job version; None without ``worker_conn_id``."""
        if not self.worker_conn_id:
            return None
        from psycopg.conninfo import conninfo_to_dict

        info = BatchInferenceHook(self.worker_conn_id, migrate=False).get_conninfo()
        role = self.grant_role or str(conninfo_to_dict(info).get("user") or "")
        if not role:
            raise AirflowFailException(f"connection {self.worker_conn_id!r} names no login; set grant_role")
        new = grant_worker_role(self.postgres_conn_id, role, job_version)
        self.log.info("%s job version %s to worker role %s; workers log in with connection %s",
                      "granted" if new else "already granted", job_version, role, self.worker_conn_id)
        return info

    def _give_back_leases(self, conninfo: str, job_version: str, w: Any) -> None:
        """The stop ended worker ``w`` by force before it released its leases (a loaded machine):
        release them here, each fenced by the owner and epoch it held, so no shard waits for its
        lease to expire."""
        from batch_inference import db
        from batch_inference.fleet import release_leases

        if w.owner is None:
            return
        with db.connect(conninfo) as conn:
            shards = release_leases(conn, job_version, w.owner)
        if shards:
            self.log.warning("[%s] ended by force: released its shard(s) %s", w.name,
                             ", ".join(map(str, shards)))

    def _halt(self, conninfo: str, job_version: str, reason: str) -> None:
        """Record the fatal failure on the job: the cutoff watch then fails the run at its next poll."""
        from batch_inference import db

        try:
            with db.connect(conninfo) as conn:
                conn.execute(db.q("halt_job"), {"job": job_version, "reason": reason})
        except Exception as exc:  # noqa: BLE001 - the task fails with the worker's reason either way
            self.log.warning("could not record the halt on %s: %s", job_version, str(exc).strip()[:200])
