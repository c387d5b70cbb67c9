"""Airflow triggers: small async loops that run in the triggerer."""
