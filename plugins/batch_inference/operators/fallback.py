"""``FallbackPoolOperator``: re-drive what the batch left, through the synchronous pool.

A thin shell over :func:`batch_inference.fallback.run_fallback`. It runs after
``CutoffSensor`` in both of the sensor's outcomes. If the cutoff fired, it
claims the remaining shards through the ledger (transport ``fallback``) and
drives their records through an OpenAI-compatible endpoint at a sustained,
rate-limited pace. If the batch completed, nothing is outstanding and it
returns at once. Its return value (an XCom) is the run's measurements: rows
re-driven, sustained rate, overhead, and the ``bi.fallback_runs`` id.

Given the night's ``deadline`` (the cutoff sensor's, in the pipeline), an
endpoint that fails does not end the try: the operator pages on-call the
moment the arithmetic knows the deadline is lost (``fallback.deadline_page``,
the nights' one message), and keeps re-driving what it can every
``retry_wait_s`` until nothing is outstanding or ``give_up_after_s`` past the
deadline. Without a deadline a failing endpoint fails the try, for Airflow's
retry.

When re-driving every outstanding row would take the bill past the spec's
``cost.budget``, the pool's page (the arithmetic in one line) goes to on-call
once, kind ``over the budget``, before the pool starts. With ``on_budget:
spend`` the task goes on and succeeds; with ``on_budget: page`` the pool stops
at the budget and the task fails without a retry (``BudgetStop``): the records left
are pending, the job cannot be published, and a retry would find the budget spent.
That page is the one on-call message of a budget stop: the DAG's ``OnCallNotifier``
sends nothing more for the failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.exceptions import BatchInferenceError
from batch_inference.hooks.connection import DEFAULT_CONN_ID, ledger_conninfo

PAGE_CHECK_S = 5.0   # while the endpoint fails: how often the rows left are checked against the deadline


class BudgetStop(AirflowFailException, BatchInferenceError):
    """The pool stopped at ``cost.budget``: the try fails without a retry. On-call already has the
    budget's page, so ``OnCallNotifier`` sends nothing more for it (``callbacks.ONCALL_SENT``)."""

    oncall_sent = True


class FallbackPoolOperator(BaseOperator):
    """Drive a job's outstanding records through the synchronous fallback pool.

    :param job_version: the job version (templated).
    :param base_url: OpenAI-compatible API root including ``/v1`` (templated); default
        ``spec.fallback.base_url``.
    :param postgres_conn_id: Airflow connection of the ledger database.
    :param rate: sustained requests/s for the whole pool, retries included (token bucket); default
        ``spec.fallback.rate``.
    :param concurrency: requests in flight across the pool; default ``spec.fallback.concurrency``.
    :param parallel_shards: shards the pool holds at once (each pool thread holds one).
    :param model: model name sent to the endpoint (templated); default ``spec.model.name``. It changes
        results, so anything but the job's pinned name is refused.
    :param style: ``json_schema`` (vLLM, OpenAI) or ``json_object`` (llama.cpp's server); default
        ``spec.fallback.response_format_style``.
    :param hosted: True marks the endpoint hosted (as ``spec.fallback.hosted`` does); otherwise the
        spec's ``endpoints`` and the address decide (``batch_inference.clearance``), never this flag.
        A record class not cleared for hosted APIs is refused before any request.
    :param api_key_env: name of the environment variable holding the API key (never the key).
    :param record_run: write the run's measured rate and overhead to ``bi.fallback_runs``.
    :param engine_options: extra options for the ``openai`` engine (``max_retries``, ``timeout_s``, ...).
    :param deadline: when the rows must be in the table, an ISO datetime (templated; the pipeline passes
        the cutoff sensor's). None: a failing endpoint fails the try, as before.
    :param page_reserve_s: what the publish needs after the re-drive, the early page's margin (default
        ``cutoff.PAGE_RESERVE_SHARE`` of the spec's ``fallback.overhead_s``).
    :param retry_wait_s: with a deadline, seconds between re-drives while the endpoint fails.
    :param give_up_after_s: with a deadline, how long past it the try keeps re-driving before it fails.
    :param step_s: the page's latest start is floored to this many seconds, as the cutoff's is.
    """

    template_fields: Sequence[str] = ("job_version", "base_url", "model", "deadline")
    ui_color = "#f6b3a6"

    def __init__(self, *, job_version: str, base_url: str | None = None, postgres_conn_id: str = DEFAULT_CONN_ID,
                 rate: float | None = None, concurrency: int | None = None, parallel_shards: int = 4,
                 model: str | None = None, style: str | None = None, hosted: bool | None = None,
                 api_key_env: str | None = None, record_run: bool = True,
                 engine_options: dict[str, Any] | None = None, deadline: str | None = None,
                 page_reserve_s: float | None = None, retry_wait_s: float = 30.0, give_up_after_s: float = 3600.0,
                 step_s: int = 60, **kwargs: Any):
        super().__init__(**kwargs)
        self.job_version = job_version
        self.base_url = base_url
        self.postgres_conn_id = postgres_conn_id
        self.rate = rate
        self.concurrency = concurrency
        self.parallel_shards = parallel_shards
        self.model = model
        self.style = style
        self.hosted = hosted
        self.api_key_env = api_key_env
        self.record_run = record_run
        self.engine_options = engine_options
        self.deadline = deadline
        self.page_reserve_s = page_reserve_s
        self.retry_wait_s = retry_wait_s
        self.give_up_after_s = give_up_after_s
        self.step_s = step_s
        self._pool: Any = None
        self._killed = False
        self._kill = threading.Event()

    def execute(self, context: Any) -> dict[str, Any]:
        from batch_inference.deadline import parse_iso
        from batch_inference.fallback import FallbackEndpointUnavailable, FallbackIncomplete, FallbackRefused, \
            run_fallback
        from batch_inference.status import UnknownJob

        def keep(pool: Any) -> None:
            self._pool = pool

        deadline = parse_iso(str(self.deadline)) if self.deadline not in (None, "", "None") else None
        paged = False
        budget_paged: list[str] = []

        def page_budget(text: str) -> None:
            if not budget_paged:          # once per try, however often the endpoint makes it re-drive
                budget_paged.append(text)
                self._page_budget(context, text)

        while True:
            if self._killed:
                raise AirflowException("fallback pool stopped from outside (the task was marked failed, cleared or "
                                       "timed out) while its endpoint was failing")
            try:
                result = run_fallback(
                    ledger_conninfo(self.postgres_conn_id), self.job_version, self.base_url or None, rate=self.rate,
                    concurrency=self.concurrency, model=self.model or None, style=self.style or None,
                    hosted=self.hosted, api_key_env=self.api_key_env, parallel_shards=self.parallel_shards,
                    record_run=self.record_run, extra_engine_options=self.engine_options, pool_ready=keep,
                    on_page=page_budget, deadline=deadline)   # with fallback.tiers: the tier each row can afford
                break
            except (FallbackRefused, UnknownJob) as exc:
                raise AirflowFailException(str(exc)) from None  # configuration: retrying cannot help
            except FallbackEndpointUnavailable as exc:
                # No record spent an attempt on the outage: what is left waits for the endpoint.
                if deadline is None or self._killed:
                    raise AirflowException(str(exc)) from None  # Airflow's retry claims what is left
                self.log.warning("%s; re-driving again in %g s", exc, self.retry_wait_s)
                paged = self._wait_for_endpoint(context, deadline, str(exc), paged)
            except FallbackIncomplete as exc:
                raise AirflowException(str(exc)) from None  # a retry claims what is left
        if self._killed:
            raise AirflowException(f"fallback pool stopped from outside (the task was marked failed, cleared or "
                                   f"timed out) with {result.outstanding} record(s) outstanding; its shards "
                                   "were released")
        if result.budget_stop:
            raise BudgetStop(f"fallback stopped at the budget with {result.outstanding} record(s) "
                             f"outstanding, the job cannot be published: {result.budget_page}")
        if result.stopped and result.outstanding:
            raise AirflowException(f"fallback pool stopped with {result.outstanding} record(s) outstanding")
        return result.to_dict()

    def _page_budget(self, context: Any, text: str) -> None:
        """The pool's budget page to on-call, with the same delivery as a failed task's."""
        from batch_inference.callbacks import deliver, task_message

        deliver(task_message(context, self.postgres_conn_id, self.job_version, text, kind="over the budget"))

    def _wait_for_endpoint(self, context: Any, deadline: datetime, error: str, paged: bool) -> bool:
        """Wait ``retry_wait_s`` for the next re-drive, paging on-call (once, before the deadline) the moment
        the deadline is lost: the rows left are checked every ``PAGE_CHECK_S``. Returns whether it paged."""
        until = time.monotonic() + self.retry_wait_s
        while not self._killed:
            now = datetime.now(timezone.utc)
            if not paged and now < deadline:
                paged = self._page_if_lost(context, deadline, error)
            if now > deadline + timedelta(seconds=self.give_up_after_s):
                raise AirflowException(f"{error} (re-driven until {self.give_up_after_s:g} s past the deadline "
                                       f"{deadline.isoformat()})")
            left = until - time.monotonic()
            if left <= 0:
                break
            self._kill.wait(min(left, PAGE_CHECK_S))
        return paged

    def _page_if_lost(self, context: Any, deadline: datetime, error: str) -> bool:
        """Page on-call if the deadline is lost with the endpoint failing; True once paged."""
        from batch_inference.callbacks import page_if_deadline_lost

        first = error.strip().splitlines()[0] if error.strip() else "no answer"
        return page_if_deadline_lost(context, self.postgres_conn_id, self.job_version, deadline,
                                     f"the fallback endpoint is failing: {first[:140]}", rate=self.rate,
                                     reserve_s=self.page_reserve_s, step_s=self.step_s) is not None

    def on_kill(self) -> None:
        # Stop taking records, write what is in flight, release the leases,
        # so a retry (or the next try) claims the shards at once. Airflow then
        # returns into execute(), which fails the try.
        self._killed = True
        self._kill.set()
        if self._pool is not None:
            self._pool.stop()
