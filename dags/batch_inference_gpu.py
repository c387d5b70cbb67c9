"""batch_inference_gpu: the backfill with one worker per GPU pod on Kubernetes.

The same pipeline as ``batch_inference_backfill``; the workers are
``GpuWorkerPodOperator`` pods mapped over the ``workers`` Param
(``.partial().expand()``), one pod per worker:

* image: the GPU runner (``Dockerfile``: vLLM, this package, no Airflow),
  command ``batch-inference worker JOB_VERSION``;
* ``nvidia.com/gpu`` limits, tolerations for GPU and spot taints, a node
  selector for GPU nodes, the low priority class ``batch-low`` (interactive
  serving preempts it), and an optional Kueue queue label;
* a termination grace period of the worker's grace plus a margin, so a pod
  told to leave finishes its in-flight records and releases its lease before
  the kubelet kills it;
* ``BATCH_INFERENCE_DB`` from the Secret ``batch-inference-worker-db``: the
  worker's own least-privilege role, never Airflow's connection.

A preempted pod exits 143 and fails its task try; the retry starts a new pod,
which claims the shard the old one released. Nothing here runs without a
cluster: tests build the pod specs with ``dry_run=True`` and validate them.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, task

from batch_inference.callbacks import OnCallNotifier, deadline_alert
from batch_inference.data import DEMO_DATASET, DEMO_SOURCE_TABLE, DEMO_SPEC
from batch_inference.operators import (
    FallbackPoolOperator,
    PublishOperator,
    SubmitJobOperator,
    ValidateOperator,
    dataset_asset,
    gpu_worker_pods,
)
from batch_inference.sensors.cutoff import CutoffSensor

CONN_ID = "batch_inference_default"

with DAG(
    dag_id="batch_inference_gpu",
    description="Backfill on GPU pods: one worker per pod, preemptible, low priority",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["batch-inference", "kubernetes"],
    doc_md=__doc__,
    params={
        "spec_path": Param(str(DEMO_SPEC), type="string", title="Job spec"),
        "source_table": Param(DEMO_SOURCE_TABLE, type="string", title="Snapshot source table"),
        "shard_size": Param(5000, type="integer", minimum=1, title="Shard size",
                            description="5,000 records: about 4.5 minutes of work on one GPU"),
        "workers": Param(8, type="integer", minimum=1, maximum=512, title="GPU workers (pods)"),
        "engine": Param("vllm", type="string", enum=["vllm", "llama-cpp", "openai", "noop"], title="Engine"),
        "image": Param("batch-inference-gpu:0.1.0", type="string", title="Runner image"),
        "kueue_queue": Param("batch", type="string", title="Kueue LocalQueue",
                             description="Pods carry kueue.x-k8s.io/queue-name; Kueue admits them by quota"),
        "deadline": Param("+20h", type="string", title="Deadline"),
    },
    default_args={
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "on_failure_callback": OnCallNotifier(postgres_conn_id=CONN_ID),
    },
    deadline=deadline_alert(timedelta(hours=20), dataset=DEMO_DATASET, postgres_conn_id=CONN_ID),
) as dag:
    submit = SubmitJobOperator(
        task_id="submit",
        spec="{{ params.spec_path }}",
        source_table="{{ params.source_table }}",
        shard_size="{{ params.shard_size }}",
        postgres_conn_id=CONN_ID,
    )
    job_version = submit.output["job_version"]

    @task
    def worker_slots(workers: int) -> list[int]:
        """One map index per pod; the count comes from the Param at run time."""
        return list(range(int(workers)))

    slots = worker_slots("{{ params.workers }}")
    workers = gpu_worker_pods(
        task_id="gpu_workers",
        job_version=job_version,
        workers=slots,
        image="{{ params.image }}",
        engine="{{ params.engine }}",
        kueue_queue="{{ params.kueue_queue }}",
        namespace="batch-inference",
        priority_class_name="batch-low",
        grace_seconds=90,            # AWS gives 120 s of notice: 90 s to finish in-flight records,
        grace_margin_seconds=15,     # then release the lease and exit, well inside the notice
        model_pvc="batch-inference-models",
        retries=5,                   # a preempted pod is a failed try; the retry is a new pod
    )

    @task(task_id="deadline")
    def resolve_deadline(deadline: str, run_after: str) -> str:
        from batch_inference.params import resolve_deadline

        return resolve_deadline(deadline, datetime.fromisoformat(run_after))

    deadline = resolve_deadline("{{ params.deadline }}", "{{ dag_run.run_after.isoformat() }}")
    cutoff = CutoffSensor(task_id="cutoff", job_version=job_version, deadline=deadline, poll_interval=300,
                          postgres_conn_id=CONN_ID)
    fallback = FallbackPoolOperator(task_id="fallback", job_version=job_version, postgres_conn_id=CONN_ID)
    validate = ValidateOperator(task_id="validate", job_version=job_version, postgres_conn_id=CONN_ID)
    publish = PublishOperator(task_id="publish", job_version=job_version, postgres_conn_id=CONN_ID,
                              outlets=[dataset_asset(DEMO_DATASET)])

    submit >> [slots, deadline]
    deadline >> cutoff >> fallback
    [workers, fallback] >> validate >> publish
