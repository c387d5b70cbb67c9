"""A job version over three regions as deployed: the ``batch_inference_regions`` DAG of the live Airflow
deployment (tests/fixtures/live_airflow.py) submits onto a deployment of three clusters (each region its own
store, a directory here: the Airflow worker's local processes get no cloud credentials), replicates the
snapshot at submit, runs each cluster's worker processes with ``--region`` (the two far from the ledger with
``--result-files``), merges their result files by key in its ``merge`` task beside the workers, then
validates and publishes; driven through the REST API, the ledger read over SQL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from batch_inference import db
from batch_inference.status import region_bill
from tests.process.test_live_airflow import NOOP_MODEL, counts, make_spec, make_table, published_rows

pytestmark = pytest.mark.live

DAG_ID = "batch_inference_regions"
REGIONS = ("us-east", "eu-west", "ap-south")


def write_deployment(home: Path) -> str:
    clusters = []
    for i, r in enumerate(REGIONS):
        (home / "stores" / r).mkdir(parents=True, exist_ok=True)
        clusters.append({"name": f"{r}-local", "region": r, "workers": {"kind": "local"},
                         "gpu": {"kind": "L4", "spot_per_hour": 0.5 + 0.25 * i, "on_demand_per_hour": 1.0 + 0.5 * i},
                         "capacity": 1, "store": {"kind": "path", "path": str(home / "stores" / r)}})
    path = home / "regions.yaml"
    path.write_text(yaml.safe_dump({
        "clusters": clusters, "ledger_region": "us-east",
        "egress": [{"from": "us-east", "to": "eu-west", "usd_per_gb": 0.02},
                   {"from": "us-east", "to": "ap-south", "usd_per_gb": 0.09},
                   {"from": "eu-west", "to": "ap-south", "usd_per_gb": 0.05}]}))
    return str(path)


def wait_parsed(dep, dag_id: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while dep.http.get(f"/api/v2/dags/{dag_id}", headers={"Authorization": f"Bearer {dep.token}"}).status_code != 200:
        assert time.monotonic() < end, f"{dag_id} was not parsed in {timeout:.0f} s:\n{dep.log_tail('dag-processor')}"
        time.sleep(1)


def test_a_job_over_three_regions_merges_its_far_results_in_the_dag_before_validate_and_publishes(live_airflow):
    dep = live_airflow
    wait_parsed(dep, DAG_ID)
    dep.unpause(DAG_ID)             # unscheduled: unpausing it creates no run
    table = make_table(dep.ledger_url, "live_regions", 90)
    spec = make_spec(dep, "live_regions", model=NOOP_MODEL, engine={"name": "noop", "options": {"delay_s": 0.02}})
    deployment = write_deployment(Path(dep.home))
    t0 = time.monotonic()
    run_id = dep.trigger(DAG_ID, {"spec_path": spec, "source_table": table, "shard_size": 10, "workers": 1,
                                  "deadline": "+20h", "deployment": deployment})
    run = dep.wait_run(DAG_ID, run_id, timeout=600)
    assert run["state"] == "success", dep.explain(DAG_ID, run_id)
    seconds = time.monotonic() - t0

    manifest = dep.xcom(DAG_ID, run_id, "submit")
    job = manifest["job_version"]
    placed = manifest["regions"]
    assert placed["placed"] and sorted(placed["regions"]) == sorted(REGIONS)         # replicated at submit
    assert placed["regions"]["us-east"]["usd"] == 0 and placed["regions"]["ap-south"]["usd"] > 0
    slots = dep.xcom(DAG_ID, run_id, "regions")
    assert {(s["region"], s["result_files"]) for s in slots} == {("us-east", False), ("eu-west", True),
                                                                 ("ap-south", True)}
    merged = dep.xcom(DAG_ID, run_id, "merge")
    with db.connect(dep.ledger_url) as conn:
        files = conn.execute("SELECT region, outcome, records FROM bi.result_files WHERE job_version = %s",
                             (job,)).fetchall()
        reads = conn.execute("SELECT shard_no, kind, region, home_region FROM bi.region_decisions "
                             "WHERE job_version = %s AND kind IN ('claim', 'steal')", (job,)).fetchall()
        replicas = conn.execute("SELECT shard_no, region FROM bi.replicas WHERE job_version = %s",
                                (job,)).fetchall()
        dupes = conn.execute("SELECT count(*) - count(DISTINCT record_id) AS d FROM bi.results "
                             "WHERE job_version = %s", (job,)).fetchone()["d"]
        bill = region_bill(conn, job)
    # every shard read where its replica is, but for recorded steals; the far regions' results came as
    # files, every one merged by the DAG's merge task; the ledger's region wrote straight to the ledger
    assert len(replicas) == 9 and {r["region"] for r in replicas} == set(REGIONS)
    assert {r["shard_no"] for r in reads} == set(range(9))
    assert all((r["kind"] == "claim") == (r["region"] == r["home_region"]) for r in reads)
    assert files and {f["region"] for f in files} <= {"eu-west", "ap-south"}
    assert all(f["outcome"] == "merged" for f in files)
    assert merged["placed"] and merged["merged"] == len(files) and merged["outstanding"] == 0
    assert merged["rows"] == sum(f["records"] for f in files)
    # every record once, validated and published; the bill carries replication and the merge's reads
    c = counts(dep, job)
    assert (c["outstanding"], c["status"]) == (0, "published")
    assert c["stored"] + c["dead_letters"] == 90 and c["dead_letters"] == manifest["dead_letters_at_planning"]
    assert dupes == 0 and published_rows(dep, "live_regions") == c["stored"]
    assert bill["placed"] and bill["replication_bytes"] > 0 and bill["merged_files"] == len(files)
    print(f"regions DAG: trigger to published in {seconds:.1f} s; {len(files)} far result files merged "
          f"({merged['rows']} rows), {sum(r['kind'] == 'steal' for r in reads)} steals")
