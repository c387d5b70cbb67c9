"""``ReviewGateTrigger``: the human review gate of a job version, polled in Airflow's triggerer.

A thin shell over :func:`batch_inference.evaluation.review_state`, the same
reading of ``bi.review_state_v1`` and ``bi.review_gate_problem_v1`` that
``bi.publish_v1`` checks, the CLI's ``review`` command prints and the
dashboard's review screen shows. The state is read from a thread
(``asyncio.to_thread``), so the triggerer's event loop never blocks on the
ledger; the Airflow connection is resolved on the loop with
:func:`batch_inference.hooks.connection.aledger_conninfo`.

The trigger yields one event and ends; its ``status`` is

* ``met``: the gate is met (``review`` holds the state);
* ``rejected``: a reviewer's rejection of the version stands in the ledger
  (``bi.review_rejections``: ``review.rejection`` says who and why);
* ``timeout``: ``timeout_at`` passed with the gate still open (``review`` says
  how far it got).

A ledger that cannot be read is logged and polled again until ``timeout_at``:
a review takes hours, a database restart seconds. A reviewer's rejection does
not come through here: Airflow resumes the deferred task itself with the
Required Action's response (``ReviewGateOperator``), and the operator
records it in the ledger.

``serialize()`` carries the job version, the times, the poll interval, the
connection *id* and the count of reviews already seen: no secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from batch_inference.hooks.connection import DEFAULT_CONN_ID

MET = "met"
REJECTED = "rejected"
TIMEOUT = "timeout"


def read_review_state(conninfo: str, job_version: str) -> dict[str, Any]:
    """The version's review state (``evaluation.review_state``) over a connection of its own."""
    from batch_inference import db
    from batch_inference.evaluation import review_state

    with db.connect(conninfo, application_name="batch-inference-review") as conn:
        return review_state(conn, job_version)


class ReviewGateTrigger(BaseTrigger):
    """Poll a job version's review gate until it is met or ``timeout_at`` passes.

    :param job_version: the job version under review.
    :param timeout_at: ISO datetime with zone; None waits without end.
    :param poll_interval: seconds between reads of the review state.
    :param postgres_conn_id: Airflow connection of the ledger database.
    :param reviewed: reviews counted at the last read, so progress is logged when it changes.
    """

    def __init__(self, job_version: str, timeout_at: str | None = None, poll_interval: float = 15.0,
                 postgres_conn_id: str = DEFAULT_CONN_ID, reviewed: int = 0):
        super().__init__()
        self.job_version = job_version
        self.timeout_at = timeout_at
        self._deadline = datetime.fromisoformat(timeout_at) if timeout_at else None  # a bad time fails at defer
        self.poll_interval = float(poll_interval)
        self.postgres_conn_id = postgres_conn_id
        self.reviewed = int(reviewed)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"job_version": self.job_version, "timeout_at": self.timeout_at, "poll_interval": self.poll_interval,
                 "postgres_conn_id": self.postgres_conn_id, "reviewed": self.reviewed})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from batch_inference.hooks.connection import aledger_conninfo

        state: dict[str, Any] | None = None
        while True:
            try:
                conninfo = await aledger_conninfo(self.postgres_conn_id)   # each time: an IAM token expires
                state = await asyncio.to_thread(read_review_state, conninfo, self.job_version)
            except Exception as exc:  # noqa: BLE001 - a restart or a blip: read again at the next poll
                self.log.warning("cannot read the review state of %s (will retry): %s", self.job_version, exc)
            if state is not None:
                if state.get("rejection"):
                    self.log.info("review of %s: %s", self.job_version, state["rejection"])
                    yield TriggerEvent({"status": REJECTED, "job_version": self.job_version, "review": state})
                    return
                if state["passed"]:
                    self.log.info("review gate of %s met: %s of %s reviewed, %s right", self.job_version,
                                  state["reviewed"], state["required"], state["right"])
                    yield TriggerEvent({"status": MET, "job_version": self.job_version, "review": state})
                    return
                if state["reviewed"] != self.reviewed:
                    self.reviewed = state["reviewed"]
                    self.log.info("review of %s: %s", self.job_version, state["problem"])
            if self._deadline is not None and datetime.now(timezone.utc) >= self._deadline:
                yield TriggerEvent({"status": TIMEOUT, "job_version": self.job_version, "review": state,
                                    "timeout_at": self.timeout_at})
                return
            await asyncio.sleep(self.poll_interval)
