"""Provider metadata for Airflow's providers manager.

Registered through the ``apache_airflow_provider`` entry point in
pyproject.toml, so ``airflow providers list`` shows the package and the UI
offers the ``batch_inference`` connection type. Airflow imports this module
at start-up in every process (scheduler, workers, CLI): it must import
nothing but the standard library.

The UI plugin is deliberately not listed under ``plugins``: the
``airflow.plugins`` entry point already registers it, and Airflow loads
provider-listed plugins as well when ``[core] lazy_discover_providers`` is
off, which would register it twice and report "already registered" as a
plugin import error.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

PACKAGE = "airflow-provider-batch-inference"
INTEGRATION = "Batch Inference"
# Where the UI plugin serves the dashboard under the API server (ui/plugin.py), and where the review
# operator's links point.
URL_PREFIX = "/batch-inference"


def _version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # a source checkout on sys.path, not installed
        return "0.0.0"


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": PACKAGE,
        "name": INTEGRATION,
        "description": (
            "Deadline-bound LLM batch jobs on preemptible GPUs: snapshot and plan a job version, "
            "run leased shards on GPU pods or local workers, validate, and publish by switching a pointer."
        ),
        "versions": [_version()],
        "integrations": [
            {"integration-name": INTEGRATION, "tags": ["ai", "software"]}
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "batch_inference.operators.submit",
                    "batch_inference.operators.local_workers",
                    "batch_inference.operators.gpu_pods",
                    "batch_inference.operators.validate",
                    "batch_inference.operators.publish",
                    "batch_inference.operators.fallback",
                    "batch_inference.operators.review",
                ],
            }
        ],
        "sensors": [
            {"integration-name": INTEGRATION, "python-modules": ["batch_inference.sensors.cutoff"]}
        ],
        "triggers": [
            {"integration-name": INTEGRATION, "python-modules": ["batch_inference.triggers.cutoff",
                                                                      "batch_inference.triggers.review"]}
        ],
        "hooks": [
            {"integration-name": INTEGRATION, "python-modules": ["batch_inference.hooks.batch_inference"]}
        ],
        "connection-types": [
            {
                "connection-type": "batch_inference",
                "hook-class-name": "batch_inference.hooks.batch_inference.BatchInferenceHook",
                "hook-name": "Batch inference ledger (PostgreSQL)",
            }
        ],
    }
