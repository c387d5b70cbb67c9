"""On-call alerting for the batch-inference DAGs.

``OnCallNotifier`` is an Airflow notifier for ``on_failure_callback``: when a
task fails it looks up the job version (the task's own, the submit task's
XCom, else the ledger's ``bi.job_runs`` row of the DAG run), reads the job's
live counts and its dead letters by cause from the ledger, and sends one
message that names the DAG, the run, the task, the job version, the counts,
the error, and what to do next, with the exact commands. ``deadline_missed``
is the same message for a DAG-level Deadline Alert
(``airflow.sdk.DeadlineAlert``), which Airflow runs in the triggerer when a
run is still going at its deadline; it has only the DAG run's fields, so it
finds the job version in ``bi.job_runs`` (written by the submit task, whether
it created the version or resumed an existing one).

Where messages go: always the task log (ERROR); a webhook that takes JSON
(``webhook_url``, default ``$BATCH_INFERENCE_ONCALL_WEBHOOK``: Slack-style
incoming webhooks read the ``text`` field); and a JSON-lines file
(``log_file``, default ``$BATCH_INFERENCE_ONCALL_FILE``). Both get the same
JSON (``message_json``). The webhook URL is a secret (it is the credential of
a Slack-style hook): it is never logged, a failure names its host only. A
delivery that fails is logged and never raised: the task's own failure is
what matters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from airflow.sdk import BaseNotifier

from batch_inference.hooks.connection import DEFAULT_CONN_ID

log = logging.getLogger("batch_inference.oncall")

WEBHOOK_ENV = "BATCH_INFERENCE_ONCALL_WEBHOOK"
FILE_ENV = "BATCH_INFERENCE_ONCALL_FILE"
NO_DEADLINE_ALERT_ENV = "BATCH_INFERENCE_NO_DEADLINE_ALERT"
WEBHOOK_TIMEOUT_S = 10.0
# An exception with this attribute true was already told to on-call by the task that raised it (the
# fallback's budget stop pages before it fails): the failure callback sends nothing more.
ONCALL_SENT = "oncall_sent"

# Dead-letter reasons (PostgreSQL regular expressions, matched case-blind by
# the query dead_letter_causes) that say the model endpoint failed, not the
# prompt: HTTP 5xx/408/429 and transport errors, and the engines' "gave up
# after N attempts", which they add only to retryable (5xx, transport) errors.
ENDPOINT_ERRORS = ("HTTP (5[0-9][0-9]|408|429)|connection (refused|reset|aborted|closed|error|lost)|connecterror|"
                   "connecttimeout|readtimeout|writetimeout|pooltimeout|timed out|timeout|gave up after|"
                   "server disconnected|remoteprotocolerror|name or service not known|name resolution|"
                   "network is unreachable|no route to host|service unavailable|bad gateway")
# Reasons that say the model answered with output the spec does not accept
# (batch_inference.outputs and the engines' empty or truncated answers).
OUTPUT_ERRORS = ("not valid JSON|does not match the schema|not a JSON object|cannot be stored|rule on '|"
                 "no output|has no content|no choices|no completion|output truncated")


# -- the message --------------------------------------------------------------

def _counts_line(c: dict[str, Any]) -> str:
    s = c.get("shards") or {}
    return (f"{c['stored']}/{c['records']} stored ({c.get('stored_fallback', 0)} by fallback, {c.get('reused', 0)} "
            f"reused), {c['dead_letters']} dead letters, {c['outstanding']} outstanding; shards pending "
            f"{s.get('pending', '?')}, leased {s.get('leased', '?')}, done {s.get('done', '?')}; "
            f"mode {c.get('mode')}, status {c.get('status')}")


def _causes_line(causes: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{cause} {c['n']}" for cause, c in causes.items())


def endpoint_was_down(causes: dict[str, dict[str, Any]] | None) -> bool:
    """More than half of the dead letters are endpoint or transport errors."""
    total = sum(c["n"] for c in (causes or {}).values())
    return bool(total) and 2 * (causes or {}).get("endpoint", {}).get("n", 0) > total


def next_steps(task_id: str | None, job_version: str | None, dataset: str | None,
               counts: dict[str, Any] | None, error: str | None,
               causes: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """What on-call should do, most likely first; every step is a command or a click.

    ``causes`` is the job's dead letters by cause (``dead_letter_causes``):
    after a failed validation whose dead letters are mostly endpoint errors
    the advice is to re-run once the endpoint answers, not to fix the prompt.
    """
    steps: list[str] = []
    task = (task_id or "").lower()
    err = (error or "").lower()
    if task == "estimate" and "before any spend" in err:
        steps.append("the preview says tonight's run would break its budget or miss its deadline (the figures "
                     "above, and in the estimate task's XCom); nothing was submitted or spent: raise cost.budget, "
                     "move the deadline, add workers or pick a cheaper model, then clear the estimate task")
        return steps
    if job_version is None:
        steps.append("the job was never submitted: fix the spec or the source named in the error, then clear "
                     "the submit task (a submit is one transaction; nothing was written)")
        return steps
    if "will be missed" in err:
        steps.append("the deadline will be missed whatever happens now (the arithmetic above): tell the readers "
                     f"of {dataset or 'the dataset'} that tonight's data will be late")
        steps.append("bring the fallback endpoint back (or point the spec's fallback.base_url at one that answers): "
                     "the fallback task keeps re-driving what it can and publish follows")
    if "stops at the budget" in err:
        steps.append("the fallback stopped at cost.budget (the arithmetic above) and the rows left stay pending: "
                     "to publish tonight, resubmit the spec with a larger cost.budget (it is not part of the job "
                     "version) and clear the fallback task; otherwise the readers keep the current version")
    if "digest" in err or "weights" in err:
        steps.append("the worker refused the model weights: mount the weights the spec pins "
                     "(or submit a new spec with the new digest), then clear the workers task")
    if ("validat" in task or "failed validation" in err) and endpoint_was_down(causes):
        ep = (causes or {})["endpoint"]
        total = sum(c["n"] for c in (causes or {}).values())
        steps.append(f"{ep['n']} of {total} dead letters are endpoint errors (e.g. \"{ep['example']}\"): the model "
                     "endpoint was down or overloaded, the prompt is not at fault; check that it answers again")
        steps.append(f"then re-run: `batch-inference drop {job_version}` and trigger the DAG again (the same spec over "
                     "the same rows is the same job version, and its dead letters stay until it is dropped)")
        steps.append(f"the dead letters: `batch-inference dead-letters {job_version}`")
    elif "validat" in task or "failed validation" in err:
        steps.append(f"inspect why: `batch-inference validate {job_version}` and "
                     f"`batch-inference dead-letters {job_version}`")
        steps.append("a prompt or schema fix is a new spec and a new job version: edit it and trigger the DAG again; "
                     f"to publish this version anyway: `batch-inference publish {job_version} --force --reason TEXT`")
    elif "review" in task and "rejected" in err:
        steps.append("a reviewer rejected the version (the reason is the error above); it stays unpublished and "
                     "downstream keeps reading the current version")
        steps.append("a prompt or schema fix is a new spec and a new job version: edit it and trigger the DAG again; "
                     "to review this version again, clear the review task (a new Required Action opens)")
    elif "review" in task:
        steps.append(f"review the sample: the dashboard's review screen (the link in the error) or "
                     f"`batch-inference review {job_version}`, then clear the review task: it passes at once when "
                     "the gate is met, and publish follows")
    elif "publish" in task:
        steps.append(f"see what is live: `batch-inference published {dataset or 'DATASET'}`")
    elif "worker" in task or "fallback" in task or "cutoff" in task:
        steps.append(f"watch the job: `batch-inference status {job_version}`; fix the cause in the task log, then "
                     "clear the task: workers resume from the ledger, only in-flight records are redone")
    if counts and counts.get("dead_letters"):
        steps.append(f"{counts['dead_letters']} dead letter(s): `batch-inference dead-letters {job_version}`")
    if dataset:
        steps.append(f"if the published data is wrong: `batch-inference rollback {dataset} --reason TEXT` "
                     "(downstream switches back at once)")
    steps.append(f"live counts: `batch-inference status {job_version}`")
    return list(dict.fromkeys(steps))


def build_message(*, dag_id: str | None, run_id: str | None, task_id: str | None, try_number: Any = None,
                  job_version: str | None, dataset: str | None = None, counts: dict[str, Any] | None,
                  error: str | None, kind: str = "task failed", extra: str | None = None,
                  causes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The on-call message: ``text`` for people, the fields for machines."""
    steps = next_steps(task_id, job_version, dataset, counts, error, causes)
    where = f"DAG {dag_id}, run {run_id}" + (f", task {task_id}" if task_id else "") + \
        (f" (try {try_number})" if try_number else "")
    lines = [f"[batch-inference] {kind}: {where}"]
    lines.append(f"job version: {job_version or '(none: not submitted)'}" + (f", dataset {dataset}" if dataset else ""))
    if counts:
        lines.append("counts: " + _counts_line(counts))
    if causes:
        lines.append("dead letters by cause: " + _causes_line(causes))
    if extra:
        lines.append(extra)
    if error:
        first = error.strip().splitlines()
        lines.append("error: " + (first[0] if first else error) + (" (more in the task log)" if len(first) > 1 else ""))
    lines.append("next:")
    lines.extend(f"  - {s}" for s in steps)
    return {"text": "\n".join(lines), "kind": kind, "dag_id": dag_id, "run_id": run_id, "task_id": task_id,
            "try_number": try_number, "job_version": job_version, "dataset": dataset, "counts": counts,
            "dead_letter_causes": causes, "error": error, "next_steps": steps,
            "at": datetime.now(timezone.utc).isoformat()}


# -- delivery -----------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    """``json.dumps``'s fallback: datetimes as ISO 8601, Decimals as numbers, anything else as text."""
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def message_json(message: dict[str, Any]) -> str:
    """The message as JSON, one line: what the webhook and the file get."""
    return json.dumps(message, default=_jsonable, ensure_ascii=False)


def redact_url(url: str) -> str:
    """The webhook URL as it may be logged: scheme and host, never the path or credentials."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(unparseable URL)"
    return f"{parts.scheme or '?'}://{host}{port}/..."


def post_webhook(url: str, body: str) -> None:
    """POST the JSON body; raises on a transport error or an HTTP error status.

    urllib, not httpx: httpx logs every request line with its full URL at
    INFO, and the task log would then hold the secret.
    """
    req = urllib.request.Request(url, data=body.encode("utf-8"), method="POST",
                                 headers={"Content-Type": "application/json; charset=utf-8"})
    with urllib.request.urlopen(req, timeout=WEBHOOK_TIMEOUT_S) as resp:  # noqa: S310 - the configured hook
        resp.read()


def deliver(message: dict[str, Any], webhook_url: str | None = None, log_file: str | None = None) -> None:
    log.error("%s", message["text"])
    body = message_json(message)
    url = webhook_url or os.environ.get(WEBHOOK_ENV)
    if url:
        try:
            post_webhook(url, body)
        except urllib.error.HTTPError as exc:
            log.warning("on-call webhook %s answered HTTP %s", redact_url(url), exc.code)
        except Exception as exc:  # noqa: BLE001 - alerting must not mask the failure it reports
            detail = (str(getattr(exc, "reason", None) or exc) or exc.__class__.__name__).replace(url, redact_url(url))
            log.warning("on-call webhook %s failed: %s", redact_url(url), detail.splitlines()[0])
    path = log_file or os.environ.get(FILE_ENV)
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(body + "\n")
        except OSError as exc:
            log.warning("on-call file %s not written: %s", path, exc)


# -- lookups ------------------------------------------------------------------

def run_job_version(conn: Any, dag_id: str, run_id: str) -> str | None:
    """The job version a DAG run's submit returned, created or resumed (``bi.job_runs``); None before it."""
    from batch_inference import db

    row = conn.execute(db.q("job_run_version"), {"dag_id": dag_id, "run_id": run_id}).fetchone()
    return row["job_version"] if row else None


def dead_letter_causes(conn: Any, job_version: str) -> dict[str, dict[str, Any]]:
    """The job's dead letters by cause (endpoint, output, input, other), most first: ``{cause: {n, example}}``."""
    from batch_inference import db

    rows = conn.execute(db.q("dead_letter_causes"),
                        {"job": job_version, "endpoint": ENDPOINT_ERRORS, "output": OUTPUT_ERRORS}).fetchall()
    return {r["cause"]: {"n": int(r["n"]), "example": r["example"]} for r in rows}


def _ledger_facts(postgres_conn_id: str, job_version: str | None,
                  run: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """What the ledger says about the job: ``job_version`` (looked up by ``run``, (dag_id, run_id), when
    not given), ``counts``, ``dataset`` and dead-letter ``causes``; None for what it cannot say."""
    facts: dict[str, Any] = {"job_version": job_version, "counts": None, "dataset": None, "causes": None}
    dag_id, run_id = run
    if not job_version and not (dag_id and run_id):
        return facts
    try:
        from batch_inference import db
        from batch_inference.hooks.connection import ledger_conninfo
        from batch_inference.status import job_counts, job_spec

        with db.connect(ledger_conninfo(postgres_conn_id)) as conn:
            if not job_version:
                facts["job_version"] = job_version = run_job_version(conn, dag_id, run_id)
                if not job_version:
                    return facts
            facts["counts"] = job_counts(conn, job_version)
            facts["dataset"] = job_spec(conn, job_version).dataset
            if facts["counts"].get("dead_letters"):
                facts["causes"] = dead_letter_causes(conn, job_version)
    except Exception as exc:  # noqa: BLE001 - the message goes out without counts rather than not at all
        log.warning("could not read %s from the ledger: %s", job_version or f"the job of run {run_id}",
                    str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__)
    return facts


def job_version_from_context(context: Any, submit_task_id: str = "submit") -> str | None:
    """The failing task's own job version if it has one, else the submit task's XCom."""
    task = context.get("task")
    own = getattr(task, "job_version", None)
    if isinstance(own, str) and own.startswith("jv_"):
        return own
    ti = context.get("ti") or context.get("task_instance")
    if ti is None:
        return None
    try:
        value = ti.xcom_pull(task_ids=submit_task_id, key="job_version")
    except Exception:  # noqa: BLE001 - no XCom (submit failed or never ran)
        return None
    if isinstance(value, list):  # some contexts return one value per mapped index
        value = next((v for v in value if v), None)
    return value or None


def task_message(context: Any, postgres_conn_id: str, job_version: str | None, error: str | None,
                 kind: str = "task failed") -> dict[str, Any]:
    """The on-call message about the task of ``context``, with what the ledger says of the job."""
    ti = context.get("ti") or context.get("task_instance")
    dag_run = context.get("dag_run")
    dag_id = getattr(dag_run, "dag_id", None) or getattr(ti, "dag_id", None)
    run_id = getattr(dag_run, "run_id", None) or getattr(ti, "run_id", None)
    facts = _ledger_facts(postgres_conn_id, job_version, (dag_id, run_id))
    return build_message(dag_id=dag_id, run_id=run_id,
                         task_id=getattr(ti, "task_id", None), try_number=getattr(ti, "try_number", None),
                         job_version=facts["job_version"], dataset=facts["dataset"], counts=facts["counts"],
                         causes=facts["causes"], error=error, kind=kind)


def page_if_deadline_lost(context: Any, postgres_conn_id: str, job_version: str, deadline: datetime, why: str, *,
                          rate: float | None = None, reserve_s: float | None = None,
                          step_s: int = 60) -> str | None:
    """Page on-call now if the arithmetic knows the deadline is lost (``fallback.deadline_page``, the nights'
    one message), with the same delivery as a failed task's, kind ``deadline will be missed``, the page as
    its error line. Returns the page, or None (not lost; or the ledger could not say, which is logged:
    the caller's work goes on)."""
    from batch_inference import db
    from batch_inference.fallback import deadline_page
    from batch_inference.hooks.connection import ledger_conninfo

    try:
        with db.connect(ledger_conninfo(postgres_conn_id)) as conn:
            page = deadline_page(conn, job_version, deadline, why, rate=rate, reserve_s=reserve_s, step_s=step_s)
    except Exception as exc:  # noqa: BLE001 - never in the way of the re-drive
        log.warning("could not work out whether the deadline of %s is lost: %s", job_version,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__)
        return None
    if page is not None:
        deliver(task_message(context, postgres_conn_id, job_version, page, kind="deadline will be missed"))
    return page


class OnCallNotifier(BaseNotifier):
    """``on_failure_callback`` for batch-inference DAGs.

    :param postgres_conn_id: Airflow connection of the ledger, for the counts. Templated.
    :param submit_task_id: the task whose XCom ``job_version`` names the job.
    :param webhook_url: POST the message as JSON here (default ``$BATCH_INFERENCE_ONCALL_WEBHOOK``). Templated.
    :param log_file: append the message as a JSON line here (default ``$BATCH_INFERENCE_ONCALL_FILE``). Templated.
    """

    template_fields: Sequence[str] = ("postgres_conn_id", "webhook_url", "log_file")

    def __init__(self, *, postgres_conn_id: str = DEFAULT_CONN_ID, submit_task_id: str = "submit",
                 webhook_url: str | None = None, log_file: str | None = None) -> None:
        super().__init__()
        self.postgres_conn_id = postgres_conn_id
        self.submit_task_id = submit_task_id
        self.webhook_url = webhook_url
        self.log_file = log_file

    def message(self, context: Any) -> dict[str, Any]:
        exc = context.get("exception")
        error = (str(exc) or exc.__class__.__name__) if exc is not None else context.get("reason")
        return task_message(context, self.postgres_conn_id, job_version_from_context(context, self.submit_task_id),
                            str(error) if error else None)

    def notify(self, context: Any) -> None:
        exc = context.get("exception")
        if getattr(exc, ONCALL_SENT, False):
            log.info("on-call already has this failure (%s): not sent again", type(exc).__name__)
            return
        deliver(self.message(context), self.webhook_url, self.log_file)


# -- DAG-level Deadline Alert -------------------------------------------------

def deadline_alert(interval: timedelta, *, dataset: str, postgres_conn_id: str = DEFAULT_CONN_ID) -> Any:
    """A DAG's ``deadline=``: ``deadline_missed`` if a run is still going ``interval`` after it was queued.

    Returns None when ``$BATCH_INFERENCE_NO_DEADLINE_ALERT`` is set. ``airflow
    dags test`` (and ``dag.test()``) in Airflow 3.3.2 fail at the end of a
    successful run of a DAG with a DeadlineAlert: ``DagRun.update_state``
    looks each alert up by id, and the DAG ``dag.test`` builds holds them
    serialized instead. The demo and the tests set the variable; a deployed
    DAG processor does not, so deployed DAGs keep their alert.
    """
    if os.environ.get(NO_DEADLINE_ALERT_ENV):
        return None
    from airflow.sdk import AsyncCallback, DeadlineAlert, DeadlineReference

    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=interval,
        callback=AsyncCallback(deadline_missed, kwargs={"dataset": dataset, "postgres_conn_id": postgres_conn_id}),
    )


async def deadline_missed(context: dict[str, Any] | None = None, *, dataset: str, postgres_conn_id: str = DEFAULT_CONN_ID,
                          webhook_url: str | None = None, log_file: str | None = None, **_: Any) -> None:
    """Deadline Alert callback (``AsyncCallback``): the DAG run is past its deadline and still running.

    Runs on the triggerer's event loop, so the ledger and the webhook are
    reached from a thread, never by blocking the loop. Airflow passes the
    DAG run as its REST form (``dag_id``, ``dag_run_id``, ``conf``...), no
    task instance and no XCom: the job version is the run's
    ``conf["job_version"]`` if set, else its ``bi.job_runs`` row.
    """
    context = context or {}
    run = context.get("dag_run") or {}
    deadline = (context.get("deadline") or {}).get("deadline_time")
    dag_id, run_id = run.get("dag_id"), run.get("dag_run_id") or run.get("run_id")
    conf_job = (run.get("conf") or {}).get("job_version") if isinstance(run.get("conf"), dict) else None

    def gather() -> dict[str, Any]:
        facts = _ledger_facts(postgres_conn_id, conf_job if isinstance(conf_job, str) and conf_job else None,
                              (dag_id, run_id))
        return build_message(dag_id=dag_id, run_id=run_id, task_id=None, job_version=facts["job_version"],
                             dataset=facts["dataset"] or dataset, counts=facts["counts"],
                             causes=facts["causes"], error=None,
                             kind="deadline missed",
                             extra=f"the run was still going at its deadline {deadline}; the cutoff sensor should "
                                   "have fired the fallback by now: check the cutoff and fallback tasks, and "
                                   "whether the review task waits for a human review (Required Actions)")

    message = await asyncio.to_thread(gather)
    await asyncio.to_thread(deliver, message, webhook_url, log_file)
