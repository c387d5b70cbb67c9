"""A DAG run's turn at its dataset: the submit waits while an earlier run that Airflow still has queued or
running works on a version of the same dataset (``SubmitJobOperator._earlier_active_run``, the query
``job_runs_earlier``), whatever DAG that run belongs to, and waits neither for a run of another dataset nor
for one that ended. The real ledger; a run's state comes from a stand-in for the task instance's
``get_dagrun_state`` (in a deployment, the Execution API's answer). The live nightly backfill test
(tests/process/test_live_airflow.py) proves the wait as deployed."""

from __future__ import annotations

import pytest

from batch_inference import db
from batch_inference.operators.submit import SubmitJobOperator
from batch_inference.plan import submit
from tests.conftest import make_source, make_spec


class RunStates:
    """The part of Airflow's task instance the wait asks: the state of another DAG run."""

    def __init__(self, states: dict[tuple[str, str], str]) -> None:
        self.states = states

    def get_dagrun_state(self, dag_id: str, run_id: str) -> str:
        return self.states[(dag_id, run_id)]


def test_a_run_waits_for_an_earlier_active_run_of_its_dataset_and_not_for_another_dataset(conn):
    make_source(conn, [(f"r{i}", f"ticket {i}: charged twice") for i in range(4)])
    first = submit(conn, make_spec(dataset="orders")).job_version
    second = submit(conn, make_spec(dataset="orders", prompt={"version": "v2"})).job_version   # a new version
    other = submit(conn, make_spec(dataset="refunds")).job_version
    assert len({first, second, other}) == 3

    def record(dag_id: str, run_id: str, job: str) -> None:
        conn.execute(db.q("job_run_record"), {"dag_id": dag_id, "run_id": run_id, "job": job, "created": True})

    record("batch_inference_nightly", "night", first)      # the dataset's earlier run, in another DAG
    record("batch_inference_backfill", "refunds", other)   # an earlier run of another dataset
    record("batch_inference_backfill", "orders_v2", second)
    record("batch_inference_backfill", "refunds_2", other)  # a later run of the other dataset
    op = SubmitJobOperator(task_id="submit", spec="unused.yaml")
    states = {("batch_inference_nightly", "night"): "running", ("batch_inference_backfill", "refunds"): "running",
              ("batch_inference_backfill", "orders_v2"): "queued"}
    context = {"ti": RunStates(states)}

    # The new version of "orders" waits for the running night on "orders"; the running "refunds" run and
    # the queued "orders" run hold nobody of the other dataset.
    assert op._earlier_active_run(conn, context, second, "batch_inference_backfill", "orders_v2") == (
        "batch_inference_nightly", "night")
    assert op._earlier_active_run(conn, context, other, "batch_inference_backfill", "refunds") is None
    # The same job version in a later run waits as before (two runs never work one version side by side).
    assert op._earlier_active_run(conn, context, other, "batch_inference_backfill", "refunds_2") == (
        "batch_inference_backfill", "refunds")
    # Once the night has ended, the new version goes on.
    states[("batch_inference_nightly", "night")] = "success"
    assert op._earlier_active_run(conn, context, second, "batch_inference_backfill", "orders_v2") is None


def test_two_runs_submitting_one_version_together_both_get_it_and_one_created_it(conn, monkeypatch):
    """Two runs triggered together (the live nightly backfill's two dates) submit the same spec over the same
    rows at once: the later one's snapshot was taken before the other committed the version, so it does not
    see it, and its insert meets the committed row. It submits again with a fresh snapshot and gets the
    version, created by the other, instead of failing its try (a retry a minute later). The stand-in for the
    race: the first look for an existing version misses, as that snapshot's would."""
    from batch_inference import plan

    make_source(conn, [(f"r{i}", f"ticket {i}: charged twice") for i in range(4)])
    spec = make_spec(dataset="orders")
    first = submit(conn, spec)
    looks = []
    real_q = plan.q

    def q(name: str) -> str:
        if name == "job_manifest":
            looks.append(name)
            if len(looks) == 1:           # the snapshot taken before the other submit committed
                return real_q(name) + " AND false"
        return real_q(name)

    monkeypatch.setattr(plan, "q", q)
    second = submit(conn, spec)
    assert len(looks) == 2                 # missed, met the committed row, looked again
    assert first.created and not second.created and second.job_version == first.job_version
    assert (second.records, second.shards) == (first.records, first.shards)
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs WHERE dataset = 'orders'").fetchone()["n"] == 1


def test_a_run_that_must_wait_defers_until_the_earlier_run_has_ended(conn, db_url, monkeypatch):
    """The wait itself: the submit defers to a trigger on the earlier run (the triggerer reads its state
    through Airflow's DagStateTrigger, no task process runs while it waits), and once back it checks again
    and goes on."""
    from airflow.sdk.exceptions import TaskDeferred

    from batch_inference.triggers.earlier_run import EarlierRunTrigger

    from batch_inference.hooks.batch_inference import airflow_connection_json
    from tests.conftest import spec_dict, tickets

    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_TURN", airflow_connection_json(db_url))
    make_source(conn, tickets(6))
    spec = {**spec_dict(), "dataset": "turns"}
    class TI(RunStates):
        def xcom_push(self, key: str, value: object) -> None:
            pass

    earlier = SubmitJobOperator(task_id="submit", spec=spec, postgres_conn_id="bi_test_turn").execute({"ti": TI({})})
    conn.execute(db.q("job_run_record"), {"dag_id": "batch_inference_nightly", "run_id": "night",
                                          "job": earlier["job_version"], "created": True})

    class LaterTI(TI):
        dag_id, run_id = "batch_inference_backfill", "later"

    ti = LaterTI({("batch_inference_nightly", "night"): "running"})
    op = SubmitJobOperator(task_id="submit", spec=spec, postgres_conn_id="bi_test_turn")
    with pytest.raises(TaskDeferred) as waited:
        op.execute({"ti": ti})
    deferred = waited.value
    trigger = deferred.trigger
    assert isinstance(trigger, EarlierRunTrigger) and deferred.method_name == "execute_after_wait"
    state = trigger.state_trigger()
    assert (state.dag_id, state.run_ids, state.states) == ("batch_inference_nightly", ["night"], ["success", "failed"])
    assert state.poll_interval == 5.0
    ti.states[("batch_inference_nightly", "night")] = "success"
    again = op.execute_after_wait({"ti": ti}, event=None)
    assert again["job_version"] == earlier["job_version"] and again["created"] is False


def test_the_wait_on_an_earlier_run_ends_when_it_ends_or_at_its_bound(monkeypatch):
    """The trigger fires with ended true once Airflow's DagStateTrigger sees the run end, and with ended false
    after recheck_seconds when it never does (a run deleted while another waits for it), so the submit
    checks again instead of waiting for ever; it serializes to itself."""
    import asyncio

    from airflow.providers.standard.triggers.external_task import DagStateTrigger

    from batch_inference.triggers.earlier_run import EarlierRunTrigger

    async def first(trigger):
        return [e.payload async for e in trigger.run()]

    async def ends(self):
        await asyncio.sleep(0.01)
        yield "ended"

    async def never(self):
        await asyncio.sleep(3600)
        yield "never"

    monkeypatch.setattr(DagStateTrigger, "run", ends)
    trigger = EarlierRunTrigger("nightly", "night", poll_interval=1.0, recheck_seconds=5.0)
    assert asyncio.run(first(trigger)) == [{"dag_id": "nightly", "run_id": "night", "ended": True}]
    monkeypatch.setattr(DagStateTrigger, "run", never)
    trigger = EarlierRunTrigger("nightly", "night", poll_interval=1.0, recheck_seconds=0.05)
    assert asyncio.run(first(trigger)) == [{"dag_id": "nightly", "run_id": "night", "ended": False}]
    path, kwargs = trigger.serialize()
    assert path == "batch_inference.triggers.earlier_run.EarlierRunTrigger"
    assert EarlierRunTrigger(**kwargs).serialize() == (path, kwargs)
