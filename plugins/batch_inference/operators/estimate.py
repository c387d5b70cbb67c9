"""``EstimateOperator``: the preview before submit; a night it already knows is lost stops here.

A thin shell over ``batch_inference.estimate.preview``: the spec as the
submit task loads it (the same overrides), its source read as the submit
reads it, nothing written but the preview's own row (``bi.estimate_previews``,
for the dashboard; no job version exists yet). The figures are the task's
XCom. A preview whose bill is over ``cost.budget``, or whose records cannot
be done by the deadline even through the fallback, fails the task with
``AirflowFailException`` (no retry: the arithmetic will not change), so
nothing downstream runs and nothing is spent; the DAG's
``OnCallNotifier`` sends the one page.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowFailException
from psycopg.types.json import Jsonb

from batch_inference import db
from batch_inference.operators.submit import SubmitJobOperator, dag_run_ids

STOPPED = "the preview stops the night before any spend"


class EstimateOperator(SubmitJobOperator):
    """Preview the job the submit task will make, and stop the run when it is over budget or late.

    Takes every argument of :class:`SubmitJobOperator` (the spec, its overrides, the ledger
    connection), and:

    :param deadline: when the version must be published: '+20h' after the run's start (a
        backfill run's: now), 'HH:MM' (next such time, UTC) or ISO; empty: no finish verdict. Templated.
    :param workers: batch workers the run will have (default: the spec's cost). Templated.
    :param run_after: the run's start, ISO (default ``{{ dag_run.run_after }}``); ``run_type`` the run's type.
    """

    template_fields: Sequence[str] = (*SubmitJobOperator.template_fields, "deadline", "workers", "run_after",
                                      "run_type")
    ui_color = "#d5e8f5"

    def __init__(self, *, deadline: str | None = None, workers: int | str | None = None,
                 run_after: str | None = None, run_type: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deadline = deadline
        self.workers = workers
        self.run_after = run_after
        self.run_type = run_type

    def _deadline(self, now: datetime) -> datetime | None:
        from batch_inference.cutoff import parse_clock
        from batch_inference.params import deadline_reference, resolve_deadline

        text = str(self.deadline or "").strip()
        if not text or text == "None":
            return None
        start = datetime.fromisoformat(self.run_after) if self.run_after else None
        ref = deadline_reference(start, self.run_type, now)
        try:
            return parse_clock(resolve_deadline(text, ref), ref)
        except ValueError as exc:
            raise AirflowFailException(f"deadline {text!r}: {exc}") from None

    def _workers(self) -> int | None:
        """The ``workers`` Param as rendered (a string through Jinja); empty means the spec's default."""
        text = str(self.workers if self.workers is not None else "").strip()
        if text in ("", "None"):
            return None
        try:
            return int(text)
        except ValueError:
            raise AirflowFailException(f"workers must be an integer, got {self.workers!r}") from None

    def execute(self, context: Context) -> dict[str, Any]:
        from datetime import UTC

        from batch_inference import estimate   # estimate.preview: `import preview` from it, grimp reads as the submodule
        from batch_inference.estimate import CharEstimate, counter_for, default_workers
        from batch_inference.exceptions import BatchInferenceError, InvalidValue
        from batch_inference.snapshot import SnapshotError
        from batch_inference.sources import for_spec

        spec = self.load_spec(context)
        now = datetime.now(UTC)
        deadline = self._deadline(now)
        workers = self._workers() or default_workers(spec)
        try:
            counter = counter_for(spec)
        except InvalidValue as exc:   # the pinned model lives on the GPU nodes, not here: say so, estimate
            self.log.warning("estimate: %s; counting tokens as an estimate instead", exc)
            counter = CharEstimate()
        reader = for_spec(spec, s3_endpoint_url=self.s3_endpoint_url, aws_conn_id=self.aws_conn_id)
        hook = self.ledger_hook(self.postgres_conn_id)
        run = dag_run_ids(context)
        try:
            with hook.get_conn() as conn:
                p = estimate.preview(conn, spec, reader=reader, counter=counter, workers=workers, deadline=deadline,
                            now=now)
                figures = p.as_dict()
                if run:
                    conn.execute(db.q("estimate_preview_insert"), {
                        "dag_id": run[0], "run_id": run[1], "dataset": spec.dataset, "spec_hash": spec.spec_hash,
                        "verdict": p.verdict, "figures": Jsonb(figures)})
        except SnapshotError as exc:
            raise AirflowFailException(f"estimate refused: {exc}") from None
        except BatchInferenceError as exc:
            raise AirflowFailException(f"estimate: {exc}") from None
        finally:
            counter.close()
        self.log.info("estimate %s: %d records (%d to run), %d input tokens (%s), bill $%s planned, finish %s: %s",
                      spec.dataset, p.records, p.eligible, p.input_tokens["total"],
                      "exact" if p.exact else "estimated", p.bill["planned"]["total"], p.finish or "unknown",
                      p.verdict)
        if p.verdict != "go":
            raise AirflowFailException(f"estimate: {STOPPED}: {p.why}")
        return figures
