"""A DAG of a user's own (not one of the examples), under ``dag.test()`` on the real embedded
PostgreSQL: built from ``batch_inference.operators.pipeline`` with ``pipeline_params(spec_path=...)``
and nothing else, over the user's own table. The source defaults to the spec's own (the demo's
table does not exist here), and the engine Param offers only engines that can run."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import textwrap

import yaml

from batch_inference import db
from batch_inference.data import NOOP_MODEL
from tests.conftest import SCHEMA
from tests.fixtures.airflow_env import airflow_home  # noqa: F401  (fixture)
from tests.integration.test_airflow_dags import ledger, oncall_messages, ti_states  # noqa: F401  (ledger: fixture)

DAG_ID = "my_reviews_triage"


def own_dag(folder, spec_path) -> str:
    path = folder / f"{DAG_ID}.py"
    path.write_text(textwrap.dedent(f'''
        # A user's own DAG (airflow, dag): the pipeline over their spec.
        from airflow.sdk import DAG

        from batch_inference.operators.pipeline import (
            batch_inference_pipeline, local_workers, pipeline_dag_args, pipeline_params)

        with DAG(dag_id="{DAG_ID}", schedule=None, params=pipeline_params(spec_path={str(spec_path)!r}, workers=1),
                 **pipeline_dag_args()):
            batch_inference_pipeline(dataset="my_reviews", workers=local_workers())
    '''))
    return str(path)


def test_a_dag_of_ones_own_runs_its_spec_over_its_own_table(airflow_home, ledger, tmp_path, monkeypatch):
    from airflow.configuration import conf
    from airflow.dag_processing.dagbag import DagBag

    url, oncall = ledger
    with db.connect(url) as conn:
        db.migrate(conn)
        conn.execute("CREATE TABLE public.my_reviews (review_id text PRIMARY KEY, body text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO public.my_reviews VALUES (%s, %s)",
                            [(f"r{i:02d}", f"Review {i}: the blender is loud but works.") for i in range(12)])
    spec = {"dataset": "my_reviews", "source": {"table": "public.my_reviews", "id_column": "review_id",
                                                "text_column": "body"},
            "model": dict(NOOP_MODEL), "engine": {"name": "noop"},
            "prompt": {"version": "v1", "system": "Label the review."}, "output_schema": SCHEMA,
            "shard_size": 5, "lease_seconds": 60, "renew_seconds": 5}
    spec_path = tmp_path / "my_reviews.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    folder = tmp_path / "dags"
    folder.mkdir()
    own_dag(folder, spec_path)
    # dag.test() serializes only a DAG inside the DAGs folder bundle (airflow.settings.DAGS_FOLDER).
    from airflow import settings

    monkeypatch.setattr(settings, "DAGS_FOLDER", str(folder))
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(folder))
    conf.set("core", "dags_folder", str(folder))
    try:
        bag = DagBag(dag_folder=str(folder))
        assert bag.import_errors == {}
        dag = bag.dags[DAG_ID]
        params = dag.params
        assert params["source_table"] == "" and params["spec_path"] == str(spec_path)
        assert "noop" not in params.get_param("engine").schema["enum"]          # runs only under a noop spec
        dr = dag.test()                                                         # every Param at its default
    finally:
        conf.set("core", "dags_folder", str(tests.fixtures.airflow_env.DAGS))
    assert str(dr.state) == "success", ti_states(dr)
    with db.connect(url) as conn:
        n = conn.execute("SELECT count(*) AS n FROM published.my_reviews").fetchone()["n"]
    assert n == 12 and oncall_messages(oncall) == []
