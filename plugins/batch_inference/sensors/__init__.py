"""Airflow sensors: tasks that wait, deferred to a trigger while they do."""
