"""On-call alerting for the batch-inference DAGs.

``OnCallNotifier`` is an Airflow notifier for ``on_failure_callback``: when a
task fails it looks up the job version (the task's own, or the submit task's
XCom), reads the job's live counts from the ledger, and sends one message
that names the DAG, the run, the task, the job version, the counts, the
error, and what to do next, with the exact commands. ``deadline_missed`` is
the same message for a DAG-level Deadline Alert (``airflow.sdk.DeadlineAlert``),
which Airflow runs in the triggerer when a run is still going at its deadline.

Where messages go: always the task log (ERROR); a webhook that takes JSON
(``webhook_url``, default ``$BATCH_INFERENCE_ONCALL_WEBHOOK``: Slack-style
incoming webhooks read the ``text`` field); and a JSON-lines file
(``log_file``, default ``$BATCH_INFERENCE_ONCALL_FILE``). A delivery that fails
is logged and never raised: the task's own failure is what matters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import BaseNotifier

log = logging.getLogger("batch_inference.oncall")

WEBHOOK_ENV = "BATCH_INFERENCE_ONCALL_WEBHOOK"
FILE_ENV = "BATCH_INFERENCE_ONCALL_FILE"
NO_DEADLINE_ALERT_ENV = "BATCH_INFERENCE_NO_DEADLINE_ALERT"


# -- the message --------------------------------------------------------------

def _counts_line(c: dict[str, Any]) -> str:
    s = c.get("shards") or {}
    return (f"{c['stored']}/{c['records']} stored ({c.get('stored_fallback', 0)} by fallback, {c.get('reused', 0)} "
            f"reused), {c['dead_letters']} dead letters, {c['outstanding']} outstanding; shards pending "
            f"{s.get('pending', '?')}, leased {s.get('leased', '?')}, done {s.get('done', '?')}; "
            f"mode {c.get('mode')}, status {c.get('status')}")


def next_steps(task_id: str | None, job_version: str | None, dataset: str | None,
               counts: dict[str, Any] | None, error: str | None) -> list[str]:
    """What on-call should do, most likely first; every step is a command or a click."""
    steps: list[str] = []
    task = (task_id or "").lower()
    err = (error or "").lower()
    if job_version is None:
        steps.append("the job was never submitted: fix the spec or the source named in the error, then clear "
                     "the submit task (a submit is one transaction; nothing was written)")
        return steps
    if "digest" in err or "weights" in err:
        steps.append("the worker refused the model weights: mount the weights the spec pins "
                     "(or submit a new spec with the new digest), then clear the workers task")
    if "validat" in task or "failed validation" in err:
        steps.append(f"inspect why: `batch-inference validate {job_version}` and "
                     f"`batch-inference dead-letters {job_version}`")
        steps.append("a prompt or schema fix is a new spec and a new job version: edit it and trigger the DAG again; "
                     f"to publish this version anyway: `batch-inference publish {job_version} --force --reason TEXT`")
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
                  error: str | None, kind: str = "task failed", extra: str | None = None) -> dict[str, Any]:
    """The on-call message: ``text`` for people, the fields for machines."""
    steps = next_steps(task_id, job_version, dataset, counts, error)
    where = f"DAG {dag_id}, run {run_id}" + (f", task {task_id}" if task_id else "") + \
        (f" (try {try_number})" if try_number else "")
    lines = [f"[batch-inference] {kind}: {where}"]
    lines.append(f"job version: {job_version or '(none: not submitted)'}" + (f", dataset {dataset}" if dataset else ""))
    if counts:
        lines.append("counts: " + _counts_line(counts))
    if extra:
        lines.append(extra)
    if error:
        first = error.strip().splitlines()
        lines.append("error: " + (first[0] if first else error) + (" (more in the task log)" if len(first) > 1 else ""))
    lines.append("next:")
    lines.extend(f"  - {s}" for s in steps)
    return {"text": "\n".join(lines), "kind": kind, "dag_id": dag_id, "run_id": run_id, "task_id": task_id,
            "try_number": try_number, "job_version": job_version, "dataset": dataset, "counts": counts,
            "error": error, "next_steps": steps, "at": datetime.now(timezone.utc).isoformat()}


# -- delivery -----------------------------------------------------------------

def deliver(message: dict[str, Any], webhook_url: str | None = None, log_file: str | None = None) -> None:
    log.error("%s", message["text"])
    url = webhook_url or os.environ.get(WEBHOOK_ENV)
    if url:
        try:
            import httpx

            httpx.post(url, json=message, timeout=10.0).raise_for_status()
        except Exception as exc:  # noqa: BLE001 - alerting must not mask the failure it reports
            log.warning("on-call webhook failed: %s", exc)
    path = log_file or os.environ.get(FILE_ENV)
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(message, default=str, ensure_ascii=False) + "\n")
        except OSError as exc:
            log.warning("on-call file %s not written: %s", path, exc)


# -- lookups ------------------------------------------------------------------

def _ledger_facts(postgres_conn_id: str | None, job_version: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """(counts, dataset) of a job version; (None, None) if the ledger cannot say."""
    if not job_version:
        return None, None
    try:
        from batch_inference import db
        from batch_inference.hooks.batch_inference import BatchInferenceHook
        from batch_inference.status import job_counts, job_spec

        conninfo = BatchInferenceHook(postgres_conn_id).get_conninfo() if postgres_conn_id else db.resolve_url(None)
        with db.connect(conninfo) as conn:
            return job_counts(conn, job_version), job_spec(conn, job_version).dataset
    except Exception as exc:  # noqa: BLE001 - the message goes out without counts rather than not at all
        log.warning("could not read the counts of %s: %s", job_version, exc)
        return None, None


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


class OnCallNotifier(BaseNotifier):
    """``on_failure_callback`` for batch-inference DAGs.

    :param postgres_conn_id: Airflow connection of the ledger, for the counts. Templated.
    :param submit_task_id: the task whose XCom ``job_version`` names the job.
    :param webhook_url: POST the message as JSON here (default ``$BATCH_INFERENCE_ONCALL_WEBHOOK``). Templated.
    :param log_file: append the message as a JSON line here (default ``$BATCH_INFERENCE_ONCALL_FILE``). Templated.
    """

    template_fields: Sequence[str] = ("postgres_conn_id", "webhook_url", "log_file")

    def __init__(self, *, postgres_conn_id: str | None = None, submit_task_id: str = "submit",
                 webhook_url: str | None = None, log_file: str | None = None) -> None:
        super().__init__()
        self.postgres_conn_id = postgres_conn_id
        self.submit_task_id = submit_task_id
        self.webhook_url = webhook_url
        self.log_file = log_file

    def message(self, context: Any) -> dict[str, Any]:
        ti = context.get("ti") or context.get("task_instance")
        dag_run = context.get("dag_run")
        job = job_version_from_context(context, self.submit_task_id)
        counts, dataset = _ledger_facts(self.postgres_conn_id, job)
        exc = context.get("exception")
        error = (str(exc) or exc.__class__.__name__) if exc is not None else context.get("reason")
        return build_message(dag_id=getattr(dag_run, "dag_id", None) or getattr(ti, "dag_id", None),
                             run_id=getattr(dag_run, "run_id", None) or getattr(ti, "run_id", None),
                             task_id=getattr(ti, "task_id", None), try_number=getattr(ti, "try_number", None),
                             job_version=job, dataset=dataset, counts=counts,
                             error=str(error) if error else None)

    def notify(self, context: Any) -> None:
        deliver(self.message(context), self.webhook_url, self.log_file)


# -- DAG-level Deadline Alert -------------------------------------------------

def deadline_alert(interval: timedelta, *, dataset: str, postgres_conn_id: str | None = None) -> Any:
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


def _latest_job_of_run(postgres_conn_id: str | None, dataset: str, since: str | None) -> str | None:
    from batch_inference import db
    from batch_inference.hooks.batch_inference import BatchInferenceHook

    conninfo = BatchInferenceHook(postgres_conn_id).get_conninfo() if postgres_conn_id else db.resolve_url(None)
    with db.connect(conninfo) as conn:
        # Read-only and only here: the newest job version of the dataset submitted since the run started.
        row = conn.execute("SELECT job_version FROM bi.jobs WHERE dataset = %s AND created_at >= "
                           "coalesce(%s::timestamptz, '-infinity') ORDER BY created_at DESC LIMIT 1",
                           (dataset, since)).fetchone()
    return row["job_version"] if row else None


async def deadline_missed(context: dict[str, Any] | None = None, *, dataset: str, postgres_conn_id: str | None = None,
                          webhook_url: str | None = None, log_file: str | None = None, **_: Any) -> None:
    """Deadline Alert callback (``AsyncCallback``): the DAG run is past its deadline and still running.

    Runs on the triggerer's event loop, so the ledger and the webhook are
    reached from a thread, never by blocking the loop.
    """
    context = context or {}
    run = context.get("dag_run") or {}
    deadline = (context.get("deadline") or {}).get("deadline_time")

    def gather() -> dict[str, Any]:
        job = None
        try:
            job = _latest_job_of_run(postgres_conn_id, dataset, run.get("start_date") or run.get("queued_at"))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not find the run's job version: %s", exc)
        counts, _ds = _ledger_facts(postgres_conn_id, job)
        return build_message(dag_id=run.get("dag_id"), run_id=run.get("dag_run_id") or run.get("run_id"),
                             task_id=None, job_version=job, dataset=dataset, counts=counts, error=None,
                             kind="deadline missed",
                             extra=f"the run was still going at its deadline {deadline}; the cutoff sensor should "
                                   "have fired the fallback by now: check the cutoff and fallback tasks")

    message = await asyncio.to_thread(gather)
    await asyncio.to_thread(deliver, message, webhook_url, log_file)
