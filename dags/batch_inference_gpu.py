"""batch_inference_gpu: the backfill with one worker per GPU pod on Kubernetes.

The same pipeline as ``batch_inference_backfill``; the workers are GPU pods
that one task, ``gpu_workers`` (``GpuAutopilotOperator``), creates and
removes through the cncf-kubernetes provider's ``KubernetesHook``, one pod per
worker:

* how many: the ``workers`` Param; when the job's spec turns the autopilot on
  (``autopilot.enabled``), the size the cutoff watch decides at every poll,
  within ``cost.min_workers`` .. ``cost.max_workers`` (docs/deadlines.md, "The
  autopilot"): pods are added when the batch falls behind and removed with a
  preemption notice when it is ahead;
* image: the GPU runner (``Dockerfile``: vLLM, this package, no Airflow),
  command ``batch-inference worker JOB_VERSION``, one of ``RUNNER_IMAGES``:
  the trigger form offers only those, and the task refuses any other
  (whoever can trigger the DAG cannot run an image of their choosing with the
  worker Secret);
* ``nvidia.com/gpu`` limits, tolerations for GPU and spot taints, a node
  selector for GPU nodes, the low priority class ``batch-low`` (interactive
  serving preempts it), and an optional Kueue queue label;
* a termination grace period of the worker's grace plus a margin, so a pod
  told to leave finishes its in-flight records and releases its lease before
  the kubelet kills it;
* ``BATCH_INFERENCE_DB`` from the Secret ``batch-inference-worker-db``: the
  worker's own least-privilege role, never Airflow's connection.

A preempted pod (exit 143, evicted, its node shut down) is replaced at the
next pass and the new pod claims the shard the old one released; a pod whose
weights or configuration are wrong fails the task at once, and so do more than
five other failures, with each failed pod's last log lines in the task log.
Nothing here runs without a cluster: tests build the pod specs with
``dry_run=True`` and validate them against the Kubernetes schema.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param

from batch_inference.callbacks import deadline_alert
from batch_inference.data import DEMO_DATASET
from batch_inference.operators.gpu_autopilot import gpu_autopilot_workers
from batch_inference.hooks import DEFAULT_CONN_ID
from batch_inference.operators.pipeline import (
    batch_inference_pipeline,
    pipeline_dag_args,
    pipeline_params,
)


# The runner images a run may choose, set here by the DAG's author: tags, or
# name@sha256:... digest pins for images that cannot change under a tag.
RUNNER_IMAGES = ("batch-inference-gpu:0.1.0",)


gpu_workers = gpu_autopilot_workers(
    workers="{{ params.workers }}",
    namespace="batch-inference",
    reconcile_seconds=30,
    max_pod_failures=5,
    pod_kwargs={
        "image": "{{ params.image }}",
        "allowed_images": RUNNER_IMAGES,
        "engine": "{{ params.engine }}",
        "kueue_queue": "{{ params.kueue_queue }}",
        "priority_class_name": "batch-low",
        "grace_seconds": 90,          # AWS gives 120 s of notice: 90 s to finish in-flight records,
        "grace_margin_seconds": 15,   # then release the lease and exit, well inside the notice
        "model_pvc": "batch-inference-models",
    },
)


with DAG(
    dag_id="batch_inference_gpu",
    description="Backfill on GPU pods: one worker per pod, preemptible, low priority",
    schedule=None,
    tags=["batch-inference", "kubernetes"],
    doc_md=__doc__,
    params={
        **pipeline_params(shard_size=5000, workers=8, max_workers=512, engine="vllm", deadline="+20h",
                          workers_title="GPU workers (pods)",
                          workers_description="One worker per pod, one GPU each (with the spec's autopilot on: "
                                              "the size until it has decided)"),
        "image": Param(RUNNER_IMAGES[0], type="string", enum=list(RUNNER_IMAGES), title="Runner image",
                       description="One of the images this DAG's author allows (RUNNER_IMAGES)"),
        "kueue_queue": Param("batch", type="string", title="Kueue LocalQueue",
                             description="Pods carry kueue.x-k8s.io/queue-name; Kueue admits them by quota"),
    },
    deadline=deadline_alert(timedelta(hours=20), dataset=DEMO_DATASET, postgres_conn_id=DEFAULT_CONN_ID),
    **pipeline_dag_args(DEFAULT_CONN_ID),
) as dag:
    batch_inference_pipeline(dataset=DEMO_DATASET, workers=gpu_workers, cutoff_poll_interval=300)
