"""Airflow hooks: the only place the provider turns a connection id into a database connection."""

from batch_inference.hooks.batch_inference import BatchInferenceHook, conninfo_from_connection

__all__ = ["BatchInferenceHook", "conninfo_from_connection"]
