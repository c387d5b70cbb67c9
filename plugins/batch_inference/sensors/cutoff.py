"""``CutoffSensor``: wait for the moving cutoff, then put the job into fallback mode.

The sensor defers at once to :class:`~batch_inference.triggers.cutoff.CutoffTrigger`,
so it holds no worker slot while it waits; the triggerer polls. The sensor
does not decide anything itself. When the trigger's event comes back:

* ``cutoff``: it calls ``bi.enter_fallback_v1``. Batch workers are refused
  new claims at once and, at their next lease renewal, stop taking records,
  write what is in flight and release their shards. If the deadline is
  already lost then (the cutoff fired late: a late submit, a triggerer that
  was down), it pages on-call at once with the nights' one message
  (``fallback.deadline_page``). The sensor returns ``{"fired": true, ...}``
  (``page``: the page sent, if any).
* ``complete``: returns ``{"fired": false, ...}``. The batch finished in time.
* ``early_warning``: sends the notification (``on_early_warning``), then
  defers again to the same trigger with ``warned=True``. A trigger can
  only end with one event, so this is how a warning is sent mid-wait
  without stopping the watch, and it goes out once per run.
* ``budget``: the autopilot's page (meeting the deadline would cost more than
  ``cost.budget``) goes to the same notifiers, then the sensor defers again with
  ``paged=True``. The autopilot itself runs inside the trigger's polls.
* ``halted``: fails the task without retries: the job's workers recorded that
  they cannot work (wrong weights, an unusable engine), so the run cannot
  succeed and ends now rather than at the deadline.
* ``error``: fails the task with the reason. The job is missing, or the
  database stayed unreachable past the deadline.

The downstream ``FallbackPoolOperator`` runs in both the fired and the
complete case (default trigger rule). When nothing is outstanding it
returns at once, so the DAG needs no branch, and the re-drive path runs
as a task every night even when it has nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

from airflow.sdk import BaseNotifier, BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference import deadline as watchlib  # not `deadline`: that is an attribute here
from batch_inference.cutoff import parse_clock, relabel_start
from batch_inference.hooks.connection import DEFAULT_CONN_ID, ledger_conninfo
from batch_inference.triggers.cutoff import CutoffTrigger

UTC = timezone.utc

EarlyWarningCallback = Callable[[Any, dict[str, Any]], Any] | BaseNotifier


class CutoffSensor(BaseOperator):
    """Wait, deferred, until the moving cutoff fires or the job completes; on cutoff enter fallback mode.

    :param job_version: the job version to watch (templated).
    :param deadline: when the rows must be in the table (templated). Either ``"HH:MM"``, meaning the
        first such time after the run's ``run_after`` (the scheduled start; the logical date, else
        now; a backfill run's: now) read in ``tz``, so ``"06:00"`` for a 22:00 run means the next
        morning, or an ISO datetime.
    :param tz: zone for clock times (default ``"UTC"``).
    :param poll_interval: seconds between polls of the counts (default 300, the seed's five minutes).
        A poll reads per-shard counters only, so it costs the same at any job size.
    :param postgres_conn_id: Airflow connection of the ledger database, read here and by the trigger.
    :param rate: fallback rows/s to assume. None: the spec's ``fallback.rate``, which the dataset's
        fallback history may lower at any time, and raise only after ``spec.fallback.min_history_runs``
        complete runs (``batch_inference.cutoff.derive_rate_and_overhead``).
    :param overhead_s: fixed fallback overhead in seconds. None works as for ``rate`` (raised by
        history at any time, lowered only by enough complete runs).
    :param relabel_at: always-re-drive mode (templated). ``"HH:MM"`` is the last such time at or before
        the deadline; an ISO datetime is taken as given. The sensor fires ``cutoff`` at that time
        whatever the counts, or earlier if the moving cutoff comes first.
    :param on_early_warning: a notifier (``BaseNotifier``, called with the context, in which
        ``early_warning`` holds the warning so templates can use ``{{ early_warning.message }}``)
        or a callable ``f(context, event)``, or a list of them. Failures are logged and do not stop
        the watch, because the warning is for people and the cutoff fires by itself.
    :param fallback_hosted: whether the fallback endpoint is a hosted API (None: ``spec.fallback.hosted``).
        Checked before deferring, so a record class not cleared for hosted APIs fails the DAG at submit
        time and not at the cutoff, when there is no time left to fix it.
    :param step_s: the latest safe start is floored to this many seconds (60: whole minutes).
    :param page_reserve_s: what the publish needs after the re-drive: when the cutoff fires, the deadline
        is lost (and on-call paged) if the outstanding rows at the pool's limit (``spec.fallback.rate``)
        plus this no longer fit before it (default ``cutoff.PAGE_RESERVE_SHARE`` of the spec's
        ``fallback.overhead_s``).
    """

    template_fields: Sequence[str] = ("job_version", "deadline", "relabel_at")
    ui_color = "#f4d6a6"

    def __init__(self, *, job_version: str, deadline: str, tz: str = "UTC", poll_interval: float = 300.0,
                 postgres_conn_id: str = DEFAULT_CONN_ID, rate: float | None = None, overhead_s: float | None = None,
                 relabel_at: str | None = None,
                 on_early_warning: EarlyWarningCallback | list[EarlyWarningCallback] | None = None,
                 fallback_hosted: bool | None = None, step_s: int = 60, page_reserve_s: float | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.job_version = job_version
        self.deadline = deadline
        self.tz = tz
        self.poll_interval = poll_interval
        self.postgres_conn_id = postgres_conn_id
        self.rate = rate
        self.overhead_s = overhead_s
        self.relabel_at = relabel_at
        self.on_early_warning = on_early_warning
        self.fallback_hosted = fallback_hosted
        self.step_s = step_s
        self.page_reserve_s = page_reserve_s
        self._killed = False

    # -- before waiting ---------------------------------------------------
    def _zone(self):
        return UTC if self.tz.upper() == "UTC" else ZoneInfo(self.tz)

    @staticmethod
    def _reference(context: Any) -> datetime:
        """Where a clock-time deadline is placed from: the run's scheduled start (a backfill run's: now)."""
        from batch_inference.params import deadline_reference

        dag_run = context.get("dag_run")
        start = getattr(dag_run, "run_after", None) or context.get("logical_date")
        return deadline_reference(start, getattr(dag_run, "run_type", None))

    @staticmethod
    def _since(context: Any) -> str | None:
        """When this attempt at the run began: worker halts recorded before it belong to an earlier one."""
        started = getattr(context.get("dag_run"), "start_date", None)
        return started.isoformat() if started else None

    def resolve_times(self, context: Any) -> tuple[datetime, datetime | None]:
        tz = self._zone()
        deadline = parse_clock(str(self.deadline), self._reference(context), tz)
        relabel = None
        if self.relabel_at:
            text = str(self.relabel_at).strip()
            relabel = parse_clock(text, deadline, tz) if ("T" in text or "-" in text[:5]) else \
                relabel_start(deadline, text)
        return deadline, relabel

    def _preflight(self, conninfo: str) -> None:
        from batch_inference import db
        from batch_inference.fallback import FallbackRefused, check_hosted
        from batch_inference.status import UnknownJob, job_spec

        try:
            with db.connect(conninfo) as conn:
                spec = job_spec(conn, self.job_version)
            check_hosted(spec, self.job_version, spec.fallback.base_url, self.fallback_hosted)
        except (UnknownJob, FallbackRefused) as exc:
            raise AirflowFailException(str(exc)) from None

    def _trigger(self, **over: Any) -> CutoffTrigger:
        return CutoffTrigger(**{**over, "postgres_conn_id": self.postgres_conn_id})

    def execute(self, context: Any) -> dict[str, Any] | None:
        deadline, relabel = self.resolve_times(context)
        conninfo = ledger_conninfo(self.postgres_conn_id)
        self._preflight(conninfo)
        self.log.info("watching %s: deadline %s%s, poll every %.0f s", self.job_version, deadline.isoformat(),
                      f", relabel mode: re-drive at {relabel.isoformat()}" if relabel else "", self.poll_interval)
        watch = dict(job_version=self.job_version, deadline=deadline.isoformat(), poll_interval=self.poll_interval,
                     rate=self.rate, overhead_s=self.overhead_s, relabel_at=relabel.isoformat() if relabel else None,
                     step_s=self.step_s, since=self._since(context))
        # The first poll runs here, not in the triggerer. A trigger that fires at
        # once races the scheduler (apache/airflow#72716, #71580: the task's
        # terminal state is refused with 404 and the try is lost); an outcome
        # that is already decided never defers.
        first = self._first_poll(conninfo, watch)
        if self._killed:
            raise AirflowException("cutoff watch stopped from outside (the task was marked failed or cleared)")
        if first.get("status") != watchlib.WAIT:
            self.log.info("decided at the first poll, without deferring: %s", first.get("reason"))
            return self.execute_complete(context, first)
        self.defer(trigger=self._trigger(**watch), method_name="execute_complete")

    def on_kill(self) -> None:
        # Airflow calls this from the SIGTERM handler and returns into execute():
        # a killed sensor must not go on to put the job into fallback mode.
        self._killed = True

    def _first_poll(self, conninfo: str, watch: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        cfg = watchlib.config_from_kwargs(**watch)
        return asyncio.run(watchlib.watch(lambda: watchlib.connect_async(conninfo), cfg, logger=self.log,
                                          max_polls=1))

    # -- after the trigger's event ----------------------------------------
    def _notify(self, context: Any, event: dict[str, Any]) -> None:
        callbacks = self.on_early_warning
        if callbacks is None:
            return
        for cb in callbacks if isinstance(callbacks, list) else [callbacks]:
            try:
                if isinstance(cb, BaseNotifier):
                    context["early_warning"] = event.get("warning") or {}
                    cb(context)
                else:
                    cb(context, event)
            except Exception:  # noqa: BLE001 - a broken notifier must not stop the cutoff
                self.log.exception("early-warning notification failed; the cutoff still fires by itself")

    def _page_if_lost(self, context: Any, summary: dict[str, Any], reason: str | None) -> str | None:
        """Page on-call if the deadline is already lost as the cutoff fires; the page, or None."""
        from batch_inference.callbacks import page_if_deadline_lost

        deadline = watchlib.parse_iso(summary.get("deadline"))
        if deadline is None:
            return None
        return page_if_deadline_lost(context, self.postgres_conn_id, summary["job_version"], deadline,
                                     f"the cutoff fired at {datetime.now(UTC):%H:%M:%S} ({reason or 'cutoff'})",
                                     reserve_s=self.page_reserve_s, step_s=self.step_s)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if not event:
            raise AirflowException("cutoff trigger ended without an event")
        status = event.get("status")
        if status == watchlib.HALTED:
            raise AirflowFailException(f"cutoff watch ended: {event.get('message')}")
        if status == "error":
            raise AirflowException(f"cutoff watch failed: {event.get('message')}")
        if status == "early_warning":
            self.log.warning("EARLY WARNING for %s: %s", self.job_version, event.get("reason"))
            self._notify(context, event)
            self.defer(trigger=self._trigger(**{**event["watch"], "warned": True}), method_name="execute_complete")
        if status == watchlib.BUDGET:
            # The autopilot's page (the budget against the deadline), sent like the early warning.
            self.log.warning("BUDGET PAGE for %s: %s", self.job_version, event.get("reason"))
            self._notify(context, {**event, "warning": {"message": event.get("reason")}})
            self.defer(trigger=self._trigger(**{**event["watch"], "paged": True}), method_name="execute_complete")
        summary = {
            "fired": status == "cutoff",
            "reason": event.get("reason"),
            "job_version": event.get("job_version", self.job_version),
            "outstanding": event.get("counts", {}).get("outstanding"),
            "latest_safe_start": event.get("decision", {}).get("latest_safe_start"),
            "deadline": event.get("decision", {}).get("deadline"),
            "constants": event.get("constants"),
            "message": event.get("message"),
        }
        if status == "cutoff":
            from batch_inference import db
            from batch_inference.fallback import enter_fallback

            with db.connect(ledger_conninfo(self.postgres_conn_id)) as conn:
                summary["entered_fallback"] = enter_fallback(conn, summary["job_version"])
            self.log.warning("CUTOFF for %s (%s): job in fallback mode, batch workers drain; %s",
                             summary["job_version"], event.get("reason"), event.get("message"))
            summary["page"] = self._page_if_lost(context, summary, event.get("reason"))
        elif status == "complete":
            self.log.info("%s complete before the cutoff: %s", summary["job_version"], event.get("message"))
        else:
            raise AirflowException(f"cutoff trigger sent an unknown event status {status!r}")
        return summary
