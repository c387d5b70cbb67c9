"""The preview as the DAG's first task, under ``dag.test()`` on the real embedded PostgreSQL:
a night whose preview is already over ``cost.budget`` stops at ``estimate``, before submit,
with one page and nothing submitted; a night within it goes on, the figures in the XCom."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

from batch_inference import db
from batch_inference.commands.demo import load_tickets
from tests.fixtures.airflow_env import airflow_home  # noqa: F401  (fixture)
from tests.integration.test_airflow_dags import (ledger, noop_spec, oncall_messages, run_backfill,  # noqa: F401
                                                 ti_states)


def test_a_night_over_budget_stops_at_the_preview_before_submit(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 80)
    # 78 records to run at $0.003625 each on batch is $0.28: over a $0.10 budget before anything runs.
    spec = noop_spec(tmp_path, cost={"budget": 0.10})

    dr, _ = run_backfill({"spec_path": spec, "workers": 2, "shard_size": 10})

    states = ti_states(dr)
    assert str(dr.state) == "failed"
    assert states["estimate"] == "failed", states
    assert states["submit"] == "upstream_failed" and states["workers"] == "upstream_failed", states
    with db.connect(url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0     # nothing submitted
        (row,) = conn.execute(db.q("estimate_previews_of_dataset"), {"dataset": "ticket_triage", "n": 5}).fetchall()
    assert row["verdict"] == "over_budget" and row["run_id"] == dr.run_id
    figures = row["figures"]
    assert figures["eligible"] == 78 and figures["budget_holds"] is False
    assert figures["bill"]["planned"]["total"] == "0.28"
    (msg,) = oncall_messages(oncall)                      # one page
    assert msg["task_id"] == "estimate" and msg["job_version"] is None
    assert "before any spend" in msg["text"] and "over cost.budget" in msg["text"]
    assert "raise cost.budget" in msg["text"]


def test_a_night_within_budget_goes_on_with_the_preview_in_the_xcom(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 20)
    spec = noop_spec(tmp_path, cost={"budget": 100.0})

    dr, _ = run_backfill({"spec_path": spec, "workers": 1, "shard_size": 10})

    assert str(dr.state) == "success", ti_states(dr)
    p = dr.get_task_instance("estimate").xcom_pull(task_ids="estimate")
    assert p["verdict"] == "go" and p["records"] == 20 and p["budget_holds"] is True
    assert p["exact"] is False                            # noop: no tokenizer of a model, stated as an estimate
    assert oncall_messages(oncall) == []
