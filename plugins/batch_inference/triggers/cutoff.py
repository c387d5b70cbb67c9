"""``CutoffTrigger``: the moving cutoff, polled in Airflow's triggerer.

A thin shell over :func:`batch_inference.deadline.watch`. The triggerer runs
every deferred task of the deployment on one event loop, so the trigger
must not block it:

* the database is read through ``psycopg.AsyncConnection``;
* the Airflow connection is resolved inside ``run()`` by
  :func:`batch_inference.hooks.connection.aledger_conninfo`, the async form of
  the resolver every task uses (``BaseHook.aget_connection``, an IAM token
  fetched in a thread). The sync getter talks to the supervisor and would
  block the loop.

``serialize()`` carries the job version, the deadline, the poll interval,
the rate and overhead overrides, the relabel time, the early-warning flag
and the *id* of the Airflow connection. It never carries a password or a
URL, because serialized triggers are stored in the metadata database in
plain text. A trigger built with ``postgres_conn_id=None`` reads
``$BATCH_INFERENCE_DB`` in the triggerer's own environment (docs/deadlines.md,
"Serialized state"); the sensor always passes its connection id.

The trigger yields exactly one event and ends. Its payload's ``status`` is
``complete``, ``cutoff``, ``early_warning``, ``budget``, ``halted`` or ``error``, as described in
:mod:`batch_inference.deadline`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from batch_inference import deadline as watchlib  # not `deadline`: that is a parameter name here
from batch_inference.db import DB_ENV


class CutoffTrigger(BaseTrigger):
    """Poll a job's counts until the cutoff fires, the job completes, or an early warning is due.

    :param job_version: the job version to watch.
    :param deadline: ISO datetime with zone, when the rows must be in the table.
    :param poll_interval: seconds between polls. A poll costs the same at any job size.
    :param rate: fallback rows/s to assume; None derives it from recent fallback runs, else the spec.
    :param overhead_s: fixed fallback overhead in seconds; None: as for ``rate``.
    :param postgres_conn_id: Airflow connection of the ledger database; None reads ``$BATCH_INFERENCE_DB``
        in the triggerer's environment (a documented deployment option, docs/deadlines.md).
    :param relabel_at: ISO datetime; always-re-drive mode, which fires ``cutoff`` at this time whatever the counts.
    :param warned: the early warning was already sent; do not send it again.
    :param step_s: the latest safe start is floored to this many seconds (60: whole minutes).
    :param since: ISO datetime; a worker halt (``bi.halt_job_v1``) recorded at or after it ends the watch
        with ``halted``. The sensor passes the DAG run's start, so halts of an earlier attempt are ignored.
    :param paged: the autopilot's budget page was already sent; do not send it again. With
        ``spec.autopilot.enabled`` every poll also decides the batch fleet's size (``batch_inference.autopilot``).
    """

    def __init__(self, job_version: str, deadline: str, poll_interval: float = 60.0, rate: float | None = None,
                 overhead_s: float | None = None, postgres_conn_id: str | None = None,
                 relabel_at: str | None = None, warned: bool = False, step_s: int = 60, since: str | None = None,
                 paged: bool = False):
        super().__init__()
        # Validated here, so a bad deadline fails the task at defer time,
        # in the task's log, and not later in the triggerer.
        self.cfg = watchlib.config_from_kwargs(job_version, deadline, poll_interval, rate, overhead_s, relabel_at,
                                               warned, step_s, since, paged)
        self.job_version = job_version
        self.postgres_conn_id = postgres_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {**watchlib.watch_kwargs(self.cfg), "postgres_conn_id": self.postgres_conn_id})

    async def _conninfo(self) -> str:
        if self.postgres_conn_id:
            from batch_inference.hooks.connection import aledger_conninfo

            return await aledger_conninfo(self.postgres_conn_id)
        url = os.environ.get(DB_ENV)
        if not url:
            # Not db.resolve_url(): starting an embedded server would block the loop.
            raise ValueError(f"no postgres_conn_id given and ${DB_ENV} is not set in the triggerer")
        return url

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            conninfo = await self._conninfo()
        except Exception as exc:  # noqa: BLE001 - reported as an event, so the task fails with the reason
            yield TriggerEvent(watchlib.error_payload(self.cfg, f"cannot resolve the ledger database: {exc}"))
            return
        payload = await watchlib.watch(lambda: watchlib.connect_async(conninfo), self.cfg, logger=self.log)
        yield TriggerEvent(payload)

