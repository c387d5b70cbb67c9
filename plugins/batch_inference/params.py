"""Reading the DAGs' Params: what a person types in the trigger form, made exact.

No Airflow import: the DAG files call these from small tasks, and tests call
them directly.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

_RELATIVE = re.compile(r"^\+\s*(\d+(?:\.\d+)?)\s*(m|min|h|d)$", re.IGNORECASE)
_UNIT = {"m": 60, "min": 60, "h": 3600, "d": 86400}


def deadline_reference(run_after: datetime | None, run_type: str | None = None,
                       now: datetime | None = None) -> datetime:
    """Where a run's deadline counts from: its scheduled start (``run_after``), except for a
    backfill run, which re-does a past night now and so counts from when it runs. A
    backfilled 22:00 run of 1 November must not find its 06:00 deadline long past and send
    every record to the fallback at twice the price."""
    now = now or datetime.now(timezone.utc)
    if run_after is None or str(run_type or "").lower().endswith("backfill"):
        return now
    return run_after if run_after.tzinfo else run_after.replace(tzinfo=timezone.utc)


def resolve_deadline(text: str, start: datetime) -> str:
    """A deadline for ``CutoffSensor``: ``+20h``/``+90m``/``+1d`` after ``start`` becomes an
    ISO datetime; a clock time (``06:00``) or an ISO datetime is returned as given."""
    text = str(text).strip()
    if not text:
        raise ValueError("the deadline is empty: give '+20h', 'HH:MM' or an ISO datetime")
    m = _RELATIVE.match(text)
    if not m:
        return text
    start = start if start.tzinfo else start.replace(tzinfo=timezone.utc)
    seconds = float(m.group(1)) * _UNIT[m.group(2).lower()]
    return (start + timedelta(seconds=seconds)).isoformat()
