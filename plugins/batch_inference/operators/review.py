"""``ReviewGateOperator``: the human review gate as a step of the DAG, in Airflow's Required Actions.

A job version whose spec asks for a human review (``evaluation.review``,
docs/evaluation.md) is refused by ``bi.publish_v1`` until enough rows of its
review sample are reviewed and marked right. This task sits between validate
and publish and waits for that gate, so publish runs once, when it can pass:

* gate met at the first read (or no review asked for): succeeds at once,
  with no Required Action and no deferral (a trigger that fires at once
  races the scheduler, apache/airflow#72716);
* gate open: writes a Required Action (the standard provider's
  human-in-the-loop detail, the same record ``HITLOperator`` writes) whose
  body links the dashboard's review screen and states the gate's progress,
  then defers to :class:`~batch_inference.triggers.review.ReviewGateTrigger`,
  which polls the gate in the triggerer. Reviews are recorded where they are
  today (the dashboard's review screen, ``batch-inference review``); when
  they meet the gate the task succeeds and publish follows;
* a reviewer answers the Required Action with **Reject** and a reason:
  Airflow resumes the deferred task with that response (its own
  human-in-the-loop response handler); the task records the rejection in
  the ledger (``bi.review_rejections``, reviewer ``airflow:NAME``) and fails
  without retries, the reason as the run's failure message;
* a rejection already stands in the ledger (``batch-inference review
  --reject``, the dashboard's review screen), at the first read or while
  waiting: the task fails without retries, naming who rejected and why;
* ``timeout`` passes with the gate still open: the task fails without
  retries and the DAG's ``on_failure_callback`` (``OnCallNotifier``) pages
  on-call with the gate's progress.

Rejecting is the only answer the Required Action offers: approval is the
reviews themselves, so the gate ``bi.publish_v1`` checks stays the one
authority. The body is written once, when the wait begins (Airflow keeps the
first one); the dashboard's screen and the task log (a line at each change)
show the progress live. The ledger's rejection is what publish obeys:
``bi.publish_v1`` refuses a version with a standing rejection in the
statement that switches the pointer, so a rejection recorded any time before
that statement commits (the dashboard's Reject, the command's ``--reject``)
stops the publish even after this task succeeded. A Required Action answered
in the seconds after the trigger found the gate met, before the task
resumed, is stored by Airflow only (Airflow resumes only a waiting task, and a
task process cannot read the response back: the supervisor answers that
request only for triggers); the body therefore points at the dashboard's
Reject too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook, LedgerTask
from batch_inference.triggers.review import MET, REJECTED, TIMEOUT, ReviewGateTrigger

REASON = "reason"


def review_url(job_version: str, base_url: str | None = None) -> str:
    """The dashboard's review screen of a job version, under Airflow's ``[api] base_url`` (a path
    from the API server's root when that is not set)."""
    from airflow.sdk.configuration import conf

    from batch_inference.provider import URL_PREFIX

    base = (base_url or conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return f"{base}{URL_PREFIX}/jobs/{job_version}/review"


def gate_line(state: dict[str, Any]) -> str:
    """The spec's review gate in words."""
    return (f"at least {max(state['required'], 1)} sample rows reviewed, at least {state['min_right']:.0%} of "
            "them marked right")


def review_body(job_version: str, dataset: str, state: dict[str, Any], url: str,
                timeout_at: datetime | None, poll_interval: float) -> str:
    """The Required Action's text (Markdown): what waits, how far the review is, where to do it."""
    lines = [
        f"Job version **{job_version}** (dataset **{dataset}**) is validated and waits for its human review "
        "before it is published.",
        "",
        f"**Progress** when this action opened: {state['problem']}. The gate: {gate_line(state)}.",
        "",
        f"[Review the sample on the dashboard]({url}): its screen shows the progress live. The run goes on to "
        f"publish by itself within {poll_interval:.0f} s of the gate being met; nothing needs answering here.",
        "",
        "**Reject**, with a reason, to fail the run instead: the rejection is recorded in the ledger, the version "
        "stays unpublished and the reason is the run's failure message. After the gate is met, reject on the "
        "dashboard's review screen: publish refuses a version whose rejection stands.",
    ]
    if timeout_at is not None:
        lines += ["", f"If the gate is still open at {timeout_at.isoformat()}, the task fails and pages on-call."]
    return "\n".join(lines)


class ReviewGateOperator(LedgerTask, HITLOperator):
    """Wait, deferred and listed in Airflow's Required Actions, until the job version's review gate is met.

    :param job_version: the job version under review (templated; an XComArg works).
    :param timeout: when to give up and page (templated): ``+8h``/``+90m`` after the wait begins,
        ``HH:MM`` (the next such time, in ``tz``) or an ISO datetime; empty waits without end.
    :param tz: zone for a clock-time ``timeout`` (default UTC).
    :param poll_interval: seconds between the trigger's reads of the gate.
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param subject: the Required Action's headline.
    """

    REJECT = "Reject"
    template_fields: Sequence[str] = ("job_version", "timeout", "postgres_conn_id", "subject")
    ui_color = "#c7b3e5"

    def __init__(self, *, job_version: Any, timeout: str | None = None, tz: str = "UTC",
                 poll_interval: float = 15.0, postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 subject: str = "Review the job version before it is published", **kwargs: Any) -> None:
        # The Required Action's one form field. The DAG's Params come in merged (apply_defaults);
        # HITLOperator keeps only the task's own, so the field is marked as the task's.
        params = ParamsDict(kwargs.pop("params", None) or {})
        params.update({REASON: Param("", type="string", title="Reason", source="task",
                                     description="Why this version must not be published: it becomes the "
                                                 "run's failure message")})
        super().__init__(subject=subject, options=[self.REJECT], params=params, **kwargs)
        self.job_version = job_version
        self.timeout = timeout
        self.tz = tz
        self.poll_interval = poll_interval
        self.postgres_conn_id = postgres_conn_id

    def timeout_at(self, now: datetime | None = None) -> datetime | None:
        """``timeout`` as a time (None: no timeout), read as the DAGs' deadline Param is."""
        from zoneinfo import ZoneInfo

        from batch_inference.cutoff import parse_clock
        from batch_inference.params import resolve_deadline

        text = str(self.timeout or "").strip()
        if not text or text.lower() == "none":
            return None
        now = now or datetime.now(timezone.utc)
        tz = timezone.utc if self.tz.upper() == "UTC" else ZoneInfo(self.tz)
        try:
            return parse_clock(resolve_deadline(text, now), now, tz)
        except ValueError as exc:
            raise AirflowFailException(f"review timeout {text!r}: {exc}") from None

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.execution_time.hitl import upsert_hitl_detail

        from batch_inference.evaluation import review_state
        from batch_inference.status import UnknownJob, job_spec

        job = str(self.job_version)
        try:
            with self.ledger_hook(self.postgres_conn_id).get_conn() as conn:
                dataset = job_spec(conn, job).dataset
                state = review_state(conn, job)
        except UnknownJob as exc:
            raise AirflowFailException(str(exc)) from None
        if state["rejection"]:
            raise AirflowFailException(f"review: job version {job} was {state['rejection']}")
        if state["passed"]:
            self.log.info("review gate of %s %s", job, "met" if state["required"] or state["min_right"]
                          else "not asked for by its spec")
            return {"job_version": job, **state}
        timeout_at = self.timeout_at()
        url = review_url(job)
        self.body = review_body(job, dataset, state, url, timeout_at, self.poll_interval)
        ti = context["task_instance"]
        upsert_hitl_detail(ti_id=ti.id, options=self.options, subject=self.subject, body=self.body,
                           defaults=self.defaults, multiple=self.multiple, params=self.serialized_params,
                           assigned_users=self.assigned_users)
        for notifier in self.notifiers:
            notifier(context)
        self.log.info("waiting for the review gate of %s: %s; review at %s (Airflow lists it under Required "
                      "Actions)%s", job, state["problem"], url,
                      f"; times out at {timeout_at.isoformat()}" if timeout_at else "")
        self.defer(trigger=ReviewGateTrigger(job, timeout_at.isoformat() if timeout_at else None, self.poll_interval,
                                             self.postgres_conn_id, state["reviewed"]),
                   method_name="execute_complete")

    def _refuse(self, chosen: list[str], params_input: dict[str, Any] | None, user: Any) -> None:
        """Fail the task if the Required Action was answered with Reject."""
        self.validate_chosen_options(chosen)
        if self.REJECT not in chosen:
            return
        from batch_inference.evaluation import record_rejection

        who = (user or {}).get("name") or "a reviewer"
        reason = str((params_input or {}).get(REASON) or "").strip() or "(no reason given)"
        try:
            with self.ledger_hook(self.postgres_conn_id).get_conn() as conn:
                record_rejection(conn, str(self.job_version), reviewer=f"airflow:{who}", reason=reason)
        except Exception as exc:  # noqa: BLE001 - the run fails either way; the log says the ledger missed it
            self.log.error("the rejection of %s was not recorded in the ledger: %s", self.job_version,
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise AirflowFailException(f"review: {who} rejected job version {self.job_version}: {reason}")

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        event = event or {}
        if "chosen_options" in event:   # Airflow resumed the task with the Required Action's response
            self._refuse(list(event["chosen_options"]), event.get("params_input"), event.get("responded_by_user"))
        status = event.get("status")
        if status == MET:
            self.log.info("review gate of %s met; publish follows", self.job_version)
            return {"job_version": str(self.job_version), **event["review"]}
        if status == REJECTED:
            raise AirflowFailException(f"review: job version {self.job_version} was {event['review']['rejection']}")
        if status == TIMEOUT:
            state = event.get("review") or {}
            problem = state.get("problem") or "the ledger could not be read"
            raise AirflowFailException(
                f"review: the gate of job version {self.job_version} was still open at {event.get('timeout_at')}: "
                f"{problem}; review the sample at {review_url(str(self.job_version))} (or `batch-inference review "
                f"{self.job_version}`), then clear this task")
        raise AirflowException(f"review trigger sent an unknown event {event!r}")
