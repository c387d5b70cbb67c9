"""Workers from Airflow: local processes, or GPU pods on Kubernetes.

Both run the same worker (``gpu_runner``: lease a shard, run the engine,
write keyed results) and know nothing of each other; the shard table is the
only coordination. A preempted worker loses only its in-flight records, so
restarting one (a new process, a new pod) is always safe.

* ``LocalWorkersOperator`` runs N ``python -m gpu_runner`` processes on the
  Airflow worker: the embedded default and the demo.
* ``GpuWorkerPodOperator`` (and ``gpu_worker_pods``, mapped over N workers)
  runs one worker per pod: the GPU runner image, ``nvidia.com/gpu`` limits,
  spot/GPU tolerations, a low priority class, an optional Kueue queue, a
  termination grace period that covers the worker's preemption handling, and
  the worker's own database credentials from a Kubernetes Secret.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook

# Exit codes of gpu_runner.worker, and what each means for the task.
EXIT_OK = 0
FATAL_EXITS = {
    2: "the ledger database stayed unreachable",
    3: "the model weights do not match the digest the spec pins (or are missing)",
    4: "configuration error (unknown job version or engine)",
    6: "the engine endpoint is unavailable (most requests failed in transport); shards released, records left "
       "pending with no attempts spent",
}
# 143: the worker handled SIGTERM (a preemption notice) and released its lease;
# -15: killed by SIGTERM before its handler was installed. Neither is the
# worker's fault: start another.
PREEMPTED_EXITS = {143, -signal.SIGTERM}


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
    env.update({"BATCH_INFERENCE_DB": db_url, "PYTHONUNBUFFERED": "1"})
    return env


def grant_worker_role(postgres_conn_id: str, role: str, job_version: str) -> bool:
    """Grant ``job_version`` to the worker ``role`` over the owner connection ``postgres_conn_id``
    (``batch_inference.plan.grant_job``); True if newly granted. A refusal fails the task."""
    from batch_inference import db
    from batch_inference.plan import GrantRefused, grant_job
    from batch_inference.status import UnknownJob

    try:
        with db.connect(BatchInferenceHook(postgres_conn_id, migrate=False).get_conninfo()) as conn:
            return grant_job(conn, role, job_version)
    except (GrantRefused, UnknownJob) as exc:
        raise AirflowFailException(f"cannot grant {job_version} to worker role {role!r}: {exc}") from None


class _Slot:
    """One worker slot: the current process, its restarts and its last log lines."""

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None
        self.restarts = 0
        self.tail: collections.deque[str] = collections.deque(maxlen=15)
        self.exit_code: int | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}"


class LocalWorkersOperator(BaseOperator):
    """Run N worker processes on the Airflow worker until the job has nothing left to claim.

    Each worker is ``python -m gpu_runner JOB_VERSION``; its log lines are
    streamed into the task log with a ``[wN]`` prefix. A worker that exits
    with 143 (preempted: it released its lease) or crashes is restarted, up to
    ``max_restarts`` per slot. A fatal exit (2: database unreachable, 3: model
    digest mismatch, 4: configuration) stops the other workers and fails the
    task without retries, with the worker's last log lines.

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
    :param worker_conn_id: Airflow connection with the workers' own credentials (a LOGIN role in
        ``bi_worker``); the job version is granted to ``grant_role`` first, over
        ``postgres_conn_id``. None: the workers use ``postgres_conn_id`` (the owner). Templated.
    :param grant_role: the role granted the job version (default: the login of ``worker_conn_id``).
    """

    template_fields: Sequence[str] = ("job_version", "workers", "engine", "engine_options", "postgres_conn_id",
                                      "env", "worker_conn_id", "grant_role")
    template_fields_renderers = {"engine_options": "json", "env": "json"}
    ui_color = "#f5d195"

    def __init__(self, *, job_version: Any, workers: int | str = 2, engine: str | None = None,
                 engine_options: Mapping[str, Any] | None = None,
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name, max_restarts: int = 3,
                 grace_seconds: float = 20.0, env: Mapping[str, str] | None = None,
                 poll_seconds: float = 0.5, worker_conn_id: str | None = None, grant_role: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
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
        self._slots: list[_Slot] = []
        self._stopping = threading.Event()
        self._killed = threading.Event()

    # -- command line ------------------------------------------------------
    def worker_command(self, job_version: str, engine: str | None, options: Mapping[str, Any]) -> list[str]:
        cmd = [sys.executable, "-m", "gpu_runner", job_version, "--grace-seconds", str(self.grace_seconds)]
        if engine:
            cmd += ["--engine", engine]
        for key, value in options.items():
            cmd += ["--engine-option", f"{key}={json.dumps(value)}"]
        return cmd

    def _plan(self, conninfo: str, job_version: str, workers: int) -> tuple[str, dict[str, Any]]:
        """The engine and merged options, read from the job's pinned spec."""
        from batch_inference import db
        from batch_inference.status import UnknownJob, job_spec

        try:
            with db.connect(conninfo) as conn:
                spec = job_spec(conn, job_version)
        except UnknownJob as exc:
            raise AirflowFailException(str(exc)) from None
        engine = (self.engine or "").strip() or spec.engine.name
        # The CLI's --engine-option replaces the spec's options, so pass the merge.
        options = {**spec.engine.options, **dict(self.engine_options or {})}
        if engine == "llama-cpp" and "n_threads" not in options:
            # Several llama.cpp processes each using every CPU thrash; share them out.
            options["n_threads"] = max(1, (os.cpu_count() or 1) // workers)
        return engine, options

    # -- processes ---------------------------------------------------------
    def _start(self, slot: _Slot, cmd: list[str], env: dict[str, str]) -> None:
        slot.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1)
        slot.exit_code = None
        slot.reader = threading.Thread(target=self._stream, args=(slot, slot.proc), daemon=True,
                                       name=f"bi-{slot.name}-log")
        slot.reader.start()
        self.log.info("[%s] started pid %d", slot.name, slot.proc.pid)

    def _stream(self, slot: _Slot, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            slot.tail.append(line)
            self.log.info("[%s] %s", slot.name, line)

    def _signal_all(self, sig: int) -> None:
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is None:
                try:
                    slot.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _stop_all(self, wait: float) -> None:
        """SIGTERM (workers release their leases at once), then SIGKILL after ``wait``."""
        self._stopping.set()
        self._signal_all(signal.SIGTERM)
        end = time.monotonic() + wait
        for slot in self._slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                slot.proc.wait()
            if slot.reader is not None:
                slot.reader.join(timeout=2)

    def on_kill(self) -> None:
        # Airflow calls this from the task's SIGTERM handler (the task was marked
        # failed, cleared, or timed out) and then returns to execute(): the flag
        # makes execute() fail the try instead of reporting the stopped workers
        # as a success.
        self._killed.set()
        self._stop_all(self.grace_seconds + 5)

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
        cmd = self.worker_command(job_version, engine, options)
        env = worker_environment(self._worker_conninfo(job_version) or conninfo, options, self.env)
        self.log.info("starting %d local worker(s) for %s: engine %s, options %s", n, job_version, engine, options)

        self._slots = [_Slot(i) for i in range(n)]
        t0 = time.monotonic()
        for slot in self._slots:
            self._start(slot, cmd, env)
        try:
            self._supervise(cmd, env)
        except AirflowFailException as exc:
            self._stop_all(self.grace_seconds + 5)
            self._halt(conninfo, job_version, str(exc).splitlines()[0])
            raise
        except BaseException:
            self._stop_all(self.grace_seconds + 5)
            raise
        if self._killed.is_set():
            raise AirflowException(f"workers of {job_version} stopped from outside (the task was marked failed, "
                                   "cleared or timed out); their shards were released")

        with db.connect(conninfo) as conn:
            counts = job_counts(conn, job_version)
        elapsed = time.monotonic() - t0
        restarts = sum(s.restarts for s in self._slots)
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

    def _halt(self, conninfo: str, job_version: str, reason: str) -> None:
        """Record the fatal failure on the job: the cutoff watch then fails the run at its next poll."""
        from batch_inference import db

        try:
            with db.connect(conninfo) as conn:
                conn.execute(db.q("halt_job"), {"job": job_version, "reason": reason})
        except Exception as exc:  # noqa: BLE001 - the task fails with the worker's reason either way
            self.log.warning("could not record the halt on %s: %s", job_version, str(exc).strip()[:200])

    def _supervise(self, cmd: list[str], env: dict[str, str]) -> None:
        running = set(range(len(self._slots)))
        while running:
            for i in sorted(running):
                slot = self._slots[i]
                assert slot.proc is not None
                rc = slot.proc.poll()
                if rc is None:
                    continue
                if slot.reader is not None:
                    slot.reader.join(timeout=5)
                slot.exit_code = rc
                if rc == EXIT_OK or self._stopping.is_set():
                    running.discard(i)
                    continue
                tail = "\n".join(slot.tail)
                if rc in FATAL_EXITS:
                    # Retrying cannot fix these; the others are stopped so
                    # their leases are released now, not at expiry.
                    raise AirflowFailException(f"worker {slot.name} failed fatally (exit {rc}): {FATAL_EXITS[rc]}. "
                                               f"Last lines:\n{tail}")
                why = "preempted" if rc in PREEMPTED_EXITS else "crashed"
                if slot.restarts >= self.max_restarts:
                    raise AirflowException(f"worker {slot.name} {why} (exit {rc}) and was already restarted "
                                           f"{slot.restarts} time(s); giving up. Last lines:\n{tail}")
                slot.restarts += 1
                self.log.warning("[%s] %s (exit %s); restarting (%d/%d): its shard is pending again, "
                                 "only in-flight records are redone", slot.name, why, rc, slot.restarts,
                                 self.max_restarts)
                self._start(slot, cmd, env)
            time.sleep(self.poll_seconds)


# -- Kubernetes ---------------------------------------------------------------

DEFAULT_IMAGE = "batch-inference-gpu:0.1.0"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def default_tolerations() -> list[Any]:
    """GPU nodes and spot/preemptible nodes are tainted so ordinary pods stay off them."""
    from kubernetes.client import models as k8s

    return [
        k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),
        k8s.V1Toleration(key="cloud.google.com/gke-spot", operator="Equal", value="true", effect="NoSchedule"),
        k8s.V1Toleration(key="kubernetes.azure.com/scalesetpriority", operator="Equal", value="spot",
                         effect="NoSchedule"),
    ]


class GpuWorkerPodOperator(KubernetesPodOperator):
    """One batch worker in one GPU pod: ``batch-inference worker JOB_VERSION``.

    The pod asks for ``gpus`` ``nvidia.com/gpu``, tolerates the GPU and spot
    taints, runs at ``priority_class_name`` (low, so interactive serving
    preempts it), optionally joins a Kueue ``LocalQueue``, and gets
    ``grace_seconds + grace_margin_seconds`` to terminate: the worker spends
    ``grace_seconds`` finishing in-flight records after SIGTERM, then releases
    its lease; the margin covers the release and the process exit. Keep the
    sum within the cloud's preemption notice (120 s on AWS, about 30 s on GCP).

    The worker's database URL comes from the Kubernetes Secret
    ``worker_db_secret`` (key ``worker_db_secret_key``) as ``BATCH_INFERENCE_DB``:
    a login role in ``bi_worker``, which can claim shards and write results
    through the ledger's functions and nothing else, and only for job versions
    granted to it (sql/0004_roles.sql). Before the pod starts, the operator
    grants the job version to ``grant_role`` over Airflow's own (owner)
    connection; Airflow's credentials never reach the pod.

    :param job_version: the job version (templated; an XComArg works).
    :param worker_slot: this pod's slot number (the value ``gpu_worker_pods`` maps over).
    :param image: the GPU runner image (see the Dockerfile). Templated.
    :param allowed_images: the images ``image`` may render to, set by the DAG author (tags or
        ``name@sha256:`` digest pins); the task fails before the grant and the pod for any other.
        Default: the ``image`` given, if it is not a template; a templated image needs the list.
    :param gpus: ``nvidia.com/gpu`` limit per pod.
    :param engine: engine name overriding the spec's (e.g. ``vllm``).
    :param kueue_queue: Kueue LocalQueue name; sets ``kueue.x-k8s.io/queue-name``.
    :param model_pvc: a PersistentVolumeClaim with the weights, mounted read-only at ``model_mount_path``.
    :param grant_role: the worker login role (or a group of them, ``bi_worker`` for all) the job
        version is granted to before the pod starts; None skips the grant.
    :param postgres_conn_id: Airflow's connection to the ledger, used only for that grant.
    """

    template_fields: Sequence[str] = (*KubernetesPodOperator.template_fields, "job_version", "grant_role")

    def __init__(self, *, job_version: Any, worker_slot: int = 0, image: str = DEFAULT_IMAGE,
                 namespace: str = "batch-inference", gpus: int = 1, cpu: str = "8", memory: str = "64Gi",
                 engine: str | None = None, priority_class_name: str = "batch-low", kueue_queue: str | None = None,
                 kueue_priority_class: str | None = None, node_selector: Mapping[str, str] | None = None,
                 tolerations: list[Any] | None = None, extra_tolerations: list[Any] | None = None,
                 grace_seconds: int = 90, grace_margin_seconds: int = 15,
                 worker_db_secret: str = "batch-inference-worker-db", worker_db_secret_key: str = "url",
                 service_account_name: str = "batch-inference-worker", model_pvc: str | None = None,
                 model_mount_path: str = "/models", shm_size: str | None = "16Gi",
                 env: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
                 grant_role: str | None = "bi_worker",
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 allowed_images: Sequence[str] | None = None, **kwargs: Any) -> None:
        from kubernetes.client import models as k8s

        self.worker_slot = worker_slot
        arguments: list[Any] = ["worker", job_version, "--grace-seconds", str(grace_seconds)]
        if engine:
            arguments += ["--engine", engine]
        env_vars = [
            k8s.V1EnvVar(name="BATCH_INFERENCE_DB", value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(name=worker_db_secret, key=worker_db_secret_key))),
            k8s.V1EnvVar(name="BATCH_INFERENCE_GRACE_SECONDS", value=str(grace_seconds)),
            k8s.V1EnvVar(name="BATCH_INFERENCE_WORKER_SLOT", value=str(worker_slot)),
            # Where the pod runs, for the worker's owner id and the shard table.
            k8s.V1EnvVar(name="NODE_NAME", value_from=k8s.V1EnvVarSource(
                field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName"))),
            *(k8s.V1EnvVar(name=k, value=str(v)) for k, v in (env or {}).items()),
        ]
        pod_labels = {
            "app.kubernetes.io/name": "batch-inference-worker",
            "app.kubernetes.io/part-of": "batch-inference",
            "batch-inference/worker-slot": str(worker_slot),
            "batch-inference/job-version": job_version,   # templated with the rest of the labels
            **dict(labels or {}),
        }
        if kueue_queue:
            pod_labels[KUEUE_QUEUE_LABEL] = kueue_queue
        if kueue_priority_class:
            pod_labels[KUEUE_PRIORITY_LABEL] = kueue_priority_class
        volumes, mounts = [], []
        if model_pvc:
            volumes.append(k8s.V1Volume(name="models", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                claim_name=model_pvc, read_only=True)))
            mounts.append(k8s.V1VolumeMount(name="models", mount_path=model_mount_path, read_only=True))
        if shm_size:
            # vLLM's workers share tensors through /dev/shm; the container default is 64 MiB.
            volumes.append(k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                                       size_limit=shm_size)))
            mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))

        kwargs.setdefault("name", "batch-inference-worker")
        kwargs.setdefault("get_logs", True)
        kwargs.setdefault("on_finish_action", "delete_succeeded_pod")   # keep failed pods to look at
        kwargs.setdefault("image_pull_policy", "IfNotPresent")
        kwargs.setdefault("retries", 5)                                  # a preempted pod is retried
        kwargs.setdefault("startup_timeout_seconds", 1800)               # GPU nodes scale up slowly
        super().__init__(
            namespace=namespace,
            image=image,
            cmds=["batch-inference"],
            arguments=arguments,
            env_vars=env_vars,
            labels=pod_labels,
            annotations={"cluster-autoscaler.kubernetes.io/safe-to-evict": "true"},
            container_resources=k8s.V1ResourceRequirements(
                limits={"nvidia.com/gpu": str(gpus), "memory": memory},
                requests={"cpu": cpu, "memory": memory}),
            node_selector=dict(node_selector) if node_selector is not None else {"nvidia.com/gpu.present": "true"},
            tolerations=[*(tolerations if tolerations is not None else default_tolerations()),
                         *(extra_tolerations or [])],
            priority_class_name=priority_class_name,
            termination_grace_period=grace_seconds + grace_margin_seconds,
            service_account_name=service_account_name,
            automount_service_account_token=False,   # a worker needs no Kubernetes API access
            security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=10001,
                                                      seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
            container_security_context=k8s.V1SecurityContext(
                allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"])),
            volumes=volumes,
            volume_mounts=mounts,
            **kwargs,
        )
        self.job_version = job_version
        self.grant_role = grant_role
        self.postgres_conn_id = postgres_conn_id
        # A templated image (a Param) needs the DAG author's list; a literal one allows itself.
        self.allowed_images = tuple(allowed_images) if allowed_images is not None else (
            () if "{{" in image else (image,))

    def grant_job(self) -> bool:
        """Let ``grant_role`` work on this job version (idempotent; True if newly granted)."""
        return grant_worker_role(self.postgres_conn_id, self.grant_role, str(self.job_version))

    def execute(self, context: Context) -> Any:
        if self.image not in self.allowed_images:
            # Whoever can trigger the DAG must not choose what runs with the worker Secret.
            raise AirflowFailException(f"image {str(self.image)[:200]!r} is not one of the DAG's allowed runner "
                                       f"images ({', '.join(self.allowed_images) or 'none'})")
        if self.grant_role:
            new = self.grant_job()
            self.log.info("%s job version %s to worker role %s", "granted" if new else "already granted",
                          self.job_version, self.grant_role)
        return super().execute(context)


def gpu_worker_pods(*, task_id: str = "gpu_workers", job_version: Any, workers: Any, **kwargs: Any):
    """``GpuWorkerPodOperator`` mapped over ``workers`` slots: one pod per slot.

    ``workers`` is a number (slots 0..N-1), a list of slot numbers, or an
    XComArg that resolves to a list at run time (e.g. from a task reading
    ``params.workers``).
    """
    slots = list(range(workers)) if isinstance(workers, int) else workers
    return GpuWorkerPodOperator.partial(task_id=task_id, job_version=job_version, **kwargs).expand(worker_slot=slots)
