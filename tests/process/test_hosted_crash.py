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

import pytest

from batch_inference.plan import submit
from batch_inference.status import job_counts
from gpu_runner.worker import run_worker
from tests.conftest import make_source, tickets
from tests.fixtures.hosted_anthropic import AnthropicBatchEmulator
from tests.fixtures.hosted_bedrock import BedrockBatchEmulator
from tests.fixtures.hosted_openai import OpenAIBatchEmulator
from tests.integration.test_hosted_anthropic import anthropic_spec
from tests.integration.test_hosted_bedrock import bedrock_spec, s3  # noqa: F401  (fixture)
from tests.integration.test_hosted_openai import batches, hosted_spec, worker_cfg

def _openai(request):
    request.getfixturevalue("monkeypatch").setenv("BI_TEST_OPENAI_KEY", "test-key-not-a-secret")
    srv = OpenAIBatchEmulator()
    return srv, lambda **kw: hosted_spec(srv.base_url, **kw)


def _anthropic(request):
    request.getfixturevalue("monkeypatch").setenv("BI_TEST_ANTHROPIC_KEY", "test-key-not-a-secret")
    srv = AnthropicBatchEmulator()
    return srv, lambda **kw: anthropic_spec(srv.url, **kw)


def _bedrock(request):
    s3 = request.getfixturevalue("s3")            # AWS test credentials in the environment, a moto bucket
    srv = BedrockBatchEmulator(s3[0])
    return srv, lambda **kw: bedrock_spec(srv, s3, **kw)


PROVIDERS = {"openai": _openai, "anthropic": _anthropic, "bedrock": _bedrock}


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_crash_between_create_and_confirmation_re_attaches_without_a_second_batch(conn, db_url, provider,
                                                                                    request):
    emulator, spec_for = PROVIDERS[provider](request)
    try:
        run(conn, db_url, emulator, spec_for)
    finally:
        emulator.close()


def run(conn, db_url, emulator, spec_for) -> None:
    make_source(conn, tickets(1000))
    job = submit(conn, spec_for(shard_size=1000, lease_seconds=2, renew_seconds=0.5)).job_version
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    created: list[str] = []
    proc = subprocess.Popen([sys.executable, "-m", "gpu_runner", job, "--no-wait"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def kill(batch):     # the provider has the batch; the worker dies before the reply reaches it
        created.append(batch.get("id") or batch["jobArn"])
        os.kill(proc.pid, signal.SIGKILL)

    emulator.on_create = kill
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out
    assert emulator.created == 1
    (intent,) = batches(conn, job)
    assert intent["state"] == "intent" and intent["provider_batch_id"] is None
    emulator.on_create = None
    t0 = time.monotonic()
    assert run_worker(worker_cfg(db_url, job, wait_for_leases=True)) == 0   # waits out the dead holder's lease
    reattach_s = time.monotonic() - t0
    assert emulator.created == 1                                             # re-attached, not submitted again
    (row,) = batches(conn, job)
    assert row["provider_batch_id"] == created[0] and row["state"] == "reconciled" and row["epoch"] == 2
    assert job_counts(conn, job)["stored"] == 1000
    assert set(emulator.billed.values()) == {1} and len(emulator.billed) == 1000
    print(f"\nre-attach after the crash: {reattach_s:.2f}s from the new worker's start to the shard stored "
          "(lease 2 s)")
