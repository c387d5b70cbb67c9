"""batch_inference_nightly: every night at 22:00, label what changed, by 06:00.

The same pipeline as ``batch_inference_backfill``, scheduled, with the spec's
``incremental`` switched on: the submit snapshots the whole table, and every
record whose text and ACL are unchanged since the last validated version of
the same spec carries its result over (transport ``reused``), so only new
and changed tickets reach a worker. The published view still holds every
record. The nightly deadline is a clock time ("06:00" UTC by default): the
cutoff sensor places it after the run's scheduled start. A spec with a human
review gate holds publish until the morning's reviews meet it, and pages at
the ``review_timeout`` ("12:00" UTC) if they have not.

    submit ──┬── workers (local processes) ──────────────┬── validate ── review ── publish ──> Asset batch_inference.ticket_triage
             └── deadline ── cutoff (sensor) ── fallback ┘

A failing task pages on-call (``OnCallNotifier``) with the job version, its
counts and the next commands; a run still going 8 hours after it was queued
(06:00 for a 22:00 run) raises a Deadline Alert.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param

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
    dag_id="batch_inference_nightly",
    description="Nightly incremental run: label new and changed records by 06:00, validate, publish",
    schedule="0 22 * * *",
    tags=["batch-inference"],
    doc_md=__doc__,
    params={
        **pipeline_params(shard_size=25, workers=2, engine="", deadline="06:00", review_timeout="12:00"),
        "incremental": Param(True, type="boolean", title="Incremental",
                             description="Reuse results of unchanged records from the last validated version"),
    },
    deadline=deadline_alert(timedelta(hours=8), dataset=DEMO_DATASET, postgres_conn_id=DEFAULT_CONN_ID),
    **pipeline_dag_args(DEFAULT_CONN_ID),
) as dag:
    # An Apache Iceberg table as well as the view (docs/publish.md): name it in the spec, where it does not
    # join the job version; publish then commits the version to the table, tags it and moves main, and a
    # rollback moves main back. Credentials come from the environment, never from the spec.
    #
    #   publish:
    #     destinations:
    #       - identifier: analytics.ticket_triage
    #         warehouse: s3://lake/warehouse        # or a local path
    #         s3_region: us-east-1
    #         cleared_record_classes: [internal]    # the spec's record_class must be listed
    #
    # DAGs scheduled on the table use batch_inference.operators.publish.iceberg_asset("analytics.ticket_triage").
    #
    # The records can come from the warehouse where they live (docs/sources.md): a Snowflake table through an
    # Airflow Snowflake connection (any common-sql connection: mysql, bigquery, redshift, databricks, trino,
    # sqlite, another postgres), read in one statement, optionally as it was at a time; the ticket's subject
    # and body each go to the prompt between their own delimiters. Credentials stay in the connection.
    #
    #   source:
    #     kind: sql
    #     conn_id: snowflake_support              # an Airflow connection of type snowflake
    #     table: SUPPORT.PUBLIC.TICKETS           # or query: SELECT ... (one read-only SELECT)
    #     # as_of: "2026-12-05T22:00:00+00:00"    # Snowflake time travel, recorded with the job
    #     id_column: TICKET_ID
    #     columns: [SUBJECT, BODY]
    #     acl_column: ACL
    #   prompt:
    #     template: "Subject:\n<<<\n{SUBJECT}\n>>>\nBody:\n<<<\n{BODY}\n>>>"
    #
    # Its OpenLineage input is the table as the Snowflake provider names it (snowflake://<org>-<account>).
    batch_inference_pipeline(dataset=DEMO_DATASET, workers=local_workers(), incremental="{{ params.incremental }}")
