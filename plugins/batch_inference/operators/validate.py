"""``ValidateOperator``: the publish gate, as a task.

A thin shell over ``batch_inference.validate.validate``: coverage, schema,
dead-letter rate, drift and a sample. The report is stored with the job
version (and its status becomes ``validated`` or ``failed_validation``)
before this task decides anything, so the UI and the CLI see the same
verdict the DAG acted on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batch_inference.hooks.batch_inference import BatchInferenceHook, LedgerTask


def plain(obj: Any) -> Any:
    """A JSON-plain copy (XCom serializes plain dicts; the Report is a dict subclass)."""
    return json.loads(json.dumps(obj, default=str, ensure_ascii=False))


class ValidateOperator(LedgerTask, BaseOperator):
    """Validate a finished job version; fail the task with the report's failures if it did not pass.

    :param job_version: the job version (templated; an XComArg works).
    :param postgres_conn_id: Airflow connection of the ledger database. Templated.
    :param fail_on_failure: fail the task when validation fails (default). With
        False the task succeeds and returns the failed report; the publish that
        follows is then refused by its own guard unless forced with a reason.
    :param sample_dir: where the evaluation sample (JSONL) is written. Templated.
    """

    template_fields: Sequence[str] = ("job_version", "postgres_conn_id", "sample_dir")
    ui_color = "#8dbb6f"

    def __init__(self, *, job_version: Any, postgres_conn_id: str = BatchInferenceHook.default_conn_name,
                 fail_on_failure: bool = True, sample_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job_version = job_version
        self.postgres_conn_id = postgres_conn_id
        self.fail_on_failure = fail_on_failure
        self.sample_dir = sample_dir

    def execute(self, context: Context) -> dict[str, Any]:
        from batch_inference.status import UnknownJob
        from batch_inference.validate import NotReady, validate

        job = str(self.job_version)
        try:
            with self.ledger_hook(self.postgres_conn_id).get_conn() as conn:
                report = plain(validate(conn, job, sample_dir=self.sample_dir or None))
        except UnknownJob as exc:
            raise AirflowFailException(str(exc)) from None
        except NotReady as exc:
            # Shards still open (a fallback pool still draining): a retry may find them done.
            raise AirflowException(str(exc)) from None
        cov = report["coverage"]
        self.log.info("%s: %s; %s stored + %s dead letters of %s (dead-letter rate %.2f%%, gate %.2f%%)%s",
                      job, "PASSED" if report["passed"] else "FAILED", cov.get("stored"), cov.get("dead_letters"),
                      cov.get("snapshot"), 100 * report["dead_letter_rate"], 100 * report["dead_letter_gate"],
                      "".join(f"\n  note: {n}" for n in report.get("notes", [])))
        if not report["passed"]:
            context["ti"].xcom_push(key="report", value=report)   # for the on-call message
            lines = "\n".join(f"  - {f}" for f in report["failures"])
            message = (f"job version {job} failed validation; it stays unpublished and downstream keeps "
                       f"reading the current version:\n{lines}")
            if self.fail_on_failure:
                raise AirflowFailException(message)
            self.log.warning("%s (continuing: fail_on_failure=False)", message)
        return report
