"""One connection resolver: an IAM-style Airflow connection resolved through every
entry point that reaches the ledger (each operator, the cutoff sensor, the cutoff
trigger's async path, the fallback pool, the on-call callbacks, the dashboard),
and each one connects with the token as its password.

Only ``PostgresHook.get_iam_token`` is stubbed: the AWS boundary, which cannot
run here. Everything else is real: the Airflow connection (``AIRFLOW_CONN_<ID>``),
the embedded PostgreSQL, the operators' own ``execute``. The connection names a
login that does not exist, so a resolver that skipped the token would fail to
connect as well as show the wrong password.
"""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import asyncio
import json
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from batch_inference.plan import submit
from tests.conftest import make_source, make_spec, spec_dict, tickets

IAM_CONN_ID = "bi_test_iam"
TOKEN = "iam-token-for-the-ledger"


class TI:
    def xcom_push(self, key, value):
        pass


@pytest.fixture
def iam(db_url, monkeypatch):
    """An IAM connection to the test ledger, the token stub, and every conninfo psycopg is given."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    parts = conninfo_to_dict(db_url)
    monkeypatch.setenv(f"AIRFLOW_CONN_{IAM_CONN_ID.upper()}", json.dumps({
        "conn_type": "postgres", "host": parts["host"], "login": "no_such_login", "schema": parts["dbname"],
        "extra": {"iam": True, "aws_conn_id": "aws_test", "region_name": "eu-west-1"}}))
    monkeypatch.delenv("BATCH_INFERENCE_DB", raising=False)
    asked: list[str] = []

    def get_iam_token(self, conn):
        assert conn.extra_dejson["iam"] is True
        asked.append(conn.conn_id)
        return parts["user"], TOKEN, int(parts.get("port") or 5432)

    monkeypatch.setattr(PostgresHook, "get_iam_token", get_iam_token)
    seen: list[dict] = []
    # Connection.connect, not psycopg.connect: db.connect opens its connection class's (the dashboard's is a subclass).
    sync_connect, async_connect = psycopg.Connection.connect.__func__, psycopg.AsyncConnection.connect

    def spy(cls, conninfo="", *args, **kwargs):
        seen.append(conninfo_to_dict(conninfo))
        return sync_connect(cls, conninfo, *args, **kwargs)

    async def aspy(conninfo="", *args, **kwargs):
        seen.append(conninfo_to_dict(conninfo))
        return await async_connect(conninfo, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(spy))
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", staticmethod(aspy))
    return {"seen": seen, "asked": asked, "user": parts["user"]}


def _job(conn, n: int = 10) -> str:
    make_source(conn, tickets(n))
    return submit(conn, make_spec(shard_size=5)).job_version


def _later() -> str:
    return (datetime.now(timezone.utc) + timedelta(hours=6)).isoformat()


def _run(entry: str, conn) -> None:
    """Reach the ledger through ``entry`` with the IAM connection; failures past the connection are fine."""
    from airflow.sdk.exceptions import AirflowException, TaskDeferred

    from batch_inference import operators

    unknown = "jv_0000000000000000"
    try:
        if entry == "SubmitJobOperator":
            make_source(conn, tickets(5))
            operators.SubmitJobOperator(task_id="t", spec=spec_dict(), postgres_conn_id=IAM_CONN_ID).execute(
                {"ti": TI()})
        elif entry == "LocalWorkersOperator":
            operators.LocalWorkersOperator(task_id="t", job_version=unknown, postgres_conn_id=IAM_CONN_ID).execute({})
        elif entry == "GpuWorkerPodOperator":
            from airflow.sdk import DAG

            with DAG("iam_grant", schedule=None):
                op = operators.GpuWorkerPodOperator(task_id="t", job_version=_job(conn), grant_role="bi_worker",
                                                    postgres_conn_id=IAM_CONN_ID)
            op.grant_job()
        elif entry in ("ValidateOperator", "PublishOperator"):
            getattr(operators, entry)(task_id="t", job_version=unknown, postgres_conn_id=IAM_CONN_ID).execute({})
        elif entry == "RollbackOperator":
            operators.RollbackOperator(task_id="t", dataset="tickets_triage", postgres_conn_id=IAM_CONN_ID).execute({})
        elif entry == "FallbackPoolOperator":
            operators.FallbackPoolOperator(task_id="t", job_version=unknown, postgres_conn_id=IAM_CONN_ID).execute({})
        elif entry == "CutoffSensor":
            from batch_inference.sensors.cutoff import CutoffSensor

            CutoffSensor(task_id="t", job_version=_job(conn), deadline=_later(),
                         postgres_conn_id=IAM_CONN_ID).execute({})
        elif entry == "CutoffTrigger":
            from batch_inference.triggers.cutoff import CutoffTrigger

            # An unknown version ends the watch at its first poll, after the connection is made.
            trigger = CutoffTrigger(job_version=unknown, deadline=_later(), postgres_conn_id=IAM_CONN_ID)
            event = asyncio.run(anext(trigger.run()))
            assert "no job version" in event.payload["message"], event.payload
        elif entry == "OnCallNotifier":
            from batch_inference.callbacks import OnCallNotifier

            class Task:
                job_version = _job(conn)

            message = OnCallNotifier(postgres_conn_id=IAM_CONN_ID).message({"task": Task()})
            assert message["counts"] is not None           # the ledger was read
        elif entry == "deadline_missed":
            from batch_inference.callbacks import deadline_missed

            asyncio.run(deadline_missed({"dag_run": {"dag_id": "d", "dag_run_id": "r",
                                                     "conf": {"job_version": _job(conn)}}},
                                        dataset="tickets_triage", postgres_conn_id=IAM_CONN_ID))
        elif entry == "dashboard":
            from batch_inference.ui import app

            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(app.CONN_ID_ENV, IAM_CONN_ID)
                ledger = app.ledger()
                next(ledger).execute("SELECT 1")
                ledger.close()
        else:
            raise AssertionError(entry)
    except (AirflowException, TaskDeferred):
        pass


ENTRY_POINTS = ["SubmitJobOperator", "LocalWorkersOperator", "GpuWorkerPodOperator", "ValidateOperator",
                "PublishOperator", "RollbackOperator", "FallbackPoolOperator", "CutoffSensor", "CutoffTrigger",
                "OnCallNotifier", "deadline_missed", "dashboard"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_iam_connection_gets_its_token_as_the_password_everywhere(iam, conn, entry):
    iam["seen"].clear()
    _run(entry, conn)
    assert IAM_CONN_ID in iam["asked"], f"{entry} did not ask for an IAM token"
    assert iam["seen"], f"{entry} never connected"
    for parts in iam["seen"]:
        assert parts.get("password") == TOKEN and parts.get("user") == iam["user"], (entry, parts.get("user"))


def test_every_entry_point_defaults_to_the_one_connection_id():
    import inspect

    from batch_inference import callbacks, operators
    from batch_inference.hooks import DEFAULT_CONN_ID, BatchInferenceHook
    from batch_inference.operators import pipeline
    from batch_inference.sensors.cutoff import CutoffSensor

    assert BatchInferenceHook.default_conn_name == DEFAULT_CONN_ID == "batch_inference_default"
    takers = [getattr(operators, name) for name in ("SubmitJobOperator", "LocalWorkersOperator",
                                                     "GpuWorkerPodOperator", "ValidateOperator", "PublishOperator",
                                                     "RollbackOperator", "FallbackPoolOperator")]
    takers += [CutoffSensor, callbacks.OnCallNotifier, callbacks.deadline_alert, callbacks.deadline_missed,
               pipeline.batch_inference_pipeline, pipeline.pipeline_dag_args]
    for f in takers:
        default = inspect.signature(f).parameters["postgres_conn_id"].default
        assert default == DEFAULT_CONN_ID, (f, default)


def test_a_connection_without_iam_asks_for_no_token(db_url, monkeypatch):
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    from batch_inference.db import airflow_connection_json
    from batch_inference.hooks.connection import ledger_conninfo

    def refuse(self, conn):
        raise AssertionError("no token for a connection without iam")

    monkeypatch.setattr(PostgresHook, "get_iam_token", refuse)
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_PLAIN", airflow_connection_json(db_url))
    assert conninfo_to_dict(ledger_conninfo("bi_test_plain"))["password"] == conninfo_to_dict(db_url)["password"]
