"""Regions on the real embedded PostgreSQL (batch_inference.regions): placement and replicas with their
digests, claims by locality and priced steals, replicas rebuilt from the ledger, result files merged by key
through the one put-if-absent and fence. The stores here are local paths (the S3 kind runs against moto's
real S3 servers in tests/process/test_regions.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import yaml

from batch_inference import db
from batch_inference.ledger import Ledger, StaleLease
from batch_inference.plan import submit
from batch_inference.regions import DeploymentError, RegionLedger, merge_pending, parse_deployment, place, report
from batch_inference.regions.merge import merge_file
from batch_inference.regions.fleet import Gate, set_gates
from batch_inference.regions import watch_regions
from batch_inference.regions.replicas import decode
from batch_inference.status import fence_counts, job_counts
from tests.conftest import make_source, make_spec, tickets
from tests.process.test_worker import duplicates

OUT = {"category": "billing", "summary": "charged twice"}
REGIONS = ("us-east", "eu-west", "ap-south")


def deployment_dict(root: Path, **over) -> dict:
    d = {
        "clusters": [
            {"name": f"{r}-gpu", "region": r, "workers": {"kind": "local"},
             "gpu": {"kind": "H100", "spot_per_hour": 2.0 + i, "on_demand_per_hour": 4.0 + i,
                     "interruption_rate": 0.05 * i},
             "capacity": 2, "store": {"kind": "path", "path": str(root / r)}}
            for i, r in enumerate(REGIONS)],
        "egress": [{"from": "us-east", "to": "eu-west", "usd_per_gb": 0.02},
                   {"from": "us-east", "to": "ap-south", "usd_per_gb": 0.09},
                   {"from": "eu-west", "to": "ap-south", "usd_per_gb": 0.05}],
    }
    d.update(over)
    return d


@pytest.fixture
def stores(tmp_path) -> Path:
    for r in REGIONS:
        (tmp_path / r).mkdir()
    return tmp_path


@pytest.fixture
def job(conn):
    make_source(conn, tickets(60))
    return submit(conn, make_spec()).job_version     # 6 shards of 10


@pytest.fixture
def placed(conn, job, stores):
    place(conn, job, parse_deployment(deployment_dict(stores)))
    return job


def region_ledger(db_url, job, owner, region, **kw) -> RegionLedger:
    return RegionLedger(db.connect(db_url), job, owner, region=region, **kw)


def replicas(conn, job) -> list[dict]:
    return [dict(r) for r in conn.execute("SELECT * FROM bi.replicas WHERE job_version = %s ORDER BY shard_no",
                                          (job,))]


def nothing_placed(conn) -> bool:
    return all(conn.execute(f"SELECT count(*) AS n FROM bi.{t}").fetchone()["n"] == 0
               for t in ("region_clusters", "region_egress", "replicas", "region_decisions"))


def test_placement_writes_each_shards_replica_once_in_its_home_region_with_its_digest(conn, job, stores):
    version_before = job
    out = place(conn, job, parse_deployment(deployment_dict(stores)))
    assert out["placed"] and sorted(out["regions"]) == sorted(REGIONS)
    reps = replicas(conn, job)
    # capacity 2 each: two shards per region, contiguous ranges in the deployment's order
    assert [(r["shard_no"], r["region"]) for r in reps] == [(0, "us-east"), (1, "us-east"), (2, "eu-west"),
                                                            (3, "eu-west"), (4, "ap-south"), (5, "ap-south")]
    for r in reps:
        data = (stores / r["region"] / r["object_key"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == r["digest"] and r["digest"] in r["object_key"]
        assert len(data) == r["bytes"] and r["records"] == 10
        ids, texts = decode(data)          # pyarrow reads it back: the shard's records in id order
        want = conn.execute("SELECT record_id, text FROM bi.snapshot_rows WHERE job_version = %s AND shard_no = %s "
                            "ORDER BY record_id", (job, r["shard_no"])).fetchall()
        assert list(zip(ids, texts)) == [(w["record_id"], w["text"]) for w in want]
    # what replication cost, per region, in the ledger
    rep = {r["region"]: r for r in report(conn, job)}
    assert all(rep[r]["shards"] == 2 and rep[r]["replica_bytes"] > 0 for r in REGIONS)
    costs = conn.execute("SELECT region, bytes, seconds FROM bi.region_decisions WHERE job_version = %s AND "
                         "kind = 'replicate'", (job,)).fetchall()
    assert sorted(c["region"] for c in costs) == sorted(REGIONS) and all(c["bytes"] > 0 for c in costs)
    # placing it again on the same clusters writes nothing; the job version is the spec's and the rows'
    assert place(conn, job, parse_deployment(deployment_dict(stores)))["placed"] is False
    assert len(replicas(conn, job)) == 6
    assert submit(conn, make_spec()).job_version == version_before


@pytest.mark.parametrize("case,change,words", [
    ("no store", lambda d, root: d["clusters"][1].pop("store"), "cluster 'eu-west-gpu' has no store"),
    ("no egress", lambda d, root: d["egress"].pop(2), "region 'eu-west' has no egress price to 'ap-south'"),
    ("unreachable store", lambda d, root: d["clusters"][2]["store"].update(path=str(root / "gone")),
     "region 'ap-south': store"),
    ("no connection", lambda d, root: d["clusters"][0].update(workers={"kind": "kubernetes",
                                                                       "conn_id": "no_such_k8s"}),
     "cluster 'us-east-gpu': Kubernetes connection 'no_such_k8s' does not exist"),
])
def test_bad_deployments_are_one_line_and_nothing_is_written(conn, job, stores, case, change, words):
    d = deployment_dict(stores)
    change(d, stores)
    with pytest.raises(DeploymentError) as err:
        place(conn, job, parse_deployment(d))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert nothing_placed(conn)
    assert not any(any((stores / r).iterdir()) for r in REGIONS)


def test_a_worker_claims_its_own_regions_shards_first_then_steals_from_a_region_behind_priced_as_egress(
        db_url, conn, placed):
    us = region_ledger(db_url, placed, "us-1", "us-east", steal=False)
    mine = [us.claim(), us.claim()]
    assert sorted(lease.shard_no for lease in mine) == [0, 1]
    assert us.claim() is None                     # none left at home, and no steal allowed
    # eu-west has a worker holding one of its two shards: pending 1 = leased 1, not behind
    eu = region_ledger(db_url, placed, "eu-1", "eu-west", steal=False)
    assert eu.claim().shard_no in (2, 3)
    us.steal = True
    assert us.claim() is None                      # no region's steal gate is open: the deadline does not need it
    set_gates(conn, placed, [Gate("ap-south", True, "ap-south: 20 records left and no worker of its own running")])
    stolen = us.claim()
    assert stolen.shard_no == 5                    # ap-south (2 pending, 0 leased): its far end first
    row = conn.execute("SELECT * FROM bi.region_decisions WHERE job_version = %s AND kind = 'steal'",
                       (placed,)).fetchone()
    rep = replicas(conn, placed)[5]
    assert (row["shard_no"], row["region"], row["home_region"], row["bytes"]) == (5, "us-east", "ap-south",
                                                                                    rep["bytes"])
    assert row["usd"] == pytest.approx(rep["bytes"] / 1e9 * 0.09) and "had no shard left" in row["reason"]
    assert "no worker of its own running" in row["reason"]          # the gate's arithmetic, with the steal
    claims = conn.execute("SELECT shard_no, region FROM bi.region_decisions WHERE job_version = %s AND kind = 'claim'"
                          " ORDER BY shard_no", (placed,)).fetchall()
    assert [(c["shard_no"], c["region"]) for c in claims][:2] == [(0, "us-east"), (1, "us-east")]
    # the stolen shard reads from its home region's replica
    ids, texts, attempts, crashes = us.record_columns(stolen)
    assert len(ids) == 10 and us.stats["steals"] == 1 and us.stats["rebuilds"] == 0


def test_a_replica_missing_or_not_matching_its_digest_is_rebuilt_from_the_ledger_never_read(db_url, conn, placed,
                                                                                           stores):
    reps = replicas(conn, placed)
    (stores / "us-east" / reps[0]["object_key"]).unlink()
    bad = stores / "us-east" / reps[1]["object_key"]
    data = bad.read_bytes()
    bad.write_bytes(data.replace(b"Ticket", b"TICKET"))     # same size, other text
    us = region_ledger(db_url, placed, "us-1", "us-east")
    for lease in (us.claim(), us.claim()):
        ids, texts, _, _ = us.record_columns(lease)
        assert all(t.startswith("Ticket ") for t in texts) and len(ids) == 10   # the ledger's text, not the copy's
    assert us.stats["rebuilds"] == 2
    for r in reps[:2]:                                        # written back: the digest matches again
        assert hashlib.sha256((stores / "us-east" / r["object_key"]).read_bytes()).hexdigest() == r["digest"]
    why = [r["reason"] for r in conn.execute(
        "SELECT reason FROM bi.region_decisions WHERE job_version = %s AND kind = 'rebuild' ORDER BY shard_no",
        (placed,))]
    assert "is missing" in why[0] and "does not match its digest" in why[1] and all("written back" in w for w in why)
    assert [r["rebuilt"] for r in replicas(conn, placed)][:2] == [1, 1]


def _finish_with_files(lg: RegionLedger, lease) -> None:
    ids, texts, _, _ = lg.record_columns(lease)
    assert lg.put_results(lease, ids, [OUT] * len(ids), ["billing"] * len(ids)) == len(ids)
    assert lg.complete(lease) == "done"


def test_result_files_merge_by_key_once_and_a_stale_or_late_file_changes_nothing(db_url, conn, placed, stores):
    far = region_ledger(db_url, placed, "ap-1", "ap-south", result_files=True)
    lease = far.claim()
    _finish_with_files(far, lease)
    # handed in, not yet stored: the ledger got one small call, the rows are in the region's store
    assert job_counts(conn, placed)["stored"] == 0
    f = conn.execute("SELECT * FROM bi.result_files WHERE job_version = %s", (placed,)).fetchone()
    assert (f["shard_no"], f["epoch"], f["region"], f["records"]) == (lease.shard_no, 1, "ap-south", 10)
    path = stores / "ap-south" / f["object_key"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == f["digest"]
    assert merge_pending(conn, placed) == {"merged": 1, "rows": 10}
    shard = conn.execute("SELECT state, stored FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (placed, lease.shard_no)).fetchone()
    assert (shard["state"], shard["stored"]) == ("done", 10)
    # merged twice: nothing; and its rows put again through the one put-if-absent: nothing either
    assert merge_file(conn, f["id"], path.read_bytes()) == {"outcome": "already", "n": 0, "done": False}
    assert Ledger(conn, placed, "ap-1").conn.execute(
        "SELECT count(*) AS n FROM bi.results WHERE job_version = %s", (placed,)).fetchone()["n"] == 10

    # a stale epoch's file: handed in, then the lease ran out and another worker took the shard over
    slow = region_ledger(db_url, placed, "ap-2", "ap-south", result_files=True)
    stale = slow.claim()
    _finish_with_files(slow, stale)
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (placed, stale.shard_no))
    taker = region_ledger(db_url, placed, "ap-3", "ap-south", result_files=True)
    took = taker.claim()
    assert (took.shard_no, took.epoch) == (stale.shard_no, stale.epoch + 1)
    assert merge_pending(conn, placed) == {"stale": 1}
    assert conn.execute("SELECT stored FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                        (placed, stale.shard_no)).fetchone()["stored"] == 0
    # a late worker (its epoch ended before it handed in): refused at the hand-in, nothing recorded
    slow.put_results(stale, ["t00050"], [OUT], ["billing"])
    with pytest.raises(StaleLease):
        slow.complete(stale)
    fences = fence_counts(conn, placed)
    assert fences.get("put_results") == 1 and fences.get("hand_in_results") == 1
    # the new holder's file merges and completes the shard: every record once
    _finish_with_files(taker, took)
    assert merge_pending(conn, placed) == {"merged": 1, "rows": 10}
    rows = conn.execute("SELECT worker_id, epoch, count(*) AS n FROM bi.results WHERE job_version = %s "
                        "GROUP BY 1, 2 ORDER BY 1", (placed,)).fetchall()
    assert [(r["worker_id"], r["epoch"], r["n"]) for r in rows] == [("ap-1", 1, 10), ("ap-3", 2, 10)]
    outs = conn.execute("SELECT DISTINCT output FROM bi.results WHERE job_version = %s", (placed,)).fetchall()
    assert [o["output"] for o in outs] == [OUT]


def _cli(db_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batch_inference.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "BATCH_INFERENCE_DB": db_url}, timeout=120)


@pytest.mark.parametrize("case,change,words", [
    ("no store", lambda d, root: d["clusters"][1].pop("store"), "cluster 'eu-west-gpu' has no store"),
    ("no egress", lambda d, root: d["egress"].clear(), "region 'us-east' has no egress price to 'eu-west'"),
    ("unreachable store", lambda d, root: d["clusters"][0]["store"].update(path=str(root / "gone")),
     "region 'us-east': store"),
    ("unknown field", lambda d, root: d["clusters"][2]["gpu"].update(spot=1), "cluster 'ap-south-gpu' field "
                                                                              "'gpu.spot': unknown field"),
])
def test_cli_place_of_a_bad_deployment_prints_one_line_exits_2_and_writes_nothing(conn, db_url, job, stores, case,
                                                                                  change, words):
    d = deployment_dict(stores)
    change(d, stores)
    path = stores / "deployment.yaml"
    path.write_text(yaml.safe_dump(d))
    p = _cli(db_url, "regions", "place", job, str(path))
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("batch-inference regions: error: ") and words in lines[0], lines
    assert nothing_placed(conn)


def test_cli_places_merges_and_reports(conn, db_url, job, stores):
    path = stores / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment_dict(stores)))
    p = _cli(db_url, "regions", "place", job, str(path))
    assert p.returncode == 0 and p.stdout.count("shard replicas") == 3, p.stderr
    far = region_ledger(db_url, job, "eu-1", "eu-west", result_files=True)
    _finish_with_files(far, far.claim())
    p = _cli(db_url, "regions", "merge", job, "--once")
    assert p.returncode == 0 and json.loads(p.stdout) == {"merged": 1, "rows": 10}, p.stderr
    p = _cli(db_url, "regions", "report", job)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["region"] for r in rows] == sorted(REGIONS) and sum(r["claims"] for r in rows) == 1


def test_a_region_lost_mid_night_its_shards_are_taken_by_another_rebuilt_from_the_ledger_and_merged_once(
        db_url, conn, placed, stores):
    """ap-south's worker handed in one shard's file and holds another; then the region is lost (its store
    unreachable, its worker gone): its leases run out, eu-west takes both shards (a steal each, the replica
    rebuilt from the ledger: the home store cannot be read), and the lost file is refused unread."""
    ap = region_ledger(db_url, placed, "ap-1", "ap-south", result_files=True)
    handed = ap.claim()
    _finish_with_files(ap, handed)
    held = ap.claim()
    ap.record_columns(held)
    (stores / "ap-south").rename(stores / "ap-south-lost")          # the region's store is gone
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = ANY (%s)", (placed, [handed.shard_no, held.shard_no]))
    found = watch_regions(conn, placed)                 # the scheduled check: its store is silent
    assert [f["region"] for f in found] == ["ap-south"] and "store does not answer" in found[0]["reason"]
    eu = region_ledger(db_url, placed, "eu-1", "eu-west", result_files=True)
    for _ in range(2):                              # its own two shards first
        _finish_with_files(eu, eu.claim())
    taken = [eu.claim(), eu.claim()]
    assert sorted(t.shard_no for t in taken) == sorted([handed.shard_no, held.shard_no])
    for lease in taken:
        _finish_with_files(eu, lease)
    assert eu.stats == {**eu.stats, "steals": 2, "rebuilds": 2}
    assert merge_pending(conn, placed) == {"merged": 4, "stale": 1, "rows": 40}
    reasons = [r["reason"] for r in conn.execute(
        "SELECT reason FROM bi.region_decisions WHERE job_version = %s AND kind = 'rebuild'", (placed,))]
    assert all("not written back" in r and "ap-south" in r for r in reasons), reasons
    c = job_counts(conn, placed)
    assert (c["stored"], c["shards"]["done"]) == (40, 4)
    assert duplicates(conn, placed) == 0


def test_a_region_found_lost_has_its_leases_ended_at_once_and_no_record_pays_for_it(db_url, conn, placed, stores):
    ap = region_ledger(db_url, placed, "ap-1", "ap-south", result_files=True)
    handed, held = ap.claim(), None
    _finish_with_files(ap, handed)
    held = ap.claim()
    us = region_ledger(db_url, placed, "us-1", "us-east")
    mine = us.claim()                                          # another region's lease: untouched
    (stores / "ap-south").rename(stores / "gone")
    p = _cli(db_url, "regions", "check", placed, "--end-leases")
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 1, p.stderr
    lost = next(r for r in rows if r["region"] == "ap-south")
    assert not lost["reachable"] and "no such directory" in lost["problem"] and lost["ended"] == 2
    assert all(r["reachable"] for r in rows if r["region"] != "ap-south")
    shards = {r["shard_no"]: r for r in conn.execute(
        "SELECT shard_no, state, lost_leases FROM bi.shards WHERE job_version = %s", (placed,))}
    assert shards[handed.shard_no]["state"] == shards[held.shard_no]["state"] == "pending"
    assert shards[mine.shard_no]["state"] == "leased"
    assert all(s["lost_leases"] == 0 for s in shards.values())            # no record's fault
    assert conn.execute("SELECT count(*) AS n FROM bi.attempts WHERE job_version = %s", (placed,)).fetchone()["n"] == 0
    why = conn.execute("SELECT reason FROM bi.region_decisions WHERE job_version = %s AND kind = 'region_lost'",
                       (placed,)).fetchone()["reason"]
    assert "2 lease(s) ended" in why and "no such directory" in why
    # at once: the other regions take them now (the handed-in file refused unread), not when leases run out
    eu = region_ledger(db_url, placed, "eu-1", "eu-west")
    eu.steal = True
    taken = {eu.claim().shard_no for _ in range(4)}
    assert {handed.shard_no, held.shard_no} <= taken
    assert merge_pending(conn, placed) == {"stale": 1}
    # by hand, for a Kubernetes API gone: the CLI's one call
    p = _cli(db_url, "regions", "lost", placed, "us-east", "--reason", "k8s API unreachable")
    assert p.returncode == 0 and json.loads(p.stdout) == {"region": "us-east", "ended": 1}, p.stderr


def test_a_hand_in_retried_after_its_reply_was_lost_hands_in_the_same_file_once(db_url, conn, placed):
    far = region_ledger(db_url, placed, "eu-1", "eu-west", result_files=True)
    lease = far.claim()
    ids, _, _, _ = far.record_columns(lease)
    far.put_results(lease, ids, [OUT] * len(ids), ["billing"] * len(ids))
    real = far.transition
    calls = []

    def lost_reply(*a, **kw):            # the hand-in commits, its answer never arrives
        calls.append(real(*a, **kw))
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return calls[-1]

    far.transition = lost_reply
    with pytest.raises(psycopg.OperationalError):
        far.complete(lease)
    assert far.complete(lease) == "done"          # the worker's retry: the same object, the same epoch's row
    assert calls[0]["file_id"] == calls[1]["file_id"]
    assert merge_pending(conn, placed) == {"merged": 1, "rows": 10}


def test_a_shard_that_stopped_short_is_no_file_its_results_go_to_the_ledger_and_it_is_released(db_url, conn, placed):
    """A far worker's shard halted part way (a preemption notice, a drain) reaches completion with fewer
    results than records: they are written straight to the ledger, no file is handed in, the ledger says
    incomplete (the worker releases it)."""
    far = region_ledger(db_url, placed, "eu-1", "eu-west", result_files=True)
    lease = far.claim()
    ids, _, _, _ = far.record_columns(lease)
    far.put_results(lease, ids[:4], [OUT] * 4, ["billing"] * 4)
    assert far.complete(lease) == "incomplete"
    assert far.release(lease)
    shard = conn.execute("SELECT state, stored FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (placed, lease.shard_no)).fetchone()
    assert (shard["state"], shard["stored"]) == ("pending", 4)
    assert not conn.execute("SELECT 1 FROM bi.result_files WHERE job_version = %s", (placed,)).fetchall()


def _spec_file(root: Path) -> str:
    from tests.conftest import spec_dict

    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict()))
    return str(path)


@pytest.mark.parametrize("case,change,words", [
    ("no store", lambda d, root: d["clusters"][1].pop("store"), "cluster 'eu-west-gpu' has no store"),
    ("no egress", lambda d, root: d["egress"].pop(2), "region 'eu-west' has no egress price to 'ap-south'"),
    ("unreachable store", lambda d, root: d["clusters"][2]["store"].update(path=str(root / "gone")),
     "region 'ap-south': store"),
    ("no connection", lambda d, root: d["clusters"][0].update(workers={"kind": "kubernetes",
                                                                       "conn_id": "no_such_k8s"}),
     "cluster 'us-east-gpu': Kubernetes connection 'no_such_k8s' does not exist"),
])
def test_submit_onto_a_bad_deployment_prints_one_line_exits_2_and_writes_nothing(conn, db_url, stores, case,
                                                                                 change, words):
    """The checks are submit's: a deployment refused writes no job version, no snapshot and no replica."""
    make_source(conn, tickets(60))
    d = deployment_dict(stores)
    change(d, stores)
    path = stores / "deployment.yaml"
    path.write_text(yaml.safe_dump(d))
    p = _cli(db_url, "submit", _spec_file(stores), "--deployment", str(path))
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("batch-inference submit: error: ") and words in lines[0], lines
    assert conn.execute("SELECT count(*) AS n FROM bi.jobs").fetchone()["n"] == 0
    assert nothing_placed(conn)
    assert not any(any((stores / r).iterdir()) for r in REGIONS if (stores / r).is_dir())


def test_submit_onto_a_deployment_replicates_and_the_bill_shows_replication_and_egress(conn, db_url, stores):
    """``submit --deployment``: the same job version as a plain submit, each shard's replica written in its home
    region at submit, what that cost (bytes, seconds, the egress price from the ledger's region) in submit's
    output, in ``status`` and in ``cost``; a steal and a far region's merged result file add egress."""
    make_source(conn, tickets(60))
    path = stores / "deployment.yaml"
    # prices large enough that a few kilobytes show in the bill's rounding (dollars to 6 places)
    path.write_text(yaml.safe_dump(deployment_dict(stores, egress=[
        {"from": "us-east", "to": "eu-west", "usd_per_gb": 200.0},
        {"from": "us-east", "to": "ap-south", "usd_per_gb": 900.0},
        {"from": "eu-west", "to": "ap-south", "usd_per_gb": 500.0}])))
    p = _cli(db_url, "submit", _spec_file(stores), "--deployment", str(path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    job = out["job_version"]
    assert job == submit(conn, make_spec()).job_version                  # placement is not the version (I2)
    assert out["regions"]["placed"] and sorted(out["regions"]["regions"]) == sorted(REGIONS)
    by_region = out["regions"]["regions"]
    assert by_region["us-east"]["usd"] == 0 and by_region["us-east"]["bytes"] > 0     # the ledger's own region
    assert 0 < by_region["ap-south"]["usd"] == pytest.approx(by_region["ap-south"]["bytes"] / 1e9 * 900)
    assert len(replicas(conn, job)) == 6
    # a steal (ap-south's shard read in eu-west) and one of eu-west's own shards handed in as a file, merged
    eu = region_ledger(db_url, job, "eu-1", "eu-west", result_files=True)
    for _ in range(2):                                               # its own two shards, handed in as files
        _finish_with_files(eu, eu.claim())
    conn.execute("SELECT bi.set_steal_gate_v1(%s, 'ap-south', true, 'behind its deadline')", (job,))
    stolen = eu.claim()                                              # then one of ap-south's: a steal
    assert stolen.shard_no == 5 and eu.stats["steals"] == 1
    assert merge_pending(conn, job) == {"merged": 2, "rows": 20}
    bill = json.loads(_cli(db_url, "cost", job, "--json").stdout)["so_far"]["regions"]
    rep_bytes = sum(r["bytes"] for r in by_region.values())
    assert bill["replication_bytes"] == rep_bytes and bill["ledger_region"] == "us-east"
    assert bill["replication_cost"] == pytest.approx(sum(r["usd"] for r in by_region.values()), abs=1e-6)
    steal = conn.execute("SELECT bytes, usd FROM bi.region_decisions WHERE job_version = %s AND kind = 'steal'",
                         (job,)).fetchone()
    files = conn.execute("SELECT sum(bytes) AS n FROM bi.result_files WHERE job_version = %s", (job,)).fetchone()["n"]
    assert (bill["steals"], bill["merged_files"]) == (1, 2)
    assert bill["egress_bytes"] == steal["bytes"] + files
    assert steal["usd"] == pytest.approx(steal["bytes"] / 1e9 * 500)                 # ap-south -> eu-west
    assert 0 < bill["egress_cost"] == pytest.approx(steal["usd"] + int(files) / 1e9 * 200, abs=1e-6)
    plain = json.loads(_cli(db_url, "cost", job, "--json", "--batch-price", "0").stdout)["so_far"]
    assert plain["total"] == pytest.approx(bill["replication_cost"] + bill["egress_cost"] + plain["gpu_cost"], abs=0.01)
    text = _cli(db_url, "cost", job).stdout
    assert "regions: replication" in text and "(1 steals, 2 far result files merged)" in text
    st = _cli(db_url, "status", job)
    assert "regions: replication" in st.stdout and "1 steals" in st.stdout, st.stderr
    assert json.loads(_cli(db_url, "status", job, "--json").stdout)["regions"]["steals"] == 1
    # a version in one region has no such lines
    one = submit(conn, make_spec(params={"max_tokens": 32})).job_version
    assert "regions" not in json.loads(_cli(db_url, "cost", one, "--json").stdout)["so_far"]
    assert "regions" not in json.loads(_cli(db_url, "status", one, "--json").stdout)


def test_a_far_workers_held_results_count_done_for_the_cutoff_until_merged_and_not_once_its_lease_ends(
        db_url, conn, placed):
    """A far worker's results reach the ledger with its shard's file: each renewal reports how many it holds
    (bi.renew_lease_held_v1), and bi.region_held_v1 sums them with the files handed in and not merged, under
    leases that are current. The cutoff counts them done (it fires later by their share of the fallback's
    time) but the job is complete only once they are stored."""
    import asyncio
    from datetime import datetime, timedelta, timezone

    from batch_inference import deadline as watchlib
    from batch_inference.cost import Prices
    from batch_inference.cutoff import DerivedConstants

    def held() -> int:
        return conn.execute(db.q("region_held"), {"job": placed}).fetchone()["held"]

    async def poll() -> dict:
        async with await watchlib.connect_async(db_url) as a:
            return await watchlib.poll_counts(a, placed)

    far = region_ledger(db_url, placed, "ap-1", "ap-south", result_files=True)
    lease = far.claim()
    ids, _, _, _ = far.record_columns(lease)
    assert far.renew(lease) == "batch" and held() == 0            # nothing held: the plain renewal
    far.put_results(lease, ids[:4], [OUT] * 4, ["billing"] * 4)
    assert far.renew(lease) == "batch" and held() == 4
    got = asyncio.run(poll())
    assert (got["outstanding"], got["region_held"], got["stored"]) == (60, 4, 0)   # the ledger's own, and held

    # The cutoff: held results are no work for the fallback; the job is not complete while they are held.
    at = datetime(2026, 12, 7, 5, 0, tzinfo=timezone.utc)
    w = watchlib.WatchConfig(job_version=placed, deadline=at + timedelta(seconds=200), step_s=1)
    ctx = watchlib.JobContext(placed, "tickets_triage", make_spec(), DerivedConstants(1.0, 10.0, "test"), Prices())
    plain = watchlib.evaluate(w, ctx, {**got, "region_held": 0}, at)
    counted = watchlib.evaluate(w, ctx, got, at)
    assert (counted.decision.latest_safe_start - plain.decision.latest_safe_start).total_seconds() == 4
    everything = watchlib.evaluate(w, ctx, {**got, "outstanding": 4}, at + timedelta(seconds=199))
    assert everything.status == "wait" and not everything.decision.complete and not everything.decision.fire

    # Handed in: the file counts until it is merged (no renewal after it), then the ledger's rows do.
    far.put_results(lease, ids[4:], [OUT] * 6, ["billing"] * 6)
    assert far.complete(lease) == "done" and held() == 10
    assert merge_pending(conn, placed) == {"merged": 1, "rows": 10}
    assert held() == 0 and job_counts(conn, placed)["stored"] == 10
    assert not conn.execute("SELECT 1 FROM bi.held_results WHERE job_version = %s AND shard_no = %s",
                            (placed, lease.shard_no)).fetchall()

    # A lease that runs out (its worker gone) takes its held results off at once; its epoch's report is stale.
    other = region_ledger(db_url, placed, "ap-2", "ap-south", result_files=True)
    gone = other.claim()
    ids, _, _, _ = other.record_columns(gone)
    other.put_results(gone, ids[:3], [OUT] * 3, ["billing"] * 3)
    assert other.renew(gone) == "batch" and held() == 3
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (placed, gone.shard_no))
    assert held() == 0
    took = region_ledger(db_url, placed, "ap-3", "ap-south", result_files=True).claim()
    assert (took.shard_no, took.epoch) == (gone.shard_no, gone.epoch + 1)
    with pytest.raises(StaleLease):
        other.renew(gone)
    assert held() == 0 and fence_counts(conn, placed).get("renew") == 1


def test_a_far_worker_writes_what_it_held_past_hold_seconds_straight_and_hands_the_rest_in_as_its_file(
        db_url, conn, placed, stores):
    """A shard whose results a far worker has held for ``hold_seconds`` has them written straight to the ledger
    (a worker that dies mid-shard loses at most that much work); the rest of the shard is its file, merged by
    key, and the shard completes with every record once."""
    import time

    far = region_ledger(db_url, placed, "ap-1", "ap-south", result_files=True, hold_seconds=0.3)
    lease = far.claim()
    ids, _, _, _ = far.record_columns(lease)
    far.put_results(lease, ids[:4], [OUT] * 4, ["billing"] * 4)
    assert job_counts(conn, placed)["stored"] == 0                      # held, not yet old enough
    time.sleep(0.35)
    far.put_results(lease, ids[4:7], [OUT] * 3, ["billing"] * 3)
    assert job_counts(conn, placed)["stored"] == 7                      # held too long: straight to the ledger
    assert far.renew(lease) == "batch"
    assert conn.execute(db.q("region_held"), {"job": placed}).fetchone()["held"] == 0
    far.put_results(lease, ids[7:], [OUT] * 3, ["billing"] * 3)
    assert far.complete(lease) == "done"
    f = conn.execute("SELECT records FROM bi.result_files WHERE job_version = %s", (placed,)).fetchone()
    assert f["records"] == 3
    assert merge_pending(conn, placed) == {"merged": 1, "rows": 3}
    shard = conn.execute("SELECT state, stored FROM bi.shards WHERE job_version = %s AND shard_no = %s",
                         (placed, lease.shard_no)).fetchone()
    assert (shard["state"], shard["stored"]) == ("done", 10)
    assert duplicates(conn, placed) == 0


def test_a_far_worker_asks_the_ledger_per_shard_only_its_claim_and_its_hand_in(db_url, conn, placed, monkeypatch):
    """Behind a far round trip each statement is one (80 ms in benchmarks.regions): a far worker (--result-files)
    sends per shard its claim and its hand-in, and once its start (the spec, its region's store) and its last
    claim; no job counts for its progress line (counts that leave out what far workers hold) and none at the end
    when it is not to wait for others' leases."""
    import threading

    from gpu_runner.worker import WorkerConfig, run_worker

    sent: list[str] = []
    real = psycopg.Cursor.execute

    def counting(self, query, *args, **kw):
        if threading.current_thread() is threading.main_thread():      # the renewals have a thread of their own
            sent.append(" ".join(str(query).split())[:80])
        return real(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.Cursor, "execute", counting)
    assert run_worker(WorkerConfig(job_version=placed, db_url=db_url, region="ap-south", result_files=True,
                                   wait_for_leases=False, progress_every=5)) == 0
    monkeypatch.undo()
    shards = conn.execute("SELECT count(*) AS n FROM bi.result_files WHERE job_version = %s", (placed,)
                          ).fetchone()["n"]
    assert shards == 2, sent                      # ap-south's own two of the six, no gate open to steal through
    claims = [s for s in sent if "claim_shard_region" in s]
    hand_ins = [s for s in sent if "hand_in_results" in s]
    assert (len(claims), len(hand_ins)) == (shards + 1, shards), sent
    assert not [s for s in sent if "job_counts" in s or "job_mode" in s], sent
    start = sent[:sent.index(claims[0])]
    assert len(sent) == len(start) + len(claims) + len(hand_ins) and len(start) <= 3, sent
    assert merge_pending(conn, placed) == {"merged": 2, "rows": 20} and duplicates(conn, placed) == 0
