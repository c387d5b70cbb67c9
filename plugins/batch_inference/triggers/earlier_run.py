"""``EarlierRunTrigger``: a submit's wait for an earlier DAG run of its dataset, in Airflow's triggerer.

Airflow's own ``DagStateTrigger`` reads the earlier run's state every
``poll_interval`` seconds and fires once it has ended (success or failed).
This trigger runs it for at most ``recheck_seconds`` and then fires anyway
(``ended`` false): the submit checks again from the ledger and Airflow, and
defers again if the run is still going. A run that is deleted while another
waits for it (``airflow db clean``, a run deleted from the UI) never reaches
an end state, so ``DagStateTrigger`` alone would wait for it for ever; here
it holds the later run up at most ``recheck_seconds``.

``serialize()`` carries the DAG and run ids and the two intervals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

# How long one deferral waits on the earlier run before the submit checks again.
RECHECK_SECONDS = 300.0


class EarlierRunTrigger(BaseTrigger):
    """Fire when DAG run ``dag_id``/``run_id`` has ended, or after ``recheck_seconds`` at the latest.

    :param dag_id: the earlier run's DAG.
    :param run_id: the earlier run.
    :param poll_interval: seconds between reads of its state (``DagStateTrigger``'s).
    :param recheck_seconds: the longest one wait lasts before the task checks again.

    Its one event: ``{"dag_id", "run_id", "ended"}``; ``ended`` false when the bound came first.
    """

    def __init__(self, dag_id: str, run_id: str, poll_interval: float = 5.0,
                 recheck_seconds: float = RECHECK_SECONDS) -> None:
        super().__init__()
        self.dag_id, self.run_id = dag_id, run_id
        self.poll_interval, self.recheck_seconds = float(poll_interval), float(recheck_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("batch_inference.triggers.earlier_run.EarlierRunTrigger",
                {"dag_id": self.dag_id, "run_id": self.run_id, "poll_interval": self.poll_interval,
                 "recheck_seconds": self.recheck_seconds})

    def state_trigger(self) -> BaseTrigger:
        from airflow.providers.standard.triggers.external_task import DagStateTrigger

        return DagStateTrigger(dag_id=self.dag_id, run_ids=[self.run_id], states=["success", "failed"],
                               poll_interval=self.poll_interval)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        events = self.state_trigger().run()
        try:
            await asyncio.wait_for(anext(events), self.recheck_seconds)
            ended = True
        except (TimeoutError, StopAsyncIteration):
            ended = False
        finally:
            await events.aclose()
        yield TriggerEvent({"dag_id": self.dag_id, "run_id": self.run_id, "ended": ended})
