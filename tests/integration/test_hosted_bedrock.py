"""The bedrock-batch transport: boto3's own ``bedrock`` and ``s3`` clients against a
loopback emulator of the batch inference calls (tests/fixtures/hosted_bedrock.py),
which moto does not implement, over a real moto S3 server; the real ledger and
the real worker, in process."""

from __future__ import annotations

import threading
import uuid

import pytest

from batch_inference import db
from batch_inference.exceptions import InvalidValue
from batch_inference.engines import load_engine
from batch_inference.fallback import enter_fallback, run_fallback
from batch_inference.plan import submit
from batch_inference.status import job_counts
from gpu_runner.worker import run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.fixtures.chat_server import ChatServer
from tests.fixtures.hosted_bedrock import BedrockBatchEmulator, claude_output
from tests.integration.test_hosted_openai import OK, batches, wait_for, worker_cfg

OUT = '{"category": "billing", "summary": "charged twice"}'
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3(moto_s3, monkeypatch):
    import boto3

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    bucket = "bi-" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=bucket)
    return client, bucket, moto_s3


@pytest.fixture
def bedrock(s3):
    srv = BedrockBatchEmulator(s3[0])
    yield srv
    srv.close()


def bedrock_spec(srv, s3, **over):
    _, bucket, s3_url = s3
    opts = {"endpoint_url": srv.url, "s3_endpoint_url": s3_url, "region": "us-east-1", "poll_seconds": 0.05,
            "cancel_poll_seconds": 0.02, "role_arn": "arn:aws:iam::123456789012:role/bedrock-batch",
            "input_s3_uri": f"s3://{bucket}/in", "output_s3_uri": f"s3://{bucket}/out",
            "model": "anthropic.claude-test-v1:0"}
    return make_spec(engine={"name": "bedrock-batch", "options": opts}, cleared_for_hosted=True,
                     **{"shard_size": 500, "lease_seconds": 30, "renew_seconds": 0.2, **over})


def objects(s3) -> list[str]:
    client, bucket, _ = s3
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_bedrock_batch_needs_its_s3_locations_and_role(bedrock, s3):
    spec = bedrock_spec(bedrock, s3)
    opts = {k: v for k, v in spec.engine.options.items() if k != "role_arn"}
    with pytest.raises(InvalidValue, match="role_arn"):
        load_engine("bedrock-batch", spec, opts)


def test_a_job_runs_end_to_end_on_bedrock_batch(conn, db_url, bedrock, s3):
    def respond(body):
        text = body["messages"][0]["content"]
        assert body["anthropic_version"] and body["system"].startswith("You label records")
        if "Ticket 7:" in text:
            return {"error": {"errorCode": 400, "errorMessage": "Malformed input request"}}
        if "Ticket 13:" in text and bedrock.billed["t00013"] == 1:
            return {"error": {"errorCode": 500, "errorMessage": "Internal server error"}}
        return {"modelOutput": claude_output(OUT)}

    bedrock.respond = respond
    make_source(conn, tickets(2000))
    job = submit(conn, bedrock_spec(bedrock, s3)).job_version
    assert run_worker(worker_cfg(db_url, job)) == 0
    c = job_counts(conn, job)
    assert c["stored"] == 1999 and c["dead_letters"] == 1 and c["outstanding"] == 0
    assert bedrock.billed["t00007"] == 3 and bedrock.billed["t00013"] == 2
    assert all(n == 1 for k, n in bedrock.billed.items() if k not in ("t00007", "t00013"))
    rows = batches(conn, job)
    assert {r["state"] for r in rows} == {"reconciled"} and {r["provider_status"] for r in rows} == {"Completed"}
    assert all(r["input_tokens"] for r in rows if r["succeeded"])
    assert all(r["idem_key"] == bedrock.batches[r["provider_batch_id"]]["clientRequestToken"] for r in rows)
    assert objects(s3) == []          # input objects and the jobs' outputs deleted after reconciliation


def test_cutoff_stops_a_bedrock_job_and_the_fallback_finishes(conn, db_url, bedrock, s3):
    bedrock.rate, bedrock.cancel_delay_s, bedrock.hold_after = 400.0, 0.3, 120
    make_source(conn, tickets(1000))
    job = submit(conn, bedrock_spec(bedrock, s3)).job_version
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run_worker(worker_cfg(db_url, job))), daemon=True)
    t.start()
    wait_for(lambda: any(r["succeeded"] == 120 for r in batches(conn, job)), what="120 records mirrored")
    assert enter_fallback(conn, job)
    t.join(60)
    assert codes == [0]
    (row,) = batches(conn, job)
    assert (row["provider_status"], row["succeeded"], row["state"]) == ("Stopped", 120, "reconciled")
    assert conn.execute(db.q("hosted_drain"), {"job": job}).fetchone()["drain_s"] >= 0.3
    chat = ChatServer(lambda body: (200, {}, OK))
    try:
        result = run_fallback(db_url, job, chat.base_url, rate=1000.0, concurrency=8)
    finally:
        chat.close()
    assert result.stored == 880 and job_counts(conn, job)["stored"] == 1000
    assert len(chat.bodies) == 880 and all(n == 1 for n in bedrock.billed.values())
