"""``BatchInferencePlugin``: the dashboard inside Airflow's UI.

Registered through the ``airflow.plugins`` entry point (pyproject.toml), so
installing the package is enough. It adds

- a FastAPI app at ``/batch-inference`` (served by ``airflow api-server``),
- Browse -> "Batch inference": every job version, and
- a "Batch inference" tab on each DAG run: that run's job version, found
  from the run's conf or XComs (``{DAG_ID}`` and ``{RUN_ID}`` are filled in by
  the UI).

Airflow imports plugins in every process (scheduler, triggerer, workers,
CLI), and only the API server needs the app, so the FastAPI app and Airflow's
API-server security module are imported on first access of
``fastapi_apps``, not when this module is imported.

Loading the plugin (``on_load``) applies ``batch_inference.airflow_fixes``:
every Airflow process loads plugins before it reads a DAG (deserializing an
operator looks up the plugins' extra links), so the API server's clears and
``airflow tasks clear`` on the command line both get the workaround for
apache/airflow#70368.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from batch_inference.provider import URL_PREFIX


class BatchInferencePlugin(AirflowPlugin):
    name = "batch_inference"

    external_views = [
        {
            "name": "Batch inference",
            "href": f"{URL_PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "batch-inference",
        },
        {
            "name": "Batch inference",
            "href": f"{URL_PREFIX}/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "batch-inference-run",
        },
    ]

    @classmethod
    def on_load(cls, *args: Any, **kwargs: Any) -> None:
        from batch_inference.airflow_fixes import fix_clear_with_queued_at_deadline

        fix_clear_with_queued_at_deadline()

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from batch_inference.ui.app import app

        return [{"app": app, "url_prefix": URL_PREFIX, "name": "Batch inference dashboard"}]
