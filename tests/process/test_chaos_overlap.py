"""The chaos harness with workers that overlap shards (batch_inference.chaos), and the CLI's small
run. A file of its own beside tests/process/test_chaos.py so that scripts/test.sh's workers (a file to
a worker) run the chaos runs side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batch_inference.chaos import ChaosConfig, run_chaos


@pytest.mark.chaos
def test_chaos_run_with_overlapping_shards_passes():
    """The default run's faults with workers that overlap shards (noop streaming, as vLLM does, 256
    requests queued across 200-record shards): several leases per worker, each fenced on its own."""
    cfg = ChaosConfig(engine_options={"delay_s": 0.03, "max_num_seqs": 256})
    report = run_chaos(cfg)
    print(report.table())
    f = report.figures
    assert report.passed, report.table()
    assert f["duplicates"] == 0 and f["coverage"]["missing"] == 0 and f["coverage"]["stored_and_dead"] == 0
    assert f["stale_writes_accepted"] == {"never_held": 0, "after_epoch_ended": 0}
    assert f["faults"]["total"] >= 100 and f["counter_drift_shards"] == 0 and f["healthy_dead_letters"] == 0


@pytest.mark.chaos
def test_cli_small_run_prints_json_and_exits_0(tmp_path):
    p = subprocess.run([sys.executable, "-m", "batch_inference.cli", "chaos", "--workers", "3", "--records", "600",
                        "--shard-size", "100", "--faults", "8", "--no-db-restart", "--seed", "3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["passed"] is True
    assert report["figures"]["faults"]["total"] >= 8
    assert report["figures"]["faults"]["by_kind"].get("db_restart", 0) == 0
    assert report["config"]["workers"] == 3

