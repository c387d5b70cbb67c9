"""The example DAGs: they import cleanly, and the backfill runs end to end
under ``dag.test()`` on the real embedded PostgreSQL, with the noop engine
(fast) and, marked slow, with SmolLM2 on llama.cpp. A failing task pages
on-call with the job version and its counts."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import json
import time
from pathlib import Path
from typing import Any

import pytest

from batch_inference import db
from batch_inference.commands.demo import load_tickets
from batch_inference.data import DEMO_DATASET, write_noop_spec
from batch_inference.spec import load_spec
from batch_inference.status import job_counts
from tests.fixtures.airflow_env import DAGS, airflow_home  # noqa: F401  (fixture)

DAG_IDS = {"batch_inference_backfill", "batch_inference_nightly", "batch_inference_gpu", "batch_inference_hosted",
           "batch_inference_regions"}
ASSET_URI = f"batch-inference://published/{DEMO_DATASET}"


def load_dag(dag_id: str):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS / f"{dag_id}.py"))
    assert not bag.import_errors, bag.import_errors
    return bag.dags[dag_id]


@pytest.fixture
def ledger(db_url, monkeypatch, tmp_path):
    """The test database as the DAGs' Airflow connection, and on-call messages in a file."""
    from batch_inference.hooks.batch_inference import airflow_connection_json

    monkeypatch.setenv("AIRFLOW_CONN_BATCH_INFERENCE_DEFAULT", airflow_connection_json(db_url))
    oncall = tmp_path / "oncall.jsonl"
    monkeypatch.setenv("BATCH_INFERENCE_ONCALL_FILE", str(oncall))
    return db_url, oncall


def oncall_messages(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ti_states(dr) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}


# -- parsing -------------------------------------------------------------------

def test_dagbag_imports_the_example_dags_without_errors():
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert set(bag.dags) == DAG_IDS
    for dag in bag.dags.values():
        assert {"submit", "deadline", "cutoff", "fallback", "validate", "review", "publish"} <= set(dag.task_dict)
        assert dag.default_args["on_failure_callback"].__class__.__name__ == "OnCallNotifier"
        DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    backfill = bag.dags["batch_inference_backfill"]
    assert {"spec_path", "source_table", "shard_size", "workers", "engine", "deadline",
            "review_timeout"} <= set(backfill.params)
    assert backfill.get_task("publish").outlets[0].uri == ASSET_URI
    # The cutoff watches beside the workers, not after them; validate waits for both paths.
    assert backfill.get_task("cutoff").upstream_task_ids == {"submit", "deadline"}
    # A lost try of a task that defers (apache/airflow#72716) is retried after 10 s, the others after a minute.
    assert [backfill.get_task(t).retry_delay.total_seconds() for t in ("submit", "cutoff", "review")] == [10] * 3
    assert backfill.get_task("validate").retry_delay.total_seconds() == 60
    assert {"workers", "fallback"} <= backfill.get_task("validate").upstream_task_ids
    assert bag.dags["batch_inference_nightly"].params["incremental"] is True
    hosted = bag.dags["batch_inference_hosted"]
    assert hosted.params["spec_path"].endswith("tickets_hosted_spec.yaml") and hosted.params["deadline"] == "06:00"
    assert hosted.get_task("fallback").api_key_env == "OPENAI_API_KEY"
    assert load_spec(hosted.params["spec_path"]).engine.name == "openai-batch"
    # Over regions: the far workers' files merged beside the workers, before validate; one region has no merge.
    regions = bag.dags["batch_inference_regions"]
    assert regions.get_task("merge").upstream_task_ids == {"submit"}
    assert {"workers", "fallback", "merge"} <= regions.get_task("validate").upstream_task_ids
    assert regions.get_task("workers").upstream_task_ids == {"regions", "submit"} and "deployment" in regions.params
    assert "merge" not in backfill.task_dict


def test_the_deadline_alert_is_on_when_not_switched_off(monkeypatch):
    from airflow.sdk import DeadlineAlert
    from airflow.serialization.serialized_objects import DagSerialization

    from batch_inference.callbacks import NO_DEADLINE_ALERT_ENV

    monkeypatch.delenv(NO_DEADLINE_ALERT_ENV, raising=False)
    dag = load_dag("batch_inference_nightly")
    (alert,) = dag.deadline
    assert isinstance(alert, DeadlineAlert)
    assert alert.interval.total_seconds() == 8 * 3600
    assert alert.callback.path == "batch_inference.callbacks.deadline_missed"
    assert alert.callback.kwargs == {"dataset": DEMO_DATASET, "postgres_conn_id": "batch_inference_default"}
    assert DagSerialization.serialize_dag(dag)["deadline"]


def test_the_dag_files_need_nothing_beside_them_so_the_wheel_copy_imports(tmp_path):
    """pyproject.toml force-includes dags/ as batch_inference/example_dags: a DAG file there can import
    only the package (the builder is batch_inference.operators.pipeline), never a sibling module."""
    import ast
    import shutil

    from airflow.dag_processing.dagbag import DagBag

    assert sorted(p.name for p in DAGS.glob("*.py")) == sorted(f"{d}.py" for d in DAG_IDS)
    for path in DAGS.glob("*.py"):
        tops = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
        assert tops <= {"__future__", "datetime", "airflow", "batch_inference"}, (path.name, tops)
    copy = tmp_path / "batch_inference" / "example_dags"
    shutil.copytree(DAGS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    bag = DagBag(dag_folder=str(copy))
    assert bag.import_errors == {} and set(bag.dags) == DAG_IDS


def test_the_pipeline_builder_wires_any_launcher_between_submit_and_validate():
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG

    from batch_inference.operators.pipeline import batch_inference_pipeline, pipeline_dag_args, pipeline_params

    seen = {}

    def launcher(job_version, postgres_conn_id):
        seen["conn"] = postgres_conn_id
        first = EmptyOperator(task_id="scale_up")
        return first, first >> EmptyOperator(task_id="run_workers")

    with DAG("builder_probe", schedule=None, params=pipeline_params(), **pipeline_dag_args("probe_conn")) as dag:
        p = batch_inference_pipeline(dataset="probe_set", workers=launcher, cutoff_poll_interval=5,
                                     postgres_conn_id="probe_conn")
    up = {t.task_id: t.upstream_task_ids for t in dag.tasks}
    assert seen["conn"] == "probe_conn"           # the launcher's tasks use the pipeline's connection
    assert up["scale_up"] == {"submit"} and up["deadline"] == {"submit"}
    assert up["cutoff"] == {"submit", "deadline"} and up["fallback"] == {"submit", "cutoff"}
    assert up["validate"] == {"submit", "run_workers", "fallback"} and up["review"] == {"submit", "validate"}
    assert up["publish"] == {"submit", "review"}         # the review gate holds publish
    assert p.workers.task_id == "run_workers" and p.cutoff.poll_interval == 5
    assert {t.postgres_conn_id for t in (p.submit, p.validate, p.review, p.publish)} == {"probe_conn"}
    assert p.publish.outlets[0].uri == "batch-inference://published/probe_set"
    assert dag.max_active_runs == 16 and dag.default_args["retries"] == 2   # [core] max_active_runs_per_dag


# -- running -------------------------------------------------------------------

def noop_spec(directory: Path, **over: Any) -> str:
    """The demo spec on the noop engine (``data.write_noop_spec``); its path, for the ``spec_path`` Param."""
    return str(write_noop_spec(directory, **over))


def run_backfill(conf: dict):
    dag = load_dag("batch_inference_backfill")
    t0 = time.monotonic()
    dr = dag.test(run_conf=conf)
    return dr, time.monotonic() - t0


def asset_events(uri: str) -> list[dict]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(select(AssetEvent.extra).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                               .where(AssetModel.uri == uri)).all()
    return [r[0] for r in rows]


def test_backfill_runs_end_to_end_with_the_noop_engine(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        assert load_tickets(conn, 80) == 80     # includes the blank ticket and the 35 KB log
    events_before = len(asset_events(ASSET_URI))

    dr, seconds = run_backfill({"spec_path": noop_spec(tmp_path), "workers": 2, "shard_size": 10})

    assert str(dr.state) == "success", ti_states(dr)
    with db.connect(url) as conn:
        pointer = conn.execute("SELECT job_version FROM bi.publish_pointer WHERE dataset = %s",
                               (DEMO_DATASET,)).fetchone()
        c = job_counts(conn, pointer["job_version"])
        n = conn.execute(f"SELECT count(*) AS n FROM published.{DEMO_DATASET}").fetchone()["n"]
        acl = conn.execute(f"SELECT acl FROM published.{DEMO_DATASET} WHERE record_id = 'TCK-100005'").fetchone()
    assert (c["records"], c["stored"], c["dead_letters"], c["outstanding"]) == (80, 78, 2, 0)
    assert c["status"] == "published" and n == 78
    assert acl["acl"] == ["team:billing"]         # the source's ACL travels with the result
    # submit's XCom is the small manifest, never records
    manifest = dr.get_task_instance("submit").xcom_pull(task_ids="submit")
    assert manifest == {"job_version": pointer["job_version"], "dataset": DEMO_DATASET, "records": 80,
                        "shards": 8, "dead_letters_at_planning": 2, "reused": 0, "created": True, "applied": []}
    # publish recorded an asset event naming the version it switched to
    events = asset_events(ASSET_URI)
    assert len(events) == events_before + 1
    assert events[-1]["to_version"] == pointer["job_version"] and events[-1]["changed"] is True
    assert oncall_messages(oncall) == []
    print(f"backfill under dag.test with noop: {seconds:.1f}s")


def make_ticket_table(conn, rows):
    conn.execute("DROP TABLE IF EXISTS public.support_tickets")
    conn.execute("CREATE TABLE public.support_tickets (id text PRIMARY KEY, text text, acl text[])")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO public.support_tickets VALUES (%s, %s, %s)", rows)


def test_failed_validation_pages_on_call_with_the_job_version_and_counts(airflow_home, ledger, tmp_path):
    url, oncall = ledger
    # Four of ten records make the noop engine answer with invalid output on
    # every attempt: they end in dead letters, 40% of the snapshot, far over
    # the spec's 5% gate.
    rows = [(f"T{i}", ("[[invalid-output]] " if i < 4 else "") + f"ticket {i}: refund please", ["team:billing"])
            for i in range(10)]
    with db.connect(url) as conn:
        db.migrate(conn)
        make_ticket_table(conn, rows)

    dr, _ = run_backfill({"spec_path": noop_spec(tmp_path), "workers": 1, "shard_size": 5})

    states = ti_states(dr)
    assert str(dr.state) == "failed"
    assert states["validate"] == "failed" and states["publish"] == "upstream_failed", states
    (msg,) = oncall_messages(oncall)
    job = msg["job_version"]
    assert job and job.startswith("jv_")
    assert msg["dag_id"] == "batch_inference_backfill" and msg["run_id"] == dr.run_id
    assert msg["task_id"] == "validate"
    assert msg["counts"]["records"] == 10 and msg["counts"]["dead_letters"] == 4 and msg["counts"]["stored"] == 6
    text = msg["text"]
    assert "batch_inference_backfill" in text and dr.run_id in text and job in text
    assert "6/10 stored" in text and "4 dead letters" in text
    assert "failed validation" in text
    assert f"batch-inference dead-letters {job}" in text
    assert f"batch-inference rollback {DEMO_DATASET}" in text
    with db.connect(url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM bi.publish_pointer").fetchone()["n"] == 0
        assert job_counts(conn, job)["status"] == "failed_validation"


@pytest.mark.slow
def test_backfill_with_smollm2_on_llama_cpp(airflow_home, ledger):
    pytest.importorskip("llama_cpp")
    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        load_tickets(conn, 6)

    dr, seconds = run_backfill({"engine": "", "workers": 1, "shard_size": 3})   # the spec's engine: llama-cpp

    assert str(dr.state) == "success", (ti_states(dr), oncall_messages(oncall))
    with db.connect(url) as conn:
        row = conn.execute(f"SELECT * FROM published.{DEMO_DATASET} ORDER BY record_id LIMIT 1").fetchone()
        pointer = conn.execute("SELECT job_version FROM bi.publish_pointer").fetchone()
        c = job_counts(conn, pointer["job_version"])
    assert c["stored"] + c["dead_letters"] == 6 and c["outstanding"] == 0
    assert row["model_name"] == "SmolLM2-135M-Instruct-Q4_1"
    assert row["category"] in ("billing", "bug", "account", "feature_request", "other")
    assert len(row["summary"]) <= 80
    print(f"backfill under dag.test with llama-cpp, 6 records: {seconds:.1f}s, {c['dead_letters']} dead letters")
