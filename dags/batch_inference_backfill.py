"""batch_inference_backfill: label a whole table of support tickets, once, by a deadline.

Trigger it from the Airflow UI ("Trigger DAG w/ config") to run a backfill;
every knob is a Param:

    submit ──┬── workers (local processes) ──────────────┬── validate ── review ── publish ──> Asset batch_inference.ticket_triage
             └── deadline ── cutoff (sensor) ── fallback ┘

* ``submit`` snapshots the source table into the ledger and plans shards;
  its XCom is a small manifest (job version, records, shards, dead letters).
* ``workers`` runs N ``python -m gpu_runner`` processes on the Airflow worker
  (the GPU pod variant is ``batch_inference_gpu``).
* ``deadline`` turns the ``deadline`` Param into a time; ``cutoff`` waits,
  deferred, until the moving cutoff fires or the job completes. If it fires,
  the job enters fallback mode: batch workers drain, and ``fallback`` drives
  what is left through the synchronous pool; if not, ``fallback`` has nothing
  to do and returns at once.
* ``validate`` is the publish gate; ``review`` holds the run while the
  spec's human review gate is open (a Required Action in Airflow's UI linking
  the dashboard's review screen; passes at once when the spec asks for no
  review, fails the run if a reviewer rejects, pages at ``review_timeout``);
  ``publish`` switches the pointer that ``published.ticket_triage`` reads
  and records an Asset event.

A failing task pages on-call (``OnCallNotifier``) with the job version, its
counts and the next commands; a run still going 20 hours after it was queued
raises a Deadline Alert.

Everything but the workers, the Params, the schedule and the deadline comes
from ``batch_inference_pipeline`` (``batch_inference.operators.pipeline``).
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG

from batch_inference.callbacks import deadline_alert
from batch_inference.data import DEMO_DATASET
from batch_inference.hooks import DEFAULT_CONN_ID
from batch_inference.operators.pipeline import (
    batch_inference_pipeline,
    local_workers,
    pipeline_dag_args,
    pipeline_params,
)

with DAG(
    dag_id="batch_inference_backfill",
    description="Backfill: snapshot a table, label it on workers by a deadline, validate, publish",
    schedule=None,
    tags=["batch-inference"],
    doc_md=__doc__,
    params=pipeline_params(shard_size=25, workers=2, engine="", deadline="+20h"),
    deadline=deadline_alert(timedelta(hours=20), dataset=DEMO_DATASET, postgres_conn_id=DEFAULT_CONN_ID),
    **pipeline_dag_args(DEFAULT_CONN_ID),
) as dag:
    batch_inference_pipeline(dataset=DEMO_DATASET, workers=local_workers())   # LocalWorkersOperator, task "workers"
