"""GPU worker pods, checked without a cluster.

There is no Kubernetes API server on these machines: the pod request is
built with ``dry_run=True`` (no kube-config, no hook), serialized the way the
Kubernetes client sends it, and validated against the Kubernetes 1.33 OpenAPI
schema with ``kubernetes_validate`` in strict mode (unknown fields fail).
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import pytest

from batch_inference.ledger import FLEET_START_JITTER_SECONDS

kubernetes_validate = pytest.importorskip("kubernetes_validate")

JOB = "jv_0123456789abcdef"


def pod_dict(op):
    from kubernetes.client import ApiClient

    pod = op.build_pod_request_obj(dry_run=True)
    d = ApiClient().sanitize_for_serialization(pod)
    kubernetes_validate.validate(d, "1.33", strict=True)
    return d


def make_op(**kw):
    from airflow.sdk import DAG

    from batch_inference.operators import GpuWorkerPodOperator

    with DAG("pods_test", schedule=None):
        return GpuWorkerPodOperator(task_id="w", job_version=JOB, **kw)


def test_the_pod_spec_is_valid_kubernetes_and_carries_the_gpu_settings():
    d = pod_dict(make_op(worker_slot=3, kueue_queue="gpu-batch", kueue_priority_class="batch-low-wpc",
                         model_pvc="models-pvc", gpus=2, grace_seconds=90, grace_margin_seconds=15))
    spec, meta = d["spec"], d["metadata"]
    (c,) = spec["containers"]
    assert c["command"] == ["batch-inference"]
    assert c["args"][:2] == ["worker", JOB] and "--grace-seconds" in c["args"]
    # the slots' pods start together: each worker waits a random part of this before its first claim
    assert c["args"][c["args"].index("--start-jitter-seconds") + 1] == str(FLEET_START_JITTER_SECONDS)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    keys = {(t["key"], t.get("value"), t["effect"]) for t in spec["tolerations"]}
    assert ("nvidia.com/gpu", None, "NoSchedule") in keys
    assert ("cloud.google.com/gke-spot", "true", "NoSchedule") in keys
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["priorityClassName"] == "batch-low"
    # The worker's grace (finish in-flight records) plus the margin (release, exit).
    assert spec["terminationGracePeriodSeconds"] == 105
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-batch"
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == "batch-low-wpc"
    assert meta["labels"]["batch-inference/worker-slot"] == "3"
    assert meta["labels"]["batch-inference/job-version"] == JOB
    # Least privilege: the worker's own database role from a Secret, no API token, not root.
    env = {e["name"]: e for e in c["env"]}
    assert env["BATCH_INFERENCE_DB"]["valueFrom"]["secretKeyRef"] == {"name": "batch-inference-worker-db",
                                                                     "key": "url"}
    assert "value" not in env["BATCH_INFERENCE_DB"]
    assert env["BATCH_INFERENCE_GRACE_SECONDS"]["value"] == "90"
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == "batch-inference-worker"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    assert spec["restartPolicy"] == "Never"      # a preempted pod fails its try; the retry is a new pod


def test_without_kueue_there_is_no_queue_label_and_overrides_apply():
    from kubernetes.client import models as k8s

    extra = k8s.V1Toleration(key="dedicated", operator="Equal", value="batch", effect="NoSchedule")
    d = pod_dict(make_op(node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                         extra_tolerations=[extra], engine="vllm", shm_size=None, priority_class_name="spot-batch"))
    assert "kueue.x-k8s.io/queue-name" not in d["metadata"]["labels"]
    assert d["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert {"key": "dedicated", "operator": "Equal", "value": "batch", "effect": "NoSchedule"} in d["spec"]["tolerations"]
    assert d["spec"]["containers"][0]["args"][-2:] == ["--engine", "vllm"]
    assert d["spec"]["priorityClassName"] == "spot-batch"
    assert "volumes" not in d["spec"] or not d["spec"]["volumes"]


def test_strict_validation_would_catch_a_bad_field():
    d = pod_dict(make_op())
    d["spec"]["containers"][0]["gpuCount"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, "1.33", strict=True)


def test_partial_expand_over_n_workers_parses_and_serializes():
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    from batch_inference.operators import GpuWorkerPodOperator, gpu_worker_pods

    with DAG("pods_mapped", schedule=None) as dag:
        mapped = gpu_worker_pods(job_version=JOB, workers=4, kueue_queue="q")
    assert mapped.operator_class is GpuWorkerPodOperator or mapped.operator_class.__name__ == "GpuWorkerPodOperator"
    assert mapped.expand_input.value == {"worker_slot": [0, 1, 2, 3]}
    restored = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    assert restored.get_task("gpu_workers").is_mapped
    # Each map index is the same operator with its slot: build them all.
    for slot in range(4):
        d = pod_dict(GpuWorkerPodOperator(task_id=f"w{slot}", job_version=JOB, worker_slot=slot, kueue_queue="q",
                                          dag=dag))
        assert d["metadata"]["labels"]["batch-inference/worker-slot"] == str(slot)


def test_the_gpu_dag_sizes_its_pods_by_the_workers_param_and_builds_them_from_the_form():
    """The shipped GPU DAG's workers are one GpuAutopilotOperator: ``workers`` pods (the autopilot's size when
    the spec turns it on); its pod arguments render from the trigger form, and each slot's pod is valid
    Kubernetes with the DAG's image, queue, priority class and grace."""
    from airflow.dag_processing.dagbag import DagBag

    from batch_inference.operators.gpu_autopilot import AUTOPILOT_LABEL
    from tests.fixtures.airflow_env import DAGS

    dag = DagBag(dag_folder=str(DAGS / "batch_inference_gpu.py")).dags["batch_inference_gpu"]
    op = dag.get_task("gpu_workers")
    assert op.task_type == "GpuAutopilotOperator" and dag.params["workers"] == 8
    assert op.max_pod_failures == 5
    params = {k: dag.params[k] for k in ("workers", "image", "engine", "kueue_queue")}
    op.job_version = JOB                     # the submit task's XCom at run time
    op.render_template_fields({"params": params})
    assert int(op.workers) == 8
    d = pod_dict(op.pod_operator(JOB, 2))
    (c,) = d["spec"]["containers"]
    assert c["image"] == params["image"] and c["args"][:2] == ["worker", JOB]
    assert d["spec"]["priorityClassName"] == "batch-low" and d["spec"]["terminationGracePeriodSeconds"] == 105
    assert d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "batch"
    assert d["metadata"]["labels"][AUTOPILOT_LABEL] == "true"
    assert d["metadata"]["labels"]["batch-inference/worker-slot"] == "2"


def test_a_pipeline_with_autopilot_pods_parses_serializes_and_builds_valid_pods():
    """The Kubernetes launcher of the autopilot as a pipeline's workers: the DAG round-trips through
    serialization and each slot's pod (labelled for the launcher) is valid Kubernetes."""
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    from batch_inference.operators.gpu_autopilot import AUTOPILOT_LABEL, gpu_autopilot_workers, pod_name
    from batch_inference.operators.pipeline import batch_inference_pipeline, pipeline_params

    with DAG("gpu_autopilot_pipeline", schedule=None, params=pipeline_params(workers=2)) as dag:
        batch_inference_pipeline(dataset="tickets_triage", workers=gpu_autopilot_workers(
            pod_kwargs={"kueue_queue": "batch", "grace_seconds": 90, "grace_margin_seconds": 15}))
    restored = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    assert restored.get_task("gpu_workers").task_type == "GpuAutopilotOperator"
    op = dag.get_task("gpu_workers")
    for slot in (0, 3):
        d = pod_dict(op.pod_operator(JOB, slot))
        assert d["metadata"]["name"] == pod_name(JOB, slot) == f"bi-worker-jv-0123456789abcdef-{slot}"
        assert d["metadata"]["labels"][AUTOPILOT_LABEL] == "true"
        assert d["spec"]["terminationGracePeriodSeconds"] == 105
