#!/usr/bin/env bash
# The main job on the embedded default: builds .venv, starts the embedded
# PostgreSQL, loads the sample support tickets, runs the example DAG with
# `airflow dags test` (local workers, the llama.cpp CPU engine), then prints
# the published view. Extra arguments go to `batch-inference demo`.
# It installs only what the demo needs (the `demo` extra: Airflow and llama.cpp).
BI_EXTRA=demo source "$(dirname "$0")/_venv.sh"
exec batch-inference demo "$@"
