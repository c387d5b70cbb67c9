"""The worker role's grant: a job version granted to a ``bi_worker`` login before its workers start.

Local workers with ``worker_conn_id`` and GPU pods both work as such a role,
which can claim shards and write results only for job versions granted to it
(``batch_inference.plan.grant_job``); the grant goes over Airflow's own
(owner) connection.
"""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook


def grant_worker_role(postgres_conn_id: str, role: str, job_version: str) -> bool:
    """Grant ``job_version`` to the worker ``role`` over the owner connection ``postgres_conn_id``;
    True if newly granted. A refusal fails the task."""
    from batch_inference import db
    from batch_inference.plan import GrantRefused, grant_job
    from batch_inference.status import UnknownJob

    try:
        with db.connect(BatchInferenceHook(postgres_conn_id, migrate=False).get_conninfo()) as conn:
            return grant_job(conn, role, job_version)
    except (GrantRefused, UnknownJob) as exc:
        raise AirflowFailException(f"cannot grant {job_version} to worker role {role!r}: {exc}") from None
