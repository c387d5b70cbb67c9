"""A job over three regions end to end on this machine (batch_inference.regions): one ledger (the embedded
PostgreSQL), three regions each with its own S3 endpoint (three moto servers, real HTTP, read back with
boto3), worker processes per region (``python -m gpu_runner --region``), replicas with digests, every
shard read in its own region except recorded steals, far workers' results handed in as files and merged
by key near the ledger, validate and publish: every record once, 0 duplicates, and the same job version
and the same results as a single-region run of the same spec."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from batch_inference import db
from batch_inference.plan import submit
from batch_inference.publish import publish
from batch_inference.regions import check_regions, merge_until, parse_deployment, place, report
from batch_inference.status import job_counts
from batch_inference.validate import validate
from gpu_runner.worker import WorkerConfig, run_worker
from tests.conftest import make_source, make_spec, tickets
from tests.process.test_worker import duplicates
from tests.fixtures.moto_server import moto_server

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
REGIONS = ("us-east", "eu-west", "ap-south")
RECORDS, SHARD = 240, 20      # 12 shards: 4 per region


@pytest.fixture
def three_endpoints(monkeypatch):
    """Three moto S3 servers, one bucket each: every region's own endpoint."""
    import boto3

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(moto_server()) for _ in REGIONS]
        if not urls[0].startswith("http"):
            pytest.skip(urls[0])
        for region, url in zip(REGIONS, urls):
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=f"replicas-{region}")
        yield dict(zip(REGIONS, urls))


def deployment(urls: dict[str, str]):
    return parse_deployment(deployment_dict(urls))


def deployment_dict(urls: dict[str, str]) -> dict:
    return ({
        "clusters": [{"name": f"{r}-gpu", "region": r, "workers": {"kind": "local"},
                      "gpu": {"kind": "L4", "spot_per_hour": 0.4 + 0.2 * i, "on_demand_per_hour": 0.8 + 0.3 * i,
                              "interruption_rate": 0.02 * i},
                      "capacity": 1,
                      "store": {"kind": "s3", "bucket": f"replicas-{r}", "endpoint": urls[r]}}
                     for i, r in enumerate(REGIONS)],
        "egress": [{"from": "us-east", "to": "eu-west", "usd_per_gb": 0.02},
                   {"from": "us-east", "to": "ap-south", "usd_per_gb": 0.09},
                   {"from": "eu-west", "to": "ap-south", "usd_per_gb": 0.05}]})


def cli(db_url: str, *args: str) -> subprocess.Popen:
    """``batch-inference ARGS`` as its own process, as an operator near the ledger runs it."""
    env = {**os.environ, **CREDS, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.Popen([sys.executable, "-m", "batch_inference.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def start_worker(db_url: str, job: str, region: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, **CREDS, "PYTHONUNBUFFERED": "1", "BATCH_INFERENCE_DB": db_url}
    return subprocess.Popen([sys.executable, "-m", "gpu_runner", job, "--region", region, "--no-wait",
                             "--flush-every", "5", "--worker-id", f"{region}-w", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    return out


def results(conn, job: str) -> dict[str, object]:
    return {r["record_id"]: r["output"] for r in conn.execute(
        "SELECT record_id, output FROM bi.results WHERE job_version = %s", (job,))}


def test_a_job_over_three_regions_runs_end_to_end_and_matches_a_single_region_run(conn, db_url, empty_db,
                                                                                  three_endpoints, tmp_path):
    import json

    import boto3
    import yaml

    from batch_inference.status import bill
    from tests.conftest import spec_dict

    rows = tickets(RECORDS)
    make_source(conn, rows)
    spec = make_spec(shard_size=SHARD)
    # submitted onto the deployment: every endpoint asked first, the replicas written at submit
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec_dict(shard_size=SHARD)))
    (tmp_path / "regions.yaml").write_text(yaml.safe_dump(deployment_dict(three_endpoints)))
    out, err = (p := cli(db_url, "submit", str(tmp_path / "spec.yaml"), "--deployment",
                         str(tmp_path / "regions.yaml"))).communicate(timeout=240)
    assert p.returncode == 0, err
    submitted = json.loads(out)
    job = submitted["job_version"]
    assert submitted["regions"]["placed"] and sorted(submitted["regions"]["regions"]) == sorted(REGIONS)

    # replicas: in each region's own endpoint, content-addressed, their digests in the ledger
    reps = conn.execute("SELECT shard_no, region, object_key, digest FROM bi.replicas WHERE job_version = %s "
                        "ORDER BY shard_no", (job,)).fetchall()
    assert [r["region"] for r in reps] == [r for r in REGIONS for _ in range(4)]
    for r in reps:
        body = boto3.client("s3", endpoint_url=three_endpoints[r["region"]]).get_object(
            Bucket=f"replicas-{r['region']}", Key=r["object_key"])["Body"].read()
        assert hashlib.sha256(body).hexdigest() == r["digest"]

    # near the ledger: us-east writes straight to it; eu-west and ap-south hand in result files, merged by
    # `batch-inference regions merge` in its own process until nothing is outstanding.
    # ap-south's worker takes two of its own four shards and stops; the others then steal the rest.
    merger = cli(db_url, "regions", "merge", job, "--poll-seconds", "0.2")
    try:
        logs = {"ap-south": finish(start_worker(db_url, job, "ap-south", "--result-files", "--no-steal",
                                                "--max-shards", "2"))}
        # no worker of ap-south's own is left with two of its shards to do: the deadline's arithmetic opens its
        # steal gate (regions.fleet.steal_gates), and only then do the others take them
        conn.execute("SELECT bi.set_steal_gate_v1(%s, 'ap-south', true, 'ap-south: 2 shards left and no worker "
                     "of its own running')", (job,))
        near = start_worker(db_url, job, "us-east")
        far = start_worker(db_url, job, "eu-west", "--result-files")
        logs["us-east"], logs["eu-west"] = finish(near), finish(far)
        out, err = merger.communicate(timeout=120)
    finally:
        if merger.poll() is None:
            merger.kill()
    assert merger.returncode == 0, err
    merged = json.loads(out)
    assert merged["merged"] >= 6 and not merged.get("stale") and not merged.get("unreadable"), merged

    # every shard read in its own region except the recorded steals, each priced as egress
    reads = conn.execute("SELECT shard_no, kind, region, home_region, usd FROM bi.region_decisions "
                         "WHERE job_version = %s AND kind IN ('claim', 'steal')", (job,)).fetchall()
    assert sorted(r["shard_no"] for r in reads) == list(range(12))       # each claimed once
    for r in reads:
        assert (r["kind"] == "claim") == (r["region"] == r["home_region"])
    steals = [r for r in reads if r["kind"] == "steal"]
    # ap-south's two shards its worker left, and any shard of a region whose own worker was behind
    assert sum(r["home_region"] == "ap-south" for r in steals) == 2 and all(r["usd"] > 0 for r in steals)
    assert not conn.execute("SELECT 1 FROM bi.region_decisions WHERE job_version = %s AND kind = 'rebuild'",
                            (job,)).fetchall()
    per_region = {r["region"]: r for r in report(conn, job)}
    assert per_region["ap-south"]["claims"] == 2 and sum(r["steals_in"] for r in per_region.values()) == len(steals)
    # the far regions' results came through files, merged by key; the near region's straight to the ledger
    files = conn.execute("SELECT region, count(*) AS n, sum(records) AS records FROM bi.result_files "
                         "WHERE job_version = %s AND outcome = 'merged' GROUP BY region", (job,)).fetchall()
    assert {f["region"] for f in files} <= {"eu-west", "ap-south"} and "ap-south" in {f["region"] for f in files}
    assert "handed in" in logs["eu-west"] and "handed in" not in logs["us-east"]
    # the bill: replication as written at submit, egress as the steals' reads and the far files merged
    regions = bill(conn, job)[0].regions
    assert regions["replication_bytes"] == sum(int(r["bytes"]) for r in submitted["regions"]["regions"].values())
    assert (regions["steals"], regions["merged_files"]) == (len(steals), merged["merged"])
    far_usd = sum(int(f["bytes"]) / 1e9 * {"eu-west": 0.02, "ap-south": 0.09}[f["region"]] for f in conn.execute(
        "SELECT region, bytes FROM bi.result_files WHERE job_version = %s AND outcome = 'merged'", (job,)))
    assert float(regions["egress_cost"]) == pytest.approx(sum(r["usd"] for r in steals) + far_usd)

    # every record once, validated and published
    c = job_counts(conn, job)
    assert (c["stored"], c["dead_letters"], c["outstanding"]) == (RECORDS, 0, 0)
    assert duplicates(conn, job) == 0
    assert validate(conn, job).passed
    out = publish(conn, job)
    assert (out["to_version"], out["changed"]) == (job, True)
    assert conn.execute(f'SELECT count(*) AS n, count(DISTINCT record_id) AS d FROM {out["view"]}').fetchone() == {
        "n": RECORDS, "d": RECORDS}
    many = results(conn, job)

    # the same spec over the same rows in one region, plain workers: the same job version, the same results
    single = empty_db()
    with db.connect(single) as one:
        db.migrate(one)
        make_source(one, rows)
        assert submit(one, spec).job_version == job
        assert run_worker(WorkerConfig(job_version=job, db_url=single)) == 0
        assert results(one, job) == many


def test_a_region_lost_mid_night_its_workers_killed_and_its_endpoint_gone_the_night_still_ends_once(
        conn, db_url, monkeypatch):
    """ap-south's worker is killed (SIGKILL) after its first hand-in and its S3 endpoint stops: the check finds
    the store silent and ends its leases at once; us-east and eu-west take its shards (steals, replicas rebuilt
    from the ledger), and every record is stored once, validated and published."""
    import boto3

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    with contextlib.ExitStack() as keep:
        urls = {r: keep.enter_context(moto_server()) for r in ("us-east", "eu-west")}
        lost_stack = contextlib.ExitStack()
        urls["ap-south"] = lost_stack.enter_context(moto_server())
        if not urls["us-east"].startswith("http"):
            pytest.skip(urls["us-east"])
        for region, url in urls.items():
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=f"replicas-{region}")
        make_source(conn, tickets(RECORDS))
        job = submit(conn, make_spec(shard_size=SHARD)).job_version
        place(conn, job, deployment(urls))
        slow = ("--engine-option", "delay_s=0.05", "--poll-seconds", "0.5")   # a second a shard
        stop = threading.Event()
        merged: dict = {}
        with db.connect(db_url) as merger_conn:
            merger = threading.Thread(target=lambda: merged.update(merge_until(merger_conn, job, stop, 0.2)))
            merger.start()
            try:
                ap = start_worker(db_url, job, "ap-south", "--result-files", "--no-steal", *slow)
                deadline = time.monotonic() + 120
                while not conn.execute("SELECT 1 FROM bi.result_files WHERE job_version = %s AND region = 'ap-south'",
                                       (job,)).fetchone():
                    assert time.monotonic() < deadline and ap.poll() is None, "ap-south handed nothing in"
                    time.sleep(0.05)
                ap.kill()                                  # every worker of the region gone at once
                ap.communicate(timeout=30)
                lost_stack.close()                         # and its S3 endpoint
                rows = {r["region"]: r for r in check_regions(conn, job, end=True)}
                assert not rows["ap-south"]["reachable"] and rows["ap-south"]["ended"] >= 1
                assert rows["us-east"]["reachable"] and rows["eu-west"]["reachable"]
                near = start_worker(db_url, job, "us-east", *slow)
                far = start_worker(db_url, job, "eu-west", "--result-files", *slow)
                finish(near), finish(far)
            finally:
                stop.set()
                merger.join(timeout=60)
        c = job_counts(conn, job)
        assert (c["stored"], c["dead_letters"], c["outstanding"]) == (RECORDS, 0, 0)
        assert duplicates(conn, job) == 0
        steals = conn.execute("SELECT shard_no FROM bi.region_decisions WHERE job_version = %s AND kind = 'steal' "
                              "AND home_region = 'ap-south'", (job,)).fetchall()
        rebuilt = conn.execute("SELECT shard_no, reason FROM bi.region_decisions WHERE job_version = %s "
                               "AND kind = 'rebuild'", (job,)).fetchall()
        assert len(steals) >= 2 and {r["shard_no"] for r in rebuilt} >= {s["shard_no"] for s in steals}
        assert all("not written back" in r["reason"] for r in rebuilt)
        assert conn.execute("SELECT sum(lost_leases) AS n FROM bi.shards WHERE job_version = %s",
                            (job,)).fetchone()["n"] == 0     # the region's loss cost no record anything
        assert validate(conn, job).passed
        assert publish(conn, job)["changed"]


def test_a_far_worker_preempted_mid_shard_writes_what_it_holds_to_the_ledger_and_releases(conn, db_url, tmp_path):
    """The preemption notice (SIGTERM) reaches a far worker holding a shard's results for its file: what it
    holds goes straight to the ledger (no file for a shard given back), the lease is released at once, and
    the next holder finishes it: every record once."""
    import signal

    (tmp_path / "far").mkdir()
    make_source(conn, tickets(200))
    job = submit(conn, make_spec(shard_size=200, lease_seconds=600)).job_version
    place(conn, job, parse_deployment({"clusters": [{
        "name": "far-gpu", "region": "far", "workers": {"kind": "local"},
        "gpu": {"kind": "L4", "spot_per_hour": 0.4, "on_demand_per_hour": 0.8}, "capacity": 1,
        "store": {"kind": "path", "path": str(tmp_path / "far")}}]}))
    w = start_worker(db_url, job, "far", "--result-files", "--engine-option", "delay_s=0.05")
    deadline = time.monotonic() + 60
    while "shard 0 epoch 1" not in (line := w.stdout.readline()):
        assert line and time.monotonic() < deadline, "the worker never read its shard"
    time.sleep(1.0)                                   # some records generated, held for the shard's file
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=30)
    assert w.returncode == 143, out
    shard = conn.execute("SELECT state, stored FROM bi.shards WHERE job_version = %s", (job,)).fetchone()
    assert shard["state"] == "pending" and 0 < shard["stored"] < 200, out
    assert not conn.execute("SELECT 1 FROM bi.result_files WHERE job_version = %s", (job,)).fetchall()
    finish(start_worker(db_url, job, "far"))
    c = job_counts(conn, job)
    assert (c["stored"], c["outstanding"]) == (200, 0)
    assert duplicates(conn, job) == 0


def test_a_worker_of_a_region_the_version_was_not_placed_in_stops_with_one_line_before_any_claim(conn, db_url,
                                                                                               tmp_path):
    make_source(conn, tickets(20))
    job = submit(conn, make_spec()).job_version
    p = start_worker(db_url, job, "mars")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 4, out
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"--region mars: job version {job} has no cluster in region 'mars'" in errors[0]
    assert conn.execute("SELECT sum(claims) AS n FROM bi.shards WHERE job_version = %s", (job,)).fetchone()["n"] == 0
