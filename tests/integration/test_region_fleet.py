"""One autopilot over every cluster on the real ledger (batch_inference.regions.fleet): each cluster's decision
recorded with its cluster and reason, each cluster's launcher reconciled to its own size, the steal gates
opened by the deadline's arithmetic, and a region found lost by the scheduled check (its workers' leases all
run out at once, its store silent, its cluster unreachable)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from batch_inference.autopilot import ADD, Policy
from batch_inference.regions import (ClusterPilot, cluster_seconds, launcher_name, parse_deployment,
                                     reconcile_clusters, watch_regions)
from batch_inference.status import job_counts
from tests.integration.test_regions import deployment_dict, job, placed, region_ledger, stores  # noqa: F401

POLICY = Policy(min_workers=1, max_workers=8, margin_s=5, start_s=1, cooldown_s=5, window_s=2)


def pilot(root) -> ClusterPilot:
    return ClusterPilot(parse_deployment(deployment_dict(root)), "us-east", POLICY, shard_s=1.0, overhead_s=0.0)


def poll(p: ClusterPilot, conn, job, now, deadline, running, **kw):
    c = job_counts(conn, job)
    return p.poll(conn, job, now, deadline, stored=int(c["stored"]), outstanding=int(c["outstanding"]),
                  shards_left=int(c["shards"]["pending"]) + int(c["shards"]["leased"]), running=running, **kw)


def test_each_clusters_size_is_decided_recorded_with_its_reason_and_reconciled_by_its_own_launcher(
        conn, placed, stores):
    p = pilot(stores)
    now = datetime.now(timezone.utc)
    p.first(conn, placed, now, {"us-east-gpu": 1}, "the planner's placement")
    # measured: one worker at 0.5 records/s (2 records in 4 s); 58 records left for a deadline 20 s away
    p.throughput.add(now.timestamp() - 6, 0, 1)
    p.throughput.add(now.timestamp() - 4, 0, 1)
    conn.execute("UPDATE bi.shards SET stored = 2 WHERE job_version = %s AND shard_no = 0", (placed,))
    p.first_rows_at = now - timedelta(seconds=4)    # rows seen a whole window ago: dearer clusters may be added
    d = poll(p, conn, placed, now, now + timedelta(seconds=20), {"us-east-gpu": 1})
    assert d.per_worker == 0.5
    sizes = d.sizes()
    assert sizes["us-east-gpu"] == 2 and sizes["eu-west-gpu"] == 2 and sizes["ap-south-gpu"] == 2 and d.page
    rows = conn.execute("SELECT cluster, action, desired, reason, page FROM bi.fleet_decisions "
                        "WHERE job_version = %s AND cluster IS NOT NULL ORDER BY id", (placed,)).fetchall()
    assert [r["cluster"] for r in rows[-3:]] == ["us-east-gpu", "eu-west-gpu", "ap-south-gpu"]
    assert all(r["action"] == ADD and "behind" in r["reason"] for r in rows[-3:])
    assert "cannot be met" in rows[-1]["page"]
    assert conn.execute("SELECT count(*) AS n FROM bi.fleet_decisions WHERE job_version = %s AND cluster IS NULL",
                        (placed,)).fetchone()["n"] == 0     # the single fleet's rows are not touched
    # each cluster's launcher makes its own size so and records what it runs
    fleets = {"us-east-gpu": 1, "eu-west-gpu": 0, "ap-south-gpu": 0}

    def scaler(name):
        return (lambda: fleets[name]), (lambda n: fleets.__setitem__(name, n))

    got = reconcile_clusters(conn, placed, "nights", {n: scaler(n) for n in fleets}, {})
    assert got == fleets == {"us-east-gpu": 2, "eu-west-gpu": 2, "ap-south-gpu": 2}
    launchers = {r["launcher"] for r in conn.execute("SELECT launcher FROM bi.fleet_observed WHERE job_version = %s",
                                                     (placed,))}
    assert launchers == {launcher_name("nights", n) for n in fleets}
    assert set(cluster_seconds(conn, placed, "nights")) == set(fleets)


def test_steals_open_only_through_the_deadlines_arithmetic_and_are_priced_with_it(db_url, conn, placed, stores):
    p = pilot(stores)
    now = datetime.now(timezone.utc)
    # us-east and eu-west each have a worker; ap-south none: its gate opens, theirs stay closed
    poll(p, conn, placed, now, now + timedelta(hours=1), {"us-east-gpu": 1, "eu-west-gpu": 1})
    gates = {r["home_region"]: r for r in conn.execute(
        "SELECT * FROM bi.region_steal_gates WHERE job_version = %s", (placed,))}
    assert gates["ap-south"]["open"] and "no worker of its own running" in gates["ap-south"]["reason"]
    assert not gates["us-east"]["open"] and not gates["eu-west"]["open"]
    us = region_ledger(db_url, placed, "us-1", "us-east")
    assert sorted(us.claim().shard_no for _ in range(2)) == [0, 1]
    taken = []
    while (lease := us.claim()) is not None:
        taken.append(lease.shard_no)
    assert sorted(taken) == [4, 5]            # ap-south's, through its open gate; eu-west's never: its gate is closed
    steal = conn.execute("SELECT usd, reason FROM bi.region_decisions WHERE job_version = %s AND kind = 'steal'",
                         (placed,)).fetchone()
    assert steal["usd"] > 0 and "no worker of its own running" in steal["reason"]
    gate_rows = conn.execute("SELECT region, reason FROM bi.region_decisions WHERE job_version = %s "
                             "AND kind = 'steal_gate'", (placed,)).fetchall()
    assert [r["region"] for r in gate_rows] == ["ap-south"] and gate_rows[0]["reason"].startswith("open: ")
    # a worker of ap-south now runs and its records fit by the deadline: the gate closes, recorded
    poll(p, conn, placed, now + timedelta(seconds=1), now + timedelta(hours=1),
         {"us-east-gpu": 1, "eu-west-gpu": 1, "ap-south-gpu": 1})
    p.throughput.estimate = 5.0
    poll(p, conn, placed, now + timedelta(seconds=2), now + timedelta(hours=1),
         {"us-east-gpu": 1, "eu-west-gpu": 1, "ap-south-gpu": 1})
    assert not conn.execute("SELECT open FROM bi.region_steal_gates WHERE job_version = %s AND home_region = "
                            "'ap-south'", (placed,)).fetchone()["open"]


def test_a_region_whose_every_worker_is_gone_at_once_is_found_lost_its_leases_end_and_its_clusters_go_to_zero(
        db_url, conn, placed, stores):
    ap1 = region_ledger(db_url, placed, "ap-1", "ap-south")
    ap2 = region_ledger(db_url, placed, "ap-2", "ap-south")
    held = [ap1.claim(), ap2.claim()]
    eu = region_ledger(db_url, placed, "eu-1", "eu-west")
    one = eu.claim()
    # one of ap-south's two leases runs out: a worker's death, the lease's own business
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (placed, held[0].shard_no))
    assert watch_regions(conn, placed) == []
    # so does eu-west's only lease: one worker, never a region lost by the ledger's account
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (placed, one.shard_no))
    assert watch_regions(conn, placed) == []
    # both of ap-south's, just now: two workers killed alone are restarted and claim again within a lease
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 second' "
                 "WHERE job_version = %s AND shard_no = %s", (placed, held[1].shard_no))
    assert watch_regions(conn, placed) == []
    # a whole lease later with none claimed there since: every worker gone at once
    conn.execute("UPDATE bi.shards SET lease_expires_at = clock_timestamp() - interval '1 hour' "
                 "WHERE job_version = %s AND shard_no = ANY(%s)", (placed, [h.shard_no for h in held]))
    p = pilot(stores)
    now = datetime.now(timezone.utc)
    p.throughput.estimate = 1.0
    d = poll(p, conn, placed, now, now + timedelta(seconds=120),
             {"us-east-gpu": 1, "eu-west-gpu": 1, "ap-south-gpu": 2})
    assert p.lost == {"ap-south": p.lost["ap-south"]} and "every worker gone at once" in p.lost["ap-south"]
    sizes = d.sizes()
    assert sizes["ap-south-gpu"] == 0 and "lost" in next(c for c in d.clusters if c.cluster == "ap-south-gpu").reason
    states = {r["shard_no"]: r for r in conn.execute(
        "SELECT shard_no, state, lost_leases FROM bi.shards WHERE job_version = %s", (placed,))}
    assert all(states[h.shard_no]["state"] == "pending" and states[h.shard_no]["lost_leases"] == 0 for h in held)
    assert conn.execute("SELECT open FROM bi.region_steal_gates WHERE job_version = %s AND home_region = 'ap-south'",
                        (placed,)).fetchone()["open"]
    # found once: the next poll does not end it again
    poll(p, conn, placed, now + timedelta(seconds=1), now + timedelta(seconds=120), {"us-east-gpu": 1})
    assert conn.execute("SELECT count(*) AS n FROM bi.region_decisions WHERE job_version = %s AND kind = "
                        "'region_lost'", (placed,)).fetchone()["n"] == 1
    # a launcher that cannot reach its cluster reports it: that region is lost too
    found = watch_regions(conn, placed, unreachable={"eu-west": "Kubernetes API refused"}, known={"ap-south"})
    assert [(f["region"], f["ended"]) for f in found] == [("eu-west", 1)] and "cannot be reached" in found[0]["reason"]


def test_the_cutoff_watch_steers_each_cluster_of_a_placed_version_and_its_launchers_follow_their_own_size(
        conn, db_url, stores):
    """The watch's poll (a fake clock whose sleep settles ten rows a minute; the ledger is real): a version
    placed over three clusters is steered per cluster (no row for the one fleet), and a launcher named
    LAUNCHER@CLUSTER reconciles to its cluster's size."""
    import asyncio

    from batch_inference import autopilot, db
    from batch_inference import deadline as watchlib
    from batch_inference.plan import submit
    from batch_inference.regions import place
    from tests.conftest import make_source, make_spec, tickets

    make_source(conn, tickets(60))
    # a window of one poll: the rows of the first minute are a whole window's measure by the third poll, when a
    # cluster dearer than the running one may be added
    job = submit(conn, make_spec(autopilot={"enabled": True, "margin_s": 60, "start_s": 30, "cooldown_s": 600,
                                            "window_s": 60})).job_version
    place(conn, job, parse_deployment(deployment_dict(stores)))
    autopilot.observe(conn, job, "local:w@us-east-gpu", 1)
    t = [datetime.now(timezone.utc)]
    deadline = t[0] + timedelta(seconds=1800 + 240)         # the spec's overhead and four minutes

    async def sleep(s: float) -> None:
        t[0] += timedelta(seconds=60)
        lease = conn.execute("SELECT * FROM bi.claim_shard_v2(%s, 'w', 'batch', 600)", (job,)).fetchone()
        ids = [r["record_id"] for r in conn.execute(
            "SELECT record_id FROM bi.snapshot_rows WHERE job_version = %s AND shard_no = %s", (job, lease["shard_no"]))]
        conn.execute(db.q("put_results"), {"job": job, "shard": lease["shard_no"], "epoch": lease["epoch"],
                                           "owner": "w", "transport": "batch", "engine": "noop", "endpoint": "local",
                                           "ids": ids, "outputs": ['{"category": "bug", "summary": "x"}'] * len(ids),
                                           "categories": ["bug"] * len(ids)})
        conn.execute("SELECT bi.complete_shard_v2(%s, %s, %s, 'w')", (job, lease["shard_no"], lease["epoch"]))

    payload = asyncio.run(watchlib.watch(lambda: watchlib.connect_async(db_url),
                                         watchlib.WatchConfig(job_version=job, deadline=deadline, poll_interval_s=60,
                                                              warned=True),
                                         now=lambda: t[0], sleep=sleep, max_polls=3))
    rows = conn.execute("SELECT cluster, action, desired, reason FROM bi.fleet_decisions WHERE job_version = %s "
                        "ORDER BY id", (job,)).fetchall()
    assert rows and all(r["cluster"] for r in rows), rows           # per cluster, never the one fleet's row
    assert {r["cluster"] for r in rows} == {"us-east-gpu", "eu-west-gpu", "ap-south-gpu"}
    assert any(r["action"] == "add" and "behind" in r["reason"] for r in rows), rows
    assert conn.execute(db.q("fleet_size"), {"job": job}).fetchone() is None
    assert {c["cluster"] for c in payload["autopilot"]["clusters"]} == {"us-east-gpu", "eu-west-gpu", "ap-south-gpu"}
    sizes = {r["cluster"]: r["desired"] for r in conn.execute(db.q("fleet_cluster_sizes"), {"job": job})}
    fleet = {"n": 0}
    got = autopilot.reconcile(conn, job, "local:w@eu-west-gpu", lambda: fleet["n"],
                              lambda k: fleet.__setitem__("n", k), default=1, bounds=(1, 8))
    assert got == fleet["n"] == sizes["eu-west-gpu"] > 0
    # a launcher of no cluster keeps the one fleet's default (no one-fleet decision here)
    assert autopilot.reconcile(conn, job, "local:w", lambda: 3, lambda k: None, default=3, bounds=(1, 8)) == 3
