"""The provider as Airflow sees it: registration, metadata, and the hook that
turns an Airflow connection into the core's ledger connection."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pytest

from batch_inference.provider import get_provider_info


def test_airflow_providers_list_shows_the_provider():
    home = tempfile.mkdtemp(prefix="bi-af-")
    env = {**os.environ, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db"}
    out = subprocess.run([sys.executable, "-m", "airflow", "providers", "list", "-o", "json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    listed = {p["package_name"]: p for p in json.loads(out.stdout[out.stdout.index("["):])}
    assert "airflow-provider-batch-inference" in listed
    assert listed["airflow-provider-batch-inference"]["version"] == get_provider_info()["versions"][0]


def test_provider_info_matches_airflow_schema_and_every_module_imports():
    import airflow

    info = get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    for kind in ("operators", "sensors", "triggers", "hooks"):
        for entry in info[kind]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for ct in info["connection-types"]:
        module, _, cls = ct["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), cls)
        assert hook.conn_type == ct["connection-type"]   # what the providers manager checks


def test_the_connection_type_is_registered():
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    hooks = ProvidersManagerTaskRuntime().hooks
    assert "batch_inference" in hooks
    assert hooks["batch_inference"].hook_class_name.endswith("BatchInferenceHook")


def _socket_uri(db_url: str) -> str:
    assert "host=/" in db_url, db_url        # the embedded server speaks over a Unix socket
    return db_url


@pytest.mark.parametrize("form", ["uri", "postgres-scheme", "json"])
def test_a_unix_socket_connection_round_trips(db_url, monkeypatch, form):
    from psycopg.conninfo import conninfo_to_dict

    from batch_inference.hooks import BatchInferenceHook
    from batch_inference.hooks.batch_inference import airflow_connection_json

    uri = _socket_uri(db_url)
    value = {"uri": uri, "postgres-scheme": uri.replace("postgresql://", "postgres://", 1),
             "json": airflow_connection_json(uri)}[form]
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_LEDGER", value)
    hook = BatchInferenceHook("bi_test_ledger")
    with hook.get_conn() as conn:
        row = conn.execute("SELECT current_database() AS db, count(*) AS n FROM bi.schema_migrations").fetchone()
    assert row["db"] == conninfo_to_dict(uri)["dbname"]
    assert row["n"] >= 1                                 # migrated through the hook
    assert hook.test_connection()[0] is True


def test_conninfo_keeps_libpq_extras_and_drops_airflow_ones(monkeypatch):
    from psycopg.conninfo import conninfo_to_dict

    from batch_inference.hooks import BatchInferenceHook
    from batch_inference.hooks.batch_inference import normalize_url, redact

    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_REMOTE", json.dumps({
        "conn_type": "postgres", "host": "db.internal", "port": 6432, "login": "airflow",
        "password": "p w'\\x", "schema": "warehouse",
        "extra": {"sslmode": "require", "cursor": "dictcursor", "sqlalchemy_scheme": "postgresql+psycopg",
                  "description": "a UI note"}}))
    info = BatchInferenceHook("bi_test_remote").get_conninfo()
    parts = conninfo_to_dict(info)
    assert parts == {"host": "db.internal", "port": "6432", "user": "airflow", "password": "p w'\\x",
                     "dbname": "warehouse", "sslmode": "require"}
    assert "p w" not in redact(info) and "***" in redact(info)
    assert normalize_url("postgresql+psycopg://u@h/d") == "postgresql://u@h/d"
    assert normalize_url("postgres://u@h/d") == "postgres://u@h/d"
