"""Workarounds for upstream Airflow bugs that the example DAGs meet, each in one place.

* apache/airflow#70368 (open in 3.3.2): clearing a task answers HTTP 500 on any DAG
  with a ``DeadlineReference.DAGRUN_QUEUED_AT`` Deadline Alert. Clearing re-queues
  the run and recomputes its deadlines in
  ``airflow.models.taskinstance._recalculate_dagrun_queued_at_deadlines``, which
  passes the alert's stored interval (a serialized ``timedelta``, a dict) to
  ``timedelta(seconds=...)``: "unsupported type for timedelta seconds component:
  dict". :func:`fix_clear_with_queued_at_deadline` replaces that function with one
  that decodes the interval as Airflow's own decoder does. The dashboard plugin
  applies it when Airflow loads it (``BatchInferencePlugin.on_load``), which every
  Airflow process does before it reads a DAG: the API server (clears from the UI
  and the REST API) and ``airflow tasks clear`` on the command line. Only on
  Airflow 3.3, the release with the bug.

The other upstream bug the DAGs meet, a trigger that fires at once racing the
scheduler (apache/airflow#72716, #71580), is avoided in ``CutoffSensor.execute``:
a decided first poll never defers.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

AFFECTED = ("3.3.",)  # Airflow releases with apache/airflow#70368


def deadline_interval(raw: Any) -> timedelta:
    """A ``deadline_alert.interval`` column as a ``timedelta``: a bare number of seconds (older
    rows), a serialized ``timedelta``, or a serialized variable-backed interval."""
    if isinstance(raw, (int, float)):
        return timedelta(seconds=raw)
    from airflow.sdk.serde import deserialize

    value = deserialize(raw)
    if isinstance(value, timedelta):
        return value
    resolve = getattr(value, "resolve", None)   # VariableInterval: seconds in an Airflow Variable
    if resolve is not None:
        return resolve()
    from airflow.serialization.definitions.deadline import SerializedVariableInterval

    return SerializedVariableInterval(key=value.key).resolve()


def recalculate_queued_at_deadlines(dagrun: Any, new_queued_at: datetime, session: Any) -> None:
    """Move the run's open ``DAGRUN_QUEUED_AT`` deadlines to ``new_queued_at + interval``.

    Nothing is flushed: the caller (``clear_task_instances``) commits with the rest of the clear.
    """
    from sqlalchemy import false, select

    from airflow.models.deadline import Deadline, ReferenceModels
    from airflow.models.deadline_alert import DeadlineAlert

    rows = session.execute(
        select(Deadline, DeadlineAlert)
        .join(DeadlineAlert, Deadline.deadline_alert_id == DeadlineAlert.id)
        .where(Deadline.dagrun_id == dagrun.id, Deadline.missed == false(),
               DeadlineAlert.reference[ReferenceModels.REFERENCE_TYPE_FIELD].as_string()
               == ReferenceModels.DagRunQueuedAtDeadline.__name__)
    ).all()
    for deadline, alert in rows:
        deadline.deadline_time = new_queued_at + deadline_interval(alert.interval)


def fix_clear_with_queued_at_deadline() -> bool:
    """Apply the apache/airflow#70368 workaround; True if it is in place after the call."""
    import airflow
    from airflow.models import taskinstance

    if not airflow.__version__.startswith(AFFECTED):
        return False
    if taskinstance._recalculate_dagrun_queued_at_deadlines is not recalculate_queued_at_deadlines:
        taskinstance._recalculate_dagrun_queued_at_deadlines = recalculate_queued_at_deadlines
        log.info("batch-inference: clearing tasks of DAGs with a DAGRUN_QUEUED_AT Deadline Alert works "
                 "(workaround for apache/airflow#70368 on Airflow %s)", airflow.__version__)
    return True
