"""Airflow hooks: the only place the provider turns a connection id into a database connection."""

from batch_inference.hooks.batch_inference import BatchInferenceHook
from batch_inference.hooks.connection import DEFAULT_CONN_ID, conninfo_from_connection, ledger_conninfo

__all__ = ["DEFAULT_CONN_ID", "BatchInferenceHook", "conninfo_from_connection", "ledger_conninfo"]
