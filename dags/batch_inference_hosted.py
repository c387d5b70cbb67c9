"""batch_inference_hosted: the seed's night on a hosted batch API, 22:00 to 06:00.

At 22:00 the workers submit each shard as one provider batch (the spec's
``openai-batch`` engine, OpenAI's Batch API at half the synchronous price) and
poll it while they hold the shard's lease; their poll mirrors the provider's
request counts into the ledger. The deferrable cutoff watches beside them:
outstanding rows leave out what the provider has already succeeded, so the
cutoff moves later as the batches settle (05:22 with 260,000 of 300,000
served by 05:00, 04:39 with 40,000 by 04:00). When it fires, the workers
cancel their batches, wait for the cancels to settle, store every result the
provider completed and release their shards, and the fallback pool re-drives
the rest through the synchronous API under the same keys; validate and
publish follow as on every night.

    submit ──┬── workers (hosted batches) ───────────────┬── validate ── review ── publish ──> Asset batch_inference.ticket_triage_hosted
             └── deadline ── cutoff (sensor) ── fallback ┘

Only a record class cleared for hosted APIs may run here (the spec's
``cleared_for_hosted``); the workers and the fallback read the API key from
``$OPENAI_API_KEY`` (or an Airflow connection: the engine's ``conn_id``).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from batch_inference.data import HOSTED_SPEC
from batch_inference.hooks import DEFAULT_CONN_ID
from batch_inference.operators.pipeline import (
    batch_inference_pipeline,
    local_workers,
    pipeline_dag_args,
    pipeline_params,
)

with DAG(
    dag_id="batch_inference_hosted",
    description="Nightly run on a hosted batch API with a moving cutoff and a synchronous fallback by 06:00",
    schedule="0 22 * * *",
    tags=["batch-inference", "hosted"],
    doc_md=__doc__,
    params={
        **pipeline_params(shard_size=5000, workers=8, engine="", deadline="06:00", review_timeout="12:00",
                          workers_title="Hosted batches in flight",
                          workers_description="Worker processes; each holds one shard's provider batch"),
        "spec_path": Param(str(HOSTED_SPEC), type="string", title="Job spec",
                           description="Path to the job spec YAML (a hosted batch engine, cleared_for_hosted)"),
    },
    **pipeline_dag_args(DEFAULT_CONN_ID),
) as dag:
    batch_inference_pipeline(dataset="ticket_triage_hosted", workers=local_workers(), cutoff_poll_interval=300,
                             fallback_kwargs={"api_key_env": "OPENAI_API_KEY"})
