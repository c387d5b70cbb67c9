"""The chaos harness through PgBouncer in transaction mode (batch_inference.chaos): the default run's
faults with workers that overlap shards, every worker, the harness and the migration going through the
pooler while PostgreSQL restarts under it, and a run on a given database without restarts (directly: the
first test's run is one on a given database through the pooler). A file of its own beside
tests/process/test_chaos.py so that scripts/test.sh's workers (a file to a worker) run the chaos runs side
by side."""

from __future__ import annotations

import tempfile
from pathlib import Path

import psycopg
import pytest

from batch_inference.chaos import ChaosConfig, run_chaos
from batch_inference.harness.database import EmbeddedServer

# The given-database run goes directly; the overlapping run is the one on a given database through PgBouncer.
DB_ROUTES = ("direct",)


@pytest.mark.chaos
def test_chaos_run_with_overlapping_shards_through_pgbouncer_with_database_restarts():
    """The default run's faults with workers that overlap shards (noop streaming, as vLLM does, 256
    requests queued across 200-record shards: several leases per worker, each fenced on its own), every
    worker, the harness and the migration going through PgBouncer in transaction mode, and PostgreSQL
    behind it restarted twice under them. test_chaos.py runs the default engine on the harness's own
    server."""
    from tests.fixtures.pgbouncer import PgBouncer, pgbouncer_binary

    if pgbouncer_binary() is None:
        pytest.skip("no PgBouncer on this machine (scripts/test.sh installs Debian's pgbouncer)")
    server = EmbeddedServer(Path(tempfile.mkdtemp(prefix="bi-chp-", dir="/tmp")))
    bouncer = PgBouncer(server.url)
    try:
        with psycopg.connect(server.url, autocommit=True) as c:
            c.execute("CREATE DATABASE chaos")
        report = run_chaos(ChaosConfig(db_url=bouncer.url(server.server.get_uri("chaos")), restart=server.restart,
                                       engine_options={"delay_s": 0.03, "max_num_seqs": 256}))
    finally:
        bouncer.close()
        server.stop()
    print(report.table())
    f = report.figures
    assert report.passed, report.table()
    assert f["faults"]["by_kind"]["db_restart"] == 2 and f["faults"]["total"] >= 100
    assert f["duplicates"] == 0 and f["coverage"]["missing"] == 0 and f["coverage"]["stored_and_dead"] == 0
    assert f["stale_writes_accepted"] == {"never_held": 0, "after_epoch_ended": 0}
    assert f["counter_drift_shards"] == 0 and f["healthy_dead_letters"] == 0


@pytest.mark.chaos
def test_run_on_a_given_database_without_restarts(db_url):
    """--db / ChaosConfig(db_url=...): the same run on a database the harness
    did not start; with no restart callable it injects no restarts."""
    report = run_chaos(ChaosConfig(db_url=db_url, workers=3, records=500, shard_size=100, faults=6, seed=5))
    assert report.passed, report.table()
    assert report.figures["faults"]["total"] >= 6
    assert "db_restart" not in report.figures["faults"]["by_kind"]

