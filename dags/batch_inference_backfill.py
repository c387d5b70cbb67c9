"""batch_inference_backfill: label a whole table of support tickets, once, by a deadline.

Trigger it from the Airflow UI ("Trigger DAG w/ config") to run a backfill;
every knob is a Param:

    submit ──┬── workers (local processes) ──────────────┬── validate ── publish ──> Asset batch_inference.ticket_triage
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
* ``validate`` is the publish gate; ``publish`` switches the pointer that
  ``published.ticket_triage`` reads and records an Asset event.

A failing task pages on-call (``OnCallNotifier``) with the job version, its
counts and the next commands; a run still going 20 hours after it was queued
raises a Deadline Alert.

Under ``airflow dags test`` tasks run one at a time in one process, so
``deadline`` runs beside ``workers`` and the sensor starts after them.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, task

from batch_inference.callbacks import OnCallNotifier, deadline_alert
from batch_inference.data import DEMO_DATASET, DEMO_SOURCE_TABLE, DEMO_SPEC
from batch_inference.operators import (
    FallbackPoolOperator,
    LocalWorkersOperator,
    PublishOperator,
    SubmitJobOperator,
    ValidateOperator,
    dataset_asset,
)
from batch_inference.sensors.cutoff import CutoffSensor

CONN_ID = "batch_inference_default"   # the ledger's PostgreSQL (AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT)

with DAG(
    dag_id="batch_inference_backfill",
    description="Backfill: snapshot a table, label it on workers by a deadline, validate, publish",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["batch-inference"],
    doc_md=__doc__,
    params={
        "spec_path": Param(str(DEMO_SPEC), type="string", title="Job spec",
                           description="Path to the job spec YAML (relative paths: next to this DAG file)"),
        "source_table": Param(DEMO_SOURCE_TABLE, type="string", title="Snapshot source table",
                              description="schema.table to snapshot; empty keeps the spec's source"),
        "shard_size": Param(25, type="integer", minimum=1, title="Shard size",
                            description="Records per shard (the seed's 5,000 for GPU workers; small for the demo)"),
        "workers": Param(2, type="integer", minimum=1, maximum=64, title="Workers",
                         description="Local worker processes"),
        "engine": Param("", type="string", enum=["", "llama-cpp", "noop", "openai", "vllm"], title="Engine",
                        description="Empty: the spec's engine. noop answers instantly (plumbing tests)"),
        "deadline": Param("+20h", type="string", title="Deadline",
                          description="'+20h' / '+90m' after the run starts, 'HH:MM' (next such time, UTC), "
                                      "or an ISO datetime"),
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

    workers = LocalWorkersOperator(
        task_id="workers",
        job_version=job_version,
        workers="{{ params.workers }}",
        engine="{{ params.engine }}",
        postgres_conn_id=CONN_ID,
    )

    @task(task_id="deadline")
    def resolve_deadline(deadline: str, run_after: str) -> str:
        """'+20h' becomes an ISO time after the run's start; 'HH:MM' and ISO pass to the sensor as they are."""
        from batch_inference.params import resolve_deadline

        return resolve_deadline(deadline, datetime.fromisoformat(run_after))

    deadline = resolve_deadline("{{ params.deadline }}", "{{ dag_run.run_after.isoformat() }}")

    cutoff = CutoffSensor(
        task_id="cutoff",
        job_version=job_version,
        deadline=deadline,
        poll_interval=60,
        postgres_conn_id=CONN_ID,
    )
    fallback = FallbackPoolOperator(task_id="fallback", job_version=job_version, postgres_conn_id=CONN_ID)
    validate = ValidateOperator(task_id="validate", job_version=job_version, postgres_conn_id=CONN_ID)
    publish = PublishOperator(
        task_id="publish",
        job_version=job_version,
        postgres_conn_id=CONN_ID,
        outlets=[dataset_asset(DEMO_DATASET)],
    )

    submit >> [workers, deadline]
    deadline >> cutoff >> fallback
    [workers, fallback] >> validate >> publish
