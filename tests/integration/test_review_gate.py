"""The review step of the example DAGs (``ReviewGateOperator``), under ``dag.test()`` on the real
embedded PostgreSQL: with the spec's review gate open the task writes a Required Action (Airflow's
human-in-the-loop record, in the SQLite metadata database) linking the dashboard's review screen
and defers; verdicts recorded meanwhile meet the gate and publish follows; a gate still open at
the review timeout fails the run and pages on-call. A Reject in Required Actions fails the task
with the reviewer's reason (the resume payload Airflow's own model builds). The live deployment
runs both through the UI's REST API (tests/process/test_live_airflow.py)."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import re
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from batch_inference import db, evaluation
from batch_inference.commands.demo import load_tickets
from tests.fixtures.airflow_env import airflow_home  # noqa: F401  (fixture)
from tests.integration.test_airflow_dags import (  # noqa: F401  (ledger: fixture)
    ledger, load_dag, noop_spec, oncall_messages, ti_states)

GATE = {"min_reviewed": 2, "min_right": 1.0}


def review_spec(directory: Path, dataset: str) -> str:
    """The demo spec on the noop engine under another dataset, with a human review gate over a sample of four."""
    return noop_spec(directory, dataset=dataset, evaluation={"review": GATE}, validation={"sample_size": 4})


def required_actions(since: datetime) -> list[Any]:
    """Airflow's human-in-the-loop records of review tasks created after ``since``."""
    from airflow.models.hitl import HITLDetail
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(HITLDetail).join(TaskInstance, HITLDetail.ti_id == TaskInstance.id)
                               .where(TaskInstance.task_id == "review", HITLDetail.created_at >= since)).all()
        for row in rows:
            session.expunge(row)
        return list(rows)


def run(spec: str, review_timeout: str):
    dag = load_dag("batch_inference_backfill")
    dag.get_task("review").poll_interval = 1.0     # the trigger reads the gate every second (15 s in the DAG)
    return dag.test(run_conf={
        "spec_path": spec, "source_table": "public.support_tickets", "engine": "", "workers": 1,
        "shard_size": 10, "review_timeout": review_timeout})


def test_the_review_step_waits_in_required_actions_until_the_gate_is_met(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 20)
    since = datetime.now(timezone.utc)
    seen: dict[str, Any] = {}

    def reviewer() -> None:
        # Once the Required Action is open (the task has deferred), two verdicts meet the gate.
        end = time.monotonic() + 240
        while not (actions := required_actions(since)):
            if time.monotonic() > end:
                return
            time.sleep(0.5)
        seen["action"] = actions[0]
        seen["job"] = re.search(r"\*\*(jv_[0-9a-f]+)\*\*", actions[0].body).group(1)
        with db.connect(url) as conn:
            for row in evaluation.review_rows(conn, seen["job"])[:2]:
                evaluation.record_review(conn, seen["job"], row["record_id"], "right", reviewer="cli:ana")

    assert required_actions(since) == []      # here first: the ORM's mappers configured before a second thread
    thread = threading.Thread(target=reviewer, daemon=True)
    thread.start()
    dr = run(review_spec(tmp_path, "review_met"), "+30m")
    thread.join(timeout=5)

    assert str(dr.state) == "success", ti_states(dr)
    action, job = seen["action"], seen["job"]
    assert action.options == ["Reject"] and not action.response_received
    assert f"/batch-inference/jobs/{job}/review" in action.body
    assert "review: 0 of 2 required sample rows reviewed" in action.body and job in action.body
    review = dr.get_task_instance("review")
    assert review.try_number == 1           # one try: it deferred with the gate open and resumed when met
    out = review.xcom_pull(task_ids="review")
    assert out["passed"] and out["reviewed"] == 2 and out["job_version"] == job
    with db.connect(url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM published.review_met").fetchone()["n"] > 0
    assert oncall_messages(oncall) == []


def test_a_review_gate_still_open_at_the_timeout_fails_the_run_and_pages(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 20)

    dr = run(review_spec(tmp_path, "review_timeout"), "+0.05m")     # three seconds after the review opens

    states = ti_states(dr)
    assert str(dr.state) == "failed"
    assert states["review"] == "failed" and states["publish"] == "upstream_failed", states
    (msg,) = oncall_messages(oncall)
    assert msg["task_id"] == "review" and msg["try_number"] == 1
    job = msg["job_version"]
    assert "was still open at" in msg["error"] and "review: 0 of 2 required sample rows reviewed" in msg["error"]
    assert f"/batch-inference/jobs/{job}/review" in msg["error"]
    assert f"batch-inference review {job}" in msg["text"] and "clear the review task" in msg["text"]


def test_a_reject_in_required_actions_fails_the_task_with_the_reviewers_reason():
    from airflow.models.hitl import HITLDetail
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.operators.review import ReviewGateOperator

    op = ReviewGateOperator(task_id="review", job_version="jv_0123456789abcdef")
    assert op.options == ["Reject"] and list(op.params) == ["reason"]
    # What Airflow's response handler resumes the deferred task with.
    answer = HITLDetail(options=["Reject"], subject="s", chosen_options=["Reject"],
                        params_input={"reason": "priorities are all urgent"},
                        responded_by={"id": "7", "name": "rita"}, responded_at=datetime.now(timezone.utc))
    with pytest.raises(AirflowFailException,
                       match="^review: rita rejected job version jv_0123456789abcdef: priorities are all urgent$"):
        op.execute_complete({}, answer.as_resume_event_payload())


def test_a_reject_in_required_actions_is_recorded_in_the_ledger_and_a_standing_one_fails_the_review_step(
        airflow_home, ledger, tmp_path):
    from airflow.models.hitl import HITLDetail
    from airflow.sdk.exceptions import AirflowFailException

    from batch_inference.operators.review import ReviewGateOperator
    from batch_inference.plan import submit
    from batch_inference.spec import load_spec
    from batch_inference.triggers.review import REJECTED, ReviewGateTrigger

    url, _oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 20)
        job = submit(conn, load_spec(review_spec(tmp_path, "review_rejected"))).job_version
    op = ReviewGateOperator(task_id="review", job_version=job)
    answer = HITLDetail(options=["Reject"], subject="s", chosen_options=["Reject"],
                        params_input={"reason": "all billing"}, responded_by={"id": "7", "name": "rita"},
                        responded_at=datetime.now(timezone.utc))
    with pytest.raises(AirflowFailException, match=f"^review: rita rejected job version {job}: all billing$"):
        op.execute_complete({}, answer.as_resume_event_payload())
    with db.connect(url) as conn:
        state = evaluation.review_state(conn, job)
    assert state["rejection"].startswith("rejected by airflow:rita at ") and state["rejection"].endswith(": all billing")
    # A later run of the step (a cleared task) fails at once, and a waiting trigger ends with it.
    with pytest.raises(AirflowFailException, match=f"^review: job version {job} was rejected by airflow:rita at "):
        ReviewGateOperator(task_id="review", job_version=job).execute({})
    trigger = ReviewGateTrigger(job, None, 0.1)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    import asyncio

    event = asyncio.run(first_event())
    assert event["status"] == REJECTED and event["review"]["rejection"] == state["rejection"]
    with pytest.raises(AirflowFailException, match="was rejected by airflow:rita"):
        op.execute_complete({}, event)


def test_the_review_timeout_reads_as_the_deadline_param_does():
    from batch_inference.operators.review import ReviewGateOperator

    now = datetime(2026, 12, 1, 22, 0, tzinfo=timezone.utc)
    at = {t: ReviewGateOperator(task_id=f"r{i}", job_version="jv_x", timeout=t).timeout_at(now)
          for i, t in enumerate(("+90m", "12:00", "2026-12-03T08:00:00+00:00", "", None))}
    assert at == {"+90m": now + timedelta(minutes=90), "12:00": datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc),
                  "2026-12-03T08:00:00+00:00": datetime(2026, 12, 3, 8, 0, tzinfo=timezone.utc), "": None, None: None}
