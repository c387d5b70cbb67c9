"""GPU worker pods reconciled to the autopilot's desired size, through the Kubernetes hook.

``GpuPodLauncher`` is the Kubernetes launcher of ``batch_inference.autopilot``: it reads the
fleet's desired size from the ledger (``bi.fleet_size``, which the autopilot in the cutoff
watch writes) and makes the job's worker pods match it, as a Kubernetes controller would:
it lists the pods it owns (labels ``batch-inference/job-version`` and
``batch-inference/autopilot``), creates the missing ones through the cncf-kubernetes
provider's ``KubernetesHook`` (``core_v1_client.create_namespaced_pod``) and deletes the
surplus, newest slot first (``delete_namespaced_pod`` with the pod's termination grace: the
kubelet sends SIGTERM, the worker's preemption notice, and it releases its lease at once).
Each pod is the pod ``GpuWorkerPodOperator`` builds for its slot, with the same image
allow-list, GPU limits, tolerations, priority class, Kueue queue and worker Secret. The
launcher keeps no state of its own: a restarted one lists its pods and goes on.

``GpuAutopilotOperator`` runs it as a task: it grants the job version to the worker role,
then reconciles every ``reconcile_seconds`` until the job has nothing left for a worker (done,
or in fallback mode), recording what runs (``bi.fleet_observed``: the GPU-hours in the bill).
A pod that ends on a preemption (exit 143, or evicted or shut down with its node) is replaced
at the next pass, as a mapped pod's retry would be; one that exits with a halting code (the
weights' digest, the configuration) fails the task at once, and more than
``max_pod_failures`` other failures fail it too, each failure's last log lines in the task log.
With the spec's autopilot off the size is ``workers`` throughout. In fallback mode the pods still
running when the drain is over (``autopilot.drain_s`` after the cutoff) are deleted at once: that is
the GPU time the fallback's budget check reserves for them. A job whose engine is a hosted batch
transport is refused: its workers need no GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from batch_inference.exits import HALTING, ExitCode, describe
from batch_inference.hooks.batch_inference import BatchInferenceHook

AUTOPILOT_LABEL = "batch-inference/autopilot"
JOB_LABEL = "batch-inference/job-version"
SLOT_LABEL = "batch-inference/worker-slot"
ENDED = frozenset({"Succeeded", "Failed"})
# What the kubelet writes in a pod's status.reason when the pod ended with its node or was evicted: a
# preemption, as exit 143 (the worker's SIGTERM handled) is.
PREEMPTED_REASONS = frozenset({"Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated"})


@dataclass(frozen=True)
class PodFailure:
    """A worker pod that ended Failed: its name, the worker container's exit code (None when it never
    ran) and the pod's or the container's reason."""

    name: str
    exit_code: int | None
    reason: str

    @property
    def preempted(self) -> bool:
        return self.exit_code == ExitCode.PREEMPTED or self.reason in PREEMPTED_REASONS

    @property
    def halting(self) -> bool:
        return self.exit_code in HALTING

    def describe(self) -> str:
        what = describe(self.exit_code) if self.exit_code is not None else "no exit code"
        return f"pod {self.name} failed ({self.reason or 'no reason'}, exit {self.exit_code}: {what})"


def pod_name(job_version: str, slot: int) -> str:
    """A DNS-1123 name per job version and slot (the job version's underscore is not allowed)."""
    return f"bi-worker-{job_version.lower().replace('_', '-')}-{slot}"[:63]


class GpuPodLauncher:
    """The job's GPU worker pods, counted, added and removed through ``hook.core_v1_client``.

    ``build(slot)`` returns the pod (a ``V1Pod``) for a slot; ``grace_seconds`` is the deletion's
    grace period (the pod's own termination grace)."""

    def __init__(self, hook: Any, namespace: str, job_version: str, build: Callable[[int], Any],
                 grace_seconds: int, log: Any = None, container: str = "base") -> None:
        self.hook, self.namespace, self.job_version = hook, namespace, job_version
        self.build, self.grace_seconds, self.log = build, grace_seconds, log
        self.container = container  # the worker's container (KubernetesPodOperator's base container)
        self._pass: list[Any] | None = None   # the pods listed in this pass (``one_pass``)
        self._in_pass = False

    @property
    def selector(self) -> str:
        return f"{JOB_LABEL}={self.job_version},{AUTOPILOT_LABEL}=true"

    @contextmanager
    def one_pass(self) -> Iterator[None]:
        """One reconcile pass: the pods are listed once, and again only after ``scale`` added or
        removed one. Outside a pass every call lists them."""
        self._in_pass, self._pass = True, None
        try:
            yield
        finally:
            self._in_pass, self._pass = False, None

    def pods(self) -> list[Any]:
        if self._pass is not None:
            return self._pass
        listed = list(self.hook.core_v1_client.list_namespaced_pod(namespace=self.namespace,
                                                                   label_selector=self.selector).items)
        if self._in_pass:
            self._pass = listed
        return listed

    def live(self) -> list[Any]:
        """Pods neither ended nor being deleted, by slot."""
        out = [p for p in self.pods() if p.metadata.deletion_timestamp is None
               and (p.status is None or p.status.phase not in ENDED)]
        return sorted(out, key=lambda p: int(p.metadata.labels.get(SLOT_LABEL, 0)))

    def drained(self) -> bool:
        """A worker pod exited 0: it found nothing left to claim, so no pod is added."""
        return any(p.status is not None and p.status.phase == "Succeeded" for p in self.pods())

    def running(self) -> int:
        return len(self.live())

    def failures(self) -> list[PodFailure]:
        """The job's pods that ended Failed and were not deleted by this launcher, oldest slot first."""
        out = []
        for p in self.pods():
            if p.status is None or p.status.phase != "Failed" or p.metadata.deletion_timestamp is not None:
                continue
            code, reason = None, p.status.reason or ""
            for c in p.status.container_statuses or []:
                term = c.state.terminated if c.state is not None else None
                if c.name == self.container and term is not None:
                    code, reason = term.exit_code, reason or term.reason or ""
            out.append((int(p.metadata.labels.get(SLOT_LABEL, 0)), PodFailure(p.metadata.name, code, reason)))
        return [f for _, f in sorted(out, key=lambda x: x[0])]

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a pod's worker log, or why they cannot be read."""
        try:
            return str(self.hook.core_v1_client.read_namespaced_pod_log(
                name=name, namespace=self.namespace, container=self.container, tail_lines=lines))
        except Exception as exc:  # noqa: BLE001 - the log is a courtesy; the failure is reported either way
            return f"(log unavailable: {type(exc).__name__})"

    def scale(self, n: int, grace_seconds: int | None = None) -> None:
        """Run ``n`` pods; the surplus is deleted with ``grace_seconds`` (default: the pod's own grace)."""
        from kubernetes.client import ApiClient

        live = self.live()
        if n > len(live) and self.drained():
            n = len(live)
        # Every listed pod keeps its name (an ended or terminating pod still exists): new slots avoid them.
        taken = {int(p.metadata.labels.get(SLOT_LABEL, -1)) for p in self.pods()}
        if n != len(live):
            self._pass = None   # what was listed no longer holds once a pod is added or removed
        slot = 0
        for _ in range(n - len(live)):
            while slot in taken:
                slot += 1
            taken.add(slot)
            body = ApiClient().sanitize_for_serialization(self.build(slot))
            self.hook.core_v1_client.create_namespaced_pod(namespace=self.namespace, body=body)
            self._say("added pod %s (slot %d)", body["metadata"]["name"], slot)
        for pod in reversed(live[n:] if n < len(live) else []):
            # The kubelet sends SIGTERM and waits the grace: the worker's preemption notice.
            grace = self.grace_seconds if grace_seconds is None else grace_seconds
            self.hook.core_v1_client.delete_namespaced_pod(name=pod.metadata.name, namespace=self.namespace,
                                                           grace_period_seconds=grace)
            self._say("removed pod %s: SIGTERM, %d s grace", pod.metadata.name, grace)

    def _say(self, msg: str, *args: Any) -> None:
        if self.log is not None:
            self.log.info(msg, *args)


class GpuAutopilotOperator(BaseOperator):
    """GPU worker pods for ``job_version``, as many as the autopilot wants (``bi.fleet_size``).

    Takes ``GpuWorkerPodOperator``'s pod arguments (``pod_kwargs``: image, allowed_images, gpus,
    kueue_queue, priority_class_name, grace_seconds, model_pvc...). ``workers`` is the size until
    the autopilot has decided; the spec's ``cost.min_workers`` .. ``cost.max_workers`` bound it.

    :param kubernetes_conn_id: the cncf-kubernetes connection the hook uses.
    :param reconcile_seconds: how often the desired size is read and the pods listed.
    :param drain_timeout_s: how long to wait, once the job needs no worker, for the pods to end.
    :param max_pod_failures: failed pods (other than preemptions) the task replaces before it fails.
    """

    template_fields: Sequence[str] = ("job_version", "workers", "pod_kwargs")
    ui_color = "#c9e4f5"

    def __init__(self, *, job_version: Any, workers: int | str = 1, namespace: str = "batch-inference",
                 kubernetes_conn_id: str = "kubernetes_default",
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name, reconcile_seconds: float = 30.0,
                 pod_kwargs: Mapping[str, Any] | None = None, drain_timeout_s: float = 900.0,
                 max_pod_failures: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job_version, self.workers, self.namespace = job_version, workers, namespace
        self.kubernetes_conn_id, self.postgres_conn_id = kubernetes_conn_id, postgres_conn_id
        self.reconcile_seconds = reconcile_seconds
        self.drain_timeout_s = drain_timeout_s
        self.pod_kwargs = dict(pod_kwargs or {})
        if "allowed_images" not in self.pod_kwargs and "{{" in str(self.pod_kwargs.get("image", "")):
            # A templated image (a Param) needs the DAG author's list, as GpuWorkerPodOperator's does.
            self.pod_kwargs["allowed_images"] = ()
        self.max_pod_failures = max_pod_failures
        self._reported: set[str] = set()

    def hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    def pod_operator(self, job_version: str, slot: int) -> Any:
        from batch_inference.operators.gpu_pods import GpuWorkerPodOperator

        kw = dict(self.pod_kwargs)
        labels = {**dict(kw.pop("labels", {}) or {}), AUTOPILOT_LABEL: "true"}
        return GpuWorkerPodOperator(task_id=f"{self.task_id}_slot_{slot}", job_version=job_version, worker_slot=slot,
                                    namespace=self.namespace, name=pod_name(job_version, slot),
                                    random_name_suffix=False, labels=labels, **kw)

    def launcher(self, job_version: str) -> GpuPodLauncher:
        probe = self.pod_operator(job_version, 0)
        probe.check_image()
        return GpuPodLauncher(self.hook(), self.namespace, job_version,
                              lambda slot: self.pod_operator(job_version, slot).build_pod_request_obj(dry_run=True),
                              int(probe.termination_grace_period or 0), self.log, probe.base_container_name)

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference import autopilot, db
        from batch_inference.status import job_counts, job_spec

        job_version = str(self.job_version or "").strip()
        if not job_version:
            raise AirflowFailException("no job version (did the submit task push one?)")
        launcher = self.launcher(job_version)  # refuses an image outside the allow-list before anything
        conninfo = BatchInferenceHook(self.postgres_conn_id, migrate=False).get_conninfo()
        with db.connect(conninfo) as conn:
            spec = job_spec(conn, job_version)
        if autopilot.hosted(spec):
            raise AirflowFailException(f"{job_version}: engine {spec.engine.name!r} is a hosted batch transport: its "
                                       "records go to the provider, so no GPU worker is started (run its workers "
                                       "with the local workers launcher)")
        bounds = (spec.cost.min_workers, spec.cost.max_workers)
        role = self.pod_kwargs.get("grant_role", "bi_worker")
        if role:
            from batch_inference.operators.grants import grant_worker_role

            grant_worker_role(self.postgres_conn_id, role, job_version)
        name, largest, passes = f"k8s:{self.namespace}", 0, 0
        while True:
            with launcher.one_pass(), db.connect(conninfo) as conn:
                self.check_failures(launcher)
                counts = job_counts(conn, job_version)
                if counts["outstanding"] == 0 or counts["mode"] != "batch":
                    autopilot.observe(conn, job_version, name, launcher.running())
                    break
                size = autopilot.reconcile(conn, job_version, name, launcher.running, launcher.scale,
                                           int(self.workers), bounds)
            largest, passes = max(largest, size), passes + 1
            time.sleep(self.reconcile_seconds)
        # The workers drain by themselves (nothing to claim, or refused in fallback mode); their GPU
        # time counts until the last pod has ended. In fallback mode a pod still running once the drain
        # is over (autopilot.drain_s after the cutoff: its lease is gone, it holds nothing) is deleted
        # at once, so the GPU time the budget reserved for the drain is the most it costs.
        end = time.monotonic() + self.drain_timeout_s
        cut = self.drain_over(conninfo, job_version, spec) if counts["mode"] == "fallback" else None
        while launcher.running() and time.monotonic() < end:
            if cut is not None and time.monotonic() >= cut:
                launcher.scale(0, grace_seconds=0)
                cut = None
            with db.connect(conninfo) as conn:
                autopilot.observe(conn, job_version, name, launcher.running())
            wait = self.reconcile_seconds if cut is None else min(self.reconcile_seconds, max(0.0, cut - time.monotonic()))
            time.sleep(wait)
        with db.connect(conninfo) as conn:
            autopilot.observe(conn, job_version, name, launcher.running())
        return {"job_version": job_version, "largest": largest, "passes": passes, "mode": counts["mode"],
                "outstanding": int(counts["outstanding"])}


    @staticmethod
    def drain_over(conninfo: str, job_version: str, spec: Any) -> float:
        """When (``time.monotonic()``) the drain is over: ``autopilot.drain_s`` after the job entered
        fallback mode, on the database's clock."""
        from batch_inference import autopilot, db

        with db.connect(conninfo) as conn:
            job = conn.execute(db.q("cutoff_job"), {"job": job_version}).fetchone()
        since = (job["db_now"] - job["fallback_at"]).total_seconds() if job and job["fallback_at"] else 0.0
        return time.monotonic() + max(0.0, autopilot.drain_s(spec) - since)

    def check_failures(self, launcher: GpuPodLauncher) -> None:
        """Log each newly failed pod with its last log lines; fail the task on a halting exit or on more
        than ``max_pod_failures`` failures that were not preemptions."""
        failures = launcher.failures()
        for f in failures:
            if f.name not in self._reported:
                self._reported.add(f.name)
                level = self.log.info if f.preempted else self.log.error
                level("%s%s; last log lines:\n%s", f.describe(), ": replaced" if f.preempted else "",
                      launcher.log_tail(f.name))
        halting = [f for f in failures if f.halting]
        if halting:
            raise AirflowFailException(f"{halting[0].describe()}; no pod is started again")
        crashed = [f for f in failures if not f.preempted]
        if len(crashed) > self.max_pod_failures:
            raise AirflowFailException(f"{len(crashed)} worker pods failed (more than max_pod_failures="
                                       f"{self.max_pod_failures}); the last: {crashed[-1].describe()}")


def gpu_autopilot_workers(*, workers: Any = "{{ params.workers }}", **kwargs: Any) -> Callable[[Any, str], Any]:
    """A worker launcher for ``batch_inference_pipeline`` (task id ``gpu_workers``): GPU pods as many as the
    autopilot wants, ``workers`` until it has decided. ``kwargs`` go to ``GpuAutopilotOperator``."""

    def launch(job_version: Any, postgres_conn_id: str) -> Any:
        return GpuAutopilotOperator(task_id="gpu_workers", job_version=job_version, workers=workers,
                                    postgres_conn_id=postgres_conn_id, **kwargs)

    return launch
