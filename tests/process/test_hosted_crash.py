"""A hosted batch worker killed between the provider's create call and the intent's confirmation.

The worker runs as a process against the loopback Batch API emulator
(tests/fixtures/hosted_openai.py), which kills it with SIGKILL after it has
created the batch and before the reply is sent: the worst moment, when the
provider has the batch and the ledger only the intent. The next holder must
find the batch by its idempotency key instead of submitting the records again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gpu_runner.worker import run_worker
from batch_inference.status import job_counts
from batch_inference.plan import submit
from tests.conftest import make_source, tickets
from tests.integration.test_hosted_openai import api_key, batches, emulator, hosted_spec, worker_cfg  # noqa: F401


def test_a_crash_between_create_and_confirmation_re_attaches_without_a_second_batch(conn, db_url, emulator):
    make_source(conn, tickets(1000))
    job = submit(conn, hosted_spec(emulator.base_url, shard_size=1000, lease_seconds=2,
                                   renew_seconds=0.5)).job_version
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    proc = subprocess.Popen([sys.executable, "-m", "gpu_runner", job, "--no-wait"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the provider created the batch; the worker dies before the reply reaches it, so before it confirms
    emulator.on_create = lambda b: os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out
    assert len(emulator.batches) == 1
    (intent,) = batches(conn, job)
    assert intent["state"] == "intent" and intent["provider_batch_id"] is None
    emulator.on_create = None
    t0 = time.monotonic()
    assert run_worker(worker_cfg(db_url, job, wait_for_leases=True)) == 0   # waits out the dead holder's lease
    reattach_s = time.monotonic() - t0
    assert len(emulator.batches) == 1                                        # re-attached, not submitted again
    (row,) = batches(conn, job)
    assert row["provider_batch_id"] == next(iter(emulator.batches)) and row["state"] == "reconciled"
    assert row["epoch"] == 2
    assert job_counts(conn, job)["stored"] == 1000
    assert set(emulator.billed.values()) == {1} and len(emulator.billed) == 1000
    print(f"\nre-attach after the crash: {reattach_s:.2f}s from the new worker's start to the shard stored "
          "(lease 2 s)")
