"""GPU worker pods on Kubernetes: one ``batch-inference worker`` per pod.

``GpuWorkerPodOperator`` (and ``gpu_worker_pods``, mapped over N worker
slots) runs the GPU runner image with ``nvidia.com/gpu`` limits, spot/GPU
tolerations, a low priority class, an optional Kueue queue, a termination
grace period that covers the worker's preemption handling, and the worker's
own database credentials from a Kubernetes Secret. It refuses any image
outside the DAG author's ``allowed_images``. The pods know nothing of each
other; the shard table is the only coordination, and a preempted pod loses
only its in-flight records, so its retry (a new pod) is always safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook
from batch_inference.ledger import FLEET_START_JITTER_SECONDS
from batch_inference.operators.grants import grant_worker_role

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
    granted to it (sql/schema/roles.sql). Before the pod starts, the operator
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
    :param start_jitter_seconds: the worker waits a random 0..S seconds before its first claim, so the
        slots' pods, started together, spread their first claims.
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
                 start_jitter_seconds: float = FLEET_START_JITTER_SECONDS,
                 worker_db_secret: str = "batch-inference-worker-db", worker_db_secret_key: str = "url",
                 service_account_name: str = "batch-inference-worker", model_pvc: str | None = None,
                 model_mount_path: str = "/models", shm_size: str | None = "16Gi",
                 env: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
                 grant_role: str | None = "bi_worker",
                 postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 allowed_images: Sequence[str] | None = None, **kwargs: Any) -> None:
        from kubernetes.client import models as k8s

        self.worker_slot = worker_slot
        arguments: list[Any] = ["worker", job_version, "--grace-seconds", str(grace_seconds),
                                "--start-jitter-seconds", str(start_jitter_seconds)]
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

    def check_image(self) -> None:
        """Whoever can trigger the DAG must not choose what runs with the worker Secret."""
        if self.image not in self.allowed_images:
            raise AirflowFailException(f"image {str(self.image)[:200]!r} is not one of the DAG's allowed runner "
                                       f"images ({', '.join(self.allowed_images) or 'none'})")

    def execute(self, context: Context) -> Any:
        self.check_image()
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
