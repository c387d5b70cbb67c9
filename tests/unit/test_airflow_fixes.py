"""The apache/airflow#70368 workaround, on the interval forms Airflow stores."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

from datetime import timedelta

import pytest

from batch_inference.airflow_fixes import deadline_interval, fix_clear_with_queued_at_deadline


def test_stored_intervals_decode_as_airflows_own_decoder_does():
    from airflow.sdk.serde import serialize

    stored = serialize(timedelta(hours=20))          # what a DeadlineAlert row holds
    assert isinstance(stored, dict)
    assert deadline_interval(stored) == timedelta(hours=20)
    assert deadline_interval(72000) == timedelta(hours=20)          # older rows: a bare number
    with pytest.raises(TypeError):
        timedelta(seconds=stored)                    # what the upstream function does with it


def test_the_fix_replaces_the_upstream_function_on_affected_releases_only():
    import airflow
    from airflow.models import taskinstance

    from batch_inference import airflow_fixes

    applied = fix_clear_with_queued_at_deadline()
    assert applied == airflow.__version__.startswith(airflow_fixes.AFFECTED)
    if applied:
        assert taskinstance._recalculate_dagrun_queued_at_deadlines is airflow_fixes.recalculate_queued_at_deadlines
