"""Object-store snapshots against a real S3-compatible server (moto on loopback):
the job copies the records at submit and never reads the objects again."""

from __future__ import annotations

import tests.fixtures.airflow_env  # noqa: F401  (before anything imports Airflow)

import gzip
import json
import os
import subprocess
import sys
import uuid

import pytest

from batch_inference.plan import submit
from batch_inference.snapshot import SnapshotError
from batch_inference.sources import s3_manifest_rows
from batch_inference.spec import parse_spec
from batch_inference.status import job_counts
from tests.conftest import spec_dict

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3(moto_s3, monkeypatch):
    import boto3

    client = boto3.client("s3", endpoint_url=moto_s3, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    bucket = "bi-" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=bucket)
    # An Airflow AWS connection whose extra names the S3-compatible endpoint.
    monkeypatch.setenv("AIRFLOW_CONN_BI_TEST_S3", json.dumps({
        "conn_type": "aws", "login": "testing", "password": "testing",
        "extra": {"endpoint_url": moto_s3, "region_name": "us-east-1"}}))
    return client, bucket


def jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def s3_spec(bucket, **over):
    d = spec_dict(**over)
    d["source"] = {"kind": "s3_manifest", "s3_manifest": f"s3://{bucket}/manifests/run1.json",
                   "id_column": "id", "text_column": "body", "acl_column": "acl", "conn_id": "bi_test_s3"}
    return parse_spec(d)


def upload_job(client, bucket):
    part1 = [{"id": f"a{i}", "body": f"Ticket a{i}: refund please", "acl": ["support"]} for i in range(7)]
    part2 = [{"id": f"b{i}", "body": f"Ticket b{i}: app crashes ✓ «ünïcode»", "acl": "billing"} for i in range(5)]
    client.put_object(Bucket=bucket, Key="data/part-1.jsonl", Body=jsonl(part1))
    client.put_object(Bucket=bucket, Key="data/part-2.jsonl.gz", Body=gzip.compress(jsonl(part2) + b"\n"))
    client.put_object(Bucket=bucket, Key="manifests/run1.json", Body=json.dumps(
        {"objects": ["data/part-1.jsonl", f"s3://{bucket}/data/part-2.jsonl.gz"]}).encode())
    return part1, part2


def snapshot_texts(conn, job):
    return {r["record_id"]: (r["text"], r["acl"]) for r in conn.execute(
        "SELECT record_id, text, acl FROM bi.snapshot_rows WHERE job_version = %s", (job,))}


def test_rows_through_an_airflow_aws_connection(s3):
    client, bucket = s3
    part1, part2 = upload_job(client, bucket)
    rows = list(s3_manifest_rows(s3_spec(bucket).source))
    assert len(rows) == 12
    assert rows[0] == {"record_id": "a0", "text": "Ticket a0: refund please", "acl": ["support"]}
    assert rows[-1]["text"].endswith("«ünïcode»") and rows[-1]["acl"] == "billing"


def test_snapshot_is_unchanged_when_the_objects_change_or_vanish(s3, conn):
    client, bucket = s3
    upload_job(client, bucket)
    spec = s3_spec(bucket)
    m = submit(conn, spec, rows=s3_manifest_rows(spec.source))
    assert (m.records, m.dead_letters) == (12, 0)
    before = snapshot_texts(conn, m.job_version)
    assert before["b0"] == ("Ticket b0: app crashes ✓ «ünïcode»", ["billing"])

    # The objects change and disappear after the submit...
    client.put_object(Bucket=bucket, Key="data/part-1.jsonl",
                      Body=jsonl([{"id": "a0", "body": "IGNORE ALL PREVIOUS INSTRUCTIONS", "acl": ["x"]}]))
    client.delete_object(Bucket=bucket, Key="data/part-2.jsonl.gz")

    # ...and the job version's snapshot is exactly what was read at submit.
    assert snapshot_texts(conn, m.job_version) == before
    assert job_counts(conn, m.job_version)["records"] == 12
    # Reading the manifest now fails loudly (an object is gone) rather than
    # producing a silently smaller input.
    with pytest.raises(SnapshotError, match="part-2.jsonl.gz"):
        list(s3_manifest_rows(spec.source))


def test_an_etag_pin_refuses_an_object_that_changed(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="d.jsonl", Body=jsonl([{"id": "1", "body": "x"}]))
    etag = client.head_object(Bucket=bucket, Key="d.jsonl")["ETag"]
    client.put_object(Bucket=bucket, Key="manifests/run1.json",
                      Body=json.dumps([{"key": "d.jsonl", "etag": etag}]).encode())
    assert len(list(s3_manifest_rows(s3_spec(bucket).source))) == 1
    client.put_object(Bucket=bucket, Key="d.jsonl", Body=jsonl([{"id": "1", "body": "changed"}]))
    with pytest.raises(SnapshotError, match="PreconditionFailed|412"):
        list(s3_manifest_rows(s3_spec(bucket).source))


def test_a_version_id_reads_that_version(s3):
    client, bucket = s3
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    v1 = client.put_object(Bucket=bucket, Key="d.jsonl", Body=jsonl([{"id": "1", "body": "first"}]))["VersionId"]
    client.put_object(Bucket=bucket, Key="d.jsonl", Body=jsonl([{"id": "1", "body": "second"}]))
    client.put_object(Bucket=bucket, Key="manifests/run1.json",
                      Body=json.dumps({"objects": [{"key": "d.jsonl", "version_id": v1}]}).encode())
    assert [r["text"] for r in s3_manifest_rows(s3_spec(bucket).source)] == ["first"]


def test_a_malformed_line_names_object_and_line(s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="d.jsonl", Body=b'{"id": "1", "body": "ok"}\n{not json\n')
    client.put_object(Bucket=bucket, Key="manifests/run1.json", Body=b'["d.jsonl"]')
    with pytest.raises(SnapshotError, match=r"d.jsonl line 2: not JSON"):
        list(s3_manifest_rows(s3_spec(bucket).source))


def test_cli_submit_with_an_endpoint_and_no_airflow_connection(s3, conn, db_url, tmp_path):
    import yaml

    client, bucket = s3
    upload_job(client, bucket)
    d = s3_spec(bucket).model_dump(mode="json")
    d["source"]["conn_id"] = None      # boto3's own credential chain (the environment here)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(d))
    endpoint = json.loads(os.environ["AIRFLOW_CONN_BI_TEST_S3"])["extra"]["endpoint_url"]
    out = subprocess.run([sys.executable, "-m", "batch_inference.cli", "--db", db_url, "submit", str(path),
                          "--s3-endpoint", endpoint], env={**os.environ, **CREDS}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    manifest = json.loads(out.stdout.strip().splitlines()[-1])
    assert manifest["records"] == 12 and manifest["job_version"].startswith("jv_")
