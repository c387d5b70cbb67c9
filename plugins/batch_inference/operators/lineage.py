"""OpenLineage datasets of the ledger operators, named as OpenLineage names PostgreSQL and S3.

Airflow's OpenLineage listener calls an operator's
``get_openlineage_facets_on_complete(task_instance)`` after it succeeds; the
submit and publish operators answer with ``operator_lineage(inputs, outputs)``,
the datasets named by ``batch_inference.lineage``.
A dataset is a ``(namespace, name)`` pair: ``postgres://host:port`` and
``database.schema.table`` for a PostgreSQL table or view (OpenLineage's naming
spec), ``s3://bucket`` and the object key for S3. A Unix-socket host (a
directory) is the local machine, named ``localhost``. Without the OpenLineage
provider installed, ``operator_lineage`` returns None and nothing is reported.
"""

from __future__ import annotations

import logging
from typing import Any

from batch_inference.lineage import Ident, iceberg_ident, postgres_location, table_ident
from batch_inference.sources import parse_s3_url

__all__ = ["Ident", "iceberg_ident", "operator_lineage", "postgres_location", "s3_ident", "table_ident"]

log = logging.getLogger(__name__)


def s3_ident(url: str) -> Ident:
    """An S3 object as OpenLineage names it: ``s3://bucket`` and the key."""
    bucket, key = parse_s3_url(url)
    return f"s3://{bucket}", key


def operator_lineage(inputs: list[Ident], outputs: list[Ident]) -> Any:
    """An ``OperatorLineage`` of these datasets, or None when the OpenLineage provider is not installed."""
    try:
        from airflow.providers.common.compat.openlineage.facet import Dataset
        from airflow.providers.openlineage.extractors import OperatorLineage
    except ImportError:
        log.debug("OpenLineage is not installed; no lineage reported")
        return None
    return OperatorLineage(inputs=[Dataset(namespace=ns, name=name) for ns, name in inputs],
                           outputs=[Dataset(namespace=ns, name=name) for ns, name in outputs])
