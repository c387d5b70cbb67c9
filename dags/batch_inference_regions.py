"""batch_inference_regions: one job version over clusters in several regions, one ledger.

The backfill's pipeline, submitted onto a deployment (docs/regions.md): its clusters, their regions,
object stores and egress prices, in a YAML file named by the ``deployment`` Param.

    submit ──┬── regions ── workers (mapped: local processes per cluster) ──┬── validate ── review ── publish
             ├── merge (far workers' result files, by key) ────────────────┤
             └── deadline ── cutoff (sensor) ── fallback ──────────────────┘

* ``submit`` asks every region's store and every Kubernetes connection first (a refusal fails the task
  with one line and writes nothing), then snapshots, plans and writes each shard's replica in its home
  region; its manifest says what replication cost.
* ``regions`` lists the placed clusters whose workers are local; ``workers`` runs each cluster's
  ``python -m gpu_runner --region R`` processes (its own shards first, read from its region's replicas;
  outside the ledger's region with ``--result-files``).
* ``merge`` merges each handed-in result file by key near the ledger, through the one put-if-absent and
  fence, until nothing is outstanding; then validate, review and publish as in every DAG.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param

from batch_inference.callbacks import deadline_alert
from batch_inference.data import DEMO_DATASET
from batch_inference.hooks import DEFAULT_CONN_ID
from batch_inference.operators.pipeline import (
    batch_inference_pipeline,
    pipeline_dag_args,
    pipeline_params,
    region_workers,
)

with DAG(
    dag_id="batch_inference_regions",
    description="A backfill over clusters in several regions: replicas near each, merged by key, one ledger",
    schedule=None,
    tags=["batch-inference", "regions"],
    doc_md=__doc__,
    params={
        **pipeline_params(shard_size=25, workers=1, engine="", deadline="+20h",
                          workers_title="Workers per cluster",
                          workers_description="Local worker processes per cluster (at most its capacity)"),
        "deployment": Param("", type="string", title="Deployment",
                            description="Path to the deployment YAML: clusters, regions, stores, egress prices "
                                        "(relative paths: next to this DAG file)"),
    },
    deadline=deadline_alert(timedelta(hours=20), dataset=DEMO_DATASET, postgres_conn_id=DEFAULT_CONN_ID),
    **pipeline_dag_args(DEFAULT_CONN_ID),
) as dag:
    batch_inference_pipeline(dataset=DEMO_DATASET, workers=region_workers(), deployment="{{ params.deployment }}")
