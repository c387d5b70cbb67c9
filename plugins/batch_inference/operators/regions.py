"""A job version over regions, as tasks: the far workers' result files merged by key before validate.

``RegionMergeOperator`` is a thin shell over ``batch_inference.regions.merge_until_settled``: it runs
beside the workers, near the ledger, and merges each handed-in result file through the one
put-if-absent and fence until the version has nothing outstanding (or, with ``idle_seconds``, until no
shard has been leased and no file handed in for that long: the workers are gone and what is left is the
fallback's). A version never placed over regions has nothing to merge: the task returns at once, so a
DAG may always have it. ``region_slots`` says which local worker processes each placed cluster runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook, LedgerTask


class RegionMergeOperator(LedgerTask, BaseOperator):
    """Merge the far workers' result files of a job version by key until it has nothing outstanding.

    :param job_version: the job version (templated; an XComArg works).
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param poll_seconds: how long it waits between looks when nothing was handed in.
    :param idle_seconds: stop once no shard has been leased and no file handed in for this long (the
        workers are gone; the cutoff's fallback takes what is left). None: wait for the last record.
    """

    template_fields: Sequence[str] = ("job_version", "postgres_conn_id")
    ui_color = "#c9e4f5"

    def __init__(self, *, job_version: Any, postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 poll_seconds: float = 1.0, idle_seconds: float | None = 300.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job_version = job_version
        self.postgres_conn_id = postgres_conn_id
        self.poll_seconds = poll_seconds
        self.idle_seconds = idle_seconds
        self._stop = threading.Event()

    def on_kill(self) -> None:
        self._stop.set()
        super().on_kill()

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference.regions import merge_until_settled
        from batch_inference.status import UnknownJob, job_counts, region_bill

        job = str(self.job_version or "").strip()
        if not job:
            raise AirflowFailException("no job version (did the submit task push one?)")
        try:
            with self.ledger_hook(self.postgres_conn_id, migrate=False).get_conn() as conn:
                job_counts(conn, job)
                if not region_bill(conn, job)["placed"]:
                    self.log.info("%s is not placed over regions: no result file to merge", job)
                    return {"job_version": job, "placed": False}
                total = merge_until_settled(conn, job, poll_s=self.poll_seconds, idle_s=self.idle_seconds,
                                            stop=self._stop)
                counts = job_counts(conn, job)
        except UnknownJob as exc:
            raise AirflowFailException(str(exc)) from None
        if self._stop.is_set():
            raise AirflowException(f"the merge of {job} was stopped from outside; files handed in since stay "
                                   "for the next merge")
        self.log.info("%s: result files merged %d (already %d, stale %d, unreadable %d), %d new rows; %d records "
                      "outstanding", job, total["merged"], total["already"], total["stale"], total["unreadable"],
                      total["rows"], counts["outstanding"])
        return {"job_version": job, "placed": True, **{k: int(v) for k, v in total.items()},
                "outstanding": counts["outstanding"]}


def region_slots(postgres_conn_id: str, job_version: str, workers: int) -> list[dict[str, Any]]:
    """``LocalWorkersOperator`` keyword arguments per cluster of the placed version whose workers are local
    (``regions.local_slots``): its ``region``, ``cluster``, ``workers`` and ``result_files``; one slot of plain
    workers for a version never placed."""
    from batch_inference.regions import local_slots

    with BatchInferenceHook(postgres_conn_id, migrate=False).get_conn() as conn:
        slots = local_slots(conn, job_version, workers)
    if not slots:
        raise AirflowFailException(f"job version {job_version}: no cluster of its deployment runs local workers")
    return slots
